"""The compiled trie: flat CSR arrays over token ids, built by sorting, then frozen and validated.

Layout and the mask walk are derived in ``docs/trie.md``. In short, a compiled registry holds up to four tries,
one per *phase* of an answer (first tool or a later one x more tools owed or the last one); the phase picks the
trie, so a terminal node never needs to know whether it ends the answer or hops to the next tool.

Arrays (all int32, so one kernel signature serves every registry; limits: < 2**31 nodes, edges and tokens):

- ``node_edge_start[N+1]``: node ``v`` owns edges ``node_edge_start[v]:node_edge_start[v+1]``, sorted by token;
- ``edge_token[E]``, ``edge_child[E]``: the token on the edge and the node it leads to;
- ``edge_tool_count[E]``: how many tools' paths (in that edge's trie) cross the edge, the initial per-edge count;
- ``node_tool[N]``: the tool whose path ends at the node, or -1 (a terminal may have children);
- ``trie_root[R]``: the root node of each trie; ``phase_trie[4]``: the trie used in each phase;
- ``tool_path_start[R*T+1]``, ``tool_path_edges[...]``: tool ``t``'s edges in trie ``r`` are
  ``tool_path_edges[tool_path_start[r*T+t]:tool_path_start[r*T+t+1]]``, one per depth.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import numpy.typing as npt

from tooltrie.errors import ArtifactError

Int32Array = npt.NDArray[np.int32]

# Phases of an answer. The trie for a phase is phase_trie[phase].
PHASE_FIRST_MORE = 0  # first tool, more owed after it: ends with a hop
PHASE_FIRST_LAST = 1  # first and only tool (k = 1): ends with stop
PHASE_NEXT_MORE = 2  # a later tool, more owed after it
PHASE_NEXT_LAST = 3  # the last tool of k > 1
N_PHASES = 4


def concat_ranges(starts: npt.NDArray[np.integer], lengths: npt.NDArray[np.integer]) -> npt.NDArray[np.int64]:
    """The concatenated ranges ``starts[i]:starts[i] + lengths[i]``, without a Python loop.

    >>> concat_ranges(np.array([5, 0]), np.array([2, 3])).tolist()
    [5, 6, 0, 1, 2]
    """
    offsets = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    ranges: npt.NDArray[np.int64] = np.repeat(starts, lengths) + offsets
    return ranges


def phase_of(emitted: int, k: int) -> int:
    """The phase of the tool being written when ``emitted`` of ``k`` tools are already out.

    >>> [phase_of(emitted, 3) for emitted in range(3)]
    [0, 2, 3]
    >>> phase_of(0, 1)
    1
    """
    return (2 if emitted > 0 else 0) + (1 if emitted + 1 == k else 0)


@dataclass(frozen=True)
class Split:
    """Where the separator is cut: ``left`` ends a tool that has a successor, ``right`` starts the successor."""

    left: str
    right: str

    def affixes(self, phase: int) -> tuple[str, str]:
        """The (prefix, suffix) written around a name in ``phase``."""
        prefix = self.right if phase in (PHASE_NEXT_MORE, PHASE_NEXT_LAST) else ""
        suffix = self.left if phase in (PHASE_FIRST_MORE, PHASE_NEXT_MORE) else ""
        return prefix, suffix


@dataclass(frozen=True, eq=False)
class CompiledTrie:
    """The frozen arrays; see the module docstring. Build with :func:`build_trie`."""

    node_edge_start: Int32Array
    edge_token: Int32Array
    edge_child: Int32Array
    edge_tool_count: Int32Array
    node_tool: Int32Array
    trie_root: Int32Array
    phase_trie: Int32Array
    tool_path_start: Int32Array
    tool_path_edges: Int32Array

    @property
    def n_nodes(self) -> int:
        return len(self.node_tool)

    @property
    def n_edges(self) -> int:
        return len(self.edge_token)

    @property
    def n_tries(self) -> int:
        return len(self.trie_root)

    @property
    def n_tools(self) -> int:
        return (len(self.tool_path_start) - 1) // max(self.n_tries, 1)

    @property
    def max_depth(self) -> int:
        return int(np.diff(self.tool_path_start).max(initial=0))

    @property
    def device_bytes(self) -> int:
        """Bytes of every array a decoding kernel reads."""
        return sum(array.nbytes for array in self.arrays().values())

    def arrays(self) -> dict[str, Int32Array]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_arrays(cls, arrays: dict[str, npt.NDArray[np.generic]]) -> CompiledTrie:
        missing = sorted({f.name for f in fields(cls)} - set(arrays))
        if missing:
            raise ArtifactError(f"missing trie arrays: {missing}")
        return cls(**{f.name: np.ascontiguousarray(arrays[f.name], dtype=np.int32) for f in fields(cls)})

    def tool_path(self, trie: int, tool: int) -> Int32Array:
        start = trie * self.n_tools + tool
        return self.tool_path_edges[self.tool_path_start[start] : self.tool_path_start[start + 1]]

    def subset_edge_counts(self, tools: npt.NDArray[np.integer]) -> Int32Array:
        """``edge_tool_count`` for a registry of ``tools`` only: how many of them cross each edge, in every trie.
        (For all tools it is ``edge_tool_count`` itself.) One pass over their paths, no recompilation."""
        tools = np.asarray(tools, dtype=np.int64)
        path = (np.arange(self.n_tries)[:, None] * self.n_tools + tools[None, :]).reshape(-1)
        starts, ends = self.tool_path_start[path], self.tool_path_start[path + 1]
        edges = self.tool_path_edges[concat_ranges(starts, ends - starts)]
        return np.bincount(edges, minlength=self.n_edges).astype(np.int32)

    def tools_below(self) -> tuple[Int32Array, Int32Array]:
        """The inverse of the tool paths: edge ``e``'s tools (those whose path in its trie crosses it) are
        ``tools[start[e]:start[e + 1]]``, ascending. What a ranker's prior is aggregated over (``walk.edge_prior``)."""
        per_path = np.diff(self.tool_path_start)
        tool_of_entry = np.repeat(np.tile(np.arange(self.n_tools, dtype=np.int32), self.n_tries), per_path)
        order = np.argsort(self.tool_path_edges, kind="stable")  # stable: each edge's tools stay ascending
        counts = np.bincount(self.tool_path_edges, minlength=self.n_edges)
        start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        return start, tool_of_entry[order].astype(np.int32)

    def node_edges(self, node: int) -> range:
        return range(int(self.node_edge_start[node]), int(self.node_edge_start[node + 1]))

    def edge_parent(self) -> Int32Array:
        """The node each edge leaves from."""
        return np.repeat(np.arange(self.n_nodes, dtype=np.int32), np.diff(self.node_edge_start))

    def node_trie(self) -> Int32Array:
        """The trie each node belongs to (tries own consecutive node ranges starting at their roots)."""
        return (np.searchsorted(self.trie_root, np.arange(self.n_nodes), side="right") - 1).astype(np.int32)

    def validate(self) -> None:
        """Check every invariant the decoders rely on; raise :class:`ArtifactError` naming the first broken one."""
        n_nodes, n_edges, n_tries, n_tools = self.n_nodes, self.n_edges, self.n_tries, self.n_tools

        def require(ok: bool | np.bool_, what: str) -> None:
            if not ok:
                raise ArtifactError(f"invalid trie: {what}")

        for name, array in self.arrays().items():
            require(array.dtype == np.int32 and array.ndim == 1, f"{name} must be a 1-d int32 array")
        require(n_tries >= 1 and (len(self.tool_path_start) - 1) == n_tries * n_tools, "tool_path_start shape")
        require(len(self.node_edge_start) == n_nodes + 1, "node_edge_start has N+1 entries")
        require(self.node_edge_start[0] == 0 and self.node_edge_start[-1] == n_edges, "node_edge_start bounds")
        require(bool(np.all(np.diff(self.node_edge_start) >= 0)), "node_edge_start is non-decreasing")
        require(len(self.edge_child) == n_edges and len(self.edge_tool_count) == n_edges, "edge array lengths")
        require(bool(np.all((self.edge_child > 0) & (self.edge_child < n_nodes))), "edge_child in range")
        require(bool(np.all(self.edge_token >= 0)), "edge tokens are non-negative")
        require(bool(np.all((self.node_tool >= -1) & (self.node_tool < n_tools))), "node_tool in range")
        require(self.trie_root[0] == 0 and bool(np.all(np.diff(self.trie_root) > 0))
                and self.trie_root[-1] < n_nodes, "trie roots start each trie's node range, in order")
        require(len(self.phase_trie) == N_PHASES, "phase_trie has one entry per phase")
        require(bool(np.all((self.phase_trie >= 0) & (self.phase_trie < n_tries))), "phase_trie in range")
        # Within a node, tokens strictly increase: binary search works and no token leads two ways.
        parent = self.edge_parent()
        same_parent = parent[1:] == parent[:-1]
        require(bool(np.all(self.edge_token[1:][same_parent] > self.edge_token[:-1][same_parent])),
                "tokens strictly increase within a node")
        node_trie = self.node_trie()
        require(bool(np.all(node_trie[parent] == node_trie[self.edge_child])), "edges stay inside their trie")
        # A trie is a tree: every non-root node has exactly one incoming edge.
        incoming = np.bincount(self.edge_child, minlength=n_nodes)
        is_root = np.zeros(n_nodes, dtype=bool)
        is_root[self.trie_root] = True
        require(bool(np.all(incoming[is_root] == 0) and np.all(incoming[~is_root] == 1)), "each node has one parent")
        # Paths: consecutive edges chain, each path ends at its tool's terminal, counts equal the paths crossing.
        require(bool(np.all(np.diff(self.tool_path_start) >= 1)), "every tool has a non-empty path in every trie")
        require(self.tool_path_start[0] == 0 and self.tool_path_start[-1] == len(self.tool_path_edges),
                "tool_path_start bounds")
        require(bool(np.all((self.tool_path_edges >= 0) & (self.tool_path_edges < n_edges))),
                "tool_path_edges in range")
        counts = np.bincount(self.tool_path_edges, minlength=n_edges)
        require(len(counts) == n_edges and bool(np.all(counts == self.edge_tool_count)),
                "edge_tool_count equals the number of tool paths crossing each edge")
        starts, ends = self.tool_path_start[:-1], self.tool_path_start[1:] - 1
        path_trie = np.repeat(np.arange(n_tries), n_tools)
        require(bool(np.all(parent[self.tool_path_edges[starts]] == self.trie_root[path_trie])),
                "every path starts at its trie's root")
        chained = parent[self.tool_path_edges[1:]] == self.edge_child[self.tool_path_edges[:-1]]
        chained[starts[1:] - 1] = True  # a path's first edge need not follow the previous path's last
        require(bool(np.all(chained)), "every path is connected")
        require(bool(np.all(self.node_tool[self.edge_child[self.tool_path_edges[ends]]] == np.tile(
            np.arange(n_tools), n_tries))), "every path ends at its tool's terminal")


class DuplicatePathError(ValueError):
    """Two tools have the same token path in one trie, so one terminal would stand for both."""

    def __init__(self, pairs: list[tuple[int, int]]) -> None:
        super().__init__(f"tools with identical token paths: {pairs[:10]}")
        self.pairs = pairs


@dataclass(frozen=True)
class FlatPaths:
    """Token paths concatenated into one array: path ``i`` is ``tokens[starts[i]:starts[i + 1]]``.

    >>> FlatPaths.of([[5, 7], [], [6]]).lengths.tolist(), FlatPaths.of([[5, 7], [], [6]]).path(2)
    ([2, 0, 1], [6])
    """

    tokens: npt.NDArray[np.int64]
    starts: npt.NDArray[np.int64]  # len(paths) + 1 entries

    @classmethod
    def of(cls, paths: Sequence[Sequence[int]]) -> FlatPaths:
        lengths = np.fromiter((len(p) for p in paths), dtype=np.int64, count=len(paths))
        tokens = np.fromiter(itertools.chain.from_iterable(paths), dtype=np.int64, count=int(lengths.sum()))
        return cls(tokens, np.concatenate([[0], np.cumsum(lengths)]))

    @classmethod
    def concatenate(cls, parts: Sequence[FlatPaths]) -> FlatPaths:
        if not parts:
            return cls.of([])
        offsets = np.cumsum([0] + [len(part.tokens) for part in parts[:-1]])
        return cls(np.concatenate([part.tokens for part in parts]),
                   np.concatenate([[0]] + [part.starts[1:] + offset for part, offset in zip(parts, offsets,
                                                                                             strict=True)]))

    def __len__(self) -> int:
        return len(self.starts) - 1

    @property
    def lengths(self) -> npt.NDArray[np.int64]:
        return np.diff(self.starts)

    def path(self, i: int) -> list[int]:
        return [int(token) for token in self.tokens[self.starts[i] : self.starts[i + 1]]]

    def padded(self) -> npt.NDArray[np.int64]:
        """A row per path, padded with -1 (a path sorts before its extensions; padding never equals a token)."""
        lengths = self.lengths
        padded = np.full((len(self), int(lengths.max(initial=0))), -1, dtype=np.int64)
        padded[np.arange(padded.shape[1]) < lengths[:, None]] = self.tokens
        return padded

    def duplicates(self) -> list[tuple[int, int]]:
        """Pairs (earlier, later) of paths with the same tokens, each later path once."""
        padded = self.padded()
        order = np.lexsort(padded.T[::-1]) if padded.shape[1] else np.arange(len(self))
        rows = padded[order]
        same = np.concatenate([[False], np.all(rows[1:] == rows[:-1], axis=1)])
        # Sorting is stable, so the first row of each run of equal rows is the earliest path.
        run_first = np.maximum.accumulate(np.where(same, 0, np.arange(len(order))))
        return [(int(order[run_first[i]]), int(order[i])) for i in np.nonzero(same)[0]]


def build_trie(paths_per_trie: Sequence[Sequence[Sequence[int]] | FlatPaths],
               phase_trie: Sequence[int]) -> CompiledTrie:
    """Build the frozen arrays from each trie's token paths (``paths_per_trie[r][tool]``).

    Each trie is built by sorting its paths: in lexicographic order, the nodes a path adds are those below its
    longest common prefix with the previous path, so node ids come out in DFS preorder without a pointer tree.
    Raises :class:`DuplicatePathError` when two tools share a path (they would share a terminal).

    >>> trie = build_trie([[[5, 7], [5], [6]]], [0, 0, 0, 0])
    >>> trie.edge_token.tolist(), trie.node_tool.tolist(), trie.edge_tool_count.tolist()
    ([5, 6, 7], [-1, 1, 0, 2], [2, 1, 1])
    """
    parts = [_build_one(paths) for paths in paths_per_trie]
    node_base = np.cumsum([0] + [part.n_nodes for part in parts])
    edge_base = np.cumsum([0] + [len(part.edge_token) for part in parts])
    path_lengths = np.concatenate([part.path_lengths for part in parts])
    return CompiledTrie(
        node_edge_start=_i32(np.concatenate(
            [part.node_edge_start[:-1] + edge_base[r] for r, part in enumerate(parts)] + [[edge_base[-1]]])),
        edge_token=_i32(np.concatenate([part.edge_token for part in parts])),
        edge_child=_i32(np.concatenate([part.edge_child + node_base[r] for r, part in enumerate(parts)])),
        edge_tool_count=_i32(np.concatenate([part.edge_tool_count for part in parts])),
        node_tool=_i32(np.concatenate([part.node_tool for part in parts])),
        trie_root=_i32(node_base[:-1]),
        phase_trie=_i32(phase_trie),
        tool_path_start=_i32(np.concatenate([[0], np.cumsum(path_lengths)])),
        tool_path_edges=_i32(np.concatenate([part.tool_path_edges + edge_base[r] for r, part in enumerate(parts)])),
    )


@dataclass(frozen=True)
class _OneTrie:
    n_nodes: int
    node_edge_start: npt.NDArray[np.int64]
    edge_token: npt.NDArray[np.int64]
    edge_child: npt.NDArray[np.int64]
    edge_tool_count: npt.NDArray[np.int64]
    node_tool: npt.NDArray[np.int64]
    path_lengths: npt.NDArray[np.int64]
    tool_path_edges: npt.NDArray[np.int64]  # concatenated in tool order


def _build_one(paths: Sequence[Sequence[int]] | FlatPaths) -> _OneTrie:
    flat = paths if isinstance(paths, FlatPaths) else FlatPaths.of(paths)
    n_tools, lengths = len(flat), flat.lengths
    depth = int(lengths.max())
    padded = flat.padded()
    order = np.lexsort(padded.T[::-1])
    rows, row_lengths = padded[order], lengths[order]
    # lcp[i]: tokens row i shares with row i-1; row i adds the nodes at depths lcp[i]..len-1.
    differs = rows[1:] != rows[:-1]
    identical = ~differs.any(axis=1)  # padding included: same tokens and same length
    if identical.any():
        rows_after = np.nonzero(identical)[0] + 1
        raise DuplicatePathError([(int(order[i - 1]), int(order[i])) for i in rows_after])
    lcp = np.zeros(n_tools, dtype=np.int64)
    lcp[1:] = differs.argmax(axis=1)
    cols = np.arange(depth)
    on_path = cols < row_lengths[:, None]
    is_new = on_path & (cols >= lcp[:, None])
    # New cells in row-major order are nodes in DFS preorder; node 0 is the root.
    cell_node = np.zeros((n_tools, depth), dtype=np.int64)
    cell_node[is_new] = np.arange(1, int(is_new.sum()) + 1)
    # A cell that is not new shares its node with the row above: the owner is the last row that created it.
    owner = np.maximum.accumulate(np.where(cols >= lcp[:, None], np.arange(n_tools)[:, None], 0), axis=0)
    cell_node = cell_node[owner, cols]
    n_nodes = int(is_new.sum()) + 1
    # Each node but the root has one incoming edge; its parent is the node one column to the left.
    child = cell_node[is_new]
    parent = np.where(np.nonzero(is_new)[1] > 0, np.roll(cell_node, 1, axis=1)[is_new], 0)
    token = rows[is_new]
    edge_order = np.lexsort((token, parent))  # CSR: edges grouped by parent, tokens ascending
    edge_of_node = np.empty(n_nodes, dtype=np.int64)
    edge_of_node[child[edge_order]] = np.arange(len(edge_order))
    node_tool = np.full(n_nodes, -1, dtype=np.int64)
    node_tool[cell_node[np.arange(n_tools), row_lengths - 1]] = order
    # Paths in original tool order.
    inverse = np.empty(n_tools, dtype=np.int64)
    inverse[order] = np.arange(n_tools)
    path_edges = edge_of_node[cell_node[inverse]][on_path[inverse]]
    return _OneTrie(
        n_nodes=n_nodes,
        node_edge_start=np.concatenate([[0], np.cumsum(np.bincount(parent, minlength=n_nodes))]),
        edge_token=token[edge_order],
        edge_child=child[edge_order],
        edge_tool_count=np.bincount(path_edges, minlength=len(edge_order)),
        node_tool=node_tool,
        path_lengths=lengths,
        tool_path_edges=path_edges,
    )


def _i32(values: npt.ArrayLike) -> Int32Array:
    array = np.asarray(values)
    if array.size and (array.max() > np.iinfo(np.int32).max or array.min() < np.iinfo(np.int32).min):
        raise OverflowError("trie array exceeds int32")
    return np.ascontiguousarray(array, dtype=np.int32)
