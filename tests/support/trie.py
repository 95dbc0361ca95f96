"""Helpers shared by the tests: read an answer off the trie arrays, and walk a trie token by token."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tooltrie.compiler import Artifact, phase_of


def trie_ids(artifact: Artifact, tool_ids: Sequence[int]) -> list[int]:
    """An answer's token ids read straight off the trie arrays (phase by phase), independently of
    ``Artifact.token_path``."""
    trie = artifact.trie
    ids: list[int] = []
    for position, tool in enumerate(tool_ids):
        phase = phase_of(position, len(tool_ids))
        edges = trie.tool_path(int(trie.phase_trie[phase]), int(tool))
        ids += trie.edge_token[edges].tolist()
    return ids


def walk(artifact: Artifact, phase: int, tokens: Sequence[int]) -> int:
    """Follow ``tokens`` from the root of ``phase``'s trie by binary search over each node's sorted edges;
    return the node reached, or -1 if some token has no edge."""
    trie = artifact.trie
    node = int(trie.trie_root[trie.phase_trie[phase]])
    for token in tokens:
        lo, hi = int(trie.node_edge_start[node]), int(trie.node_edge_start[node + 1])
        at = lo + int(np.searchsorted(trie.edge_token[lo:hi], token))
        if at == hi or int(trie.edge_token[at]) != token:
            return -1
        node = int(trie.edge_child[at])
    return node
