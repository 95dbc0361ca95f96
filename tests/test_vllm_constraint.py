"""The vLLM logits processors' core (``RequestConstraint``), on CPU, without vLLM: fed the same token streams as the
engine, it gives the engine's legal sets (``kernels/rules.py``), ``TrieMatcher``'s bitmask and
``TrieLogitsProcessor``'s mask, token for token. The streams are the engine's own answers with the tiny model, and
random legal walks."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest
import torch
from support.serve import small_artifact, tiny_model

from tooltrie.compiler import Artifact, TokenizerInfo
from tooltrie.eval.constraint import RequestConstraint, mask_rows_
from tooltrie.kernels import TrieMatcher, allocate_token_bitmask
from tooltrie.kernels.bitmask import allowed_tokens
from tooltrie.kernels.rules import Slot, advance, legal_moves
from tooltrie.serve.engine import Engine, Request
from tooltrie.serve.hf import TrieLogitsProcessor

QUERIES = ("What is the weather in Paris?", "stock price of ACME", "book a table and a flight, then convert euros")


def engine_rule(artifact: Artifact, k: int, stream: list[int]) -> list[list[int]]:
    """The engine's legal set before each token of ``stream`` (and after the last), from ``kernels/rules.py``."""
    slot, sets = Slot.start(artifact.trie, k), []
    for token in stream:
        moves = legal_moves(artifact.trie, slot, artifact.eos_id)
        sets.append(sorted(moves))
        slot = advance(artifact.trie, slot, moves[token])
    sets.append([artifact.eos_id])  # after the answer: only the stop token
    return sets


def constraint_sets(artifact: Artifact, k: int, stream: list[int]) -> tuple[list[list[int]], list[np.ndarray]]:
    """What the core allows before each token, fed the growing output list as vLLM keeps it."""
    constraint, sets, masks = RequestConstraint(artifact, k), [], []
    vocab = artifact.max_token_id + 1
    for end in range(len(stream) + 1):
        constraint.update(stream[:end])
        sets.append(constraint.allowed_tokens())
        masks.append(constraint.mask(vocab))
    assert constraint.error is None
    return sets, masks  # type: ignore[return-value]


def matcher_sets(artifact: Artifact, k: int, stream: list[int]) -> list[list[int]]:
    matcher, sets = TrieMatcher(artifact, k), []
    bitmask = allocate_token_bitmask(1, artifact.max_token_id + 1)
    for token in [*stream, None]:
        if matcher.is_terminated():
            sets.append([artifact.eos_id])
            break
        matcher.fill_next_token_bitmask(bitmask)
        sets.append(allowed_tokens(bitmask[0], artifact.max_token_id + 1).tolist())
        assert token is not None and matcher.accept_token(token)
    return sets


def processor_sets(artifact: Artifact, k: int, stream: list[int]) -> list[list[int]]:
    """``TrieLogitsProcessor`` under a generate-like loop over one row."""
    processor, sets = TrieLogitsProcessor(artifact, k), []
    prompt = [5, 6, 7]
    for end in range(len(stream) + 1):
        scores = torch.zeros((1, artifact.max_token_id + 1))
        masked = processor(torch.tensor([prompt + stream[:end]]), scores)
        sets.append(torch.nonzero(masked[0] == 0).flatten().tolist())
    return sets


def random_walk(artifact: Artifact, k: int, rng: random.Random) -> list[int]:
    matcher, stream = TrieMatcher(artifact, k), []
    while not matcher.is_terminated():
        token = rng.choice(matcher.legal_tokens() or [])
        assert matcher.accept_token(token)
        stream.append(token)
    return stream


@pytest.fixture(scope="module")
def artifacts(smollm: TokenizerInfo, catalog_artifact: Artifact) -> dict[str, Artifact]:
    return {"small": small_artifact(smollm), "catalog": catalog_artifact}


@pytest.fixture(scope="module")
def engine_streams(artifacts: dict[str, Artifact], smollm: TokenizerInfo) -> list[tuple[str, int, list[int]]]:
    """The engine's own answers (token ids, stop included) with the tiny model, for k = 1..3 on both registries."""
    streams = []
    for name, artifact in artifacts.items():
        engine = Engine(tiny_model(), smollm, artifact, max_batch=4)
        requests = [Request(query, k) for k in (1, 2, 3) for query in QUERIES]
        for request, answer in zip(requests, engine.run(requests), strict=True):
            assert answer.finish_reason == "stop"
            streams.append((name, request.k, answer.token_ids))
    return streams


def all_streams(artifacts: dict[str, Artifact], engine_streams: list[tuple[str, int, list[int]]], walks: int
                ) -> list[tuple[str, int, list[int]]]:
    rng = random.Random(7)
    return engine_streams + [(name, k, random_walk(artifacts[name], k, rng)) for name in artifacts
                             for k in (1, 2, 3, 5) for _ in range(walks)]


# oracle -> (its legal sets, random walks per registry and k besides the engine's answers; the processor is slower)
ORACLES: dict[str, tuple[Callable[[Artifact, int, list[int]], list[list[int]]], int]] = {
    "engine rules": (engine_rule, 6),
    "TrieMatcher bitmask": (matcher_sets, 6),
    "TrieLogitsProcessor": (processor_sets, 1),
}


@pytest.mark.parametrize("oracle", list(ORACLES))
def test_same_streams_give_identical_masks(oracle: str, artifacts: dict[str, Artifact],
                                           engine_streams: list[tuple[str, int, list[int]]]) -> None:
    legal_sets, walks = ORACLES[oracle]
    for name, k, stream in all_streams(artifacts, engine_streams, walks):
        artifact = artifacts[name]
        ours, masks = constraint_sets(artifact, k, stream)
        assert ours == legal_sets(artifact, k, stream), (name, k, stream)
        for legal, mask in zip(ours, masks, strict=True):
            assert np.flatnonzero(mask).tolist() == legal


def test_bias_is_the_mask_as_zero_and_minus_infinity(artifacts: dict[str, Artifact]) -> None:
    constraint = RequestConstraint(artifacts["catalog"], 2)
    vocab = artifacts["catalog"].max_token_id + 1
    bias, mask = constraint.bias(vocab), constraint.mask(vocab)
    assert bias.dtype == np.float32 and (bias[mask] == 0).all() and np.isneginf(bias[~mask]).all()


def test_output_that_no_longer_extends_what_was_fed_starts_over(artifacts: dict[str, Artifact]) -> None:
    artifact = artifacts["catalog"]
    stream = random_walk(artifact, 2, random.Random(1))
    other = random_walk(artifact, 2, random.Random(2))
    constraint = RequestConstraint(artifact, 2)
    constraint.update(stream[:-1])
    constraint.update(other[:2])  # a preempted request recomputed: not a continuation
    fresh = RequestConstraint(artifact, 2)
    fresh.update(other[:2])
    assert constraint.fed == other[:2] and constraint.allowed_tokens() == fresh.allowed_tokens()


def test_an_illegal_token_is_an_error_state_that_only_allows_stop(artifacts: dict[str, Artifact]) -> None:
    artifact = artifacts["catalog"]
    constraint = RequestConstraint(artifact, 1)
    illegal = next(t for t in range(artifact.max_token_id) if t not in (constraint.allowed_tokens() or []))
    constraint.update([illegal])
    assert constraint.error is not None and f"token {illegal}" in constraint.error
    assert constraint.allowed_tokens() == [artifact.eos_id]
    constraint.update([illegal, 5, 6])  # it never leaves the state
    assert constraint.allowed_tokens() == [artifact.eos_id]


def test_mask_rows_masks_only_the_given_rows(artifacts: dict[str, Artifact]) -> None:
    artifact = artifacts["catalog"]
    vocab = artifact.max_token_id + 1
    logits = torch.randn((3, vocab))
    original = logits.clone()
    first, second = RequestConstraint(artifact, 1), RequestConstraint(artifact, 2)
    second.update(random_walk(artifact, 2, random.Random(3))[:1])
    mask_rows_(logits, [2, 0], [first, second])
    assert torch.equal(logits[1], original[1])
    for row, constraint in ((2, first), (0, second)):
        kept = torch.isfinite(logits[row])
        assert kept.nonzero().flatten().tolist() == constraint.allowed_tokens()
        assert torch.equal(logits[row][kept], original[row][kept])
