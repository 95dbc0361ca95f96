"""The decode state of a batch: a few small arrays per row, one form for every backend.

A row's state is O(k), whatever the registry's size: the node and depth it is at, the tools it has finished
(at most k), and a status. The per-edge counts of unused tools are derived from those as the walk goes (see
``kernels/walk.py``), so nothing proportional to the trie is kept per row, unless a row is limited to a subset of
the registry: then the batch carries per-row edge counts and an allowed-tool bitmap (``counts``, ``allowed``),
computed from the subset once, when the row is added (no recompilation).

The state persists across steps: rows are added, removed and moved between steps (continuous batching; vLLM's
persistent batch), and each step advances the rows it is given in place. ``kernels/batch.py`` pairs it with a
backend; the row as a readable ``Slot`` (:meth:`BatchState.slot`) is for the oracle and tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from tooltrie.compiler.artifact import Artifact
from tooltrie.compiler.trie import phase_of
from tooltrie.errors import DecodeError
from tooltrie.kernels.rules import Slot, Status
from tooltrie.kernels.walk import (  # the table's layout: columns and status values
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
    K,
)

__all__ = [
    "CONSTRAINED",
    "DEPTH",
    "DONE",
    "EMITTED",
    "ERROR",
    "NODE",
    "RUNNING",
    "STATUS",
    "THINKING",
    "USED",
    "BatchState",
    "FollowUp",
    "Following",
    "K",
    "check_k",
    "check_subset",
]

Column = npt.NDArray[np.int32]  # a view into the table: writes go through
Subset = Collection[int] | None  # tool indices a slot may name; None: the whole registry
# A request's prior for its next tool, given the tools its answer has committed to (``tooltrie.ranker.FollowUp``).
FollowUp = Callable[[tuple[int, ...]], npt.ArrayLike]


@dataclass(eq=False)
class Following:
    """A ranked row whose prior follows its answer: ``follow_up`` makes the prior of the next tool, and ``tools``
    are the committed tools the row's ranker holds the prior for."""

    follow_up: FollowUp
    tools: tuple[int, ...] = ()


def _no_rows(dtype: type[np.generic]) -> npt.NDArray[Any]:
    return np.zeros((0, 0), dtype=dtype)


@dataclass(eq=False)
class BatchState:
    """One int32 table, a row per slot (one array to pass to a kernel, one to reorder on eviction).

    ``used[i, :emitted[i]]`` are slot i's finished tools, in order. ``constrained[i]`` is 0 for rows without a
    grammar (plain argmax); ``thinking[i]`` is 1 while a reasoning model has not yet emitted its
    reasoning-end marker (the constraint starts after it). ``counts [B, E]`` and ``allowed [B, n_tools]`` hold
    each row's subset; with no rows (the default) every slot has the whole registry. ``ranker [B, 1 + n_tools]``
    (float32) holds each row's fused ranker, the model's weight then each tool's prior (``walk.has_ranker``; NaN
    weight: none); with no rows, no row has one. ``following[i]`` (None: no) says how row i's prior follows its
    answer (``TrieBatch.add(follow=...)``): host-side, one entry per row, moved with the rows.
    """

    table: npt.NDArray[np.int32]
    counts: npt.NDArray[np.int32] = field(default_factory=lambda: _no_rows(np.int32))
    allowed: npt.NDArray[np.uint8] = field(default_factory=lambda: _no_rows(np.uint8))
    ranker: npt.NDArray[np.float32] = field(default_factory=lambda: _no_rows(np.float32))
    following: list[Following | None] = field(default_factory=list)
    limited: npt.NDArray[np.bool_] = field(default_factory=lambda: np.zeros(0, dtype=bool))  # rows with a subset
    occupied: npt.NDArray[np.bool_] = field(default_factory=lambda: np.zeros(0, dtype=bool))  # added, not removed

    def __post_init__(self) -> None:
        self.following += [None] * (len(self.table) - len(self.following))
        self.limited = np.concatenate([self.limited, np.zeros(len(self.table) - len(self.limited), dtype=bool)])
        self.occupied = np.concatenate([self.occupied, np.zeros(len(self.table) - len(self.occupied), dtype=bool)])

    @property
    def k(self) -> Column:
        return self.table[:, K]

    @property
    def node(self) -> Column:
        return self.table[:, NODE]

    @property
    def depth(self) -> Column:
        return self.table[:, DEPTH]

    @property
    def emitted(self) -> Column:
        return self.table[:, EMITTED]

    @property
    def status(self) -> Column:
        return self.table[:, STATUS]

    @property
    def constrained(self) -> Column:
        return self.table[:, CONSTRAINED]

    @property
    def thinking(self) -> Column:
        return self.table[:, THINKING]

    @property
    def used(self) -> Column:
        return self.table[:, USED:]

    @classmethod
    def start(cls, artifact: Artifact, ks: Sequence[int], *, constrained: Sequence[bool] | None = None,
              thinking: Sequence[bool] | None = None, k_max: int | None = None,
              subsets: Sequence[Subset] | None = None) -> BatchState:
        """Fresh slots, one per entry of ``ks``, each on the whole registry or on its entry of ``subsets``;
        refuses any k outside 1..number of tools (of the subset) up front."""
        n_tools = artifact.trie.n_tools
        ks_array = np.asarray(ks, dtype=np.int32).reshape(-1)
        constrained_array = np.ones(len(ks_array), bool) if constrained is None else np.asarray(constrained, bool)
        subsets = [None] * len(ks_array) if subsets is None else list(subsets)
        if len(subsets) != len(ks_array):
            raise DecodeError(f"{len(subsets)} subsets for {len(ks_array)} slots")
        for row, (k, has_grammar) in enumerate(zip(ks_array, constrained_array, strict=True)):
            if has_grammar:
                check_k(int(k), n_tools, where=f"slot {row}")
                check_subset(artifact, subsets[row], int(k), where=f"slot {row}")
        widest = max(1, int(ks_array.max(initial=1)))
        width = widest if k_max is None else int(k_max)
        if width < widest:
            raise DecodeError(f"k_max={width} leaves no room for a slot with k={widest}")
        table = np.zeros((len(ks_array), USED + width), dtype=np.int32)
        table[:, USED:] = -1
        table[:, K] = ks_array
        table[:, NODE] = [artifact.trie.trie_root[artifact.trie.phase_trie[phase_of(0, max(int(k), 1))]]
                          for k in ks_array]
        table[:, CONSTRAINED] = constrained_array
        table[:, THINKING] = False if thinking is None else np.asarray(thinking, bool)
        state = cls(table)
        state.occupied[:] = True
        for row, subset in enumerate(subsets):
            if subset is not None:
                state._limit(artifact, row, subset)
        return state

    def _limit(self, artifact: Artifact, row: int, subset: Subset) -> None:
        """Give ``row`` the edge counts and allowed tools of ``subset`` (None: the whole registry)."""
        trie = artifact.trie
        if subset is None and self.counts.shape[0] == 0:
            return
        if self.counts.shape[0] == 0:  # the first subset in this batch: every row gets its own counts
            self.counts = np.tile(trie.edge_tool_count, (len(self), 1))
            self.allowed = np.ones((len(self), trie.n_tools), dtype=np.uint8)
        self.limited[row] = subset is not None
        if subset is None:
            self.counts[row], self.allowed[row] = trie.edge_tool_count, 1
        else:
            tools = np.fromiter(subset, dtype=np.int64)
            self.counts[row] = trie.subset_edge_counts(tools)
            self.allowed[row] = 0
            self.allowed[row, tools] = 1

    def __len__(self) -> int:
        return len(self.k)

    def slot(self, row: int) -> Slot:
        emitted = int(self.emitted[row])
        allowed = frozenset(np.flatnonzero(self.allowed[row]).tolist()) if self.allowed.shape[0] else None
        return Slot(k=int(self.k[row]), node=int(self.node[row]), depth=int(self.depth[row]),
                    used=tuple(int(t) for t in self.used[row, :emitted]), status=Status(int(self.status[row])),
                    allowed=allowed)

    def set_slot(self, row: int, slot: Slot) -> None:
        self.node[row], self.depth[row], self.status[row] = slot.node, slot.depth, int(slot.status)
        self.emitted[row] = slot.emitted
        self.used[row, :] = -1
        self.used[row, : slot.emitted] = slot.used

    def tools(self, row: int) -> list[int]:
        return [int(t) for t in self.used[row, : self.emitted[row]]]

    def committed(self, artifact: Artifact, row: int) -> tuple[int, ...]:
        """The tools row's answer has committed to (``rules.committed``, read from the table)."""
        trie, used = artifact.trie, tuple(self.tools(row))
        node = int(self.node[row])
        tool = int(trie.node_tool[node]) if self.constrained[row] and not self.thinking[row] else -1
        ended = (self.status[row] == RUNNING and tool >= 0 and tool not in used and len(used) + 1 < self.k[row]
                 and trie.node_edge_start[node + 1] == trie.node_edge_start[node])
        return (*used, tool) if ended else used

    @classmethod
    def empty(cls, capacity: int, *, k_max: int = 1) -> BatchState:
        """``capacity`` free rows (rows are added with :meth:`add`)."""
        table = np.zeros((capacity, USED + k_max), dtype=np.int32)
        table[:, USED:] = -1
        table[:, STATUS] = DONE
        return cls(table)

    def add(self, artifact: Artifact, row: int, k: int, *, constrained: bool = True, thinking: bool = False,
            subset: Subset = None, prior: npt.ArrayLike | None = None, model_weight: float = 1.0,
            follow: FollowUp | None = None) -> None:
        """Start a new request in ``row`` (growing the batch if needed): its counts come from its subset, once.
        With ``prior`` (one float per tool, already weighted), its choices rank ``model_weight * score + prior``
        (the fused ranker of ``kernels/walk.py``); with ``follow`` too, the prior follows the answer
        (``TrieBatch``)."""
        if follow is not None and prior is None:
            raise DecodeError(f"slot {row}: a prior that follows the answer needs a prior to start from")
        if constrained:
            check_k(k, artifact.trie.n_tools, where=f"slot {row}")
            check_subset(artifact, subset, k, where=f"slot {row}")
        if row >= len(self):
            self.grow(max(row + 1, 2 * len(self)))
        self._limit(artifact, row, subset)
        self._rank(artifact, row, prior, model_weight)
        self.following[row] = None if follow is None else Following(follow)
        self.occupied[row] = True
        if k > self.used.shape[1]:
            self.table = np.pad(self.table, ((0, 0), (0, k - self.used.shape[1])), constant_values=-1)
        self.k[row] = k
        self.constrained[row], self.thinking[row] = constrained, thinking
        self.set_slot(row, Slot.start(artifact.trie, max(k, 1)))

    def _rank(self, artifact: Artifact, row: int, prior: npt.ArrayLike | None, model_weight: float) -> None:
        """Give ``row`` its ranker (None: none)."""
        if prior is None and self.ranker.shape[0] == 0:
            return
        n_tools = artifact.trie.n_tools
        if self.ranker.shape[0] == 0:  # the first ranker in this batch: every row gets a (NaN: empty) one
            self.ranker = np.zeros((len(self), 1 + n_tools), np.float32)
            self.ranker[:, 0] = np.nan
        if prior is None:
            self.ranker[row, 0] = np.nan
            return
        values = np.asarray(prior, dtype=np.float32)
        if values.shape != (n_tools,) or not np.isfinite(values).all() or not math.isfinite(model_weight):
            raise DecodeError(f"slot {row}: a ranker needs {n_tools} finite priors and a finite model weight, got "
                              f"shape {values.shape}, weight {model_weight}")
        self.ranker[row, 0], self.ranker[row, 1:] = model_weight, values

    def remove(self, row: int) -> None:
        """Free ``row``: it is done, and no step touches it until it is added again. What only the rows that left
        needed goes with them (:meth:`release`)."""
        self.status[row], self.constrained[row] = DONE, 0
        self.following[row] = None
        self.limited[row] = self.occupied[row] = False
        self.release()

    def release(self) -> None:
        """Keep only the widths the rows not removed need: used-tool columns for their largest k, per-row
        edge counts while one of them has a subset, ranker rows while one of them has a prior. A request with a
        large k, a subset or a prior widens the state while it lives, and no longer."""
        live = self.occupied
        width = max(1, int(self.k[live].max(initial=1)))
        if width < self.used.shape[1]:
            self.table = np.ascontiguousarray(self.table[:, : USED + width])
        if self.counts.shape[0] and not (self.limited & live).any():
            self.counts, self.allowed = _no_rows(np.int32), _no_rows(np.uint8)
        if self.ranker.shape[0] and np.isnan(self.ranker[live, 0]).all():
            self.ranker = _no_rows(np.float32)

    def move(self, source: int, target: int) -> None:
        """Row ``source``'s request moves to ``target`` (whose own request, if any, is dropped); ``source`` is free."""
        if max(source, target) >= len(self):
            self.grow(max(source, target) + 1)
        if source == target:
            return
        for array in self._row_arrays():
            array[target] = array[source]
        self.following[target] = self.following[source]
        self.status[source], self.constrained[source] = DONE, 0
        self.following[source], self.limited[source], self.occupied[source] = None, False, False

    def swap(self, a: int, b: int) -> None:
        """Rows ``a`` and ``b`` trade places."""
        if max(a, b) >= len(self):
            self.grow(max(a, b) + 1)
        for array in self._row_arrays():
            array[[a, b]] = array[[b, a]]
        self.following[a], self.following[b] = self.following[b], self.following[a]

    def _row_arrays(self) -> list[npt.NDArray[Any]]:
        """The arrays with a row per slot (those without rows are not in use)."""
        return [array for array in (self.table, self.counts, self.allowed, self.ranker, self.limited,
                                                   self.occupied) if array.shape[0]]

    def grow(self, capacity: int) -> None:
        """Room for ``capacity`` rows; the new ones are free."""
        extra = capacity - len(self)
        if extra <= 0:
            return
        self.table = np.concatenate([self.table, BatchState.empty(extra, k_max=self.used.shape[1]).table])
        self.following += [None] * extra
        self.limited = np.concatenate([self.limited, np.zeros(extra, dtype=bool)])
        self.occupied = np.concatenate([self.occupied, np.zeros(extra, dtype=bool)])
        if self.counts.shape[0]:
            self.counts = np.concatenate([self.counts, np.zeros((extra, self.counts.shape[1]), np.int32)])
            self.allowed = np.concatenate([self.allowed, np.zeros((extra, self.allowed.shape[1]), np.uint8)])
        if self.ranker.shape[0]:
            self.ranker = np.concatenate([self.ranker, np.full((extra, self.ranker.shape[1]), np.nan, np.float32)])

    def compact(self, batch_mapping: Sequence[int] | npt.NDArray[np.integer]) -> None:
        """Drop and reorder slots after an eviction: ``batch_mapping[i]`` is old slot i's new index, or -1."""
        mapping = np.asarray(batch_mapping, dtype=np.int64)
        if mapping.shape != (len(self),):
            raise DecodeError(f"batch_mapping has shape {mapping.shape}, expected ({len(self)},)")
        if (mapping < -1).any():
            raise DecodeError(f"batch_mapping holds {int(mapping.min())}: entries are new indices, or -1 for evicted")
        kept = mapping[mapping >= 0]
        if not np.array_equal(np.sort(kept), np.arange(len(kept))):
            raise DecodeError(f"batch_mapping must send kept slots to 0..{len(kept) - 1} exactly once, got {kept}")
        order = np.argsort(np.where(mapping >= 0, mapping, len(self)), kind="stable")[: len(kept)]
        self.table = np.ascontiguousarray(self.table[order])
        self.following = [self.following[i] for i in order.tolist()]
        self.limited = np.ascontiguousarray(self.limited[order])
        self.occupied = np.ascontiguousarray(self.occupied[order])
        if self.counts.shape[0]:
            self.counts = np.ascontiguousarray(self.counts[order])
            self.allowed = np.ascontiguousarray(self.allowed[order])
        if self.ranker.shape[0]:
            self.ranker = np.ascontiguousarray(self.ranker[order])


def check_subset(artifact: Artifact, subset: Subset, k: int, *, where: str = "request") -> None:
    """A subset must name real tools, at least k of them: refused before decoding starts."""
    if subset is None:
        return
    tools = set(subset)
    bad = sorted(t for t in tools if not 0 <= t < artifact.trie.n_tools)
    if bad:
        raise DecodeError(f"{where}: tool indices {bad[:5]} are outside 0..{artifact.trie.n_tools - 1}")
    if len(tools) < k:
        raise DecodeError(f"{where}: k={k} but only {len(tools)} tools are allowed; an answer needs k distinct "
                          "allowed tools")


def check_k(k: int, n_tools: int, *, where: str = "request") -> None:
    """k must be 1..number of tools: with more, no answer exists; refuse before decoding starts."""
    if not 1 <= k <= n_tools:
        raise DecodeError(f"{where}: k={k} is outside 1..{n_tools} (the number of tools this grammar allows)")
