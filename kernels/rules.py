"""The rules in the mask, for one slot, written to be read: the oracle every backend is tested against.

A slot is in some trie (picked by its phase, see ``tooltrie.compiler.trie``) at some node and depth. Its legal
moves are:

- an edge of the node whose count of unused tools is positive. The count is the compiled ``edge_tool_count``
  minus the used tools whose path crosses the edge; a used tool crosses at most one edge of a node, the one at
  this depth of its path, so this is one comparison per used tool (a slot has used at most k tools);
- at a terminal whose tool is unused: **stop** if it is the k-th tool, else a **hop**: the edges of the next
  phase's root, counted as if the terminal's tool were already used;
- nothing else. With no legal move the slot is in error (fail loudly); with k <= number of tools that never
  happens, since every counted edge leads to an unused tool.

A slot may be limited to a subset of the registry (``allowed``: per-request permissions): its edge counts are then
the allowed tools crossing each edge, and a terminal counts only if its tool is allowed. A tool outside the subset
is in effect used from the start; nothing is recompiled.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import IntEnum

import numpy as np
import numpy.typing as npt

from tooltrie.compiler.trie import CompiledTrie, phase_of
from tooltrie.kernels import walk


class Status(IntEnum):
    RUNNING = walk.RUNNING
    DONE = walk.DONE
    ERROR = walk.ERROR


@dataclass(frozen=True)
class Slot:
    """One answer being decoded. ``used`` lists the finished tools in order; ``allowed`` (None: all) the tools
    it may name."""

    k: int
    node: int
    depth: int = 0
    used: tuple[int, ...] = ()
    status: Status = Status.RUNNING
    allowed: frozenset[int] | None = None
    # The subset's edge counts, counted once when the slot starts (every move keeps the same array).
    allowed_counts: npt.NDArray[np.int32] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def start(cls, trie: CompiledTrie, k: int, allowed: frozenset[int] | None = None) -> Slot:
        return cls(k=k, node=_root(trie, 0, k), allowed=allowed, allowed_counts=subset_counts(trie, allowed))

    @property
    def emitted(self) -> int:
        return len(self.used)


@dataclass(frozen=True)
class Move:
    """Where a token leads: an edge of the current node, a hop to the next tool, or the stop."""

    token: int
    kind: str  # "edge" | "hop" | "stop"
    edge: int = -1


def legal_moves(trie: CompiledTrie, slot: Slot, eos_id: int) -> dict[int, Move]:
    """Every legal token of ``slot`` and where it leads."""
    if slot.status is not Status.RUNNING:
        return {}
    phase_trie = int(trie.phase_trie[phase_of(slot.emitted, slot.k)])
    counts = _edge_counts(trie, slot)
    moves = {int(trie.edge_token[e]): Move(int(trie.edge_token[e]), "edge", e)
             for e in _open_edges(trie, phase_trie, slot.node, slot.depth, slot.used, counts)}
    tool = int(trie.node_tool[slot.node])
    if tool >= 0 and tool not in slot.used and (slot.allowed is None or tool in slot.allowed):
        if slot.emitted + 1 == slot.k:
            moves[eos_id] = Move(eos_id, "stop")
        else:
            next_trie = int(trie.phase_trie[phase_of(slot.emitted + 1, slot.k)])
            root = int(trie.trie_root[next_trie])
            for e in _open_edges(trie, next_trie, root, 0, (*slot.used, tool), counts):
                moves[int(trie.edge_token[e])] = Move(int(trie.edge_token[e]), "hop", e)
    return moves


def advance(trie: CompiledTrie, slot: Slot, move: Move) -> Slot:
    """The slot after taking ``move`` (one of ``legal_moves``)."""
    if move.kind == "edge":
        return replace(slot, node=int(trie.edge_child[move.edge]), depth=slot.depth + 1)
    finished = (*slot.used, int(trie.node_tool[slot.node]))
    if move.kind == "stop":
        return replace(slot, used=finished, status=Status.DONE)
    return replace(slot, node=int(trie.edge_child[move.edge]), depth=1, used=finished)


def committed(trie: CompiledTrie, slot: Slot) -> tuple[int, ...]:
    """The tools ``slot``'s answer has committed to, in order: its finished tools and, where its name has ended with
    more tools owed and no token can make it a longer name, the tool it names. What the prior of the next tool is
    made from (``TrieBatch.add(follow=...)``), before the token that starts the next tool is chosen."""
    tool = int(trie.node_tool[slot.node])
    ended = (slot.status is Status.RUNNING and tool >= 0 and tool not in slot.used and slot.emitted + 1 < slot.k
             and trie.node_edge_start[slot.node + 1] == trie.node_edge_start[slot.node])
    return (*slot.used, tool) if ended else slot.used


def runs_to_next_choice(trie: CompiledTrie, slot: Slot, eos_id: int, budget: int) -> list[tuple[int, ...]]:
    """From a choice, the runs that lead to the next choice inside the same name: a legal token, then the tokens
    the trie forces after it (edges only: the name goes on), ending where more than one token is legal again. In
    token order, each taken while it fits what is left of ``budget`` tokens. (Research|Finder and Research|Helper
    give the run ``Research``.)"""
    runs: list[tuple[int, ...]] = []
    for token, move in sorted(legal_moves(trie, slot, eos_id).items()):
        if move.kind == "stop":
            continue
        run, at = [token], advance(trie, slot, move)
        moves = legal_moves(trie, at, eos_id)
        while len(moves) == 1:
            (forced,) = moves.values()
            if forced.kind != "edge":  # the name ends here: nothing is left to choose in it
                break
            run.append(forced.token)
            at = advance(trie, at, forced)
            moves = legal_moves(trie, at, eos_id)
        if len(moves) > 1 and len(run) <= budget:
            runs.append(tuple(run))
            budget -= len(run)
    return runs


def fail(slot: Slot) -> Slot:
    return replace(slot, status=Status.ERROR)


def subset_counts(trie: CompiledTrie, allowed: frozenset[int] | None) -> npt.NDArray[np.int32] | None:
    """How many allowed tools cross each edge (None: all of them, the compiled ``edge_tool_count``)."""
    return None if allowed is None else trie.subset_edge_counts(np.fromiter(sorted(allowed), dtype=np.int64))


def _edge_counts(trie: CompiledTrie, slot: Slot) -> npt.NDArray[np.int32]:
    if slot.allowed is None:
        return trie.edge_tool_count
    if slot.allowed_counts is not None:
        return slot.allowed_counts
    return trie.subset_edge_counts(np.fromiter(sorted(slot.allowed), dtype=np.int64))  # a slot built by hand


def _open_edges(trie: CompiledTrie, phase_trie: int, node: int, depth: int, used: tuple[int, ...],
                edge_counts: npt.NDArray[np.int32]) -> list[int]:
    edges = trie.node_edges(node)
    counts = {e: int(edge_counts[e]) for e in edges}
    for tool in used:
        path = trie.tool_path(phase_trie, tool)
        if depth < len(path) and int(path[depth]) in counts:
            counts[int(path[depth])] -= 1
    return [e for e in edges if counts[e] > 0]


def _root(trie: CompiledTrie, emitted: int, k: int) -> int:
    return int(trie.trie_root[trie.phase_trie[phase_of(emitted, k)]])
