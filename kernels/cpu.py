"""The CPU backend: the mask walk of ``kernels/walk.py`` compiled with Numba, a loop over the batch.

Same semantics as ``kernels/reference.py`` (tested against it). It reads only the legal tokens' scores, never the
whole row: with ``hidden`` and an output embedding ``W`` instead of logits it is the sparse head, computing
``hidden[row] . W[token]`` for the legal tokens alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from tooltrie.compiler.artifact import Artifact
from tooltrie.kernels.state import BatchState
from tooltrie.kernels.vocab import VocabMap, check_step_inputs
from tooltrie.kernels.walk import step_rows


def step(artifact: Artifact, state: BatchState, logits: Any, *, reasoning_end_id: int | None = None,
         vocab: VocabMap | None = None) -> npt.NDArray[np.int32]:
    """One step for the whole batch; advances ``state`` in place and returns the chosen full token ids."""
    scores = as_numpy_scores(logits)
    return _run(artifact, state, scores, None, scores.shape[0], scores.shape[1], reasoning_end_id, vocab)


def sparse_step(artifact: Artifact, state: BatchState, hidden: Any, output_embedding: Any, *,
                reasoning_end_id: int | None = None, vocab: VocabMap | None = None) -> npt.NDArray[np.int32]:
    """One step from final hidden states ``[B, H]`` and the output embedding ``W [V, H]``: only the rows of
    ``W`` for legal tokens are multiplied (rows without a grammar still need the whole head)."""
    weights, hidden_states = as_numpy_scores(output_embedding), as_numpy_scores(hidden)
    return _run(artifact, state, weights, hidden_states, hidden_states.shape[0], weights.shape[0], reasoning_end_id,
                vocab)


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


def _run(artifact: Artifact, state: BatchState, scores: npt.NDArray[Any], hidden: npt.NDArray[Any] | None,
         n_rows: int, n_cols: int, reasoning_end_id: int | None, vocab: VocabMap | None) -> npt.NDArray[np.int32]:
    vocab = vocab or VocabMap.identity(n_cols)
    check_step_inputs(artifact, len(state), n_rows, n_cols, vocab)
    trie = artifact.trie
    chosen = np.empty(len(state), dtype=np.int32)
    step_rows(trie.node_edge_start, trie.edge_token, trie.edge_child, trie.edge_tool_count, trie.node_tool,
               trie.trie_root, trie.phase_trie, trie.tool_path_start, trie.tool_path_edges, trie.n_tools,
               artifact.eos_id, -1 if reasoning_end_id is None else reasoning_end_id, state.table, state.counts,
               state.allowed, scores, hidden,
               n_cols, vocab.full_to_output, vocab.output_to_full, chosen)
    return chosen
