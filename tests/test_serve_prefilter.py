"""The retrieval pre-filter against the real server (uvicorn on a loopback port, in a thread): the top N tools by
similarity become the request's allowed subset, within what its tenant and its allow/deny permit, and the model
decodes inside them.

Checked with a fake, deterministic ranker (word overlap with the query, ties to the later tool, so a tenant's
forbidden tools often rank first): with k = N the answer is exactly the top N of the allowed tools, so a tool from
beyond them would show; the registry's setting is the default and the ceiling; N below k, below 1, above the
ceiling, or without a retriever is a 422; HTTP and MCP agree; a ranker is built once per registry version and
rebuilt after a reload; a failing ranker is a 503. With all-MiniLM-L6-v2 installed, the server's real retriever
(``tooltrie.retrieval``) answers with its own top N (skipped when the model package is missing).
The model is the tiny random Llama with SmolLM2's vocabulary. No network beyond loopback.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st
from mcp import Client
from support.serve_http import (
    Running,
    catalog,
    catalog_tools,
    check_answer,
    running_server,
    tiny_service,
    write_registry,
)

from tooltrie.registry import CATALOG_PATH, Registry, make_registry
from tooltrie.serve.errors import UnavailableError
from tooltrie.serve.mcp_tools import MCP_PATH, TOOL_NAME
from tooltrie.serve.policy import Policy
from tooltrie.serve.prefilter import Prefilter, PrefilterError, Ranker, prior_rankers
from tooltrie.serve.server import prefilter_limits

pytestmark = pytest.mark.usefixtures("loopback_only")

KEY = "prefilter-tenant-key-0123456789"
ADMIN_KEY = "prefilter-admin-key-0123456789"
TIMEOUT = httpx.Timeout(60.0)
SHOP_TAGS = {"FinanceTool": ["money"], "ExchangeTool": ["money"], "NewsTool": ["info"], "MapTool": ["info"],
             "CourseTool": ["info"], "NotesTool": ["internal"], "MemoryTool": ["internal"], "LawTool": ["internal"]}
TENANT_SHOP = {"FinanceTool", "ExchangeTool", "NewsTool", "MapTool", "CourseTool"}  # allow [money, info]
QUERIES = ("take notes about the law and remember them", "convert dollars to euros", "news on a map", "hi")


class WordOverlap:
    """Scores a tool by the query's words found in its name and description; ties go to the later tool."""

    def __init__(self, registry: Registry) -> None:
        self.texts = [f"{tool.name} {tool.description}".lower() for tool in registry.tools]

    def rank_indices(self, query: str, k: int) -> list[int]:
        words = set(re.findall(r"[a-z]+", query.lower()))
        score = [sum(word in text for word in words) for text in self.texts]
        return sorted(range(len(self.texts)), key=lambda i: (-score[i], -i))[:k]


def top(registry: Registry, query: str, n: int, within: set[str]) -> set[str]:
    """What the fake ranker keeps: the first n of ``within`` in its order."""
    order = [registry.tools[i].name for i in WordOverlap(registry).rank_indices(query, len(registry))]
    return set([name for name in order if name in within][:n])


class Counting:
    def __init__(self) -> None:
        self.built: list[str] = []  # registry sha256 of each ranker built

    def __call__(self, registry: Registry) -> Ranker:
        self.built.append(registry.sha256)
        return WordOverlap(registry)


@pytest.fixture(scope="module")
def shop(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Registry]:
    path = tmp_path_factory.mktemp("registries") / "shop.yaml"
    return path, write_registry(path, "shop", catalog_tools(0, 12), SHOP_TAGS)


@pytest.fixture(scope="module")
def rankers() -> Counting:
    return Counting()


@pytest.fixture(scope="module")
def server(shop: tuple[Path, Registry], rankers: Counting,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    policy = Policy.parse({"tenants": {
        "acme": {"keys": [KEY], "registries": {"shop": {"allow": ["money", "info"]}, "catalog": {}}},
        "ops": {"keys": [ADMIN_KEY], "admin": True, "registries": {"shop": {}, "catalog": {}}}}})
    service = tiny_service([shop[0], CATALOG_PATH], tmp_path_factory.mktemp("cache"), policy=policy,
                           prefilter=Prefilter(rankers, limits={"catalog": 6}))
    with running_server(service) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Running) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


def ask(client: httpx.Client, body: dict[str, Any]) -> httpx.Response:
    return client.post("/v1/discover", json=body)


def names(reply: httpx.Response) -> set[str]:
    assert reply.status_code == 200, reply.text
    return {tool["name"] for tool in reply.json()["tools"]}


@pytest.mark.parametrize("query", QUERIES)
def test_answer_is_the_top_n_of_the_allowed_tools(client: httpx.Client, shop: tuple[Path, Registry],
                                                  query: str) -> None:
    everything = set(catalog().names)
    for n in (1, 3, 5):
        reply = ask(client, {"query": query, "k": n, "prefilter": n, "registry": "catalog"})
        check_answer(reply.json(), catalog(), n)
        assert names(reply) == top(catalog(), query, n, everything)
    reply = ask(client, {"query": query, "k": 2, "prefilter": 4, "registry": "catalog"})  # k < N: within the N
    assert names(reply) <= top(catalog(), query, 4, everything)


@pytest.mark.parametrize("query", QUERIES)
def test_prefilter_never_widens_the_tenants_tools(client: httpx.Client, shop: tuple[Path, Registry],
                                                  query: str) -> None:
    """The ranker puts forbidden tools first (ties to the later tool, and they come last); none gets through."""
    registry = shop[1]
    for n in (1, 2, 3):
        assert names(ask(client, {"query": query, "k": n, "prefilter": n})) == top(registry, query, n, TENANT_SHOP)
    assert names(ask(client, {"query": query, "k": 2, "prefilter": 5})) <= TENANT_SHOP
    narrowed = {"ExchangeTool", "NewsTool", "MapTool"}
    reply = ask(client, {"query": query, "k": 2, "prefilter": 2, "allow": ["ExchangeTool", "info"],
                         "deny": ["CourseTool"]})
    assert names(reply) == top(registry, query, 2, narrowed)


def test_registry_setting_is_the_default_and_the_ceiling(client: httpx.Client) -> None:
    query = QUERIES[0]
    reply = ask(client, {"query": query, "k": 6, "registry": "catalog"})  # no prefilter asked: catalog's 6
    assert names(reply) == top(catalog(), query, 6, set(catalog().names))
    for body, phrase in (({"prefilter": 7, "k": 1}, "prefilter=7 is over registry 'catalog''s limit of 6"),
                         ({"prefilter": 2, "k": 3}, "prefilter=2 keeps fewer tools than k=3"),
                         ({"prefilter": 0, "k": 1}, "prefilter must be at least 1"),
                         ({"prefilter": -1, "k": 1}, "prefilter must be at least 1"),
                         ({"prefilter": "3", "k": 1}, "prefilter: Input should be"),
                         ({"k": 7}, "prefilter=6 keeps fewer tools than k=7")):
        reply = ask(client, {"query": query, "registry": "catalog", **body})
        assert reply.status_code == 422 and phrase in reply.json()["error"]["message"], (body, reply.text)


def test_mcp_prefilter_matches_http(server: Running, client: httpx.Client) -> None:
    calls = [{"query": query, "k": 3, "prefilter": 3, "registry": registry}
             for query in QUERIES for registry in ("shop", "catalog")]
    over_http = [names(ask(client, call)) for call in calls]

    async def over_mcp() -> list[Any]:
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http, \
                Client(streamable_http_client(server.url + MCP_PATH, http_client=http)) as mcp:
            return list(await asyncio.gather(*(mcp.call_tool(TOOL_NAME, call) for call in calls)))

    for expected, result in zip(over_http, asyncio.run(asyncio.wait_for(over_mcp(), 120)), strict=True):
        assert not result.is_error, result.content
        assert {tool["name"] for tool in result.structured_content["tools"]} == expected


def test_ranker_is_built_once_per_registry_version(server: Running, client: httpx.Client, rankers: Counting,
                                                   shop: tuple[Path, Registry]) -> None:
    path, registry = shop
    ask(client, {"query": "hi", "k": 1, "prefilter": 2})
    built = rankers.built.count(registry.sha256)
    for query in QUERIES:
        ask(client, {"query": query, "k": 1, "prefilter": 2})
    assert built == 1 and rankers.built.count(registry.sha256) == 1
    try:
        changed = write_registry(path, "shop", catalog_tools(0, 10), SHOP_TAGS)
        reload = client.post("/v1/registries/shop/reload", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert reload.status_code == 200, reload.text
        reply = ask(client, {"query": QUERIES[0], "k": 2, "prefilter": 2})
        assert names(reply) == top(changed, QUERIES[0], 2, TENANT_SHOP)
        assert rankers.built.count(changed.sha256) == 1
    finally:
        write_registry(path, "shop", catalog_tools(0, 12), SHOP_TAGS)
        client.post("/v1/registries/shop/reload", headers={"Authorization": f"Bearer {ADMIN_KEY}"})


def test_failing_ranker_is_unavailable_and_bad_settings_are_refused() -> None:
    registry = make_registry([{"name": name} for name in ("a", "b", "c")], name="demo")

    class Broken:
        def rank_indices(self, query: str, k: int) -> list[int]:
            raise RuntimeError("the encoder broke")

    with pytest.raises(UnavailableError, match="the encoder broke"):
        Prefilter(lambda _: Broken()).top(registry, "q", 1, within=frozenset({0, 1, 2}))

    class Wild:  # out-of-range, repeated and forbidden ids: the result stays inside `within`
        def rank_indices(self, query: str, k: int) -> list[int]:
            return [7, 2, 2, -1, 0, 1]

    assert Prefilter(lambda _: Wild()).top(registry, "q", 2, within=frozenset({0, 2})) == {0, 2}
    assert Prefilter(lambda _: Wild()).top(registry, "q", 1, within=frozenset({0, 1, 2})) == {2}
    with pytest.raises(PrefilterError, match="at least 1"):
        Prefilter(WordOverlap, limits={"demo": 0})
    with pytest.raises(PrefilterError, match="no retriever"):
        Prefilter(None, limits={"demo": 3}, unavailable="no retriever here")


def test_a_registrys_own_prefilter_wins_over_the_bare_one_in_any_order() -> None:
    names = ["catalog", "shop", "bfcl"]
    for given in ({"catalog": 5, None: 20}, {None: 20, "catalog": 5}):
        assert prefilter_limits(given, names) == {"catalog": 5, "shop": 20, "bfcl": 20}
    assert prefilter_limits({"shop": 3}, names) == {"shop": 3}
    with pytest.raises(PrefilterError, match=r"names registries \['nope'\], which are not served"):
        prefilter_limits({"nope": 3}, names)


@pytest.mark.parametrize("prior", ["hybrid", "lexical"])
def test_real_retriever_answers_with_its_own_top_n(tmp_path: Path, prior: str) -> None:
    """The retrieval prior (all-MiniLM-L6-v2 and BM25) through ``tooltrie serve``'s own wiring (``prior_rankers``),
    on the catalog."""
    factory, why = prior_rankers(prior)
    if factory is None:
        pytest.skip(f"the {prior} retriever is not available: {why}")
    from tooltrie.ranker import Ranker as PriorRanker

    queries = ("What will the weather be in Paris tomorrow?", "Convert 100 US dollars to euros")
    service = tiny_service([CATALOG_PATH], tmp_path, prefilter=Prefilter(factory))
    with running_server(service) as running, httpx.Client(base_url=running.url, timeout=TIMEOUT) as client:
        replies = [client.post("/v1/discover", json={"query": query, "k": 3, "prefilter": 3}) for query in queries]
    ranker = PriorRanker(catalog(), prior=prior)
    for query, reply in zip(queries, replies, strict=True):
        assert names(reply) == {catalog().names[i] for i in ranker.rank_indices(query, 3)}


# -- top N by arrays against the rule they replace ------------------------------------------------------------------

def sorted_top(n_tools: int, n: int, within: frozenset[int] | None, scores: Any) -> frozenset[int]:
    """The rule ``Prefilter.top`` followed with a Python sort over a set of every allowed tool: the first n by
    (-score, tool id), or all of them when there are no more than n."""
    allowed = frozenset(range(n_tools)) if within is None else within
    if len(allowed) <= n:
        return allowed
    return frozenset(sorted(allowed, key=lambda tool: (-float(scores[tool]), tool))[:n])


def looped_top(order: list[int], n: int, within: frozenset[int]) -> frozenset[int]:
    """The rule it followed with a ranker's order: the first n distinct tools of ``within`` in that order."""
    if len(within) <= n:
        return within
    kept: list[int] = []
    for index in order:
        if index in within and index not in kept:
            kept.append(index)
            if len(kept) == n:
                break
    return frozenset(kept)


# A few values, signed zeros among them, so that most draws have ties, at the n-th score too.
TIED_SCORES = st.sampled_from([-1.5, -0.0, 0.0, 0.25, 0.25000003, 1.0, 3.0])


@st.composite
def rankings(draw: st.DrawFn) -> tuple[int, int, frozenset[int] | None, Any, list[int]]:
    n_tools = draw(st.integers(1, 40))
    n = draw(st.integers(1, n_tools + 2))
    within = draw(st.none() | st.frozensets(st.integers(0, n_tools - 1)))
    scores = np.array(draw(st.lists(TIED_SCORES, min_size=n_tools, max_size=n_tools)), dtype=np.float32)
    order = draw(st.lists(st.integers(-3, n_tools + 3), max_size=2 * n_tools + 3))
    return n_tools, n, within, scores, order


def _as_given(within: frozenset[int] | None, form: str, n_tools: int) -> Any:
    """``within`` as a caller may give it: a set, a bool mask or an int array of tool ids."""
    if within is None or form == "set":
        return within
    ids = np.array(sorted(within), dtype=np.int64)
    if form == "ids":
        return ids
    mask = np.zeros(n_tools, dtype=bool)
    mask[ids] = True
    return mask


@hypothesis.settings(max_examples=400, deadline=None)
@hypothesis.given(rankings(), st.sampled_from(["set", "mask", "ids"]))
def test_top_by_arrays_is_the_sorted_rule(drawn: tuple[int, int, frozenset[int] | None, Any, list[int]],
                                          form: str) -> None:
    """Scores with ties (at the n-th score too): the same tools as the Python sort, ties to the lower tool id, for
    ``within`` as a set, a mask, ids, or None (every tool); and, ranked by a ranker whose order repeats ids and
    names ids outside the registry, the same tools as the loop over its order."""
    n_tools, n, within, scores, order = drawn
    registry = make_registry([{"name": f"t{i}"} for i in range(n_tools)], name="demo")
    given_within = _as_given(within, form, n_tools)
    kept = Prefilter(None).top(registry, "q", n, within=given_within, scores=scores)
    assert (frozenset(range(n_tools)) if kept is None else kept) == sorted_top(n_tools, n, within, scores)

    class Ordered:
        def rank_indices(self, query: str, k: int) -> list[int]:
            return order

    ranked = Prefilter(lambda _: Ordered()).top(registry, "q", n, within=given_within)
    everything = frozenset(range(n_tools))
    assert (everything if ranked is None else ranked) == looped_top(order, n, everything if within is None
                                                                    else within)
