"""The mask walk as device-agnostic Numba functions: compiled for the CPU (``kernels/cpu.py``) and called from
the CUDA kernels (``kernels/cuda.py``); under the CUDA simulator they run as plain Python.

The same rules as ``kernels/rules.py`` (the oracle), over the flat arrays. A move is chosen in two parts so one
function serves every thread layout: :func:`best_move` scans this lane's share of the candidate tokens
(``lane``, ``lane + stride``, ...), the caller reduces across lanes if it has several, and :func:`take_move`
advances the slot. The order of candidates never matters: :func:`beats` is a total order (higher score, then
lower token id).

``trie`` is the tuple ``(node_edge_start, edge_token, edge_child, edge_tool_count, node_tool, trie_root,
phase_trie, tool_path_start, tool_path_edges)``. A row limited to a subset of the registry reads its own edge
counts and allowed tools from ``counts [B, E]`` and ``allowed [B, n_tools]``; when those arrays have no rows,
every slot has the whole registry (the compiled ``edge_tool_count``). Scores come from
``score(scores, hidden, row, col)``: logits ``[B, V]`` (float, or bfloat16 bits viewed as int16) when ``hidden``
is None or a 1-D array (a CUDA launch cannot pass None: it passes an empty one), else the sparse head: the dot
product of ``hidden[row]`` (``[B, H]``) with row ``col`` of the output embedding ``scores = W [V, H]``.

A step may also report, per row, what a score of the decision needs (``stats [B, 3]`` float64: the best value,
the runner-up value, the log-sum-exp of the candidates' values; see :func:`put_stats`), so no caller has to
recompute the legal logits. Each lane keeps a running maximum and sum for the log-sum-exp (:func:`lse_add`), and
lanes merge under a fixed tree (:func:`lse_merge`). An ``stats`` array without rows asks for none of it.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from types import ModuleType
from typing import Any

import numba
import numpy as np
from numba import types
from numba.core.extending import overload

# The slot-state table (one int32 row per slot; ``kernels/state.py`` wraps it). Its layout is defined here, in
# the file the compiled code comes from, so Numba's on-disk cache (keyed by this file) never outlives a change.
K, NODE, DEPTH, EMITTED, STATUS, CONSTRAINED, THINKING, USED = range(8)  # columns; used tools from USED on
RUNNING, DONE, ERROR = 0, 1, 2  # values of the STATUS column

MOVE_EDGE, MOVE_HOP, MOVE_STOP = 0, 1, 2
NO_EDGE = 2**31 - 1  # above every edge id (int32)
_BF16_MAGNITUDE, _BF16_INF = 0x7FFF, 0x7F80

# The CUDA simulator runs kernels as Python threads over fake device arrays, which compiled CPU functions cannot
# take; it calls a twin of this module whose functions stay plain Python (see ``python_twin``).
_AS_PYTHON: bool = globals().get("_AS_PYTHON", False)
_jit: Any = (lambda function: function) if _AS_PYTHON else numba.njit(cache=True, inline="always")
_entry: Any = (lambda function: function) if _AS_PYTHON else numba.njit(cache=True, nogil=True)


@functools.cache
def python_twin() -> ModuleType:
    """This module loaded again with every function left as plain Python."""
    spec = importlib.util.spec_from_file_location(f"{__name__}_python", __file__)
    assert spec is not None and spec.loader is not None  # this file exists: it is running
    twin = importlib.util.module_from_spec(spec)
    twin._AS_PYTHON = True
    spec.loader.exec_module(twin)
    return twin


def _logit_float(scores: Any, hidden: Any, row: int, col: int) -> float:
    value = np.float64(scores[row, col])  # widen first: float() keeps float16 (and its compare routines)
    return -np.inf if value != value else value  # NaN ranks lowest


def _logit_bf16(scores: Any, hidden: Any, row: int, col: int) -> float:
    # bfloat16 bits are sign-magnitude: +/- magnitude orders them exactly as their float values (+0 == -0).
    bits = np.int32(scores[row, col])
    magnitude = bits & _BF16_MAGNITUDE
    if magnitude > _BF16_INF:
        return -np.inf  # NaN
    return float(magnitude) if bits >= 0 else -float(magnitude)


def _dot(scores: Any, hidden: Any, row: int, col: int) -> float:
    total = 0.0
    for j in range(hidden.shape[1]):
        total += np.float64(hidden[row, j]) * np.float64(scores[col, j])
    return -np.inf if total != total else total


def score(scores: Any, hidden: Any, row: int, col: int) -> float:
    """The score of output column ``col`` for ``row`` (Python dispatch; compiled code uses the overload)."""
    if hidden is not None and hidden.ndim == 2:
        return _dot(scores, hidden, row, col)
    if scores.dtype == np.int16:
        return _logit_bf16(scores, hidden, row, col)
    return _logit_float(scores, hidden, row, col)


def _score_overload(scores: Any, hidden: Any, row: int, col: int) -> Any:  # same parameters as the impls
    if isinstance(hidden, types.Array) and hidden.ndim == 2:
        return _dot
    return _logit_bf16 if scores.dtype == types.int16 else _logit_float


if not _AS_PYTHON:
    overload(score, target="generic")(_score_overload)


@_jit
def phase(emitted: int, k: int) -> int:
    return (2 if emitted > 0 else 0) + (1 if emitted + 1 == k else 0)


@_jit
def beats(value: float, token: int, best_value: float, best_token: int) -> bool:
    """Argmax order: higher score, then the lower token id; independent of the order candidates are seen."""
    return best_token < 0 or value > best_value or (value == best_value and token < best_token)


@_jit
def lse_add(lse_max: float, lse_sum: float, value: float) -> tuple[float, float]:
    """Online log-sum-exp as (max, sum of exp(value - max)); -inf (and NaN, already -inf) adds nothing."""
    if value == -np.inf:
        return lse_max, lse_sum
    if value > lse_max:
        return value, lse_sum * math.exp(lse_max - value) + 1.0
    return lse_max, lse_sum + math.exp(value - lse_max)


@_jit
def lse_merge(max_a: float, sum_a: float, max_b: float, sum_b: float) -> tuple[float, float]:
    """Two lanes' online log-sum-exps as one."""
    if max_b == -np.inf:
        return max_a, sum_a
    if max_a == -np.inf:
        return max_b, sum_b
    if max_a >= max_b:
        return max_a, sum_a + sum_b * math.exp(max_b - max_a)
    return max_b, sum_b + sum_a * math.exp(max_a - max_b)


@_jit
def put_stats(stats: Any, row: int, best_value: float, runner_up: float, lse_max: float, lse_sum: float) -> None:
    """Write a row's decision statistics, if asked for: (best, runner-up, log-sum-exp) of the candidates' values.
    The runner-up equals the best on a tie and is -inf with a single candidate; a row with no candidate gets
    -inf throughout."""
    if stats.shape[0] > 0:
        stats[row, 0] = best_value
        stats[row, 1] = runner_up
        stats[row, 2] = lse_max + math.log(lse_sum) if lse_sum > 0 else -np.inf


@_jit
def no_stats(stats: Any, row: int) -> None:
    """A row that took no step (not running): NaN statistics."""
    if stats.shape[0] > 0:
        stats[row, 0] = np.nan
        stats[row, 1] = np.nan
        stats[row, 2] = np.nan


@_jit
def terminal_open(table: Any, allowed: Any, row: int, tool: int) -> bool:
    """The node's tool may end here: it exists, is allowed, and is not used yet."""
    if tool < 0 or (allowed.shape[0] > 0 and allowed[row, tool] == 0):
        return False
    for j in range(table[row, EMITTED]):  # noqa: SIM110  (Numba compiles loops, not all() over a generator)
        if table[row, USED + j] == tool:
            return False
    return True


@_jit
def next_crossing(table: Any, row: int, emitted: int, extra_tool: int, trie_index: int, at_depth: int,
                  n_tools: int, tool_path_start: Any, tool_path_edges: Any, lowest: int) -> tuple[int, int]:
    """The lowest edge from ``lowest`` on that a used tool (or ``extra_tool``, unless -1) crosses at ``at_depth`` of
    trie ``trie_index``, and how many of them cross it; ``NO_EDGE`` and 0 when none does. Each tool's path has
    one edge per depth, so only these edges lose count at a node (those of other nodes are never scanned)."""
    edge, times = NO_EDGE, 0
    for j in range(emitted + (1 if extra_tool >= 0 else 0)):
        used = table[row, USED + j] if j < emitted else extra_tool
        start = tool_path_start[trie_index * n_tools + used]
        if at_depth < tool_path_start[trie_index * n_tools + used + 1] - start:
            crossed = tool_path_edges[start + at_depth]
            if lowest <= crossed < edge:
                edge, times = crossed, 1
            elif crossed == edge:
                times += 1
    return edge, times


@_jit
def best_move(row: int, lane: int, stride: int, trie: Any, n_tools: int, eos_id: int, table: Any, counts: Any,
              allowed: Any, scores: Any, hidden: Any, full_to_output: Any, with_stats: bool
              ) -> tuple[float, int, int, int, float, float, float]:
    """This lane's best legal move of a constrained, running slot: (score, token, kind, edge); token -1: none.
    Then, with ``with_stats`` (else -inf, -inf, 0), this lane's runner-up value and its online log-sum-exp
    (max, sum) over its legal tokens."""
    node_edge_start, edge_token, edge_tool_count, node_tool = trie[0], trie[1], trie[3], trie[4]
    trie_root, phase_trie, tool_path_start, tool_path_edges = trie[5], trie[6], trie[7], trie[8]
    k, node, depth, emitted = table[row, K], table[row, NODE], table[row, DEPTH], table[row, EMITTED]
    tool = node_tool[node]
    unused = terminal_open(table, allowed, row, tool)
    own_counts = counts.shape[0] > 0  # a subset: this row's counts, else the compiled ones
    own_trie = phase_trie[phase(emitted, k)]
    own_first, n_own = node_edge_start[node], node_edge_start[node + 1] - node_edge_start[node]
    # At an unused terminal with tools still owed, the next tool's root edges are candidates too (a hop),
    # counted as if this terminal's tool were already used.
    hop_trie, hop_first, n_hop = own_trie, 0, 0
    if unused and emitted + 1 < k:
        hop_trie = phase_trie[phase(emitted + 1, k)]
        root = trie_root[hop_trie]
        hop_first, n_hop = node_edge_start[root], node_edge_start[root + 1] - node_edge_start[root]
    best_value, best_token, best_kind, best_edge = -np.inf, -1, -1, -1
    runner_up, lse_max, lse_sum = -np.inf, -np.inf, 0.0
    # The next edge a used tool crosses (see next_crossing; -1: not looked up yet), looked up again only once this
    # lane is past it.
    crossing_edge, crossing_times, hopping = -1, 0, False
    for i in range(lane, n_own + n_hop, stride):
        if i < n_own:
            edge, kind, trie_index, at_depth, extra_tool = own_first + i, MOVE_EDGE, own_trie, depth, -1
        else:
            edge, kind, trie_index, at_depth, extra_tool = hop_first + i - n_own, MOVE_HOP, hop_trie, 0, tool
            if not hopping:  # the hop's edges, at another node: their crossings are looked up afresh
                crossing_edge, hopping = -1, True
        # The count of unused tools below the edge: its compiled count minus the used tools (and, for a hop,
        # this terminal's tool) whose path crosses it. Edges come in ascending order, so one comparison an edge
        # tells whether any does: the used tools are looked up a few times a step, not once per edge.
        count = counts[row, edge] if own_counts else edge_tool_count[edge]
        if edge >= crossing_edge:
            if edge > crossing_edge:
                crossing_edge, crossing_times = next_crossing(table, row, emitted, extra_tool, trie_index,
                                                              at_depth, n_tools, tool_path_start, tool_path_edges,
                                                              edge)
            if edge == crossing_edge:
                count -= crossing_times
        token = edge_token[edge]
        col = full_to_output[token]
        if count > 0 and col >= 0:
            value = score(scores, hidden, row, col)
            if with_stats:
                runner_up = max(runner_up, min(value, best_value))
                lse_max, lse_sum = lse_add(lse_max, lse_sum, value)
            if beats(value, token, best_value, best_token):
                best_value, best_token, best_kind, best_edge = value, token, kind, edge
    if lane == 0 and unused and emitted + 1 == k and full_to_output[eos_id] >= 0:
        value = score(scores, hidden, row, full_to_output[eos_id])
        if with_stats:
            runner_up = max(runner_up, min(value, best_value))
            lse_max, lse_sum = lse_add(lse_max, lse_sum, value)
        if beats(value, eos_id, best_value, best_token):
            best_value, best_token, best_kind, best_edge = value, eos_id, MOVE_STOP, -1
    return best_value, best_token, best_kind, best_edge, runner_up, lse_max, lse_sum


@_jit
def best_plain(row: int, lane: int, stride: int, n_cols: int, scores: Any, hidden: Any, output_to_full: Any,
               excluded: int, with_stats: bool) -> tuple[float, int, float, float, float]:
    """This lane's share of a plain argmax (rows without a grammar, or still thinking): (score, full token), then
    the statistics as in :func:`best_move`, over every column but ``excluded``. ``excluded`` (a full id, or -1)
    is never chosen: a constrained row may not stop while it thinks."""
    best_value, best_token = -np.inf, -1
    runner_up, lse_max, lse_sum = -np.inf, -np.inf, 0.0
    for col in range(lane, n_cols, stride):
        token = output_to_full[col]
        if token != excluded:
            value = score(scores, hidden, row, col)
            if with_stats:
                runner_up = max(runner_up, min(value, best_value))
                lse_max, lse_sum = lse_add(lse_max, lse_sum, value)
            if beats(value, token, best_value, best_token):
                best_value, best_token = value, token
    return best_value, best_token, runner_up, lse_max, lse_sum


@_jit
def plain_excluded(table: Any, row: int, eos_id: int) -> int:
    """The token a plain step must not take: the stop token while a constrained row is still thinking."""
    return eos_id if table[row, CONSTRAINED] != 0 else -1


@_jit
def take_move(row: int, token: int, kind: int, edge: int, trie: Any, table: Any, chosen: Any) -> None:
    """Advance a constrained slot by its chosen move; no move at all is the error state (fail loudly)."""
    if token < 0:
        table[row, STATUS] = ERROR
        chosen[row] = -1
        return
    chosen[row] = token
    emitted = table[row, EMITTED]
    if kind == MOVE_EDGE:
        table[row, NODE] = trie[2][edge]
        table[row, DEPTH] += 1
        return
    table[row, USED + emitted] = trie[4][table[row, NODE]]
    table[row, EMITTED] = emitted + 1
    if kind == MOVE_STOP:
        table[row, STATUS] = DONE
    else:
        table[row, NODE] = trie[2][edge]
        table[row, DEPTH] = 1


@_jit
def take_plain(row: int, token: int, eos_id: int, reasoning_end_id: int, table: Any, chosen: Any) -> None:
    """Record a plain argmax: a thinking row starts its constraint after the marker; a row without a
    grammar is done at the stop token; a row with nothing to choose (every column excluded) fails."""
    chosen[row] = token
    if token < 0:
        table[row, STATUS] = ERROR
    elif table[row, THINKING] != 0 and token == reasoning_end_id:
        table[row, THINKING] = 0
    elif table[row, CONSTRAINED] == 0 and token == eos_id:
        table[row, STATUS] = DONE


@_jit
def is_plain(table: Any, row: int) -> bool:
    return table[row, CONSTRAINED] == 0 or table[row, THINKING] != 0


@_entry
def step_rows(node_edge_start: Any, edge_token: Any, edge_child: Any, edge_tool_count: Any, node_tool: Any,
               trie_root: Any, phase_trie: Any, tool_path_start: Any, tool_path_edges: Any, n_tools: int,
               eos_id: int, reasoning_end_id: int, table: Any, counts: Any, allowed: Any, scores: Any, hidden: Any,
               n_cols: int, full_to_output: Any, output_to_full: Any, chosen: Any, stats: Any) -> None:
    """The CPU backend's batch loop: each running row takes its best move (or plain argmax), one at a time;
    ``stats [B, 3]`` gets each row's statistics (:func:`put_stats`) unless it has no rows."""
    trie = (node_edge_start, edge_token, edge_child, edge_tool_count, node_tool, trie_root, phase_trie,
            tool_path_start, tool_path_edges)
    with_stats = stats.shape[0] > 0
    for row in range(table.shape[0]):
        chosen[row] = -1
        if table[row, STATUS] != RUNNING:
            no_stats(stats, row)
            continue
        if is_plain(table, row):
            value, token, runner_up, lse_max, lse_sum = best_plain(
                row, 0, 1, n_cols, scores, hidden, output_to_full, plain_excluded(table, row, eos_id), with_stats)
            put_stats(stats, row, value, runner_up, lse_max, lse_sum)
            take_plain(row, token, eos_id, reasoning_end_id, table, chosen)
            continue
        value, token, kind, edge, runner_up, lse_max, lse_sum = best_move(
            row, 0, 1, trie, n_tools, eos_id, table, counts, allowed, scores, hidden, full_to_output, with_stats)
        put_stats(stats, row, value, runner_up, lse_max, lse_sum)
        take_move(row, token, kind, edge, trie, table, chosen)
