"""A request that asks several things gets one tool per ask (``tooltrie.ranker.PerAsk``, ``Ranker.row``).

- the asks' bookkeeping against a brute force: after any committed tools, the open asks are those the best ask-tool
  pairs leave (``eval.backends.one_per_ask``, the clause-split baseline's own rule);
- the decode ranked by the prior alone (the model's weight 0) answers, on every backend, the best pair per ask and
  then the whole request's follow-up; with the model's scores beside it, every backend answers alike;
- ``Ranker.row``: the asks scored in one encoder batch after the request; a request of one ask keeps today's
  prior; bad input (one word, only connectives, 200 clauses, k beyond the asks or the tools) gives k distinct tools.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import config, cuda
from support.encoders import MadeUpEncoder

from tooltrie.asks import MAX_ASKS
from tooltrie.compiler import Artifact, TokenizerInfo, compile_registry
from tooltrie.eval.backends import one_per_ask
from tooltrie.kernels import TrieBatch
from tooltrie.ranker import ASKS, FollowUp, PerAsk, Ranker, Weights
from tooltrie.registry import CATALOG_PATH, load_registry, make_registry

pytest.importorskip("bm25s", reason="the lexical prior needs bm25s (the model extra)")  # not in the GPU image
PRIOR_ALONE = Weights(model=0.0, retrieval=1.0)
ASKED = ("What's the weather in Paris? Also find me a hotel near the Louvre",
         "convert 100 dollars to euros, then find a cheap hotel and book a table at a restaurant",
         "1) translate this letter into French 2) check my stock portfolio 3) play some jazz 4) order a taxi",
         "Search the web for vegan recipes and send the list to my sister by email")
BACKENDS = ["reference", "cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not (config.ENABLE_CUDASIM or cuda.is_available()), reason="no GPU and NUMBA_ENABLE_CUDASIM is not set"))]


@pytest.fixture(scope="module")
def catalog() -> Artifact:
    return compile_registry(load_registry(CATALOG_PATH), TokenizerInfo.load("smollm2-135m"))


def decode(artifact: Artifact, backend: str, k: int, prior: np.ndarray, follow: PerAsk | None,
           model_weight: float = 0.0) -> list[int]:
    """The answer in one row of ``backend``: the model's scores random (seeded by k) where it has a weight."""
    batch = TrieBatch(artifact, capacity=1, backend=backend)
    batch.add(0, k, prior=prior, model_weight=model_weight, follow=follow)
    rng = np.random.default_rng(k)
    for _ in range(400):
        if not batch.is_running(0):
            break
        step = rng.standard_normal((1, artifact.max_token_id + 1)).astype(np.float32) * (model_weight != 0)
        batch.choose(step)
    assert batch.is_done(0)
    return batch.tools(0)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.integers(2, 12), st.integers(0, 2**32 - 1), st.data())
def test_open_asks_are_those_the_best_pairs_leave(n_asks: int, n_tools: int, seed: int, data: st.DataObject) -> None:
    """The prior alone answers the best pairs in their order (scores without ties: tied pairs may be taken in
    another order); any committed tools close one ask each, in order, each the open ask that scores it highest (ties
    to the earlier ask)."""
    rng = np.random.default_rng(seed)
    asks = (rng.integers(-4, 5, (n_asks, n_tools)) / 4).astype(np.float32)  # quarters: ties happen
    follow = PerAsk(asks, np.zeros(n_tools, np.float32))
    untied = rng.standard_normal((n_asks, n_tools)).astype(np.float32)
    assert PerAsk(untied, follow.whole).top(min(n_asks, n_tools)) == _pairs_in_pick_order(untied)
    tools = tuple(data.draw(st.permutations(range(n_tools)))[: data.draw(st.integers(0, n_tools))])
    expected = list(range(n_asks))
    for tool in tools[:n_asks]:
        best = max(asks[expected, tool])
        expected.remove(next(a for a in expected if asks[a, tool] == best))
    assert follow.open_asks(tools) == expected
    prior = follow(tools)
    np.testing.assert_array_equal(prior, asks[expected].max(axis=0) if expected else follow.whole)


def _pairs_in_pick_order(asks: np.ndarray) -> list[int]:
    """``one_per_ask``'s tools in the order it picks them (it returns them in the asks' order)."""
    values, order = asks.astype(np.float64), []
    for _ in range(min(asks.shape)):
        ask, tool = np.unravel_index(int(np.argmax(values)), values.shape)
        order.append(int(tool))
        values[ask, :], values[:, tool] = -np.inf, -np.inf
    assert sorted(order) == sorted(one_per_ask(asks, min(asks.shape)))
    return order


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_prior_alone_answers_one_tool_per_ask_then_follows_the_request(catalog: Artifact, backend: str) -> None:
    ranker = Ranker(catalog.registry, fused=PRIOR_ALONE, encoder=MadeUpEncoder())  # no two priors tie
    before = Ranker(catalog.registry, fused=PRIOR_ALONE, encoder=MadeUpEncoder(), asks=False)
    moved = 0
    for query in ASKED if backend != "cuda" else ASKED[:2]:
        made = ranker.row(query, "fused")
        assert isinstance(made.follow, PerAsk) and isinstance(made.follow.then, FollowUp)
        n = len(made.follow.asks)
        for k in sorted({1, n - 1, n, n + 2}):
            got = decode(catalog, backend, k, made.scores, made.follow)
            assert got == made.follow.top(k), (query, k)
            pairs = sorted(one_per_ask(made.follow.asks, min(k, n)))
            assert sorted(got[: min(k, n)]) == pairs, (query, k)  # the best pairs first, one per ask
            rest = made.follow.then
            for tool in got[n:]:  # past the asks, the whole request's follow-up from the tools before
                prior = np.array(rest(tuple(got[: got.index(tool)])), np.float64)
                prior[got[: got.index(tool)]] = -np.inf
                assert tool == int(np.argmax(prior)), (query, k)
            moved += got != before.row(query, "fused").follow.top(k)
    assert moved > 0


@pytest.mark.parametrize("backend", ["cpu", BACKENDS[2]])
def test_with_the_model_every_backend_answers_as_the_reference(catalog: Artifact, backend: str) -> None:
    ranker = Ranker(catalog.registry, fused=Weights(model=1.0, retrieval=2.0), encoder=MadeUpEncoder())
    for query in ASKED[:2] if backend == "cuda" else ASKED:
        made = ranker.row(query, "fused")
        for k in (2, 3):
            expected = decode(catalog, "reference", k, made.scores, made.follow, model_weight=1.0)
            assert decode(catalog, backend, k, made.scores, made.follow, model_weight=1.0) == expected


def test_the_asks_are_scored_in_one_batch_after_the_request() -> None:
    registry = load_registry(CATALOG_PATH)
    encoder = MadeUpEncoder()
    ranker = Ranker(registry, fused=PRIOR_ALONE, encoder=encoder)
    ranker.tool_embeddings  # noqa: B018 (the tools' embeddings first, apart)
    encoder.forget()
    made = ranker.row(ASKED[1], "fused")
    assert isinstance(made.follow, PerAsk)
    assert encoder.encoded == [ASKED[1], *ranker.asks_of(ASKED[1])]
    whole = ranker.prior_scores([ASKED[1]])[0]
    by_ask = ranker.prior_scores(ranker.asks_of(ASKED[1]))
    blend = ASKS["whole"]
    np.testing.assert_allclose(made.follow.asks, (1 - blend) * by_ask + blend * whole, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(made.follow.whole, whole, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(made.scores, made.follow(()))
    # scores the caller has (a pre-filter ranked by them): only the asks are embedded
    encoder.forget()
    again = ranker.row(ASKED[1], "fused", scores=whole)
    assert encoder.encoded == ranker.asks_of(ASKED[1])
    np.testing.assert_allclose(again.follow.asks, made.follow.asks, rtol=1e-5, atol=1e-6)


def test_a_request_of_one_ask_or_an_answer_of_one_tool_keeps_its_prior() -> None:
    registry = load_registry(CATALOG_PATH)
    asks, one = (Ranker(registry, fused=PRIOR_ALONE, encoder=MadeUpEncoder(), asks=on) for on in (True, False))
    for query in ("What will the weather be in Paris tomorrow?", "the stock's price and the company's latest news",
                  "I'm flying to Rome on Friday. What's the weather there?"):
        made, plain = asks.row(query, "fused"), one.row(query, "fused")
        assert isinstance(made.follow, FollowUp), query
        np.testing.assert_array_equal(made.scores, plain.scores)
    assert Ranker(registry, encoder=MadeUpEncoder(), follow=False).row(ASKED[0], "fused").follow is None
    # an answer of one tool answers the whole request, however many things it asks
    single, plain = asks.row(ASKED[2], "fused", k=1), one.row(ASKED[2], "fused", k=1)
    assert isinstance(single.follow, FollowUp) and isinstance(asks.row(ASKED[2], "fused", k=2).follow, PerAsk)
    np.testing.assert_array_equal(single.scores, plain.scores)
    scores = asks.prior_scores([ASKED[2]])[0]
    np.testing.assert_array_equal(asks.reach(ASKED[2], scores, k=1), scores)


@pytest.mark.parametrize("query", ["weather", "and then also, finally", " , ; . ",
                                   ". ".join(f"find tool number {i}" for i in range(200))])
def test_bad_input_gives_k_distinct_tools(query: str) -> None:
    tokenizer = TokenizerInfo.load("smollm2-135m")
    words = make_registry([{"name": name} for name in ("alpha", "beta", "gamma", "delta")], name="words")
    artifact = compile_registry(words, tokenizer)
    ranker = Ranker(words, fused=PRIOR_ALONE, encoder=MadeUpEncoder())
    made = ranker.row(query, "fused")
    assert made.scores is not None and np.isfinite(made.scores).all()
    if isinstance(made.follow, PerAsk):
        assert 2 <= len(made.follow.asks) <= MAX_ASKS
    for k in (1, 3, 4):  # fewer tools than the asks, more, all of them
        got = decode(artifact, "cpu", k, made.scores, made.follow)
        assert len(set(got)) == k


def test_a_made_prior_keeps_the_tools_a_pre_filter_would() -> None:
    """``PerAsk.reach`` (admission, from the prior it made) orders the tools as ``Ranker.reach`` (from the scores)."""
    ranker = Ranker(load_registry(CATALOG_PATH), fused=Weights(model=1.0, retrieval=3.0), encoder=MadeUpEncoder())
    for query in ASKED:
        made = ranker.row(query, "fused", k=3)
        assert isinstance(made.follow, PerAsk)
        scores = ranker.prior_scores([query])[0]
        np.testing.assert_array_equal(np.argsort(-made.follow.reach(), kind="stable"),
                                      np.argsort(-ranker.reach(query, scores, k=3), kind="stable"))
