"""The CPU backend: the mask walk of ``kernels/walk.py`` compiled with Numba, a loop over the batch.

Same semantics as ``kernels/reference.py`` (tested against it). It reads only the legal tokens' scores, never the
whole row: with ``hidden`` and an output embedding ``W`` instead of logits it is the sparse head, computing
``hidden[row] . W[token]`` for the legal tokens alone.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import numpy.typing as npt

from tooltrie.compiler.artifact import Artifact
from tooltrie.kernels.state import RUNNING, STATUS, BatchState
from tooltrie.kernels.vocab import VocabMap, check_step_inputs
from tooltrie.kernels.walk import best_move, best_plain, is_plain, plain_excluded, take_move, take_plain


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
    return values.astype(np.float32) if values.dtype == np.float16 else values


def _run(artifact: Artifact, state: BatchState, scores: npt.NDArray[Any], hidden: npt.NDArray[Any] | None,
         n_rows: int, n_cols: int, reasoning_end_id: int | None, vocab: VocabMap | None) -> npt.NDArray[np.int32]:
    vocab = vocab or VocabMap.identity(n_cols)
    check_step_inputs(artifact, len(state), n_rows, n_cols, vocab)
    trie = artifact.trie
    chosen = np.empty(len(state), dtype=np.int32)
    _step_rows(trie.node_edge_start, trie.edge_token, trie.edge_child, trie.edge_tool_count, trie.node_tool,
               trie.trie_root, trie.phase_trie, trie.tool_path_start, trie.tool_path_edges, trie.n_tools,
               artifact.eos_id, -1 if reasoning_end_id is None else reasoning_end_id, state.table, scores, hidden,
               n_cols, vocab.full_to_output, vocab.output_to_full, chosen)
    return chosen


@numba.njit(cache=True, nogil=True)
def _step_rows(node_edge_start: Any, edge_token: Any, edge_child: Any, edge_tool_count: Any, node_tool: Any,
               trie_root: Any, phase_trie: Any, tool_path_start: Any, tool_path_edges: Any, n_tools: int,
               eos_id: int, reasoning_end_id: int, table: Any, scores: Any, hidden: Any, n_cols: int,
               full_to_output: Any, output_to_full: Any, chosen: Any) -> None:
    trie = (node_edge_start, edge_token, edge_child, edge_tool_count, node_tool, trie_root, phase_trie,
            tool_path_start, tool_path_edges)
    for row in range(table.shape[0]):
        chosen[row] = -1
        if table[row, STATUS] != RUNNING:
            continue
        if is_plain(table, row):
            _, token = best_plain(row, 0, 1, n_cols, scores, hidden, output_to_full,
                                  plain_excluded(table, row, eos_id))
            take_plain(row, token, eos_id, reasoning_end_id, table, chosen)
            continue
        _, token, kind, edge = best_move(row, 0, 1, trie, n_tools, eos_id, table, scores, hidden, full_to_output)
        take_move(row, token, kind, edge, trie, table, chosen)
