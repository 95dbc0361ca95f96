"""Batched per-slot decode state: a few small arrays per slot, shared by every backend.

A slot's state is O(k), whatever the registry's size: the node and depth it is at, the tools it has finished
(at most k), and a status. The per-edge counts of unused tools are derived from those at each step (see
``kernels/rules.py``), so nothing proportional to the trie is copied per slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
    "K",
    "check_k",
]

Column = npt.NDArray[np.int32]  # a view into the table: writes go through


@dataclass(eq=False)
class BatchState:
    """One int32 table, a row per slot (one array to pass to a kernel, one to reorder on eviction).

    ``used[i, :emitted[i]]`` are slot i's finished tools, in order. ``constrained[i]`` is 0 for rows without a
    grammar (plain argmax); ``thinking[i]`` is 1 while a reasoning model has not yet emitted its
    reasoning-end marker (the constraint starts after it).
    """

    table: npt.NDArray[np.int32]

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
              thinking: Sequence[bool] | None = None, k_max: int | None = None) -> BatchState:
        """Fresh slots, one per entry of ``ks``; refuses any k outside 1..number of tools up front."""
        n_tools = artifact.trie.n_tools
        ks_array = np.asarray(ks, dtype=np.int32).reshape(-1)
        constrained_array = np.ones(len(ks_array), bool) if constrained is None else np.asarray(constrained, bool)
        for row, (k, has_grammar) in enumerate(zip(ks_array, constrained_array, strict=True)):
            if has_grammar:
                check_k(int(k), n_tools, where=f"slot {row}")
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
        return cls(table)

    def __len__(self) -> int:
        return len(self.k)

    def slot(self, row: int) -> Slot:
        emitted = int(self.emitted[row])
        return Slot(k=int(self.k[row]), node=int(self.node[row]), depth=int(self.depth[row]),
                    used=tuple(int(t) for t in self.used[row, :emitted]), status=Status(int(self.status[row])))

    def set_slot(self, row: int, slot: Slot) -> None:
        self.node[row], self.depth[row], self.status[row] = slot.node, slot.depth, int(slot.status)
        self.emitted[row] = slot.emitted
        self.used[row, :] = -1
        self.used[row, : slot.emitted] = slot.used

    def tools(self, row: int) -> list[int]:
        return [int(t) for t in self.used[row, : self.emitted[row]]]

    def reset(self, artifact: Artifact, row: int, k: int, *, constrained: bool = True,
              thinking: bool = False) -> None:
        """Reuse ``row`` for a new request (continuous batching: a slot joins between steps)."""
        if constrained:
            check_k(k, artifact.trie.n_tools, where=f"slot {row}")
        if k > self.used.shape[1]:
            self.table = np.pad(self.table, ((0, 0), (0, k - self.used.shape[1])), constant_values=-1)
        self.k[row] = k
        self.constrained[row], self.thinking[row] = constrained, thinking
        self.set_slot(row, Slot.start(artifact.trie, max(k, 1)))

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


def check_k(k: int, n_tools: int, *, where: str = "request") -> None:
    """k must be 1..number of tools: with more, no answer exists; refuse before decoding starts."""
    if not 1 <= k <= n_tools:
        raise DecodeError(f"{where}: k={k} is outside 1..{n_tools} (the number of tools this grammar allows)")
