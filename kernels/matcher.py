"""A per-request matcher with XGrammar's API, for engines that want a token bitmask.

>>> from tooltrie.compiler import TokenizerInfo, compile_registry
>>> from tooltrie.registry import make_registry
>>> tok = TokenizerInfo.load("gpt2")
>>> artifact = compile_registry(make_registry([{"name": "get"}, {"name": "get_user"}], name="demo"), tok)
>>> matcher = TrieMatcher(artifact, k=2)
>>> matcher.forced_tokens()  # every answer starts with "get"
[1136]
>>> for token in tok.encode("get_user, get") + [tok.eos_id]:
...     assert matcher.accept_token(token)
>>> matcher.is_terminated(), matcher.tool_names()
(True, ['get_user', 'get'])
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from tooltrie.compiler.artifact import Artifact
from tooltrie.kernels.bitmask import set_allowed
from tooltrie.kernels.rules import Slot, Status, advance, legal_moves
from tooltrie.kernels.state import check_k, check_subset


@dataclass(frozen=True)
class _State:
    slot: Slot
    thinking: bool


class TrieMatcher:
    """Matches one answer token by token; every accepted token can be rolled back.

    With ``reasoning_end_id`` set, the matcher accepts anything until that marker (the model's reasoning),
    and the constraint starts on the token after it.
    """

    def __init__(self, artifact: Artifact, k: int, *, reasoning_end_id: int | None = None,
                 allowed: Collection[int] | None = None) -> None:
        check_k(k, artifact.trie.n_tools)
        check_subset(artifact, allowed, k)
        self.artifact = artifact
        self.k = k
        self.reasoning_end_id = reasoning_end_id
        subset = None if allowed is None else frozenset(allowed)
        self._initial = _State(Slot.start(artifact.trie, k, subset), thinking=reasoning_end_id is not None)
        self._history = [self._initial]

    @property
    def accepted(self) -> int:
        """How many tokens have been accepted (and not rolled back)."""
        return len(self._history) - 1

    @property
    def _state(self) -> _State:
        return self._history[-1]

    def legal_tokens(self) -> list[int] | None:
        """The legal next tokens in ascending order, or None while thinking (then anything but stop is legal)."""
        if self._state.thinking:
            return None
        return sorted(legal_moves(self.artifact.trie, self._state.slot, self.artifact.eos_id))

    def accept_token(self, token: int) -> bool:
        """Advance by ``token`` if legal; an illegal token is refused and changes nothing."""
        state = self._state
        if state.thinking:
            if token == self.artifact.eos_id:
                return False  # the answer is owed: no stop before it, not even while thinking
            self._history.append(replace(state, thinking=token != self.reasoning_end_id))
            return True
        move = legal_moves(self.artifact.trie, state.slot, self.artifact.eos_id).get(int(token))
        if move is None:
            return False
        self._history.append(replace(state, slot=advance(self.artifact.trie, state.slot, move)))
        return True

    def fill_next_token_bitmask(self, bitmask: npt.NDArray[np.int32], index: int = 0) -> bool:
        """Write the legal next tokens into row ``index``; returns whether the row restricts anything."""
        tokens = self.legal_tokens()
        if tokens is None:
            bitmask[index] = -1
            eos = self.artifact.eos_id
            bitmask[index].view(np.uint32)[eos >> 5] &= ~np.uint32(1 << (eos & 31))
            return True
        set_allowed(bitmask[index], tokens)
        return True

    def rollback(self, num_tokens: int = 1) -> None:
        if not 0 <= num_tokens < len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {len(self._history) - 1} accepted")
        del self._history[len(self._history) - num_tokens :]

    def reset(self) -> None:
        self._history = [self._initial]

    def is_terminated(self) -> bool:
        return self._state.slot.status is Status.DONE

    def is_error(self) -> bool:
        """True when no token is legal (never, for a valid artifact and 1 <= k <= tools)."""
        return not self._state.thinking and not self.is_terminated() and not self.legal_tokens()

    def tools(self) -> list[int]:
        return list(self._state.slot.used)

    def tool_names(self) -> list[str]:
        return [self.artifact.registry.tools[t].name for t in self.tools()]

    def forced_tokens(self, *, include_stop: bool = False) -> list[int]:
        """The run of tokens the trie forces from here (jump-forward): each the only legal next token."""
        if self._state.thinking:
            return []
        trie, eos = self.artifact.trie, self.artifact.eos_id
        slot, forced = self._state.slot, list[int]()
        while True:
            moves = legal_moves(trie, slot, eos)
            if len(moves) != 1:
                return forced
            (move,) = moves.values()
            if move.kind == "stop" and not include_stop:
                return forced
            forced.append(move.token)
            slot = advance(trie, slot, move)

    def fill_draft_tree_bitmask(self, tokens: Sequence[int], parents: Sequence[int],
                                bitmask: npt.NDArray[np.int32]) -> npt.NDArray[np.bool_]:
        """Masks for a speculative draft tree, by a DFS with rollback; the matcher ends where it started.

        Node ``i`` has token ``tokens[i]`` and parent ``parents[i]`` (-1: a child of the current state;
        parents come before children). Row 0 of ``bitmask`` is the mask at the current state, row ``i + 1`` the
        mask after the path from the root to node ``i``. A node refused by its parent's state is left
        unmasked (all ones), with its whole subtree. Returns which nodes were accepted.
        """
        n = len(tokens)
        if len(parents) != n or bitmask.shape[0] < n + 1:
            raise ValueError(f"need parents for each of {n} nodes and a bitmask with {n + 1} rows")
        children: list[list[int]] = [[] for _ in range(n + 1)]  # children[0]: the root's
        for node, parent in enumerate(parents):
            if not -1 <= parent < node:
                raise ValueError(f"node {node}: parent {parent} must be -1 or an earlier node")
            children[parent + 1].append(node)
        accepted = np.zeros(n, dtype=bool)
        bitmask[: n + 1] = -1
        self.fill_next_token_bitmask(bitmask, 0)
        stack: list[tuple[int, bool]] = [(child, False) for child in reversed(children[0])]
        while stack:
            node, leaving = stack.pop()
            if leaving:
                self.rollback(1)
                continue
            if not self.accept_token(tokens[node]):
                continue  # refused: this row and its subtree stay unmasked
            accepted[node] = True
            self.fill_next_token_bitmask(bitmask, node + 1)
            stack.append((node, True))
            stack.extend((child, False) for child in reversed(children[node + 1]))
        return accepted
