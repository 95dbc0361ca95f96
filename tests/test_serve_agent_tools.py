"""An agent's own tool list searched without a registry file (``serve/agent_tools.py``): every platform's shape read
(OpenAI functions, custom tools and namespaces, Anthropic tools, MCP entries; platform tools left out), compiled once
per distinct list, deferred tools alone answered, namespaces as tags, answers in the agent's own definitions, the
tenants' ``agent_tools`` grants, and the bound on lists held at once."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pydantic
import pytest
from anthropic.types import ToolParam
from mcp import Client
from openai.types.responses import NamespaceToolParam, ResponseToolSearchOutputItemParam
from support.serve_http import Running, catalog, running_server, tiny_service

from tooltrie.errors import RegistryError
from tooltrie.registry import CATALOG_PATH
from tooltrie.serve.agent_tools import PREFIX, list_digest, read_agent_tools
from tooltrie.serve.limits import ServeLimits
from tooltrie.serve.mcp_tools import MCP_PATH, SEARCH_TOOL_NAME
from tooltrie.serve.policy import Policy
from tooltrie.serve.tool_search import json_schema

QUERY = "Will it rain in Paris tomorrow?"
KEYS = {"agents": "agents-key-0123456789", "registries-only": "registries-key-0123456789",
        "no-billing": "no-billing-key-0123456789"}


def anthropic_tools(deferred: bool = True) -> list[dict[str, Any]]:
    """The catalog's tools as an Anthropic request lists them."""
    tools = [ToolParam(name=tool.name, description=tool.description, input_schema=json_schema(tool.parameters),
                       defer_loading=deferred) for tool in catalog().tools]
    pydantic.TypeAdapter(list[ToolParam]).validate_python(tools)
    return [dict(tool) for tool in tools]


def namespaced() -> list[dict[str, Any]]:
    """An OpenAI Responses request: two namespaces of deferred functions, a plain function, and platform tools."""
    crm = NamespaceToolParam(type="namespace", name="crm", description="Customer records", tools=[
        {"type": "function", "name": "get_customer", "description": "Look up a customer by email",
         "parameters": {"type": "object", "properties": {"email": {"type": "string"}}}, "defer_loading": True},
        {"type": "function", "name": "update_customer", "description": "Change a customer's address",
         "parameters": None, "defer_loading": True}])
    billing = NamespaceToolParam(type="namespace", name="billing", description="Invoices and payments", tools=[
        {"type": "function", "name": "send_invoice", "description": "Email an invoice to a customer",
         "parameters": None, "defer_loading": True},
        {"type": "function", "name": "refund_payment", "description": "Refund a card payment",
         "parameters": None, "defer_loading": True}])
    return [dict(crm), dict(billing),
            {"type": "function", "name": "get_weather", "description": "Weather forecast for a city",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "defer_loading": True},
            {"type": "web_search"}, {"type": "tool_search", "execution": "client"}]


# -- the list as a registry -------------------------------------------------------------------------------------


def test_every_shape_is_read_and_platform_tools_are_left_out() -> None:
    tools = [*namespaced(), {"name": "read_file", "description": "Read a file", "inputSchema": {  # MCP
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
        {"name": "get_time", "description": "The time in a city", "input_schema": {  # Anthropic
            "type": "object", "properties": {"city": {"type": "string"}}}, "defer_loading": False},
        {"type": "custom", "name": "run_sql", "description": "Run a SQL query"},
        {"type": "tool_search_tool_regex_20251119", "name": "tool_search_tool_regex"}]
    agent = read_agent_tools(tools)
    registry = agent.registry
    assert registry.names == ["get_customer", "update_customer", "send_invoice", "refund_payment", "get_weather",
                              "read_file", "get_time", "run_sql"]
    assert registry.name == PREFIX + list_digest(tools)[:16]
    assert registry.tools[0].tags == ("crm",) and registry.tools[2].tags == ("billing",)
    assert [p.name for p in registry.tools[5].parameters] == ["path"] and registry.tools[5].parameters[0].required
    assert [p.name for p in registry.tools[6].parameters] == ["city"]
    assert agent.loaded == {"read_file", "get_time", "run_sql"}  # not deferred, where others are
    grouped = agent.openai_tools(["send_invoice", "get_weather", "get_customer", "refund_payment"])
    assert [entry.get("name") for entry in grouped] == ["billing", "get_weather", "crm"]
    assert [tool["name"] for tool in grouped[0]["tools"]] == ["send_invoice", "refund_payment"]
    assert grouped[0]["description"] == "Invoices and payments" and grouped[2]["tools"][0] == tools[0]["tools"][0]
    shuffled = [dict(reversed(list(entry.items()))) for entry in tools]
    assert list_digest(shuffled) == list_digest(tools)  # one compile per list, whatever its keys' order
    assert read_agent_tools([*anthropic_tools(deferred=False)]).loaded == frozenset()  # nothing deferred: all


def test_a_bad_list_names_its_entries() -> None:
    with pytest.raises(RegistryError) as caught:
        read_agent_tools([{"name": "ok"}, {"type": "namespace", "name": "n", "tools": [{"type": "function",
                                                                                         "name": ""}]},
                          {"type": "function", "function": 3}])
    message = str(caught.value)
    assert "the request's tools (tools[1].tools[0])" in message and "(tools[2]).function" in message
    with pytest.raises(RegistryError, match="has no tools"):
        read_agent_tools([{"type": "web_search"}])


# -- served ------------------------------------------------------------------------------------------------------


def policy() -> Policy:
    return Policy.parse({"tenants": {
        "agents": {"keys": [KEYS["agents"]], "registries": {"catalog": {}}, "agent_tools": True},
        "registries-only": {"keys": [KEYS["registries-only"]], "registries": {"catalog": {}}},
        "no-billing": {"keys": [KEYS["no-billing"]], "registries": {"catalog": {}},
                       "agent_tools": {"deny": ["billing", "nowhere"]}}}})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    with running_server(tiny_service([CATALOG_PATH], tmp_path_factory.mktemp("cache"))) as running:
        yield running


def search(server: Running, body: dict[str, Any], key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + "/v1/tool-search", json=body, headers=headers, timeout=120)


def test_an_agent_list_answers_as_the_same_registry_file_does_and_compiles_once(server: Running) -> None:
    """The catalog's tools sent as an Anthropic list: the same answers as the catalog served from its file (the
    model ranks them; the registry's name is not in the prompt), the list compiled on its first search only."""
    tools = anthropic_tools()
    queries = [QUERY, "convert 20 euros to dollars", "find me a recipe with leeks", "news about the stock market"]
    for i, query in enumerate(queries):
        sent = tools if i % 2 == 0 else [dict(reversed(list(tool.items()))) for tool in tools]
        ours = search(server, {"query": query, "limit": 3, "tools": sent})
        assert ours.status_code == 200, ours.text
        theirs = search(server, {"query": query, "limit": 3})
        assert [t["name"] for t in ours.json()["tools"]] == [t["name"] for t in theirs.json()["tools"]]
        assert ours.json()["registry"].startswith(PREFIX)
    assert len(server.service._agent_lists) == 1


def test_only_deferred_tools_are_answered_and_namespaces_narrow(server: Running) -> None:
    tools = namespaced()
    reply = search(server, {"query": "refund the card payment of the customer", "limit": 10, "tools": tools})
    assert reply.status_code == 200, reply.text
    assert {t["name"] for t in reply.json()["tools"]} == {"get_customer", "update_customer", "send_invoice",
                                                          "refund_payment", "get_weather"}  # a limit over: them all
    loaded = [*tools[:3], {**tools[2], "name": "get_time", "defer_loading": False}]
    reply = search(server, {"query": "what time is it in Lima", "limit": 10, "tools": loaded})
    assert "get_time" not in {t["name"] for t in reply.json()["tools"]}  # in the agent's context already
    reply = search(server, {"query": "refund", "limit": 5, "namespaces": ["billing"], "tools": tools,
                            "format": "openai", "call_id": "ts_1"})
    assert reply.status_code == 200, reply.text
    item = ResponseToolSearchOutputItemParam.model_validate(reply.json())  # what the client sends back
    assert [(group.type, group.name) for group in item.tools] == [("namespace", "billing")]  # type: ignore[union-attr]
    assert {tool.name for tool in item.tools[0].tools} == {"send_invoice", "refund_payment"}  # type: ignore
    sent = reply.json()["tools"][0]
    assert sent["description"] == "Invoices and payments" and all(t in tools[1]["tools"] for t in sent["tools"])


def test_bad_lists_are_refused_before_any_compile(server: Running) -> None:
    reply = search(server, {"query": QUERY, "tools": [{"name": "ok"}, {"name": ""}]})
    assert reply.status_code == 422 and "tools[1]" in reply.json()["error"]["message"]
    reply = search(server, {"query": QUERY, "tools": [{"type": "web_search"}]})
    assert reply.status_code == 422 and "has no tools" in reply.json()["error"]["message"]
    reply = search(server, {"query": QUERY, "tools": [], "limit": 1})
    assert reply.status_code == 422
    reply = search(server, {"query": QUERY, "tools": [{"name": "a"}], "registry": "catalog"})
    assert reply.status_code == 422 and "not both" in reply.text


def test_mcp_search_tools_takes_the_agents_list(server: Running) -> None:
    import asyncio

    async def call() -> dict[str, Any]:
        async with Client(server.url + MCP_PATH) as client:
            result = await client.call_tool(SEARCH_TOOL_NAME, {"query": "refund a payment", "limit": 2,
                                                               "tools": namespaced()})
            assert not result.is_error, result
            return json.loads(result.content[0].text)  # type: ignore[union-attr]

    body = asyncio.run(call())
    assert len(body["tools"]) == 2 and body["registry"].startswith(PREFIX)


def test_tenants_need_agent_tools_and_their_denials_hold(tmp_path: Path) -> None:
    service = tiny_service([CATALOG_PATH], tmp_path / "cache", policy=policy())
    with running_server(service) as running:
        body = {"query": "send the invoice to the customer", "limit": 10, "tools": namespaced()}
        assert search(running, body).status_code == 401
        refused = search(running, body, KEYS["registries-only"])
        assert refused.status_code == 403 and "agent_tools" in refused.json()["error"]["message"]
        allowed = search(running, body, KEYS["agents"])
        assert allowed.status_code == 200 and "send_invoice" in {t["name"] for t in allowed.json()["tools"]}
        narrowed = search(running, body, KEYS["no-billing"])
        assert narrowed.status_code == 200, narrowed.text
        assert {t["name"] for t in narrowed.json()["tools"]} == {"get_customer", "update_customer", "get_weather"}
        asked = search(running, {**body, "namespaces": ["billing"]}, KEYS["no-billing"])
        assert asked.status_code == 422  # a denied namespace is as unknown as one that does not exist


def test_lists_held_at_once_are_bounded_and_the_idle_one_goes(tmp_path: Path) -> None:
    limits = ServeLimits(agent_lists=1, timeout_s=1.0, max_tools_body_bytes=200_000)
    service = tiny_service([CATALOG_PATH], tmp_path / "cache", limits=limits)
    first, second = anthropic_tools(), namespaced()
    with running_server(service) as running:
        assert search(running, {"query": QUERY, "tools": first}).status_code == 200
        busy = search(running, {"query": QUERY, "tools": second})
        assert busy.status_code == 503 and "agent_lists" in busy.json()["error"]["message"]
        time.sleep(1.1)
        assert search(running, {"query": QUERY, "tools": second}).status_code == 200  # the idle one went
        assert [entry.tools.registry.names for entry in service._agent_lists.values()] == [
            read_agent_tools(second).registry.names]
        huge = [{"name": f"tool_{i}", "description": "x" * 200} for i in range(1_000)]
        random.Random(0).shuffle(huge)
        assert search(running, {"query": QUERY, "tools": huge}).status_code == 413
