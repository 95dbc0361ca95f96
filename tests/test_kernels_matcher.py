"""TrieMatcher (the XGrammar-style per-request API) and the bitmask utilities.

Refusal without side effects, masks equal to the legal set, rollback/reset, termination, forced tokens and
jump-forward, applying a mask to NumPy and torch logits, bitmask shapes, and the draft-tree masks checked
against walking each root-to-node path with a fresh matcher.
"""

from __future__ import annotations

import random
from functools import cache
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.kernels import bundled, compile_names

from tooltrie.compiler import Artifact
from tooltrie.kernels import TrieMatcher, allocate_token_bitmask, apply_token_bitmask_inplace, get_bitmask_shape
from tooltrie.kernels.bitmask import allowed_tokens, set_allowed

NAMES = ("get", "get_user", "getUser", "get_users", "a", "ab", "abc", "search", "search_web", "météo")
K_VALUES = (1, 2, 3, len(NAMES))


def examples(n: int) -> settings:
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@cache
def artifact_for(tokenizer_name: str = "gpt2", separator: str = ", ") -> Artifact:
    return compile_names(NAMES, bundled(tokenizer_name), separator)


def vocab_of(artifact: Artifact) -> int:
    return int(artifact.tokenizer_meta["vocab_size"])


def snapshot(matcher: TrieMatcher) -> tuple[Any, ...]:
    return (matcher.legal_tokens(), matcher.tools(), matcher.is_terminated(), matcher.is_error())


def replay(artifact: Artifact, k: int, tokens: list[int], **kwargs: Any) -> TrieMatcher:
    matcher = TrieMatcher(artifact, k, **kwargs)
    for token in tokens:
        assert matcher.accept_token(token)
    return matcher


def random_walk(matcher: TrieMatcher, rng: random.Random, steps: int) -> list[int]:
    """Accept up to ``steps`` random legal tokens; returns them."""
    taken = []
    for _ in range(steps):
        legal = matcher.legal_tokens()
        if not legal:
            break
        token = rng.choice(legal)
        assert matcher.accept_token(token)
        taken.append(token)
    return taken


def mask_row(matcher: TrieMatcher, vocab: int) -> np.ndarray[Any, Any]:
    bitmask = allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask)
    return bitmask[0].copy()


# ------------------------------------------------------------------------------------------------ accept/refuse


@pytest.mark.parametrize("tokenizer_name", ["gpt2", "smollm2-135m"])
@pytest.mark.parametrize("k", K_VALUES)
def test_accept_refuses_illegal_tokens_without_changing_state(tokenizer_name: str, k: int) -> None:
    artifact = artifact_for(tokenizer_name)
    vocab = vocab_of(artifact)
    rng = random.Random(k)
    for _ in range(4):
        matcher = TrieMatcher(artifact, k)
        accepted = 0
        while True:
            legal = matcher.legal_tokens()
            assert legal is not None
            before = snapshot(matcher)
            illegal = {rng.randrange(vocab) for _ in range(20)} | {artifact.eos_id, 0, vocab - 1, -1, vocab, 2**40}
            for token in sorted(illegal - set(legal)):
                assert not matcher.accept_token(token), token
                assert snapshot(matcher) == before
            if not legal:
                break
            assert matcher.accept_token(rng.choice(legal))
            accepted += 1
        assert matcher.is_terminated() and not matcher.is_error()
        assert len(matcher.tools()) == k == len(set(matcher.tools()))
        # Refused tokens left nothing to roll back: exactly the accepted ones lead back to the start.
        with pytest.raises(ValueError):
            matcher.rollback(accepted + 1)
        matcher.rollback(accepted)
        assert snapshot(matcher) == snapshot(TrieMatcher(artifact, k))


@pytest.mark.parametrize("k", K_VALUES)
def test_bitmask_equals_legal_set(k: int) -> None:
    artifact = artifact_for("smollm2-135m", "\n")
    vocab = vocab_of(artifact)
    rng = random.Random(k)
    for _ in range(4):
        matcher = TrieMatcher(artifact, k)
        while not matcher.is_terminated():
            bitmask = allocate_token_bitmask(4, vocab)
            untouched = bitmask.copy()
            assert matcher.fill_next_token_bitmask(bitmask, 2) is True
            assert allowed_tokens(bitmask[2], vocab).tolist() == matcher.legal_tokens()
            np.testing.assert_array_equal(np.delete(bitmask, 2, axis=0), np.delete(untouched, 2, axis=0))
            assert matcher.accept_token(rng.choice(matcher.legal_tokens() or []))
        assert allowed_tokens(mask_row(matcher, vocab), vocab).tolist() == []


# ------------------------------------------------------------------------------------------- rollback and reset


@pytest.mark.parametrize("k", K_VALUES)
def test_rollback_restores_exactly(k: int) -> None:
    artifact = artifact_for()
    rng = random.Random(k)
    for _ in range(4):
        matcher = TrieMatcher(artifact, k)
        history = [snapshot(matcher)]
        while not matcher.is_terminated():
            random_walk(matcher, rng, 1)
            history.append(snapshot(matcher))
        depth = len(history) - 1
        matcher.rollback(0)
        assert snapshot(matcher) == history[depth]
        while depth > 0:
            back = rng.randint(1, depth)
            matcher.rollback(back)
            depth -= back
            assert snapshot(matcher) == history[depth]
            forward = random_walk(matcher, rng, rng.randint(0, 3))
            if forward:
                matcher.rollback(len(forward))
            assert snapshot(matcher) == history[depth]
        with pytest.raises(ValueError):
            matcher.rollback(1)
        assert snapshot(matcher) == history[0]


def test_rollback_more_than_accepted_refused() -> None:
    matcher = TrieMatcher(artifact_for(), 2)
    random_walk(matcher, random.Random(0), 3)
    before = snapshot(matcher)
    for bad in (4, 100, -1):
        with pytest.raises(ValueError):
            matcher.rollback(bad)
        assert snapshot(matcher) == before


def test_reset_returns_to_the_start() -> None:
    artifact = artifact_for()
    rng = random.Random(0)
    for k in K_VALUES:
        matcher = TrieMatcher(artifact, k)
        start = snapshot(matcher)
        random_walk(matcher, rng, 1000)
        assert matcher.is_terminated()
        matcher.reset()
        assert snapshot(matcher) == start and matcher.tools() == []
        random_walk(matcher, rng, 1000)  # and it decodes a whole new answer
        assert matcher.is_terminated() and len(set(matcher.tools())) == k


def test_terminated_after_stop_only() -> None:
    artifact = artifact_for()
    tokenizer = bundled("gpt2")
    matcher = TrieMatcher(artifact, 2)
    for token in tokenizer.encode("get_user, get"):
        assert matcher.accept_token(token)
        assert not matcher.is_terminated()
    assert matcher.legal_tokens() is not None and artifact.eos_id in matcher.legal_tokens()
    assert matcher.accept_token(artifact.eos_id)
    assert matcher.is_terminated() and not matcher.is_error()
    assert matcher.tool_names() == ["get_user", "get"]
    assert matcher.legal_tokens() == []
    assert not matcher.accept_token(artifact.eos_id)
    matcher.rollback(1)
    assert not matcher.is_terminated() and matcher.tools() == [NAMES.index("get_user")]


def test_the_matcher_reads_its_state_from_its_batch_row() -> None:
    """The matcher's status, thinking and tools are its batch row's (one state, one path), not a copy kept beside it:
    a row the batch finished elsewhere (here, restored to another matcher's finished row) reads as finished."""
    artifact = artifact_for()
    tokenizer = bundled("gpt2")
    done, fresh = TrieMatcher(artifact, 2), TrieMatcher(artifact, 2)
    for token in [*tokenizer.encode("get_user, get"), artifact.eos_id]:
        assert done.accept_token(token)
    fresh._batch.restore(0, done._batch.checkpoint(0))
    assert fresh.is_terminated() and fresh.tool_names() == ["get_user", "get"] and fresh.legal_tokens() == []


# ----------------------------------------------------------------------------------------- forced, jump-forward


def walk_forced(matcher: TrieMatcher, include_stop: bool) -> list[int]:
    """The forced run, by walking: accept while exactly one token is legal (stop only if ``include_stop``)."""
    forced: list[int] = []
    while True:
        legal = matcher.legal_tokens()
        if legal is None or len(legal) != 1:
            break
        if legal[0] == matcher.artifact.eos_id and not include_stop:
            break
        assert matcher.accept_token(legal[0])
        forced.append(legal[0])
    if forced:
        matcher.rollback(len(forced))
    return forced


@pytest.mark.parametrize("tokenizer_name", ["gpt2", "smollm2-135m"])
@pytest.mark.parametrize("k", K_VALUES)
def test_forced_tokens_equal_the_single_choice_run(tokenizer_name: str, k: int) -> None:
    artifact = artifact_for(tokenizer_name, " | ")
    rng = random.Random(k)
    seen_nonempty = False
    for _ in range(6):
        matcher = TrieMatcher(artifact, k)
        while not matcher.is_terminated():
            before = snapshot(matcher)
            for include_stop in (False, True):
                forced = matcher.forced_tokens(include_stop=include_stop)
                assert snapshot(matcher) == before  # asking does not move the matcher
                assert forced == walk_forced(matcher, include_stop)
                seen_nonempty |= bool(forced)
            random_walk(matcher, rng, 1)
    assert seen_nonempty


def choice_for(prefix: list[int], legal: list[int]) -> int:
    """A deterministic policy: the choice depends only on where the decode is."""
    return legal[hash(tuple(prefix)) % len(legal)]


@pytest.mark.parametrize("k", K_VALUES)
def test_jump_forward_gives_the_same_answer(k: int) -> None:
    artifact = artifact_for("smollm2-135m")
    for salt in range(5):
        step_by_step, jumping = TrieMatcher(artifact, k), TrieMatcher(artifact, k)
        slow: list[int] = [salt]
        while not step_by_step.is_terminated():
            legal = step_by_step.legal_tokens() or []
            token = legal[0] if len(legal) == 1 else choice_for(slow, legal)
            assert step_by_step.accept_token(token)
            slow.append(token)
        fast: list[int] = [salt]
        jumps = 0
        while not jumping.is_terminated():
            forced = jumping.forced_tokens(include_stop=True)
            if forced:
                jumps += 1
                for token in forced:
                    assert jumping.accept_token(token)
                fast += forced
                continue
            token = choice_for(fast, jumping.legal_tokens() or [])
            assert jumping.accept_token(token)
            fast.append(token)
        assert fast == slow
        assert jumping.tools() == step_by_step.tools() and len(set(jumping.tools())) == k
        assert jumps > 0


# ----------------------------------------------------------------------------------------- bitmask utilities


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 64, 49152, 50257])
@pytest.mark.parametrize("batch", [1, 3])
def test_bitmask_shape_and_dtype(batch: int, vocab: int) -> None:
    words = (vocab + 31) // 32
    assert get_bitmask_shape(batch, vocab) == (batch, words)
    bitmask = allocate_token_bitmask(batch, vocab)
    assert bitmask.shape == (batch, words) and bitmask.dtype == np.int32
    assert (bitmask == -1).all()
    assert allowed_tokens(bitmask[0], vocab).tolist() == list(range(vocab))


def masked_bitmask(vocab: int, rows: int, rng: np.random.Generator) -> tuple[np.ndarray[Any, Any], list[set[int]]]:
    bitmask = allocate_token_bitmask(rows, vocab)
    allowed = []
    for row in range(rows):
        tokens = set(rng.choice(vocab, size=rng.integers(0, 12), replace=False).tolist()) | {vocab - 1}
        set_allowed(bitmask[row], tokens)
        allowed.append(tokens)
    return bitmask, allowed


def expected_masked(logits: np.ndarray[Any, Any], allowed: list[set[int]], indices: list[int] | None,
                    vocab: int) -> np.ndarray[Any, Any]:
    out = logits.copy()
    for row in range(logits.shape[0]) if indices is None else indices:
        keep = np.zeros(logits.shape[1], bool)
        keep[[t for t in allowed[row] if t < vocab]] = True
        out[row, ~keep] = -np.inf
    return out


@pytest.mark.parametrize("indices", [None, [1, 3], [2], []])
@pytest.mark.parametrize("vocab", [70, 96, 1000])
def test_apply_bitmask_numpy(indices: list[int] | None, vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    bitmask, allowed = masked_bitmask(vocab, 4, rng)
    for dtype in (np.float32, np.float16, np.float64):
        logits = rng.standard_normal((4, vocab)).astype(dtype)
        want = expected_masked(logits, allowed, indices, vocab)
        apply_token_bitmask_inplace(logits, bitmask, indices=indices)
        np.testing.assert_array_equal(logits, want)
        assert logits.dtype == dtype


def test_apply_bitmask_numpy_wider_logits_masks_the_columns_past_the_bitmask() -> None:
    rng = np.random.default_rng(0)
    bitmask, allowed = masked_bitmask(64, 2, rng)
    logits = rng.standard_normal((2, 80)).astype(np.float32)  # a padded vocabulary: 16 columns past the mask
    want = expected_masked(logits, allowed, None, 64)
    apply_token_bitmask_inplace(logits, bitmask)
    np.testing.assert_array_equal(logits, want)
    assert np.isneginf(logits[:, 64:]).all()


@pytest.mark.parametrize("indices", [None, [1, 3], [2]])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_apply_bitmask_torch(indices: list[int] | None, dtype: str) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    vocab = 1000
    bitmask, allowed = masked_bitmask(vocab, 4, rng)
    base = rng.standard_normal((4, vocab)).astype(np.float32)
    logits = torch.from_numpy(base).to(getattr(torch, dtype))
    want = expected_masked(logits.float().numpy(), allowed, indices, vocab)
    apply_token_bitmask_inplace(logits, torch.from_numpy(bitmask), indices=indices)
    assert logits.dtype == getattr(torch, dtype)
    np.testing.assert_array_equal(logits.float().numpy(), want)


def test_apply_bitmask_torch_empty_indices() -> None:
    torch = pytest.importorskip("torch")
    logits = torch.zeros((2, 64))
    apply_token_bitmask_inplace(logits, torch.from_numpy(allocate_token_bitmask(2, 64)), indices=[])
    assert (logits == 0).all()


def test_apply_numpy_bitmask_to_torch_logits() -> None:
    """The documented flow: allocate (NumPy), fill from the matcher, apply to the model's torch logits."""
    torch = pytest.importorskip("torch")
    artifact = artifact_for()
    vocab = vocab_of(artifact)
    matcher = TrieMatcher(artifact, 2)
    bitmask = allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask)
    logits = torch.zeros((1, vocab))
    apply_token_bitmask_inplace(logits, bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == matcher.legal_tokens()


# ------------------------------------------------------------------------------------------------ draft trees


@st.composite
def draft_trees(draw: st.DrawFn) -> tuple[int, list[int], list[int], list[int]]:
    """(k, prefix, tokens, parents): node tokens are legal at their parent's state or not."""
    artifact = artifact_for()
    k = draw(st.sampled_from(K_VALUES))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    base = TrieMatcher(artifact, k)
    prefix = random_walk(base, rng, draw(st.integers(0, 6)))
    n = draw(st.integers(1, 14))
    tokens: list[int] = []
    parents: list[int] = []
    paths: list[list[int] | None] = []  # a node's root path, None below a refused node
    for node in range(n):
        parent = draw(st.integers(-1, node - 1))
        parent_path = [] if parent < 0 else paths[parent]
        legal: list[int] = []
        if parent_path is not None:
            matcher = replay(artifact, k, prefix + parent_path)
            legal = matcher.legal_tokens() or []
        if legal and draw(st.integers(0, 3)) > 0:
            token = draw(st.sampled_from(legal))
        else:
            token = draw(st.sampled_from([artifact.eos_id, 0, 11, 1136, 62, vocab_of(artifact) - 1]))
        tokens.append(token)
        parents.append(parent)
        accepted = parent_path is not None and token in legal
        paths.append([*parent_path, token] if accepted and parent_path is not None else None)
    return k, prefix, tokens, parents


@examples(120)
@given(draft_trees())
def test_draft_tree_masks_equal_separate_walks(tree: tuple[int, list[int], list[int], list[int]]) -> None:
    k, prefix, tokens, parents = tree
    artifact = artifact_for()
    vocab = vocab_of(artifact)
    matcher = replay(artifact, k, prefix)
    before = snapshot(matcher)
    bitmask = np.zeros((len(tokens) + 1, (vocab + 31) // 32), np.int32)
    accepted = matcher.fill_draft_tree_bitmask(tokens, parents, bitmask)
    assert snapshot(matcher) == before  # the matcher ends where it started
    np.testing.assert_array_equal(bitmask[0], mask_row(matcher, vocab))
    for node in range(len(tokens)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        fresh = replay(artifact, k, prefix)
        ok = all(fresh.accept_token(tokens[i]) for i in reversed(path))
        assert bool(accepted[node]) == ok, node
        if ok:
            np.testing.assert_array_equal(bitmask[node + 1], mask_row(fresh, vocab), err_msg=f"node {node}")
        else:
            assert (bitmask[node + 1] == -1).all(), f"refused node {node} (or its subtree) must be all ones"
    # ... with the same history: the prefix, no more, no less.
    with pytest.raises(ValueError):
        matcher.rollback(len(prefix) + 1)
    matcher.rollback(len(prefix))
    assert snapshot(matcher) == snapshot(TrieMatcher(artifact, k))


def test_draft_tree_rejects_bad_parents() -> None:
    matcher = TrieMatcher(artifact_for(), 2)
    bitmask = allocate_token_bitmask(4, vocab_of(artifact_for()))
    before = snapshot(matcher)
    for parents in ([0, -1, 0], [-1, 2, 0], [-1, -2, 0]):
        with pytest.raises(ValueError):
            matcher.fill_draft_tree_bitmask([1136, 62, 7220], parents, bitmask)
    with pytest.raises(ValueError):
        matcher.fill_draft_tree_bitmask([1136, 62, 7220], [-1, 0], bitmask)  # parents for every node
    with pytest.raises(ValueError):
        matcher.fill_draft_tree_bitmask([1136, 62, 7220, 1, 2], [-1, 0, 1, 2, 3], bitmask)  # too few rows
    assert snapshot(matcher) == before


# -------------------------------------------------------------------------------------------------- reasoning


def test_reasoning_matcher_unconstrained_until_marker() -> None:
    artifact = artifact_for()
    vocab = vocab_of(artifact)
    marker = 31000
    matcher = TrieMatcher(artifact, 2, reasoning_end_id=marker)
    for token in (artifact.eos_id, 5, 40000, 1136):
        assert matcher.legal_tokens() is None and matcher.forced_tokens() == []
        bitmask = np.zeros((1, (vocab + 31) // 32), np.int32)
        assert matcher.fill_next_token_bitmask(bitmask) is True  # everything but the stop token
        assert allowed_tokens(bitmask[0], vocab).tolist() == [t for t in range(vocab) if t != artifact.eos_id]
        if token == artifact.eos_id:
            assert not matcher.accept_token(token)  # an answer is owed: no stop while thinking
            continue
        assert matcher.accept_token(token)
        assert not matcher.is_terminated() and not matcher.is_error()
    assert matcher.accept_token(marker)
    assert matcher.legal_tokens() == TrieMatcher(artifact, 2).legal_tokens()
    matcher.rollback(1)
    assert matcher.legal_tokens() is None
