"""The prior follows the answer (``tooltrie.ranker.FollowUp``, ``TrieBatch.add(follow=...)``).

- the follow-up against a brute force: each request word's BM25 part on its own (bm25s's scores of that word
  alone), counted ``covered`` times where a chosen tool's name holds the word, z-scored, beside the parts that do
  not follow;
- the decode ranked by a following prior alone (the model's weight 0) answers, on every backend, its greedy top k
  (``FollowUp.top``): each tool the best by the prior made from the tools before it; and that answer is not always
  the static top k, nor (on a registry with chains, ``tooltrie/chains.py``) the answer without chains;
- the first tool's prior is the request's own (a request that asks several things is one ask here: its asks are
  ``tests/test_prior_asks.py``'s); bad input (a request of stop words, one-word names, no
  descriptions, k beyond what the request names) gives finite priors and k distinct tools; a follow-up that fails
  fails its own row only.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from numba import config, cuda
from support.encoders import MadeUpEncoder

from tooltrie.compiler import Artifact, TokenizerInfo, compile_registry
from tooltrie.eval.datasets import registry_path
from tooltrie.kernels import TrieBatch
from tooltrie.kernels.state import DONE, ERROR
from tooltrie.ranker import FOLLOW, FollowUp, Ranker, Weights, standardized
from tooltrie.registry import CATALOG_PATH, load_registry, make_registry

pytest.importorskip("bm25s", reason="the lexical prior needs bm25s (the model extra)")  # not in the GPU image
PRIOR_ALONE = Weights(model=0.0, retrieval=1.0)
QUERIES = ("what is the weather in Paris and the news about flights there",
           "convert dollars to euros, then find a cheap hotel and a restaurant",
           "search the web for recipes and send the list by email",
           "I want to buy a house and need a mortgage calculator and a moving company",
           "translate this text to French and read it aloud")
# RestBench's TMDB: requests that name the end of a chain (``tooltrie/chains.py``)
CHAIN_QUERIES = ("Who starred in the movie Titanic and where was its lead actor born?",
                 "Give me reviews and similar shows for the TV series Breaking Bad",
                 "What are the latest movie credits of Christopher Nolan?")
BACKENDS = ["reference", "cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not (config.ENABLE_CUDASIM or cuda.is_available()), reason="no GPU and NUMBA_ENABLE_CUDASIM is not set"))]


@pytest.fixture(scope="module")
def artifacts() -> dict[str, Artifact]:
    tokenizer = TokenizerInfo.load("smollm2-135m")
    return {name: compile_registry(load_registry(path), tokenizer) for name, path in (
        ("catalog", CATALOG_PATH), ("bfcl", registry_path("bfcl")), ("tmdb", registry_path("restbench-tmdb")))}


def brute_force(follow: FollowUp, tools: tuple[int, ...]) -> np.ndarray:
    """The prior after ``tools``, worked out from bm25s's score of each word alone."""
    index = follow.index
    per_word = np.array([index._bm25.get_scores_from_ids([word]) for word in follow.words], np.float64).reshape(
        len(follow.words), index.n_tools)
    covered = {word for tool in tools for word in index.words(follow.tools[tool].name)}
    weights = np.array([follow.covered if word in covered else 1.0 for word in follow.words])
    first_lexical = standardized(per_word.sum(axis=0)[None])[0]
    later_lexical = standardized((weights[:, None] * per_word).sum(axis=0)[None])[0]
    return follow.first - follow.lexical_weight * first_lexical + follow.later_weight * later_lexical


@pytest.mark.parametrize("prior", ["lexical", "hybrid"])
def test_the_follow_up_is_the_requests_words_rescored_as_its_tools_cover_them(prior: str) -> None:
    registry = load_registry(CATALOG_PATH)
    ranker = Ranker(registry, prior=prior, encoder=MadeUpEncoder(), asks=False)
    rng = np.random.default_rng(4)
    for query in QUERIES:
        made = ranker.row(query, "fused")
        follow = made.follow
        assert follow is not None and follow.covered == FOLLOW["covered"]
        assert follow.later_weight == ranker.fused.retrieval * (FOLLOW["lexical"] if prior == "hybrid" else 1.0)
        assert follow(()) is made.scores  # the first tool's prior is the request's own
        for covered in sorted({0.0, 0.25, FOLLOW["covered"]}):  # the shipped constant, and words discounted
            follow = FollowUp(made.follow.first, query, made.follow.index, registry.tools,
                              made.follow.lexical_weight, made.follow.later_weight, covered)
            for n in (1, 2, 3):
                tools = tuple(int(t) for t in rng.choice(len(registry), n, replace=False))
                np.testing.assert_allclose(follow(tools), brute_force(follow, tools), rtol=1e-5, atol=1e-5)


def test_words_counted_fully_at_the_same_weight_leave_the_prior_as_it_was() -> None:
    ranker = Ranker(load_registry(CATALOG_PATH), encoder=MadeUpEncoder(), asks=False)
    made = ranker.row(QUERIES[0], "fused")
    assert made.follow is not None and made.scores is not None
    same = FollowUp(made.scores, made.follow.query, made.follow.index, made.follow.tools,
                    made.follow.lexical_weight, made.follow.lexical_weight, covered=1.0)
    np.testing.assert_allclose(same((3, 7)), made.scores, atol=1e-5)
    assert not np.allclose(made.follow((3, 7)), made.scores, atol=1e-3)  # the shipped constants do move it


def decode(artifact: Artifact, backend: str, k: int, prior: np.ndarray, follow: FollowUp | None) -> list[int]:
    batch = TrieBatch(artifact, backend=backend, capacity=1)
    batch.add(0, k, prior=prior, model_weight=0.0, follow=follow)
    logits = np.zeros((1, artifact.max_token_id + 1), np.float32)
    for _ in range(400):
        if not batch.is_running(0):
            break
        batch.choose(logits)
    assert batch.is_done(0)
    return batch.tools(0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_decode_ranked_by_a_following_prior_alone_answers_its_greedy_top_k(artifacts: dict[str, Artifact],
                                                                              backend: str) -> None:
    moved, chained = 0, 0
    for name, artifact in artifacts.items():
        ranker = Ranker(artifact.registry, fused=PRIOR_ALONE, encoder=MadeUpEncoder(), asks=False)  # no two priors tie
        queries = CHAIN_QUERIES if name == "tmdb" else QUERIES
        for query in queries if backend != "cuda" else queries[:2]:
            made = ranker.row(query, "fused")
            assert made.follow is not None and made.scores is not None
            for k in (2, 3):
                got = decode(artifact, backend, k, made.scores, made.follow)
                assert got == made.follow.top(k), (name, query, k)
                static = [int(t) for t in np.argsort(-made.scores, kind="stable")[:k]]
                assert decode(artifact, backend, k, made.scores, None) == static, (name, query, k)
                moved += got != static
                chained += got != replace(made.follow, chains=None).top(k)
    assert moved > 0 and chained > 0  # the follow-up changed some answers, and its chains some more


def test_bad_input_gives_finite_priors_and_k_distinct_tools() -> None:
    tokenizer = TokenizerInfo.load("smollm2-135m")
    words = make_registry([{"name": name} for name in ("alpha", "beta", "gamma", "delta")], name="words")
    artifact = compile_registry(words, tokenizer)
    ranker = Ranker(words, prior="lexical", fused=PRIOR_ALONE, asks=False)
    for query in ("the of and to", "?!.,", "alpha", "alpha beta"):  # stop words, symbols, fewer needs than k
        made = ranker.row(query, "fused")
        assert made.follow is not None and made.scores is not None
        for tools in ((), (0,), (0, 1), (3, 2, 1)):
            assert np.isfinite(made.follow(tools)).all(), (query, tools)
        if not made.follow.words:  # nothing to rescore: the prior stays the first one
            np.testing.assert_array_equal(made.follow((0, 1)), made.scores)
        got = decode(artifact, "cpu", 4, made.scores, made.follow)
        assert sorted(got) == [0, 1, 2, 3], query


def test_no_follow_up_where_nothing_follows() -> None:
    registry = load_registry(CATALOG_PATH)
    encoder = MadeUpEncoder()
    assert Ranker(registry, prior="dense", encoder=encoder).row("weather", "fused").follow is None  # no lexical part
    assert Ranker(registry, follow=False, encoder=encoder).row("weather", "fused").follow is None
    assert Ranker(registry, encoder=encoder).row("weather", "model").follow is None  # no prior at all
    assert Ranker(registry, encoder=encoder).row("weather", "retrieval").follow is not None


def test_a_follow_up_that_fails_fails_its_own_row_only(artifacts: dict[str, Artifact]) -> None:
    artifact = artifacts["catalog"]
    ranker = Ranker(artifact.registry, prior="lexical", fused=PRIOR_ALONE, asks=False)
    made = ranker.row(QUERIES[0], "fused")
    batch = TrieBatch(artifact, capacity=3)
    batch.add(0, 2, prior=made.scores, model_weight=0.0, follow=lambda tools: np.full(len(tools) + 1, np.nan))
    batch.add(1, 2, prior=made.scores, model_weight=0.0, follow=made.follow)
    batch.add(2, 2, prior=made.scores, model_weight=0.0, follow=lambda tools: 1 / 0)
    logits = np.zeros((3, artifact.max_token_id + 1), np.float32)
    for _ in range(100):
        if not any(batch.is_running(row) for row in range(3)):
            break
        batch.choose(logits)
    assert [batch.status(row) for row in range(3)] == [ERROR, DONE, ERROR]
    assert made.follow is not None and batch.tools(1) == made.follow.top(2)
