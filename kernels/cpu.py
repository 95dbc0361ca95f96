"""The CPU backend: the reference step's rules compiled with Numba, walking the flat arrays directly.

Same semantics as ``kernels/reference.py`` (tested against it): per row, read the current node's edges, drop
those whose count of unused tools is zero, add stop or the next root's edges at an unused terminal, and take
the argmax with ties toward the lower token id. Reads only the legal tokens' logits, never the whole row.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import numpy.typing as npt

from tooltrie.compiler.artifact import Artifact
from tooltrie.kernels.state import (
    CONSTRAINED,
    DEPTH,
    DONE,
    EMITTED,
    ERROR,
    NODE,
    RUNNING,
    STATUS,
    THINKING,
    USED,
    BatchState,
    K,
)
from tooltrie.kernels.vocab import VocabMap

_EDGE, _HOP, _STOP = 0, 1, 2


def step(artifact: Artifact, state: BatchState, logits: Any, *, reasoning_end_id: int | None = None,
         vocab: VocabMap | None = None) -> npt.NDArray[np.int32]:
    """One step for the whole batch; advances ``state`` in place and returns the chosen full token ids."""
    logits = as_numpy_logits(logits)
    vocab = vocab or VocabMap.identity(logits.shape[1])
    trie = artifact.trie
    chosen = np.empty(len(state), dtype=np.int32)
    _step_rows(trie.node_edge_start, trie.edge_token, trie.edge_child, trie.edge_tool_count, trie.node_tool,
               trie.trie_root, trie.phase_trie, trie.tool_path_start, trie.tool_path_edges, trie.n_tools,
               artifact.eos_id, -1 if reasoning_end_id is None else reasoning_end_id,
               state.table, logits, vocab.full_to_output, vocab.output_to_full, chosen)
    return chosen


def as_numpy_logits(logits: Any) -> npt.NDArray[np.floating[Any]]:
    """NumPy view of CPU logits; a torch tensor is shared when it can be (bfloat16 becomes float32)."""
    if isinstance(logits, np.ndarray):
        return logits
    import torch

    if logits.dtype == torch.bfloat16:
        logits = logits.float()
    return np.asarray(logits.detach().cpu().numpy())


@numba.njit(cache=True, inline="always")
def _phase(emitted: int, k: int) -> int:
    return (2 if emitted > 0 else 0) + (1 if emitted + 1 == k else 0)


@numba.njit(cache=True, inline="always")
def _logit(logits: Any, row: int, out: int) -> float:
    value = logits[row, out]
    return -np.inf if value != value else value  # NaN ranks lowest


@numba.njit(cache=True, inline="always")
def _beats(value: float, token: int, best_value: float, best_token: int) -> bool:
    """Argmax order: higher logit first, then the lower token id (no dependence on visiting order)."""
    return best_token < 0 or value > best_value or (value == best_value and token < best_token)


@numba.njit(cache=True, inline="always")
def _used_crossing(edge: int, trie: int, depth: int, table: Any, row: int, extra_tool: int,
                   n_tools: int, tool_path_start: Any, tool_path_edges: Any) -> int:
    """How many used tools (plus ``extra_tool``, if >= 0) have ``edge`` at ``depth`` of their path."""
    crossing = 0
    emitted = table[row, EMITTED]
    for j in range(emitted + (1 if extra_tool >= 0 else 0)):
        tool = table[row, USED + j] if j < emitted else extra_tool
        start = tool_path_start[trie * n_tools + tool]
        if depth < tool_path_start[trie * n_tools + tool + 1] - start and tool_path_edges[start + depth] == edge:
            crossing += 1
    return crossing


@numba.njit(cache=True, nogil=True)
def _step_rows(node_edge_start: Any, edge_token: Any, edge_child: Any, edge_tool_count: Any, node_tool: Any,
               trie_root: Any, phase_trie: Any, tool_path_start: Any, tool_path_edges: Any, n_tools: int,
               eos_id: int, reasoning_end_id: int, table: Any, logits: Any, full_to_output: Any,
               output_to_full: Any, chosen: Any) -> None:
    for row in range(table.shape[0]):
        chosen[row] = -1
        if table[row, STATUS] != RUNNING:
            continue
        if table[row, CONSTRAINED] == 0 or table[row, THINKING] != 0:
            token = output_to_full[np.argmax(logits[row])]  # first maximum: the lowest id
            chosen[row] = token
            if table[row, THINKING] != 0:
                if token == reasoning_end_id:
                    table[row, THINKING] = 0
            elif token == eos_id:
                table[row, STATUS] = DONE
            continue

        k, node, depth, emitted = table[row, K], table[row, NODE], table[row, DEPTH], table[row, EMITTED]
        tool = node_tool[node]
        unused = tool >= 0
        for j in range(emitted):
            if table[row, USED + j] == tool:
                unused = False
        best_token, best_kind, best_edge = -1, -1, -1
        best_value = -np.inf
        # Two edge ranges: the node's own edges, then (at an unused terminal with tools still owed) the next
        # tool's root edges, counted as if this terminal's tool were already used.
        for source in range(2):
            if source == 0:
                trie, first, last, at_depth, extra_tool, kind = (
                    phase_trie[_phase(emitted, k)], node_edge_start[node], node_edge_start[node + 1], depth, -1,
                    _EDGE)
            elif unused and emitted + 1 < k:
                trie = phase_trie[_phase(emitted + 1, k)]
                root = trie_root[trie]
                first, last = node_edge_start[root], node_edge_start[root + 1]
                at_depth, extra_tool, kind = 0, tool, _HOP
            else:
                break
            for edge in range(first, last):
                if edge_tool_count[edge] - _used_crossing(edge, trie, at_depth, table, row, extra_tool, n_tools,
                                                          tool_path_start, tool_path_edges) <= 0:
                    continue
                token = edge_token[edge]
                out = full_to_output[token]
                if out >= 0 and _beats(_logit(logits, row, out), token, best_value, best_token):
                    best_token, best_kind, best_edge, best_value = token, kind, edge, _logit(logits, row, out)
        if unused and emitted + 1 == k:
            out = full_to_output[eos_id]
            if out >= 0 and _beats(_logit(logits, row, out), eos_id, best_value, best_token):
                best_token, best_kind, best_edge = eos_id, _STOP, -1

        if best_token < 0:
            table[row, STATUS] = ERROR  # nothing legal: fail loudly
            continue
        chosen[row] = best_token
        if best_kind == _EDGE:
            table[row, NODE] = edge_child[best_edge]
            table[row, DEPTH] = depth + 1
        else:
            table[row, USED + emitted] = tool
            table[row, EMITTED] = emitted + 1
            if best_kind == _STOP:
                table[row, STATUS] = DONE
            else:
                table[row, NODE] = edge_child[best_edge]
                table[row, DEPTH] = 1
