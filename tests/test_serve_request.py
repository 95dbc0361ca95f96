"""One ``Request`` from admission to answer: the tools admission chose stay ids into the registry version they were
chosen in (found again by name after a reload), an admitted prior is used only for the version and weights it was
made for, and the request's status follows it through the worker (a cancelled one is never delivered)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from support.serve import tiny_model

from tooltrie.compiler import TokenizerInfo, compile_registry
from tooltrie.errors import RegistryError
from tooltrie.ranker import Prior, Ranker, Weights
from tooltrie.registry import make_registry
from tooltrie.serve.engine import Engine
from tooltrie.serve.request import Request, RequestStatus, check_request
from tooltrie.serve.worker import Worker

NAMES = ("get_weather", "get_news", "search_flights", "convert_currency", "stock_price")


def _artifact(smollm: TokenizerInfo, names: tuple[str, ...]):  # type: ignore[no-untyped-def]
    return compile_registry(make_registry([{"name": name, "description": f"{name} tool"} for name in names],
                                          name="tools"), smollm)


def test_admitted_ids_are_used_as_they_are_in_their_own_version(smollm: TokenizerInfo) -> None:
    artifact = _artifact(smollm, NAMES)
    request = Request("weather and news", 2, tools=frozenset({0, 1}), tools_of=artifact.registry,
                      allow=("stock_price",))  # what admission narrowed wins over the names it started from
    assert check_request(request, artifact) == frozenset({0, 1})


def test_admitted_ids_are_found_again_by_name_after_a_reload(smollm: TokenizerInfo) -> None:
    before = _artifact(smollm, NAMES)
    after = _artifact(smollm, ("stock_price", "new_tool", *reversed(NAMES[:4])))  # same tools, other places
    request = Request("weather and news", 2, tools=frozenset({0, 1}), tools_of=before.registry)
    tools = check_request(request, after)
    assert tools is not None
    assert sorted(after.registry.names[tool] for tool in tools) == ["get_news", "get_weather"]


def test_an_admitted_tool_gone_after_a_reload_is_refused(smollm: TokenizerInfo) -> None:
    before = _artifact(smollm, NAMES)
    after = _artifact(smollm, NAMES[1:])
    request = Request("weather", 1, tools=frozenset({0, 2}), tools_of=before.registry)
    with pytest.raises(RegistryError, match="get_weather"):
        check_request(request, after)


def test_k_above_the_admitted_tools_is_refused(smollm: TokenizerInfo) -> None:
    artifact = _artifact(smollm, NAMES)
    with pytest.raises(ValueError, match="only 2 tools are allowed"):
        check_request(Request("q", 3, tools=frozenset({0, 1}), tools_of=artifact.registry), artifact)


class _CountingRanker(Ranker):
    """A lexical ranker that counts the priors it makes (the one entry point, ``row``)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.rows: list[str | None] = []

    def row(self, query: str, name: str, *, k: int | None = None, prior: str | None = None,
            scores: object = None) -> Prior:
        self.rows.append(prior)
        return super().row(query, name, k=k, prior=prior, scores=scores)  # type: ignore[arg-type]


def test_an_admitted_prior_is_used_only_where_it_was_made_for(smollm: TokenizerInfo) -> None:
    artifact = _artifact(smollm, NAMES)
    ranker = _CountingRanker(artifact.registry, prior="lexical", fused=Weights(model=1.0, retrieval=10.0))
    engine = Engine(tiny_model(), smollm, artifact, ranker=ranker)
    fitting = ranker.row("currency", "fused")
    ranker.rows.clear()
    request = engine.submit(Request("currency", 1, ranker="fused", prior=fitting))
    assert request.prior is fitting and ranker.rows == []  # made at admission, not again
    other_weights = Prior(fitting.scores, 1.0, Weights(model=1.0, retrieval=99.0), fitting.registry_sha256)
    other_version = Prior(fitting.scores, 1.0, fitting.weights, "0" * 64)
    for stale in (other_weights, other_version):
        made = engine.submit(Request("currency", 1, ranker="fused", prior=stale, prior_kind="lexical"))
        assert made.prior is not stale and made.prior is not None
        assert made.prior.weights == fitting.weights
        np.testing.assert_array_equal(made.prior.scores, fitting.scores)
    assert ranker.rows == ["lexical", "lexical"]  # made again with the request's own prior kind
    while engine.busy:
        engine.step()


def test_a_requests_status_follows_it_through_the_worker(smollm: TokenizerInfo) -> None:
    artifact = _artifact(smollm, NAMES)
    worker = Worker({"tools": Engine(tiny_model(), smollm, artifact)}, queue_limit=4)
    delivered: list[Request] = []
    done = threading.Event()

    def deliver(request: Request) -> None:
        delivered.append(request)
        done.set()

    request = Request("stock price of ACME", 1, registry="tools", deliver=deliver)
    assert request.status is RequestStatus.NEW
    worker.start()
    try:
        worker.submit(request)
        assert done.wait(60), "no answer"
        assert delivered == [request] and request.status is RequestStatus.FINISHED
        assert request.answer is not None and request.answer.artifact is artifact
        assert request.answer.response()["registry_sha256"] == artifact.registry.sha256
        assert len(request.answer.tools) == 1 and request.error is None
    finally:
        worker.stop()


def test_a_cancelled_request_is_never_delivered(smollm: TokenizerInfo) -> None:
    artifact = _artifact(smollm, NAMES)
    engine = Engine(tiny_model(), smollm, artifact)
    first, second = engine.submit(Request("news", 2)), engine.submit(Request("weather", 1))
    assert engine.cancel(second) and second.status is RequestStatus.CANCELLED
    finished = []
    while engine.busy:
        finished += engine.step()
    assert finished == [first] and first.status is RequestStatus.FINISHED and second.answer is None
