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

import numpy as np
import numpy.typing as npt

from tooltrie.compiler.artifact import Artifact
from tooltrie.kernels.batch import TrieBatch
from tooltrie.kernels.bitmask import allowed_tokens, get_bitmask_shape
from tooltrie.kernels.state import DONE, ERROR, RUNNING, check_k, check_subset


class TrieMatcher:
    """Matches one answer token by token; every accepted token can be rolled back. A one-row view of the batch
    state every consumer drives (``kernels/batch.py``), on the CPU backend unless told otherwise.

    With ``reasoning_end_id`` set, the matcher accepts anything until that marker (the model's reasoning),
    and the constraint starts on the token after it.
    """

    def __init__(self, artifact: Artifact, k: int, *, reasoning_end_id: int | None = None,
                 allowed: Collection[int] | None = None, backend: str = "cpu") -> None:
        check_k(k, artifact.trie.n_tools)
        check_subset(artifact, allowed, k)
        self.artifact = artifact
        self.k = k
        self.reasoning_end_id = reasoning_end_id
        self._batch = TrieBatch(artifact, backend=backend, capacity=1, reasoning_end_id=reasoning_end_id)
        self._batch.add(0, k, thinking=reasoning_end_id is not None, subset=allowed)
        # The row after each accepted token (a few ints each): what ``rollback`` restores. The matcher's state is the
        # batch's row, read there; the history is never read for it.
        self._history = [self._batch.checkpoint(0)]
        self._scratch = np.empty(get_bitmask_shape(1, artifact.max_token_id + 1), dtype=np.int32)

    @property
    def accepted(self) -> int:
        """How many tokens have been accepted (and not rolled back)."""
        return len(self._history) - 1

    @property
    def _thinking(self) -> bool:
        return bool(self._batch.fetch().thinking[0])

    @property
    def _status(self) -> int:
        return self._batch.status(0)

    def legal_tokens(self) -> list[int] | None:
        """The legal next tokens in ascending order, or None while thinking (then anything but stop is legal)."""
        if self._thinking:
            return None
        if self._status != RUNNING:
            return []
        self._batch.fill_bitmask(self._scratch)
        self._batch.restore(0, self._history[-1])  # a row with nothing legal was put in error: not by a query
        legal: list[int] = allowed_tokens(self._scratch[0], self._scratch.shape[1] * 32).tolist()
        return legal

    def accept_token(self, token: int) -> bool:
        """Advance by ``token`` if legal; an illegal token is refused and changes nothing."""
        if self._status != RUNNING:
            return False
        self._batch.accept([[int(token)]])
        if self._batch.status(0) == ERROR:
            self._batch.restore(0, self._history[-1])
            return False
        self._history.append(self._batch.checkpoint(0))
        return True

    def fill_next_token_bitmask(self, bitmask: npt.NDArray[np.int32], index: int = 0) -> bool:
        """Write the legal next tokens into row ``index``; returns whether the row restricts anything."""
        self._batch.fill_bitmask(bitmask[index : index + 1])
        if self._status == DONE:
            bitmask[index] = 0  # nothing follows a finished answer
        self._batch.restore(0, self._history[-1])
        return True

    def rollback(self, num_tokens: int = 1) -> None:
        if not 0 <= num_tokens < len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {len(self._history) - 1} accepted")
        del self._history[len(self._history) - num_tokens :]
        self._batch.restore(0, self._history[-1])

    def reset(self) -> None:
        self.rollback(self.accepted)

    def is_terminated(self) -> bool:
        return self._status == DONE

    def is_error(self) -> bool:
        """True when no token is legal (never, for a valid artifact and 1 <= k <= tools)."""
        return not self._thinking and not self.is_terminated() and not self.legal_tokens()

    def tools(self) -> list[int]:
        return self._batch.tools(0)

    def tool_names(self) -> list[str]:
        return [self.artifact.registry.tools[t].name for t in self.tools()]

    def forced_tokens(self, *, include_stop: bool = False) -> list[int]:
        """The run of tokens the trie forces from here (jump-forward): each the only legal next token."""
        if self._thinking:
            return []
        (forced,) = self._batch.follow_forced()
        self._batch.restore(0, self._history[-1])
        if forced and forced[-1] == self.artifact.eos_id and not include_stop:
            forced.pop()
        return forced

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
