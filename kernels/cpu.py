"""The CPU backend: the mask walk of ``kernels/walk.py`` compiled with Numba, a loop over the batch.

Same semantics as ``kernels/reference.py`` (tested against it). It reads only the legal tokens' scores, never the
whole row: with ``hidden`` and an output embedding ``W`` instead of logits it is the sparse head, computing
``hidden[row] . W[token]`` for the legal tokens alone. With ``stats=`` (float64 ``[B, 3]``) a step also writes
each row's best value, runner-up value and log-sum-exp over its candidates (``kernels/walk.py``, ``put_stats``):
what a decision's score needs, without recomputing the legal logits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from tooltrie.compiler.artifact import Artifact
from tooltrie.errors import DecodeError
from tooltrie.kernels.state import BatchState
from tooltrie.kernels.vocab import VocabMap, check_step_inputs
from tooltrie.kernels.walk import step_rows


def step(artifact: Artifact, state: BatchState, logits: Any, *, reasoning_end_id: int | None = None,
         vocab: VocabMap | None = None, stats: npt.NDArray[np.float64] | None = None) -> npt.NDArray[np.int32]:
    """One step for the whole batch; advances ``state`` in place and returns the chosen full token ids.
    ``stats`` (float64 ``[B, 3]``, optional) receives (best, runner-up, log-sum-exp) per row."""
    scores = as_numpy_scores(logits)
    return _run(artifact, state, scores, None, scores.shape[0], scores.shape[1], reasoning_end_id, vocab, stats)


def sparse_step(artifact: Artifact, state: BatchState, hidden: Any, output_embedding: Any, *,
                reasoning_end_id: int | None = None, vocab: VocabMap | None = None,
                stats: npt.NDArray[np.float64] | None = None) -> npt.NDArray[np.int32]:
    """One step from final hidden states ``[B, H]`` and the output embedding ``W [V, H]``: only the rows of
    ``W`` for legal tokens are multiplied (rows without a grammar still need the whole head).

    >>> import numpy as np
    >>> from tooltrie.compiler import TokenizerInfo, compile_registry
    >>> from tooltrie.registry import make_registry
    >>> artifact = compile_registry(make_registry([{"name": "get"}, {"name": "set"}], name="doc"),
    ...                             TokenizerInfo.load("gpt2"))
    >>> state = BatchState.start(artifact, [1])
    >>> weights = np.zeros((50257, 2), np.float32); weights[1136, 0] = 2.0  # "get": 2, "set" and the rest: 0
    >>> stats = np.empty((1, 3))
    >>> sparse_step(artifact, state, np.ones((1, 2), np.float32), weights, stats=stats).tolist()
    [1136]
    >>> stats.round(4).tolist()  # best, runner-up, log(e**2 + e**0) over the two legal tokens
    [[2.0, 0.0, 2.1269]]
    """
    weights, hidden_states = as_numpy_scores(output_embedding), as_numpy_scores(hidden)
    return _run(artifact, state, weights, hidden_states, hidden_states.shape[0], weights.shape[0], reasoning_end_id,
                vocab, stats)


def as_numpy_scores(values: Any) -> npt.NDArray[Any]:
    """A NumPy view of CPU scores; a torch tensor is shared when it can be. Half precision (float16, bfloat16)
    becomes float32: Numba's CPU target has no half types, and the conversion is exact."""
    if not isinstance(values, np.ndarray):
        import torch

        if values.dtype in (torch.bfloat16, torch.float16):
            values = values.float()
        values = values.detach().cpu().numpy()
    array: npt.NDArray[Any] = values.astype(np.float32) if values.dtype == np.float16 else values
    return array


def check_stats(stats: Any, n_slots: int) -> None:
    """A statistics output must be float64 ``[B, 3]`` (or have no rows: not wanted)."""
    if stats.shape[0] and (tuple(stats.shape) != (n_slots, 3) or str(stats.dtype) not in ("float64", "torch.float64")):
        raise DecodeError(f"stats must be float64 [{n_slots}, 3], got {stats.dtype} {tuple(stats.shape)}")


_NO_STATS = np.zeros((0, 3), dtype=np.float64)


def _run(artifact: Artifact, state: BatchState, scores: npt.NDArray[Any], hidden: npt.NDArray[Any] | None,
         n_rows: int, n_cols: int, reasoning_end_id: int | None, vocab: VocabMap | None,
         stats: npt.NDArray[np.float64] | None) -> npt.NDArray[np.int32]:
    vocab = vocab or VocabMap.identity(n_cols)
    check_step_inputs(artifact, len(state), n_rows, n_cols, vocab)
    stats = _NO_STATS if stats is None else stats
    check_stats(stats, len(state))
    trie = artifact.trie
    chosen = np.empty(len(state), dtype=np.int32)
    step_rows(trie.node_edge_start, trie.edge_token, trie.edge_child, trie.edge_tool_count, trie.node_tool,
               trie.trie_root, trie.phase_trie, trie.tool_path_start, trie.tool_path_edges, trie.n_tools,
               artifact.eos_id, -1 if reasoning_end_id is None else reasoning_end_id, state.table, state.counts,
               state.allowed, scores, hidden,
               n_cols, vocab.full_to_output, vocab.output_to_full, chosen, stats)
    return chosen
