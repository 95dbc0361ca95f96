"""The ranker behind the engine (``tooltrie/ranker.py``): with ``retrieval`` the engine answers the prior's top k in
order, with ``fused`` at a zero retrieval weight the model's own answer; the tools' embeddings are kept beside the
artifact and reused only for the same registry and tool text. A made-up encoder (a fixed random vector per text)
stands in for all-MiniLM-L6-v2, so nothing is downloaded."""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import numpy as np
import pytest
from support.encoders import MadeUpEncoder
from support.serve import small_artifact, tiny_model
from support.serve_http import Gate

from tooltrie import retrieval
from tooltrie.compiler import Artifact, TokenizerInfo
from tooltrie.ranker import Ranker, RankerError, Weights, embeddings_path
from tooltrie.registry import make_registry
from tooltrie.serve.engine import Answer, Engine, Request
from tooltrie.serve.errors import DecodingFailedError
from tooltrie.serve.worker import Worker

QUERIES = ["find the weather in Paris", "book me a table", "search the web for news", "x"]


@pytest.fixture(scope="module")
def artifact(smollm: TokenizerInfo) -> Artifact:
    return small_artifact(smollm)


@pytest.fixture(scope="module")
def engine(smollm: TokenizerInfo, artifact: Artifact) -> Engine:
    ranker = Ranker(artifact.registry, fused=Weights(model=1.0, retrieval=0.0), encoder=MadeUpEncoder())
    return Engine(tiny_model(), smollm, artifact, ranker=ranker)


def test_the_retrieval_ranker_answers_the_priors_top_k_in_order(engine: Engine) -> None:
    assert engine.ranker is not None
    for k in (1, 2, 3):
        answers = engine.run([Request(q, k, ranker="retrieval") for q in QUERIES])
        for query, answer in zip(QUERIES, answers, strict=True):
            order = np.argsort(-engine.ranker.prior_scores([query])[0], kind="stable")[:k]
            assert [t.name for t in answer.tools] == [engine.artifact.registry.names[i] for i in order], (query, k)
            assert answer.response()["ranker"] == {"model": 0.0, "retrieval": 1.0}


def test_fused_with_no_retrieval_weight_is_the_models_answer(engine: Engine) -> None:
    for k in (1, 3):
        plain = engine.run([Request(q, k) for q in QUERIES])
        fused = engine.run([Request(q, k, ranker="fused") for q in QUERIES])
        assert [[t.name for t in a.tools] for a in fused] == [[t.name for t in a.tools] for a in plain]
        assert plain[0].ranker == {"model": 1.0, "retrieval": 0.0}


def test_a_ranker_the_engine_cannot_give_is_refused(smollm: TokenizerInfo, artifact: Artifact,
                                                    engine: Engine) -> None:
    bare = Engine(tiny_model(), smollm, artifact)
    with pytest.raises(RankerError, match="retrieval ranker"):
        bare.run([Request("x", 1, ranker="fused")])
    with pytest.raises(RankerError, match="unknown ranker"):
        engine.run([Request("x", 1, ranker="best")])


def test_embeddings_are_kept_beside_the_artifact_for_the_same_registry_only(
        artifact: Artifact, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = embeddings_path(tmp_path / "tools.trie.safetensors")
    assert path.name == "tools.trie.embeddings.safetensors"
    first = MadeUpEncoder()
    expected = Ranker(artifact.registry, embeddings_path=path, encoder=first).tool_embeddings
    assert path.is_file() and len(first.encoded) == len(artifact.registry)
    again = MadeUpEncoder()
    np.testing.assert_array_equal(Ranker(artifact.registry, embeddings_path=path, encoder=again).tool_embeddings,
                                  expected)
    assert again.encoded == []  # read back, not computed
    other = make_registry([{"name": "only_one", "description": "another registry"}], name="other")
    fresh = MadeUpEncoder()
    assert Ranker(other, embeddings_path=path, encoder=fresh).tool_embeddings.shape == (1, 16)
    assert fresh.encoded == ["only_one: another registry"]  # another registry's: computed afresh
    assert Ranker(artifact.registry, embeddings_path=path, encoder=MadeUpEncoder()).tool_embeddings.shape[0] == len(
        artifact.registry)
    monkeypatch.setattr(retrieval, "TEXT_VERSION", retrieval.TEXT_VERSION + "-next")
    remade = MadeUpEncoder()
    assert Ranker(artifact.registry, embeddings_path=path, encoder=remade).tool_embeddings.shape[0] == len(
        artifact.registry)
    assert len(remade.encoded) == len(artifact.registry)  # kept for another tool text: computed afresh
    path.write_bytes(b"damaged")
    assert Ranker(artifact.registry, embeddings_path=path, encoder=MadeUpEncoder()).tool_embeddings.shape[0] == len(
        artifact.registry)


def test_a_failed_step_leaves_the_worker_ranking(smollm: TokenizerInfo, artifact: Artifact) -> None:
    """A step that raises fails its rows; the engine the worker swaps in keeps the ranker and the settings, so the
    next request ranked by retrieval is answered as before the failure."""
    model = copy.deepcopy(tiny_model())  # its own: the gate's hook stays off the shared one
    gate = Gate(model)
    ranker = Ranker(artifact.registry, fused=Weights(model=1.0, retrieval=0.0), encoder=MadeUpEncoder())
    engine = Engine(model, smollm, artifact, ranker=ranker, speculate=3, max_batch=2)
    fresh = engine.fresh()
    assert (fresh.ranker, fresh.adapter, fresh.prompt, fresh.backend, fresh.speculate, fresh.max_batch) == (
        ranker, None, engine.prompt, engine.backend, 3, 2)
    expected = engine.run([Request(QUERIES[0], 2, ranker="retrieval")])[0]
    worker = Worker({"r": engine}, queue_limit=4)
    worker.start()

    def answer(request: Request) -> object:
        outcome: list[object] = []
        done = threading.Event()
        request.registry = "r"
        request.deliver = lambda done_request: (outcome.append(done_request.error or done_request.answer), done.set())
        worker.submit(request)
        assert done.wait(60), "no answer"
        return outcome[0]

    try:
        gate.fail_next = True
        assert isinstance(answer(Request(QUERIES[0], 2, ranker="retrieval")), DecodingFailedError)
        after = answer(Request(QUERIES[0], 2, ranker="retrieval"))
        assert isinstance(after, Answer), after
        assert [tool.name for tool in after.tools] == [tool.name for tool in expected.tools]
    finally:
        worker.stop()
