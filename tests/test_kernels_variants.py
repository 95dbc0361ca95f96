"""``kernels/walk.py``'s compile-time no-repeat switch: the copy compiled with it off differs from the main walk only
by allowing repeats.

For small registries every answer of k tools is enumerated twice, with distinct tools and with repeats allowed, and
read off as canonical token ids (the tokenizer's own). Along random walks through the answers with repeats:

- the off variant's mask is exactly {x : prefix + [x] is a prefix of an answer with repeats}, and the main walk's
  exactly the same over the answers with distinct tools, for as long as the prefix is one of theirs;
- on the same random logits both choose the same token (and reach the same table) whenever their legal sets agree,
  i.e. while no used tool is reachable;
- where the walk finishes a used tool again, the off variant goes on and the main walk fails (the error state).
"""

from __future__ import annotations

import itertools
import random
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from support.kernels import BUNDLED, NAME_ALPHABET, SEPARATORS, SequenceSet, answer_sequences, bundled, try_compile

from tooltrie.compiler import Artifact, Contract, TokenizerInfo
from tooltrie.kernels import BatchState, walk
from tooltrie.kernels.bitmask import get_bitmask_shape
from tooltrie.kernels.cpu import CpuBackend, no_rows
from tooltrie.kernels.state import DONE, ERROR, RUNNING


@pytest.fixture(scope="module")
def off() -> ModuleType:
    return walk.variant(no_repeat=False)


class Walker:
    """One row of a batch state, driven through one compiled copy of the walk."""

    def __init__(self, module: ModuleType, artifact: Artifact, k: int, width: int) -> None:
        self.module, self.backend, self.width = module, CpuBackend(artifact), width
        self.state = BatchState.start(artifact, [k])
        self.rows = np.zeros(1, np.int32)

    def _args(self) -> tuple[Any, ...]:
        return self.backend.trie, self.backend.n_tools, self.backend.eos_id

    def legal(self) -> set[int]:
        bitmask = np.zeros(get_bitmask_shape(1, self.width), np.int32)
        s = self.state
        self.module.fill_rows(*self._args(), s.table.copy(), s.counts, s.allowed, self.rows, bitmask,
                              *self.backend.node_masks)
        bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")
        return set(np.flatnonzero(bits).tolist())

    def choose(self, logits: np.ndarray) -> tuple[int, np.ndarray]:
        """The token this copy chooses on ``logits`` and the table it reaches (the row itself is left as it is)."""
        table, s = self.state.table.copy(), self.state
        chosen = np.empty(1, np.int32)
        full_to_output = np.arange(self.width, dtype=np.int32)
        self.module.choose_rows(*self._args(), -1, table, s.counts, s.allowed, self.rows, logits, None, self.width,
                                full_to_output, full_to_output, chosen, no_rows(3, dtype=np.float64), no_rows(3),
                                no_rows(0), no_rows(), self.module.no_ranker())
        return int(chosen[0]), table

    def accept(self, token: int) -> None:
        s = self.state
        self.module.accept_rows(*self._args(), -1, s.table, s.counts, s.allowed, self.rows,
                                np.array([[token]], np.int32), np.ones(1, np.int32))

    @property
    def status(self) -> int:
        return int(self.state.status[0])


def canonical(tokenizer: TokenizerInfo, names: list[str], k: int, separator: str, *, repeats: bool
              ) -> SequenceSet:
    """The canonical token ids of every answer of k tools: distinct ones, or with repeats allowed."""
    tools = range(len(names))
    answers = list(itertools.product(tools, repeat=k) if repeats else itertools.permutations(tools, k))
    return SequenceSet(answer_sequences(tokenizer, Contract(separator=separator), names, answers))


def check_walks(off: ModuleType, artifact: Artifact, tokenizer: TokenizerInfo, names: list[str], k: int,
                separator: str, seed: int, *, walks: int = 4) -> int:
    """Random walks through the answers with repeats; returns how many steps finished a used tool again."""
    width = max(tokenizer.vocab_size, int(artifact.trie.edge_token.max()) + 1, artifact.eos_id + 1)
    with_repeats = canonical(tokenizer, names, k, separator, repeats=True)
    distinct = canonical(tokenizer, names, k, separator, repeats=False)
    rng, np_rng = random.Random(seed), np.random.default_rng(seed)
    repeated = 0
    for _ in range(walks):
        loose, main = Walker(off, artifact, k, width), Walker(walk, artifact, k, width)
        prefix: tuple[int, ...] = ()
        while loose.status == RUNNING:
            where = f"names={names} sep={separator!r} k={k} prefix={list(prefix)}"
            expected_loose = with_repeats.next_tokens(prefix)
            assert loose.legal() == expected_loose, where
            on_track = main.status == RUNNING
            if on_track:
                assert main.legal() == distinct.next_tokens(prefix), where
            logits = np_rng.standard_normal((1, width)).astype(np.float32)
            if on_track and main.legal() == expected_loose:  # no used tool reachable: the same choice
                (token_a, table_a), (token_b, table_b) = loose.choose(logits), main.choose(logits)
                assert token_a == token_b, where
                np.testing.assert_array_equal(table_a, table_b, err_msg=where)
            token = rng.choice(sorted(expected_loose))
            loose.accept(token)
            if on_track:
                main.accept(token)
                if not distinct.has_prefix((*prefix, token)):  # a used tool again: the main walk cannot
                    assert main.status == ERROR, where
                    repeated += 1
            prefix = (*prefix, token)
        assert loose.status == DONE, prefix
    return repeated


def examples(n: int) -> settings:
    return settings(max_examples=n, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@examples(25)
@given(tokenizer_name=st.sampled_from(BUNDLED), separator=st.sampled_from(SEPARATORS),
       names=st.lists(st.sampled_from(NAME_ALPHABET), min_size=1, max_size=5, unique=True), data=st.data())
def test_off_variant_allows_repeats_and_nothing_else(off: ModuleType, tokenizer_name: str, separator: str,
                                                     names: list[str], data: st.DataObject) -> None:
    tokenizer = bundled(tokenizer_name)
    artifact = try_compile(names, tokenizer, separator)
    if artifact is None:
        reject()
    k = data.draw(st.integers(1, min(3, len(names))), label="k")  # a batch state refuses k above the registry
    check_walks(off, artifact, tokenizer, names, k, separator, data.draw(st.integers(0, 2**32 - 1), label="seed"))


@pytest.mark.parametrize("tokenizer_name", BUNDLED)
def test_off_variant_finishes_a_used_tool_again_where_the_main_walk_cannot(off: ModuleType,
                                                                          tokenizer_name: str) -> None:
    tokenizer = bundled(tokenizer_name)
    names = ["get", "get_user", "set"]
    artifact = try_compile(names, tokenizer, ", ")
    assert artifact is not None
    assert check_walks(off, artifact, tokenizer, names, 3, ", ", seed=1, walks=12) > 0
    answer = [*tokenizer.encode_batch(["get_user, get_user, set"])[0], artifact.eos_id]
    width = max(tokenizer.vocab_size, artifact.eos_id + 1)
    loose, main = Walker(off, artifact, 3, width), Walker(walk, artifact, 3, width)
    for token in answer:
        loose.accept(token)
        main.accept(token)
    assert loose.status == DONE and loose.state.tools(0) == [1, 1, 2]
    assert main.status == ERROR


def test_variants_are_separate_copies_without_the_disk_cache(off: ModuleType) -> None:
    again = walk.variant(no_repeat=True)
    assert walk.NO_REPEAT and again.NO_REPEAT and not off.NO_REPEAT
    assert again is not off and again.__name__ != off.__name__ != walk.__name__
    assert not again._CACHE and not off._CACHE and walk._CACHE
