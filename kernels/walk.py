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
product of ``hidden[row]`` (``[B, H]``) with row ``col`` of the output embedding ``scores = W [V, H]`` (float, or
bfloat16 bits viewed as int16, widened exactly).

A step may also report, per row, what a score of the decision needs (``stats [B, 3]`` float64: the best value,
the runner-up value, the log-sum-exp of the candidates' values; see :func:`put_stats`), so no caller has to
recompute the legal logits. Each lane keeps a running maximum and sum for the log-sum-exp (:func:`lse_add`), and
lanes merge under a fixed tree (:func:`lse_merge`). An ``stats`` array without rows asks for none of it.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import math
from types import ModuleType
from typing import Any

import numba
import numpy as np
from numba import types
from numba.core.extending import overload

from tooltrie.compiler.trie import phase_of

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
# No-repeat (each tool at most once per answer) is a compile-time switch: Numba reads module globals as constants,
# so a copy loaded with it off (``variant``) has no used-tools code at all. Copies compile without the on-disk
# cache, whose files are keyed by this source file and must only ever hold this module's code.
NO_REPEAT: bool = globals().get("NO_REPEAT", True)
_CACHE: bool = globals().get("_CACHE", True)
_jit: Any = (lambda function: function) if _AS_PYTHON else numba.njit(cache=_CACHE, inline="always")
# Batch entry points allocate nothing, so they compile without Numba's reference counting (``_nrt=False``): with
# it, every inlined call that takes an array increments and decrements a count atomically, and those atomics were
# most of a step's time (accept at batch 256: 53 µs with them, 5 µs without). ``next_runs`` allocates: it keeps them.
_entry: Any = (lambda function: function) if _AS_PYTHON else numba.njit(  # type: ignore[call-overload]
    cache=_CACHE, nogil=True, _nrt=False)
_allocating_entry: Any = (lambda function: function) if _AS_PYTHON else numba.njit(cache=_CACHE, nogil=True)
_variants = itertools.count()


@functools.cache
def python_twin() -> ModuleType:
    """This module loaded again with every function left as plain Python."""
    spec = importlib.util.spec_from_file_location(f"{__name__}_python", __file__)
    assert spec is not None and spec.loader is not None  # this file exists: it is running
    twin = importlib.util.module_from_spec(spec)
    twin._AS_PYTHON = True
    spec.loader.exec_module(twin)
    return twin


def variant(*, no_repeat: bool) -> ModuleType:
    """This module loaded again with no-repeat on or off, compiled afresh on first use (no on-disk cache): each
    call gives a new compilation, so two variants with the same switch are two copies of the same code (what a
    benchmark's A/A arm times). With ``no_repeat=False`` a used tool may be chosen again; nothing else changes."""
    spec = importlib.util.spec_from_file_location(f"{__name__}_variant{next(_variants)}", __file__)
    assert spec is not None and spec.loader is not None  # this file exists: it is running
    copy = importlib.util.module_from_spec(spec)
    copy.NO_REPEAT, copy._CACHE = no_repeat, False
    spec.loader.exec_module(copy)
    return copy


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


def _dot_bf16(scores: Any, hidden: Any, row: int, col: int) -> float:
    # A bfloat16 head's bits viewed as int16: each weight widened to float32 exactly (its 16 bits on top), so the
    # sum is the float32 head's, bit for bit, from half the memory.
    total = 0.0
    for j in range(hidden.shape[1]):
        weight = np.uint32((np.int32(scores[col, j]) & 0xFFFF) << 16).view(np.float32)
        total += np.float64(hidden[row, j]) * np.float64(weight)
    return -np.inf if total != total else total


def score(scores: Any, hidden: Any, row: int, col: int) -> float:
    """The score of output column ``col`` for ``row`` (Python dispatch; compiled code uses the overload)."""
    if hidden is not None and hidden.ndim == 2:
        return (_dot_bf16 if scores.dtype == np.int16 else _dot)(scores, hidden, row, col)
    if scores.dtype == np.int16:
        return _logit_bf16(scores, hidden, row, col)
    return _logit_float(scores, hidden, row, col)


def _score_overload(scores: Any, hidden: Any, row: int, col: int) -> Any:  # same parameters as the impls
    if isinstance(hidden, types.Array) and hidden.ndim == 2:
        return _dot_bf16 if scores.dtype == types.int16 else _dot
    return _logit_bf16 if scores.dtype == types.int16 else _logit_float


if not _AS_PYTHON:
    overload(score, target="generic")(_score_overload)


phase = _jit(phase_of)  # the compiler's formula, compiled


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
    """The node's tool may end here: it exists, is allowed, and is not used yet (with no-repeat on)."""
    if tool < 0 or (allowed.shape[0] > 0 and allowed[row, tool] == 0):
        return False
    if not NO_REPEAT:
        return True
    for j in range(table[row, EMITTED]):  # noqa: SIM110  (Numba compiles loops, not all() over a generator)
        if table[row, USED + j] == tool:
            return False
    return True


@_jit
def next_crossing(table: Any, row: int, extra_tool: int, trie_index: int, at_depth: int, n_tools: int, trie: Any,
                  lowest: int) -> tuple[int, int]:
    """The lowest edge from ``lowest`` on that a used tool (or ``extra_tool``, unless -1) crosses at ``at_depth`` of
    trie ``trie_index``, and how many of them cross it; ``NO_EDGE`` and 0 when none does. Each tool's path has
    one edge per depth, so only these edges lose count at a node (those of other nodes are never scanned). With
    no-repeat off nothing crosses. The one place the used tools below an edge are counted: a scan over a node's
    edges in ascending order asks again only once past the edge it was given (:func:`open_edge`,
    :func:`mark_node`); one edge asks once (:func:`edge_count`)."""
    edge, times = NO_EDGE, 0
    if not NO_REPEAT:
        return edge, times
    emitted = table[row, EMITTED]
    for j in range(emitted + (1 if extra_tool >= 0 else 0)):
        crossed = crossed_edge(table, row, j, emitted, extra_tool, trie_index, at_depth, n_tools, trie)
        if lowest <= crossed < edge:
            edge, times = crossed, 1
        elif crossed == edge:
            times += 1
    return edge, times


# -- the candidates of a running constrained row -------------------------------------------------------------------
# A row's candidates are numbered 0 .. n_own + n_hop - 1: the current node's edges, then (at an unused terminal with
# tools still owed) the next phase's root edges, the hop; the stop token is apart (``Frame.can_stop``). Every scan
# below (choose, accept, mask, forced runs) walks them with :func:`frame` and :func:`open_edge`, so the rules are
# written once.

@_jit
def frame(row: int, trie: Any, table: Any, allowed: Any) -> tuple[int, int, int, int, int, int, int, bool]:
    """(own trie, own first edge, own edge count, hop trie, hop first edge, hop edge count, the node's tool, whether
    stop is legal) of a running constrained row."""
    node_edge_start, node_tool, trie_root, phase_trie = trie[0], trie[4], trie[5], trie[6]
    k, node, emitted = table[row, K], table[row, NODE], table[row, EMITTED]
    tool = node_tool[node]
    unused = terminal_open(table, allowed, row, tool)
    own_trie = phase_trie[phase(emitted, k)]
    own_first, n_own = node_edge_start[node], node_edge_start[node + 1] - node_edge_start[node]
    # At an unused terminal with tools still owed, the next tool's root edges are candidates too (a hop),
    # counted as if this terminal's tool were already used.
    hop_trie, hop_first, n_hop = own_trie, 0, 0
    if unused and emitted + 1 < k:
        hop_trie = phase_trie[phase(emitted + 1, k)]
        root = trie_root[hop_trie]
        hop_first, n_hop = node_edge_start[root], node_edge_start[root + 1] - node_edge_start[root]
    return own_trie, own_first, n_own, hop_trie, hop_first, n_hop, tool, unused and emitted + 1 == k


@_jit
def open_edge(i: int, stride: int, row: int, fr: Any, trie: Any, n_tools: int, table: Any, counts: Any,
              crossing_edge: int, crossing_times: int) -> tuple[int, int, int, int, int]:
    """Candidate ``i`` of the row: (edge, kind, count of unused allowed tools below it) and the crossing cache after
    it (``crossing_edge`` -1: not looked up yet). The count is the edge's compiled count (or the row's subset count)
    minus the used tools (and, for a hop, this terminal's tool) whose path crosses it. Candidates are visited in
    ascending edge order per part, so the used tools are looked up a few times a scan, not once per edge: the
    cache holds the next edge a used tool crosses, and is looked up again only once past it."""
    own_trie, own_first, n_own, hop_trie, hop_first, tool = fr[0], fr[1], fr[2], fr[3], fr[4], fr[6]
    if i < n_own:
        edge, kind, trie_index, at_depth, extra_tool = own_first + i, MOVE_EDGE, own_trie, table[row, DEPTH], -1
    else:
        edge, kind, trie_index, at_depth, extra_tool = hop_first + i - n_own, MOVE_HOP, hop_trie, 0, tool
        if i - stride < n_own:  # this lane's first hop edge, at another node: crossings are looked up afresh
            crossing_edge = -1
    count = allowed_count(row, edge, trie, counts)
    if NO_REPEAT and edge >= crossing_edge:  # with no-repeat off, nothing is subtracted
        if edge > crossing_edge:
            crossing_edge, crossing_times = next_crossing(table, row, extra_tool, trie_index, at_depth, n_tools, trie,
                                                          edge)
        if edge == crossing_edge:
            count -= crossing_times
    return edge, kind, count, crossing_edge, crossing_times


@_jit
def allowed_count(row: int, edge: int, trie: Any, counts: Any) -> int:
    """The allowed tools below an edge, used or not: the row's subset count, or the compiled one (no subsets)."""
    return counts[row, edge] if counts.shape[0] > 0 else trie[3][edge]


@_jit
def n_candidates(fr: Any) -> int:
    return fr[2] + fr[5]


@_jit
def best_move(row: int, srow: int, lane: int, stride: int, trie: Any, n_tools: int, eos_id: int, table: Any,
              counts: Any, allowed: Any, scores: Any, hidden: Any, full_to_output: Any, with_stats: bool,
              ranked: Any) -> tuple[float, int, int, int, float, float, float, int, int]:
    """This lane's best legal move of a constrained, running slot: (value, token, kind, edge); token -1: none.
    Then, with ``with_stats`` (else -inf, -inf, 0), this lane's runner-up value and its online log-sum-exp
    (max, sum) over its legal tokens; then how many legal tokens this lane saw, and how many of them continue
    the current name (edges and stop, not hops). Scores are read from row ``srow``. A row with a ranker
    (:func:`has_ranker`) is scanned by one lane (``lane`` 0, ``stride`` 1): see the fused ranker below."""
    fr = frame(row, trie, table, allowed)
    ranker = ranked[0]
    fused = has_ranker(ranker, row)
    weight = float(ranker[row, 0]) if fused else 1.0
    tool = fr[6]
    end_prior = float(ranker[row, 1 + tool]) if fused and tool >= 0 else 0.0
    # Where the name may end here or go on (hops beside open edges of its own), ending it is one option of the
    # decision, valued by this tool's prior; which hop then starts the next tool is decided by the next tool's.
    grouped = fused and fr[5] > 0 and continues_name(row, fr, trie, n_tools, table, counts, full_to_output)
    best_value, best_token, best_kind, best_edge = -np.inf, -1, -1, -1
    hop_value, hop_token, hop_edge, group_value = -np.inf, -1, -1, -np.inf
    top, runner_up, lse_max, lse_sum = -np.inf, -np.inf, -np.inf, 0.0  # over every option's value
    n_legal, n_continue = 0, 0
    crossing_edge, crossing_times = -1, 0
    for i in range(lane, n_candidates(fr), stride):
        edge, kind, count, crossing_edge, crossing_times = open_edge(i, stride, row, fr, trie, n_tools, table,
                                                                     counts, crossing_edge, crossing_times)
        token = trie[1][edge]
        col = full_to_output[token]
        if count > 0 and col >= 0:
            n_legal += 1
            n_continue += 1 if kind == MOVE_EDGE else 0
            value = score(scores, hidden, srow, col)
            if fused:
                raw = value
                value = fuse(weight, raw, edge_prior(row, edge, -1 if kind == MOVE_EDGE else tool, table, allowed,
                                                     ranked))
                if grouped and kind == MOVE_HOP:
                    if beats(value, token, hop_value, hop_token):
                        hop_value, hop_token, hop_edge = value, token, edge
                    value = fuse(weight, raw, end_prior)
                    group_value = max(group_value, value)
            if with_stats:
                runner_up, top = max(runner_up, min(value, top)), max(top, value)
                lse_max, lse_sum = lse_add(lse_max, lse_sum, value)
            if not (grouped and kind == MOVE_HOP) and beats(value, token, best_value, best_token):
                best_value, best_token, best_kind, best_edge = value, token, kind, edge
    if lane == 0 and fr[7] and full_to_output[eos_id] >= 0:
        n_legal += 1
        n_continue += 1
        value = score(scores, hidden, srow, full_to_output[eos_id])
        if fused:
            value = fuse(weight, value, end_prior)
        if with_stats:
            runner_up, top = max(runner_up, min(value, top)), max(top, value)
            lse_max, lse_sum = lse_add(lse_max, lse_sum, value)
        if beats(value, eos_id, best_value, best_token):
            best_value, best_token, best_kind, best_edge = value, eos_id, MOVE_STOP, -1
    if hop_token >= 0 and beats(group_value, hop_token, best_value, best_token):
        best_value, best_token, best_kind, best_edge = group_value, hop_token, MOVE_HOP, hop_edge
    return best_value, best_token, best_kind, best_edge, runner_up, lse_max, lse_sum, n_legal, n_continue


# -- the fused ranker ------------------------------------------------------------------------------------------------
# ``ranked = (ranker, below_start, below_tools)``: ``ranker [B, 1 + n_tools]`` float32 holds, per state row, the
# weight of the model's score (column 0; NaN: the row has no ranker) and each tool's prior, already weighted
# (column 1 + tool); with no rows, no row has one. ``below_start``/``below_tools`` are ``CompiledTrie.tools_below``.
# A legal token's value is then ``weight * score + prior`` (:func:`fuse`), the prior of a token being the best
# prior among the unused allowed tools below its edge (:func:`edge_prior`), so with the weight at 0 the answer is
# the prior's top k, best first. Where a name may end or go on, ending it is one option valued by its own tool's
# prior, and the hop that starts the next tool is chosen among the hops by the next tool's (:func:`best_move`).
# Ranker values are compared as floats: bfloat16 logits (compared as their bits) cannot be ranked.

def no_ranker() -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """``ranked`` for a batch without a ranker."""
    return np.zeros((0, 1), np.float32), np.zeros(1, np.int32), np.zeros(0, np.int32)


@_jit
def has_ranker(ranker: Any, row: int) -> bool:
    return ranker.shape[0] > 0 and not math.isnan(ranker[row, 0])


@_jit
def fuse(weight: float, value: float, prior: float) -> float:
    """``weight * value + prior``; a zero weight leaves the model's score out altogether (even -inf)."""
    return prior if weight == 0.0 else weight * value + prior


@_jit
def edge_prior(row: int, edge: int, extra_tool: int, table: Any, allowed: Any, ranked: Any) -> float:
    """The best prior among the unused allowed tools below ``edge`` other than ``extra_tool`` (a hop's terminal
    tool, taken by the hop); -inf when there is none."""
    ranker, below_start, below_tools = ranked
    best = -np.inf
    for i in range(below_start[edge], below_start[edge + 1]):
        tool = below_tools[i]
        prior = float(ranker[row, 1 + tool])
        if prior > best and tool != extra_tool and terminal_open(table, allowed, row, tool):
            best = prior
    return best


@_jit
def continues_name(row: int, fr: Any, trie: Any, n_tools: int, table: Any, counts: Any, full_to_output: Any
                   ) -> bool:
    """Whether one of the row's own edges is legal: the current name may go on."""
    crossing_edge, crossing_times = -1, 0
    for i in range(fr[2]):
        edge, _, count, crossing_edge, crossing_times = open_edge(i, 1, row, fr, trie, n_tools, table, counts,
                                                                  crossing_edge, crossing_times)
        if count > 0 and full_to_output[trie[1][edge]] >= 0:
            return True
    return False


@_jit
def find_move(row: int, token: int, trie: Any, n_tools: int, eos_id: int, table: Any, counts: Any, allowed: Any
              ) -> tuple[int, int]:
    """Where ``token`` leads from a running constrained row: (kind, edge); kind -1 when it is not legal. A node's
    edges are sorted by token (``docs/trie.md``), so each part is one binary search and one count: O(log edges + k),
    however wide the node."""
    fr = frame(row, trie, table, allowed)
    if token == eos_id and fr[7]:
        return MOVE_STOP, -1
    edge = edge_with_token(trie[1], fr[1], fr[1] + fr[2], token)
    if edge >= 0 and edge_count(row, edge, fr[0], table[row, DEPTH], -1, trie, n_tools, table, counts) > 0:
        return MOVE_EDGE, edge
    edge = edge_with_token(trie[1], fr[4], fr[4] + fr[5], token)
    if edge >= 0 and edge_count(row, edge, fr[3], 0, fr[6], trie, n_tools, table, counts) > 0:
        return MOVE_HOP, edge
    return -1, -1


@_jit
def edge_with_token(edge_token: Any, lo: int, hi: int, token: int) -> int:
    """The edge in ``lo .. hi - 1`` (sorted by token) whose token is ``token``; -1 when none is."""
    end = hi
    while lo < hi:
        mid = (lo + hi) >> 1
        if edge_token[mid] < token:
            lo = mid + 1
        else:
            hi = mid
    return lo if lo < end and edge_token[lo] == token else -1


@_jit
def edge_count(row: int, edge: int, trie_index: int, depth: int, extra_tool: int, trie: Any, n_tools: int,
               table: Any, counts: Any) -> int:
    """The unused allowed tools below one edge at ``depth`` of trie ``trie_index``: its compiled (or the row's
    subset) count minus the used tools (and ``extra_tool``, unless -1) whose path crosses it."""
    count = allowed_count(row, edge, trie, counts)
    crossed, times = next_crossing(table, row, extra_tool, trie_index, depth, n_tools, trie, edge)
    return count - times if crossed == edge else count


@_jit
def only_move(row: int, trie: Any, n_tools: int, eos_id: int, table: Any, counts: Any, allowed: Any
              ) -> tuple[int, int, int, int]:
    """How many legal moves a running constrained row has (counted up to 2), and the (token, kind, edge) of the
    first one found."""
    fr = frame(row, trie, table, allowed)
    n, found_token, found_kind, found_edge = 0, -1, -1, -1
    if fr[7]:
        n, found_token, found_kind = 1, eos_id, MOVE_STOP
    crossing_edge, crossing_times = -1, 0
    for i in range(n_candidates(fr)):
        edge, kind, count, crossing_edge, crossing_times = open_edge(i, 1, row, fr, trie, n_tools, table, counts,
                                                                     crossing_edge, crossing_times)
        if count > 0:
            if n > 0:
                return 2, found_token, found_kind, found_edge
            n, found_token, found_kind, found_edge = 1, trie[1][edge], kind, edge
    return n, found_token, found_kind, found_edge


@_jit
def mark_legal(row: int, srow: int, trie: Any, n_tools: int, eos_id: int, table: Any,
               counts: Any, allowed: Any, bitmask: Any, node_words: Any, node_cached: Any) -> int:
    """Set the bits of the row's legal tokens in ``bitmask[srow]`` (already cleared); returns how many. A node with
    many edges (a root: the first token of a name, a hop; hundreds of edges in a large registry) comes from its
    precomputed bitmask, ``node_words[node_cached[node]]``, when ``node_cached`` has entries and the row has no
    subset (:func:`mark_node`); other nodes walk their edges."""
    fr = frame(row, trie, table, allowed)
    n = 0
    if fr[7]:
        or_bits(bitmask, srow, eos_id)
        n += 1
    first, last = 0, n_candidates(fr)
    if node_cached.shape[0] > 0 and counts.shape[0] == 0:
        node = table[row, NODE]
        if node_cached[node] >= 0:
            n += mark_node(row, srow, trie, n_tools, table, node_words[node_cached[node]], node, fr[0],
                           table[row, DEPTH], -1, bitmask)
            first = fr[2]
        root = trie[5][fr[3]]
        if fr[5] > 0 and node_cached[root] >= 0:
            n += mark_node(row, srow, trie, n_tools, table, node_words[node_cached[root]], root, fr[3], 0, fr[6],
                           bitmask)
            last = fr[2]
    crossing_edge, crossing_times = -1, 0
    for i in range(first, last):
        edge, _, count, crossing_edge, crossing_times = open_edge(i, 1, row, fr, trie, n_tools, table, counts,
                                                                  crossing_edge, crossing_times)
        if count > 0:
            or_bits(bitmask, srow, trie[1][edge])
            n += 1
    return n


@_jit
def mark_node(row: int, srow: int, trie: Any, n_tools: int, table: Any, words: Any, node: int, trie_index: int,
              depth: int, extra_tool: int, bitmask: Any) -> int:
    """OR ``words`` (every edge token of ``node``, at ``depth`` of trie ``trie_index``) into ``bitmask[srow]``, then
    clear the tokens of the node's edges whose every tool is used (or is ``extra_tool``, unless -1): only the at
    most k edges the used tools cross at this depth can close. Returns how many of the node's tokens stay."""
    lo, hi = trie[0][node], trie[0][node + 1]
    n = hi - lo
    for word in range(min(words.shape[0], bitmask.shape[1])):
        bitmask[srow, word] |= words[word]
    edge, times = next_crossing(table, row, extra_tool, trie_index, depth, n_tools, trie, lo)
    while edge < hi:  # the node's edges the used tools cross, in ascending order (none with no-repeat off)
        if trie[3][edge] - times <= 0:
            token = trie[1][edge]
            bitmask[srow, token >> 5] &= ~(np.int32(1) << np.int32(token & 31))
            n -= 1
        edge, times = next_crossing(table, row, extra_tool, trie_index, depth, n_tools, trie, edge + 1)
    return n


@_jit
def crossed_edge(table: Any, row: int, j: int, emitted: int, extra_tool: int, trie_index: int, depth: int,
                 n_tools: int, trie: Any) -> int:
    """The edge at ``depth`` of trie ``trie_index`` on used tool ``j``'s path (``extra_tool`` for j == emitted);
    -1 when the path is shorter."""
    used = table[row, USED + j] if j < emitted else extra_tool
    start = trie[7][trie_index * n_tools + used]
    return trie[8][start + depth] if trie[7][trie_index * n_tools + used + 1] - start > depth else -1


@_jit
def or_bits(bitmask: Any, srow: int, token: int) -> None:
    """Set ``token``'s bit in row ``srow`` of an int32 bitmask (bit 31 of a word is its sign bit)."""
    bitmask[srow, token >> 5] |= np.int32(1) << np.int32(token & 31)


@_jit
def best_plain(row: int, srow: int, lane: int, stride: int, n_cols: int, scores: Any, hidden: Any,
               output_to_full: Any, excluded: int, with_stats: bool) -> tuple[float, int, float, float, float]:
    """This lane's share of a plain argmax (rows without a grammar, or still thinking): (score, full token), then
    the statistics as in :func:`best_move`, over every column of score row ``srow`` but ``excluded``.
    ``excluded`` (a full id, or -1) is never chosen: a constrained row may not stop while it thinks."""
    best_value, best_token = -np.inf, -1
    runner_up, lse_max, lse_sum = -np.inf, -np.inf, 0.0
    for col in range(lane, n_cols, stride):
        token = output_to_full[col]
        if token != excluded:
            value = score(scores, hidden, srow, col)
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
def take_move(row: int, token: int, kind: int, edge: int, trie: Any, table: Any) -> None:
    """Advance a constrained slot by a legal move; no move at all (token -1) is the error state (fail loudly)."""
    if token < 0:
        table[row, STATUS] = ERROR
        return
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
def take_plain(row: int, token: int, eos_id: int, reasoning_end_id: int, table: Any) -> None:
    """Record a plain token: a thinking row starts its constraint after the marker and may not stop before its
    answer; a row without a grammar is done at the stop token; no token at all (every column excluded) fails."""
    if token < 0 or (table[row, THINKING] != 0 and token == eos_id):
        table[row, STATUS] = ERROR
    elif table[row, THINKING] != 0 and token == reasoning_end_id:
        table[row, THINKING] = 0
    elif table[row, CONSTRAINED] == 0 and token == eos_id:
        table[row, STATUS] = DONE


@_jit
def is_plain(table: Any, row: int) -> bool:
    return table[row, CONSTRAINED] == 0 or table[row, THINKING] != 0


@_jit
def accept_token(row: int, token: int, trie: Any, n_tools: int, eos_id: int, reasoning_end_id: int, table: Any,
                 counts: Any, allowed: Any) -> None:
    """Advance a row by a token chosen elsewhere. A row that is not running ignores it (done, or failed for good);
    an illegal token puts the row in the error state."""
    if table[row, STATUS] != RUNNING:
        return
    if is_plain(table, row):
        take_plain(row, token, eos_id, reasoning_end_id, table)
        return
    kind, edge = find_move(row, token, trie, n_tools, eos_id, table, counts, allowed)
    take_move(row, token if kind >= 0 else -1, kind, edge, trie, table)


@_jit
def follow_forced(row: int, srow: int, trie: Any, n_tools: int, eos_id: int, table: Any, counts: Any,
                  allowed: Any, forced: Any, n_forced: Any) -> None:
    """Take the moves the trie forces from here (each the only legal one, the stop included), writing them to
    ``forced[srow]`` and their number to ``n_forced[srow]``; at most ``forced.shape[1]`` (the next step goes on)."""
    n = 0
    while n < forced.shape[1] and table[row, STATUS] == RUNNING and not is_plain(table, row):
        n_moves, token, kind, edge = only_move(row, trie, n_tools, eos_id, table, counts, allowed)
        if n_moves != 1:
            break
        take_move(row, token, kind, edge, trie, table)
        forced[srow, n] = token
        n += 1
    if n_forced.shape[0] > 0:
        n_forced[srow] = n


@_jit
def put_decision(decision: Any, srow: int, table: Any, row: int, n_legal: int, n_continue: int) -> None:
    """What the engine's scores need of a decision (when ``decision`` has rows): how many tokens were legal, how
    many continued the current name, and which tool (by rank, from 0) the decision was about: the one being
    spelled, unless every option starts the next one. Written before the move is taken."""
    if decision.shape[0] > 0:
        decision[srow, 0] = n_legal
        decision[srow, 1] = n_continue
        decision[srow, 2] = table[row, EMITTED] + (1 if n_continue == 0 else 0)


@_jit
def choose_row(row: int, srow: int, trie: Any, n_tools: int, eos_id: int, reasoning_end_id: int, table: Any,
               counts: Any, allowed: Any, scores: Any, hidden: Any, n_cols: int, full_to_output: Any,
               output_to_full: Any, chosen: Any, stats: Any, decision: Any, forced: Any, n_forced: Any, ranked: Any
               ) -> None:
    """One row's whole choice by one lane: its best move (or plain argmax), then the moves the trie forces after
    it; ``stats`` (:func:`put_stats`), ``decision`` (:func:`put_decision`) and ``forced`` are written when they have
    rows. A row that is not running (or ``row`` -1) chooses nothing."""
    chosen[srow] = -1
    if n_forced.shape[0] > 0:
        n_forced[srow] = 0
    if row < 0 or table[row, STATUS] != RUNNING:
        no_stats(stats, srow)
        return
    with_stats = stats.shape[0] > 0
    if is_plain(table, row):
        value, token, runner_up, lse_max, lse_sum = best_plain(
            row, srow, 0, 1, n_cols, scores, hidden, output_to_full, plain_excluded(table, row, eos_id), with_stats)
        put_stats(stats, srow, value, runner_up, lse_max, lse_sum)
        chosen[srow] = token
        take_plain(row, token, eos_id, reasoning_end_id, table)
    else:
        value, token, kind, edge, runner_up, lse_max, lse_sum, n_legal, n_continue = best_move(
            row, srow, 0, 1, trie, n_tools, eos_id, table, counts, allowed, scores, hidden, full_to_output,
            with_stats, ranked)
        put_stats(stats, srow, value, runner_up, lse_max, lse_sum)
        put_decision(decision, srow, table, row, n_legal, n_continue)
        chosen[srow] = token
        take_move(row, token, kind, edge, trie, table)
    follow_forced(row, srow, trie, n_tools, eos_id, table, counts, allowed, forced, n_forced)


@_jit
def fuse_row(row: int, srow: int, trie: Any, n_tools: int, eos_id: int, table: Any, counts: Any, allowed: Any,
             logits: Any, logits_bits: Any, hidden: Any, full_to_output: Any, ranked: Any) -> None:
    """Write a ranked row's option values over its legal logits (float32 ``logits[srow]``, already masked, and
    ``logits_bits``, the same memory as int32), so that the argmax of the row (its only maximum) is the token
    :func:`best_move` chooses and its log-softmax is the choice's ``best - log_total``. Each legal token gets its
    value as :func:`best_move` adds it to the statistics; where a name may end or go on, those of the hops (each
    valued by the ending tool's prior) are permuted so the hop that starts the next tool holds the group's
    maximum. Every other value that ties the chosen token's (after rounding to float32) is moved one float step
    down, so the chosen token is the row's only maximum: the multiset of values is the choice's, but for that
    nudge. Rows not running, unconstrained, thinking or without a ranker are left as they are."""
    if row < 0 or table[row, STATUS] != RUNNING or is_plain(table, row) or not has_ranker(ranked[0], row):
        return
    chosen = best_move(row, srow, 0, 1, trie, n_tools, eos_id, table, counts, allowed, logits, hidden,
                       full_to_output, False, ranked)[1]
    if chosen < 0:
        return
    fr = frame(row, trie, table, allowed)
    ranker = ranked[0]
    weight, tool = float(ranker[row, 0]), fr[6]
    end_prior = float(ranker[row, 1 + tool]) if tool >= 0 else 0.0
    grouped = fr[5] > 0 and continues_name(row, fr, trie, n_tools, table, counts, full_to_output)
    hop_value, hop_token, hop_col = -np.inf, -1, -1
    group_value, group_token, group_col = -np.inf, -1, -1
    crossing_edge, crossing_times = -1, 0
    for i in range(n_candidates(fr)):
        edge, kind, count, crossing_edge, crossing_times = open_edge(i, 1, row, fr, trie, n_tools, table, counts,
                                                                     crossing_edge, crossing_times)
        token = trie[1][edge]
        col = full_to_output[token]
        if count > 0 and col >= 0:
            raw = score(logits, hidden, srow, col)
            value = fuse(weight, raw, edge_prior(row, edge, -1 if kind == MOVE_EDGE else tool, table, allowed,
                                                 ranked))
            if grouped and kind == MOVE_HOP:
                if beats(value, token, hop_value, hop_token):
                    hop_value, hop_token, hop_col = value, token, col
                value = fuse(weight, raw, end_prior)
                if beats(value, token, group_value, group_token):
                    group_value, group_token, group_col = value, token, col
            logits[srow, col] = value
    if fr[7] and full_to_output[eos_id] >= 0:
        col = full_to_output[eos_id]
        logits[srow, col] = fuse(weight, score(logits, hidden, srow, col), end_prior)
    if hop_col >= 0 and group_col != hop_col:  # the hop that would start the next tool holds the group's value
        held = logits[srow, hop_col]
        logits[srow, hop_col] = logits[srow, group_col]
        logits[srow, group_col] = held
    top = logits[srow, full_to_output[chosen]]
    if top == -np.inf:
        return
    if fr[7] and eos_id != chosen and logits[srow, full_to_output[eos_id]] == top:
        step_down(logits_bits, srow, full_to_output[eos_id])
    crossing_edge, crossing_times = -1, 0
    for i in range(n_candidates(fr)):
        edge, kind, count, crossing_edge, crossing_times = open_edge(i, 1, row, fr, trie, n_tools, table, counts,
                                                                     crossing_edge, crossing_times)
        token = trie[1][edge]
        col = full_to_output[token]
        if count > 0 and col >= 0 and token != chosen and logits[srow, col] == top:
            step_down(logits_bits, srow, col)


@_jit
def step_down(bits: Any, row: int, col: int) -> None:
    """``nextafter(x, -inf)`` of a finite float32 held as its int32 bits: sign-magnitude, so a positive value loses
    one from its bits, a negative one (and -0.0) gains one, and +0.0 becomes the negative smallest subnormal."""
    value = bits[row, col]
    if value > 0:
        bits[row, col] = value - 1
    elif value == 0:
        bits[row, col] = np.int32(-2147483647)
    else:
        bits[row, col] = value + 1


# -- the CPU backend's batch loops (``kernels/cpu.py``); ``rows[i]`` is the state row of score row i, -1: none -----

@_entry
def choose_rows(trie: Any, n_tools: int, eos_id: int, reasoning_end_id: int, table: Any, counts: Any,
                allowed: Any, rows: Any, scores: Any, hidden: Any, n_cols: int, full_to_output: Any,
                output_to_full: Any, chosen: Any, stats: Any, decision: Any, forced: Any, n_forced: Any,
                ranked: Any) -> None:
    """Each row's choice (:func:`choose_row`), one after another."""
    for srow in range(rows.shape[0]):
        choose_row(rows[srow], srow, trie, n_tools, eos_id, reasoning_end_id, table, counts, allowed, scores, hidden,
                   n_cols, full_to_output, output_to_full, chosen, stats, decision, forced, n_forced, ranked)


@_entry
def fuse_rows(trie: Any, n_tools: int, eos_id: int, table: Any, counts: Any, allowed: Any, rows: Any, logits: Any,
              logits_bits: Any, hidden: Any, full_to_output: Any, ranked: Any) -> None:
    """Each ranked row's option values over its masked logits (:func:`fuse_row`), one after another."""
    for srow in range(rows.shape[0]):
        fuse_row(rows[srow], srow, trie, n_tools, eos_id, table, counts, allowed, logits, logits_bits, hidden,
                 full_to_output, ranked)


@_entry
def accept_rows(trie: Any, n_tools: int, eos_id: int, reasoning_end_id: int, table: Any, counts: Any,
                allowed: Any, rows: Any, tokens: Any, n_tokens: Any) -> None:
    """Row ``rows[i]`` takes ``tokens[i, :n_tokens[i]]`` in order (:func:`accept_token`)."""
    for i in range(rows.shape[0]):
        row = rows[i]
        if row >= 0:
            for j in range(n_tokens[i]):
                accept_token(row, tokens[i, j], trie, n_tools, eos_id, reasoning_end_id, table, counts, allowed)


@_entry
def forced_rows(trie: Any, n_tools: int, eos_id: int, table: Any, counts: Any, allowed: Any, rows: Any,
                forced: Any, n_forced: Any) -> None:
    """Each row takes the moves the trie forces from where it stands (:func:`follow_forced`)."""
    for i in range(rows.shape[0]):
        if rows[i] >= 0:
            follow_forced(rows[i], i, trie, n_tools, eos_id, table, counts, allowed, forced, n_forced)
        elif n_forced.shape[0] > 0:
            n_forced[i] = 0


@_entry
def fill_rows(trie: Any, n_tools: int, eos_id: int, table: Any, counts: Any, allowed: Any, rows: Any,
              bitmask: Any, node_words: Any, node_cached: Any) -> None:
    """Row ``i`` of the int32 ``bitmask`` gets the legal next tokens of state row ``rows[i]`` (-1: left as it is):
    the trie's legal tokens while it runs; every token but stop while it thinks; every token without a grammar; only
    stop once it is done or failed (an engine pads finished rows with it; a failed answer ends). A running row with
    nothing legal enters the error state (and gets only stop)."""
    for i in range(rows.shape[0]):
        if rows[i] >= 0:
            clear_words(rows[i], i, 0, 1, table, bitmask)
            mark_row(rows[i], i, trie, n_tools, eos_id, table, counts, allowed, bitmask, node_words, node_cached)


@_jit
def clear_words(row: int, i: int, lane: int, stride: int, table: Any, bitmask: Any) -> None:
    """This lane's share of ``bitmask[i]``'s words, set to where :func:`mark_row` starts: every token for a running
    row without a grammar or still thinking, none otherwise."""
    fill = -1 if table[row, STATUS] == RUNNING and is_plain(table, row) else 0
    for word in range(lane, bitmask.shape[1], stride):
        bitmask[i, word] = fill


@_jit
def mark_row(row: int, i: int, trie: Any, n_tools: int, eos_id: int, table: Any, counts: Any, allowed: Any,
             bitmask: Any, node_words: Any, node_cached: Any) -> None:
    """After :func:`clear_words`: a thinking row loses the stop token (its answer is owed), a running constrained
    row gets its legal tokens (none: the error state), a row that is done or failed gets the stop token alone."""
    status = table[row, STATUS]
    if status == RUNNING and is_plain(table, row):
        if table[row, CONSTRAINED] != 0:
            bitmask[i, eos_id >> 5] &= ~(np.int32(1) << np.int32(eos_id & 31))
        return
    if status == RUNNING and mark_legal(row, i, trie, n_tools, eos_id, table, counts, allowed, bitmask,
                                        node_words, node_cached) == 0:
        table[row, STATUS] = ERROR
        status = ERROR
    if status != RUNNING:
        or_bits(bitmask, i, eos_id)


@_entry
def mask_rows(bitmask: Any, rows: Any, logits_bits: Any, minus_inf: int) -> None:
    """Write ``minus_inf`` (the bit pattern of -inf in the logits' dtype, viewed as integers of the same width)
    over every logit whose bit is clear in ``bitmask[i]``, for the rows with ``rows[i] >= 0``; columns past the
    bitmask are masked too. Word by word (:func:`mask_word`), as fast as filling memory (measured: the time of
    ``fill(-inf)`` over the whole ``[256, 49152]`` float32 array on one core)."""
    n_cols, n_words = logits_bits.shape[1], bitmask.shape[1]
    whole = min(n_words, n_cols >> 5)  # the words whose 32 columns all exist
    for i in range(rows.shape[0]):
        if rows[i] < 0:
            continue
        out = logits_bits[i]
        for word in range(whole):
            mask_word(out, word << 5, bitmask[i, word], minus_inf)
        for col in range(whole << 5, n_cols):  # a last partial word, and the columns past the bitmask
            if col >> 5 >= n_words or (bitmask[i, col >> 5] >> (col & 31)) & 1 == 0:
                out[col] = minus_inf


# The lane of a word's lowest set bit, by de Bruijn multiplication (``lowest * 0x077CB531`` maps each of the 32
# single bits to its own top five bits).
_DE_BRUIJN = np.array([0, 1, 28, 2, 29, 14, 24, 3, 30, 22, 20, 15, 25, 17, 4, 8,
                       31, 27, 13, 23, 21, 19, 16, 7, 26, 12, 18, 6, 11, 5, 10, 9], dtype=np.int64)


@_entry
def copy_legal(bitmask: Any, constrained: Any, logits_bits: Any, out_bits: Any, written: Any, n_written: Any,
               minus_inf: int) -> None:
    """Into ``out_bits``, which holds -inf wherever this did not write last time: for each row i with
    ``constrained[i]``, the logits whose bit is set in ``bitmask[i]``, after setting back to -inf the columns it
    wrote there last time (``written[i, :n_written[i]]``; -1: the whole row); every other row copied whole. Writes
    the legal tokens only (a word's set bits found by :data:`_DE_BRUIJN`, not lane by lane), where a mask in place
    writes every illegal logit. A row with more legal tokens than ``written`` has room for is reset whole next
    time; columns past the bitmask stay -inf."""
    n_cols, room = logits_bits.shape[1], written.shape[1]
    n_words = min(bitmask.shape[1], (n_cols + 31) >> 5)
    for i in range(logits_bits.shape[0]):
        out, source = out_bits[i], logits_bits[i]
        if not constrained[i]:
            for col in range(n_cols):  # an element loop: copying an array slice would allocate
                out[col] = source[col]
            n_written[i] = -1
            continue
        if n_written[i] < 0:
            out[:] = minus_inf
        else:
            for j in range(n_written[i]):
                out[written[i, j]] = minus_inf
        n = 0
        for word in range(n_words):
            bits = np.int64(bitmask[i, word]) & 0xFFFFFFFF
            while bits != 0:
                lowest = bits & -bits
                col = (word << 5) + _DE_BRUIJN[((lowest * 0x077CB531) & 0xFFFFFFFF) >> 27]
                bits ^= lowest
                if col < n_cols:
                    out[col] = source[col]
                    if n < room:
                        written[i, n] = col
                    n += 1
        n_written[i] = n if n <= room else -1


@_jit
def mask_word(out: Any, first: int, bits: int, minus_inf: int) -> None:
    """``out[first : first + 32]`` under one bitmask word: a fixed 32 lanes, so each case compiles to straight
    vector code: nothing allowed is a fill, everything allowed is left alone, and a mix is a branchless select."""
    bits = np.int32(bits)
    if bits == 0:
        out[first : first + 32] = minus_inf
    elif bits != -1:
        for lane in range(32):
            keep = -((bits >> np.int32(lane)) & np.int32(1))  # every bit set where the token is allowed
            out[first + lane] = (out[first + lane] & keep) | (minus_inf & ~keep)


@_allocating_entry
def next_runs(trie: Any, n_tools: int, eos_id: int, table: Any, counts: Any, allowed: Any, row: int, budget: int,
              run_tokens: Any, run_lengths: Any) -> int:
    """From a running constrained row, the runs that lead to its next choice inside the same name: a legal token,
    then the tokens the trie forces after it (edges only: the name goes on), ending where more than one token is
    legal again; in token order, each taken while it fits what is left of ``budget`` tokens. Writes them one after
    another to ``run_tokens`` (room for ``budget``) and their lengths to ``run_lengths``; returns how many. The row
    is left as it was. (Research|Finder and Research|Helper give the run ``Research``.)"""
    fr = frame(row, trie, table, allowed)
    n = n_candidates(fr)
    tokens, kinds, edges = np.empty(n, np.int32), np.empty(n, np.int32), np.empty(n, np.int32)
    m, crossing_edge, crossing_times = 0, -1, 0
    for i in range(n):
        edge, kind, count, crossing_edge, crossing_times = open_edge(i, 1, row, fr, trie, n_tools, table, counts,
                                                                     crossing_edge, crossing_times)
        if count > 0:
            tokens[m], kinds[m], edges[m] = trie[1][edge], kind, edge
            m += 1
    saved = table[row].copy()
    n_runs, used = 0, 0
    for j in np.argsort(tokens[:m]):
        take_move(row, tokens[j], kinds[j], edges[j], trie, table)
        if used < run_tokens.shape[0]:
            run_tokens[used] = tokens[j]
        length = 1
        while True:
            n_moves, token, kind, edge = only_move(row, trie, n_tools, eos_id, table, counts, allowed)
            if n_moves != 1 or kind != MOVE_EDGE:
                break
            if used + length < run_tokens.shape[0]:
                run_tokens[used + length] = token
            length += 1
            take_move(row, token, kind, edge, trie, table)
        table[row, :] = saved
        if n_moves > 1 and length <= budget:
            run_lengths[n_runs] = length
            n_runs += 1
            used += length
            budget -= length
    return n_runs
