"""Per-request tool subsets in the mask: a slot limited to some tools, with no recompilation.

Checked against brute force (every answer over the subset, tokenized), against a registry compiled from the subset
alone (same logits, same tokens), between the backends (reference, cpu, and the CUDA kernel under the simulator),
and for the refusals (empty, too small, unknown tools).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.kernels import NAME_ALPHABET, SequenceSet, bundled, try_compile

from tooltrie.compiler import Artifact, Contract
from tooltrie.errors import DecodeError
from tooltrie.kernels import BatchState, TrieMatcher, step
from tooltrie.kernels.rules import Slot, advance, legal_moves
from tooltrie.kernels.state import DONE, RUNNING

TOKENIZERS = ("gpt2", "smollm2-135m")


def examples(n: int) -> settings:
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def registry_and_subset(draw: Any, max_names: int = 7) -> tuple[Artifact, frozenset[int], int] | None:
    names = draw(st.lists(st.sampled_from(NAME_ALPHABET), min_size=2, max_size=max_names, unique=True))
    tokenizer = bundled(draw(st.sampled_from(TOKENIZERS)))
    artifact = try_compile(names, tokenizer, draw(st.sampled_from((", ", "\n"))))
    if artifact is None:
        return None
    subset = frozenset(draw(st.lists(st.integers(0, len(names) - 1), min_size=1, max_size=len(names), unique=True)))
    k = draw(st.integers(1, min(3, len(subset))))
    return artifact, subset, k


def subset_sequences(artifact: Artifact, subset: frozenset[int], k: int) -> SequenceSet:
    """Every answer of k distinct tools from the subset, as the tokenizer encodes it, plus the stop token."""
    names = artifact.registry.names
    tokenizer = bundled(str(artifact.tokenizer_meta["source"]))
    texts = [artifact.contract.render([names[t] for t in answer]) for answer in itertools.permutations(subset, k)]
    return SequenceSet((*ids, artifact.eos_id) for ids in tokenizer.encode_batch(texts))


@examples(40)
@given(case=registry_and_subset())
def test_subset_edge_counts_of_every_tool_are_the_compiled_counts(case: Any) -> None:
    if case is None:
        return
    artifact, subset, _ = case
    trie = artifact.trie
    np.testing.assert_array_equal(trie.subset_edge_counts(np.arange(trie.n_tools)), trie.edge_tool_count)
    counts = trie.subset_edge_counts(np.array(sorted(subset)))
    assert (counts <= trie.edge_tool_count).all() and (counts >= 0).all()


@examples(40)
@given(case=registry_and_subset(max_names=6))
def test_legal_tokens_are_brute_force_over_the_subset(case: Any) -> None:
    """At every prefix of every answer over the subset, the legal tokens are exactly the next tokens of those
    answers: nothing outside the subset is ever legal, nothing inside it is ever missing."""
    if case is None:
        return
    artifact, subset, k = case
    answers = subset_sequences(artifact, subset, k)
    stack = [((), Slot.start(artifact.trie, k, subset))]
    while stack:
        prefix, slot = stack.pop()
        moves = legal_moves(artifact.trie, slot, artifact.eos_id)
        assert set(moves) == answers.next_tokens(prefix), prefix
        for token, move in moves.items():
            stack.append(((*prefix, token), advance(artifact.trie, slot, move)))


@examples(30)
@given(case=registry_and_subset(), seed=st.integers(0, 2**31))
def test_backends_agree_and_answer_from_the_subset(case: Any, seed: int) -> None:
    if case is None:
        return
    artifact, subset, k = case
    rng = np.random.default_rng(seed)
    ks = [k, k, 1]
    subsets = [subset, None, frozenset([min(subset)])]  # a subset, the whole registry, a subset of one
    states = {backend: BatchState.start(artifact, ks, subsets=subsets) for backend in ("reference", "cpu")}
    width = max(int(artifact.tokenizer_meta["vocab_size"]), artifact.eos_id + 1)
    for _ in range(64):
        if not (states["reference"].status == RUNNING).any():
            break
        logits = rng.integers(0, 3, size=(len(ks), width)).astype(np.float32)  # many ties
        chosen = {backend: step(artifact, state, logits, backend=backend) for backend, state in states.items()}
        np.testing.assert_array_equal(chosen["cpu"], chosen["reference"])
        np.testing.assert_array_equal(states["cpu"].table, states["reference"].table)
    state = states["reference"]
    assert (state.status == DONE).all()
    for row, allowed in enumerate(subsets):
        tools = state.tools(row)
        assert len(tools) == ks[row] == len(set(tools))
        assert allowed is None or set(tools) <= allowed


@examples(25)
@given(case=registry_and_subset(), seed=st.integers(0, 2**31))
def test_a_subset_decodes_as_the_registry_compiled_from_it(case: Any, seed: int) -> None:
    """Same logits, same tokens: limiting a slot to a subset is compiling a registry of the subset alone."""
    if case is None:
        return
    artifact, subset, k = case
    names = artifact.registry.names
    tokenizer = bundled(str(artifact.tokenizer_meta["source"]))
    alone = try_compile([names[t] for t in sorted(subset)], tokenizer, artifact.contract.separator)
    if alone is None or (alone.split_left, alone.split_right) != (artifact.split_left, artifact.split_right):
        return  # the sub-registry compiles with another separator split: token paths differ by design
    rng = np.random.default_rng(seed)
    width = max(int(artifact.tokenizer_meta["vocab_size"]), artifact.eos_id + 1)
    limited = BatchState.start(artifact, [k], subsets=[subset])
    own = BatchState.start(alone, [k])
    limited_tokens, own_tokens = [], []
    for _ in range(64):
        if limited.status[0] != RUNNING and own.status[0] != RUNNING:
            break
        logits = rng.standard_normal((1, width)).astype(np.float32)
        limited_tokens.append(int(step(artifact, limited, logits, backend="cpu")[0]))
        own_tokens.append(int(step(alone, own, logits, backend="cpu")[0]))
    assert limited_tokens == own_tokens
    assert [names[t] for t in limited.tools(0)] == [alone.registry.names[t] for t in own.tools(0)]


def test_a_subset_of_exactly_k_tools_always_completes() -> None:
    artifact = try_compile(["get", "get_user", "get_users", "search", "a", "ab"], bundled("gpt2"), ", ")
    assert artifact is not None
    rng = np.random.default_rng(0)
    for subset in itertools.combinations(range(6), 3):
        state = BatchState.start(artifact, [3], subsets=[frozenset(subset)])
        for _ in range(40):
            if state.status[0] != RUNNING:
                break
            step(artifact, state, rng.standard_normal((1, 50257)).astype(np.float32), backend="cpu")
        assert state.status[0] == DONE
        assert sorted(state.tools(0)) == list(subset)


@pytest.mark.parametrize(("subset", "k", "message"), [
    (frozenset(), 1, "k=1 but only 0 tools are allowed"),
    (frozenset({0, 1}), 3, "k=3 but only 2 tools are allowed"),
    (frozenset({0, 9}), 1, r"tool indices \[9\] are outside 0..3"),
])
def test_empty_too_small_or_unknown_subsets_are_refused(subset: frozenset[int], k: int, message: str) -> None:
    artifact = try_compile(["get", "set", "a", "b"], bundled("gpt2"), ", ")
    assert artifact is not None
    with pytest.raises(DecodeError, match=message):
        BatchState.start(artifact, [k], subsets=[subset])
    with pytest.raises(DecodeError, match=message):
        TrieMatcher(artifact, k, allowed=subset)
    state = BatchState.start(artifact, [1])
    with pytest.raises(DecodeError, match=message):
        state.add(artifact, 0, k, subset=subset)


def test_slots_keep_their_subsets_through_compact_and_reset() -> None:
    artifact = try_compile(["get", "set", "a", "b", "ab"], bundled("gpt2"), ", ")
    assert artifact is not None
    state = BatchState.start(artifact, [1, 1, 1], subsets=[None, frozenset({1}), frozenset({2, 3})])
    state.compact([-1, 1, 0])
    assert state.slot(0).allowed == frozenset({2, 3}) and state.slot(1).allowed == frozenset({1})
    state.add(artifact, 0, 2, subset=None)
    assert state.slot(0).allowed == frozenset(range(5))  # the whole registry, spelled out
    np.testing.assert_array_equal(state.counts[0], artifact.trie.edge_tool_count)


def test_the_matcher_takes_a_subset() -> None:
    artifact = try_compile(["get", "get_user", "set"], bundled("gpt2"), ", ")
    assert artifact is not None
    matcher = TrieMatcher(artifact, 1, allowed={1})
    tokenizer = bundled("gpt2")
    assert matcher.forced_tokens(include_stop=True) == [*tokenizer.encode("get_user"), tokenizer.eos_id]
    assert not TrieMatcher(artifact, 1, allowed={1}).accept_token(tokenizer.encode("set")[0])


def test_subset_names_in_context_render_as_the_contract_says() -> None:
    """A decoded subset answer parses back to its tools through the contract."""
    artifact = try_compile(["météo", "mé", "a.b", "x1", "x12"], bundled("smollm2-135m"), ", ")
    assert artifact is not None
    tokenizer = bundled("smollm2-135m")
    state = BatchState.start(artifact, [2], subsets=[frozenset({0, 4})])
    tokens = []
    rng = np.random.default_rng(1)
    while state.status[0] == RUNNING:
        tokens.append(int(step(artifact, state, rng.standard_normal((1, 49152)).astype(np.float32))[0]))
    text = tokenizer.decode(tokens[:-1])
    assert sorted(Contract(", ").parse(text)) == ["météo", "x12"]
