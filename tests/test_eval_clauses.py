"""The clause-split baseline arm (``eval/backends.ClausesArm``): the request cut into its asks, each ask ranked by
the 1:1 sum of dense and lexical z-scores, one tool per ask; checked against the same sums made here by hand, and the
assignment (``one_per_ask``) against its definition. The prior arm (``PriorArm``) against the decode it stands for:
the engine's answers ranked by the same prior alone."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from support.encoders import MadeUpEncoder

from tooltrie.compiler import Artifact, TokenizerInfo
from tooltrie.eval.backends import ClausesArm, EvalSetup, PriorArm, one_per_ask
from tooltrie.eval.datasets import LabelledQuery, load_split
from tooltrie.ranker import Ranker, standardized
from tooltrie.serve.prompt import Prompt


@pytest.fixture(scope="module")
def arm(catalog_artifact: Artifact, smollm: TokenizerInfo) -> ClausesArm:
    ranker = Ranker(catalog_artifact.registry, encoder=MadeUpEncoder())
    setup = EvalSetup(model=None, tokenizer=smollm, artifact=catalog_artifact, prompt=Prompt.style("short"),
                      options={"retrieval": ranker})
    return ClausesArm(setup)


def sums(arm: ClausesArm, texts: list[str]) -> np.ndarray:
    lexical = np.array([arm.ranker.lexical.scores(text) for text in texts])
    return standardized(arm.ranker.similarities(texts)) + standardized(lexical)


def test_one_tool_per_ask_by_the_asks_own_sums(arm: ClausesArm) -> None:
    asks = ["Convert 100 US dollars to euros", "what's the weather in Paris tomorrow?"]
    query = LabelledQuery(f"{asks[0]}, and {asks[1]}", ("ExchangeTool", "WeatherTool"))
    (prediction,) = arm.predict([query])
    names = arm.setup.artifact.contract.parse(prediction.text)
    expected = one_per_ask(sums(arm, asks), 2)
    assert names == [arm.setup.artifact.registry.names[i] for i in expected]


def test_a_single_ask_is_the_whole_requests_top_k(arm: ClausesArm) -> None:
    query = LabelledQuery("Convert 100 US dollars to euros", ("ExchangeTool", "FinanceTool", "WeatherTool"))
    (prediction,) = arm.predict([query])
    order = np.argsort(-sums(arm, [query.query])[0], kind="stable")
    # the one ask's best, then the whole request's next two (the ask is the request: the same order)
    assert arm.setup.artifact.contract.parse(prediction.text) == [
        arm.setup.artifact.registry.names[i] for i in order[:3]]


def test_every_answer_is_k_distinct_tools(arm: ClausesArm) -> None:
    queries = load_split("catalog-compound", "test")
    for query, prediction in zip(queries, arm.predict(queries), strict=True):
        names = arm.setup.artifact.contract.parse(prediction.text)
        assert len(names) == query.k == len(set(names))


@given(arrays(np.float64, st.tuples(st.integers(1, 5), st.integers(1, 8)),
              elements=st.floats(-5, 5, allow_nan=False)), st.integers(1, 8))
def test_one_per_ask_takes_the_best_free_pair_each_time(scores: np.ndarray, k: int) -> None:
    chosen = one_per_ask(scores, k)
    assert len(chosen) == min(k, *scores.shape) == len(set(chosen))
    free, left = scores.astype(float).copy(), set(chosen)
    for _ in chosen:  # each pick was the best pair among asks without a tool and tools not taken
        ask, tool = np.unravel_index(int(np.argmax(free)), free.shape)
        assert int(tool) in left
        left.discard(int(tool))
        free[ask, :], free[:, tool] = -np.inf, -np.inf


def test_the_prior_arm_answers_as_the_decode_ranked_by_the_prior_alone(catalog_artifact: Artifact,
                                                                     smollm: TokenizerInfo) -> None:
    """``PriorArm`` is what ``--ranker retrieval`` answers: on requests of one ask and of several, its tools are the
    decode's with the model's weight at 0 (the reference backend fed zero logits), in order."""
    from tooltrie.kernels import TrieBatch

    ranker = Ranker(catalog_artifact.registry, encoder=MadeUpEncoder())  # no two priors tie
    setup = EvalSetup(model=None, tokenizer=smollm, artifact=catalog_artifact, prompt=Prompt.style("short"),
                      options={"retrieval": ranker})
    queries = [*load_split("catalog-compound", "validation")[:6], *load_split("metatool-single", "validation")[:4]]
    names = catalog_artifact.registry.names
    for query, prediction in zip(queries, PriorArm(setup).predict(queries), strict=True):
        made = ranker.row(query.query, "retrieval", k=query.k)
        batch = TrieBatch(catalog_artifact, capacity=1, backend="reference")
        batch.add(0, query.k, prior=made.scores, model_weight=0.0, follow=made.follow)
        while batch.is_running(0):
            batch.choose(np.zeros((1, catalog_artifact.max_token_id + 1), np.float32))
        assert catalog_artifact.contract.parse(prediction.text) == [names[t] for t in batch.tools(0)], query.query
