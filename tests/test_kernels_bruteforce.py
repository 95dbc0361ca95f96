"""Brute-force differential: the legal set at every step equals the set read off every answer's canonical ids.

For a small registry every answer (k distinct tools, in order) is enumerated and its canonical token ids
``encode(render(answer)) + [eos]`` computed by the tokenizer itself. Along random walks, at every step:

- ``TrieMatcher.legal_tokens()`` == {x : prefix + [x] is a prefix of some answer's ids};
- the rules oracle (``legal_moves`` on the batched state) says the same;
- the batched ``reference`` and ``cpu`` backends can choose exactly those tokens (found by elimination with
  random logits over the whole vocabulary), and both follow the walk token for token with identical tables.

A walk ends at the stop token; the matcher and both states then hold exactly the answer those ids encode.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from support.kernels import (
    BACKENDS,
    BUNDLED,
    NAME_ALPHABET,
    SEPARATORS,
    SequenceSet,
    all_answers,
    answer_sequences,
    backend_choices,
    bundled,
    legal_tokens,
    tiny_bpe_json,
    tiny_tokenizer,
    try_compile,
)

from tooltrie.compiler import Artifact, Contract, TokenizerInfo
from tooltrie.kernels import BatchState, TrieMatcher, step


def examples(n: int) -> settings:
    return settings(max_examples=n, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

TINY_NAME_CHARS = "abe_é"
TINY_CHARS = TINY_NAME_CHARS + ", |\n"


def vocab_width(artifact: Artifact, tokenizer: TokenizerInfo) -> int:
    return max(tokenizer.vocab_size, int(artifact.trie.edge_token.max()) + 1, artifact.eos_id + 1)


def check_walks(artifact: Artifact, tokenizer: TokenizerInfo, names: list[str], k: int, separator: str,
                seed: int, *, walks: int = 3) -> None:
    contract = Contract(separator=separator)
    answers = all_answers(names, k)
    sequences = answer_sequences(tokenizer, contract, names, answers)
    by_sequence = dict(zip(sequences, answers, strict=True))
    assert len(by_sequence) == len(answers), "two different answers have the same canonical token ids"
    canonical = SequenceSet(sequences)
    width = vocab_width(artifact, tokenizer)
    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    for _ in range(walks):
        matcher = TrieMatcher(artifact, k)
        states = {backend: BatchState.start(artifact, [k]) for backend in BACKENDS}
        prefix: tuple[int, ...] = ()
        while True:
            expected = canonical.next_tokens(prefix)
            where = f"names={names} sep={separator!r} k={k} prefix={list(prefix)}"
            assert matcher.legal_tokens() == sorted(expected), where
            if not expected:
                break
            slot = states["reference"].slot(0)
            assert legal_tokens(artifact, slot) == expected, where
            for backend in BACKENDS:
                assert set(backend_choices(artifact, slot, backend, width, np_rng)) == expected, (backend, where)
            token = rng.choice(sorted(expected))
            assert matcher.accept_token(token), where
            logits = np_rng.standard_normal((1, width)).astype(np.float32)
            logits[0, token] = 100.0
            for backend, state in states.items():
                assert step(artifact, state, logits, backend=backend).tolist() == [token], (backend, where)
            np.testing.assert_array_equal(states["cpu"].table, states["reference"].table)
            prefix = (*prefix, token)
        answer = list(by_sequence[prefix])
        assert matcher.is_terminated()
        assert matcher.tools() == answer
        for state in states.values():
            assert int(state.status[0]) == 1 and state.tools(0) == answer


@st.composite
def bundled_cases(draw: st.DrawFn) -> tuple[str, str, list[str], int, int]:
    tokenizer = draw(st.sampled_from(BUNDLED))
    separator = draw(st.sampled_from(SEPARATORS))
    names = draw(st.lists(st.sampled_from(NAME_ALPHABET), min_size=1, max_size=7, unique=True))
    k = draw(st.integers(1, min(3, len(names))))
    return tokenizer, separator, names, k, draw(st.integers(0, 2**32 - 1))


@examples(30)
@given(bundled_cases())
def test_legal_set_equals_brute_force_bundled(case: tuple[str, str, list[str], int, int]) -> None:
    tokenizer_name, separator, names, k, seed = case
    tokenizer = bundled(tokenizer_name)
    artifact = try_compile(names, tokenizer, separator)
    if artifact is None:
        reject()
    check_walks(artifact, tokenizer, names, k, separator, seed)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-tokenizers")


tiny_names = st.lists(st.text(TINY_NAME_CHARS, min_size=1, max_size=4), min_size=1, max_size=6, unique=True)


@examples(120)
@given(merges=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=16), names=tiny_names,
       separator=st.sampled_from((*SEPARATORS, ",")), data=st.data())
def test_legal_set_equals_brute_force_tiny_bpe(tiny_dir: Path, merges: list[tuple[int, int]], names: list[str],
                                               separator: str, data: st.DataObject) -> None:
    """Hand-made BPE tokenizers without a pre-tokenizer: merges cross the name/separator boundary."""
    tokenizer = tiny_tokenizer(tiny_bpe_json(TINY_CHARS, merges), str(tiny_dir))
    artifact = try_compile(names, tokenizer, separator)
    if artifact is None:
        reject()
    k = data.draw(st.integers(1, min(3, len(names))), label="k")
    check_walks(artifact, tokenizer, names, k, separator, data.draw(st.integers(0, 2**32 - 1), label="seed"))


# Fixed cases the design calls out: names that are token-prefixes of each other, in both directions of use.
@pytest.mark.parametrize("tokenizer_name", BUNDLED)
@pytest.mark.parametrize("separator", SEPARATORS)
@pytest.mark.parametrize("names", [
    ["get", "get_user", "getUser", "get_users"],
    ["a", "ab", "abc", "b"],
    ["météo", "mé", "météo_v2", "naïve"],
])
def test_legal_set_equals_brute_force_prefix_names(tokenizer_name: str, separator: str, names: list[str]) -> None:
    tokenizer = bundled(tokenizer_name)
    artifact = try_compile(names, tokenizer, separator)
    assert artifact is not None, "these registries compile with every bundled tokenizer and separator"
    for k in range(1, min(3, len(names)) + 1):
        check_walks(artifact, tokenizer, names, k, separator, seed=k, walks=6)


def test_exhaustive_walks_small_registry() -> None:
    """Every canonical path of a small registry is walked (not sampled), with k = 1..n."""
    tokenizer = bundled("gpt2")
    names = ["get", "get_user", "a", "ab"]
    artifact = try_compile(names, tokenizer, ", ")
    assert artifact is not None
    contract = Contract()
    for k in range(1, len(names) + 1):
        answers = all_answers(names, k)
        sequences = answer_sequences(tokenizer, contract, names, answers)
        canonical = SequenceSet(sequences)
        for sequence, answer in zip(sequences, answers, strict=True):
            matcher = TrieMatcher(artifact, k)
            for depth, token in enumerate(sequence):
                assert matcher.legal_tokens() == sorted(canonical.next_tokens(sequence[:depth]))
                assert matcher.accept_token(token)
            assert matcher.is_terminated() and matcher.tools() == list(answer)


@pytest.mark.parametrize("tokenizer_name", BUNDLED)
@pytest.mark.parametrize("separator", [*SEPARATORS, " "])  # " ": the next name's first token holds the separator
def test_a_hop_from_a_name_with_longer_names_below_it_skips_used_tools(tokenizer_name: str, separator: str) -> None:
    """At a terminal that continues into longer names ("get" below "get_user") and hops to the next tool, the move
    search scans two nodes in turn: the hop's edges must be checked against the used tools afresh, not with what
    the continuing edges left behind. Every answer of a small registry, walked many times."""
    tokenizer = bundled(tokenizer_name)
    names = ["set", "get", "get_user"]
    artifact = try_compile(names, tokenizer, separator)
    assert artifact is not None
    for k in (2, 3):
        check_walks(artifact, tokenizer, names, k, separator, seed=k, walks=24)
