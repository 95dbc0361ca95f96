"""Tool search in the platforms' shapes (``serve/tool_search.py``), checked with the platforms' own Python SDKs,
offline: the agent's request (deferred tools and a search tool) is built from their types, the search call comes as
their models make it, and the answer must validate as what their clients send back: Anthropic's ``tool_result`` of
``tool_reference`` blocks inside the next user message, OpenAI's ``tool_search_output`` input item. The tools it
names are the discovery answer's, in order; the plain form and the MCP tool carry their definitions. A change in
either platform's shape (a renamed field, a new required one) fails here."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import io
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pydantic
import pytest
from anthropic.types import MessageParam, ToolParam, ToolResultBlockParam, ToolUseBlock
from mcp import Client
from openai.types.responses import (
    FunctionToolParam,
    ResponseInputItemParam,
    ResponseToolSearchCall,
    ResponseToolSearchOutputItemParam,
    ToolSearchToolParam,
)
from support.serve_http import Running, catalog, running_server, tiny_service

from tooltrie.registry import CATALOG_PATH
from tooltrie.serve.mcp_tools import MCP_PATH, SEARCH_TOOL_NAME
from tooltrie.serve.tool_search import json_schema

QUERY = "Will it rain in Paris tomorrow, and is there news about flights?"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    with running_server(tiny_service([CATALOG_PATH], tmp_path_factory.mktemp("cache"))) as running:
        yield running


def search(server: Running, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + "/v1/tool-search", json=body, timeout=60)


def discovered(server: Running, query: str, k: int) -> list[str]:
    reply = httpx.post(server.url + "/v1/discover", json={"query": query, "k": k}, timeout=60)
    return [tool["name"] for tool in reply.json()["tools"]]


def test_anthropic_client_tool_search(server: Running) -> None:
    deferred = [ToolParam(name=tool.name, description=tool.description, input_schema=json_schema(tool.parameters),
                          defer_loading=True) for tool in catalog().tools]
    searcher = ToolParam(name="tool_search", description="Find the tools for a request.",
                         input_schema={"type": "object", "properties": {"query": {"type": "string"},
                                                                        "limit": {"type": "integer"}}})
    pydantic.TypeAdapter(list[ToolParam]).validate_python([*deferred, searcher])  # the agent's request, as sent
    call = ToolUseBlock(id="toolu_01A09q90qw90lq917835lq9", name="tool_search", type="tool_use",
                        input={"query": QUERY, "limit": 3})
    reply = search(server, {**call.input, "format": "anthropic", "call_id": call.id})  # type: ignore[dict-item]
    assert reply.status_code == 200, reply.text
    adapter = pydantic.TypeAdapter(ToolResultBlockParam)  # kept while its lazy iterable is read
    result = adapter.validate_python(reply.json())
    blocks = list(result["content"])  # type: ignore[arg-type]  (an iterable: validated as it is read)
    assert {**result, "content": blocks} == reply.json() and result["tool_use_id"] == call.id  # nothing dropped
    next_turn = MessageParam(role="user", content=[result])  # what the client sends back: the typed dict as is
    assert next_turn["content"][0]["type"] == "tool_result"  # type: ignore[index]
    names = [block["tool_name"] for block in blocks]
    assert all(block["type"] == "tool_reference" for block in blocks)
    assert names == discovered(server, QUERY, 3) and set(names) <= {tool["name"] for tool in deferred}


def test_openai_client_executed_tool_search(server: Running) -> None:
    pydantic.TypeAdapter(list[FunctionToolParam | ToolSearchToolParam]).validate_python([
        *(FunctionToolParam(type="function", name=tool.name, description=tool.description, strict=False,
                            parameters=json_schema(tool.parameters), defer_loading=True) for tool in catalog().tools),
        ToolSearchToolParam(type="tool_search", execution="client", description="Find the tools for a request.",
                            parameters={"type": "object", "properties": {"query": {"type": "string"}}})])
    call = ResponseToolSearchCall(id="tsc_1", call_id="call_8f2", type="tool_search_call", execution="client",
                                  status="completed", arguments={"query": QUERY})
    arguments: dict[str, Any] = call.arguments  # type: ignore[assignment]
    reply = search(server, {"query": arguments["query"], "limit": 2, "format": "openai", "call_id": call.call_id})
    assert reply.status_code == 200, reply.text
    item = ResponseToolSearchOutputItemParam.model_validate(reply.json())
    assert item.call_id == call.call_id and item.execution == "client" and item.status == "completed"
    names = [tool.name for tool in item.tools]  # type: ignore[union-attr]
    assert names == discovered(server, QUERY, 2)
    assert item.tools[0].parameters == json_schema(catalog().tools[catalog().index(names[0])].parameters)  # type: ignore[union-attr]
    as_input = pydantic.TypeAdapter(ResponseInputItemParam).validate_python(reply.json())  # the next request's item
    assert as_input["type"] == "tool_search_output"


def test_plain_search_names_tools_with_their_definitions_and_namespaces_narrow_it(server: Running) -> None:
    reply = search(server, {"query": QUERY, "limit": 4})
    assert reply.status_code == 200, reply.text
    tools = reply.json()["tools"]
    assert [tool["name"] for tool in tools] == discovered(server, QUERY, 4)
    for tool in tools:
        entry = catalog().tools[catalog().index(tool["name"])]
        assert tool["description"] == entry.description and tool["pointer"] == entry.pointer
        assert tool["parameters"] == json_schema(entry.parameters) and tool["chosen_by"] == "decoded"
    named = search(server, {"query": "select:MapTool", "limit": 2}).json()["tools"]
    assert named[0]["name"] == "MapTool" and named[0]["chosen_by"] == "named" and len(named) == 2


def test_a_limit_over_the_tools_gives_them_all_and_bad_calls_are_refused(server: Running) -> None:
    assert len(search(server, {"query": QUERY, "limit": 500}).json()["tools"]) == len(catalog())
    missing = search(server, {"query": QUERY, "format": "anthropic"})
    assert missing.status_code == 422 and "call_id" in missing.json()["error"]["message"]
    assert search(server, {"query": QUERY, "limit": 0}).status_code == 422
    unknown = search(server, {"query": QUERY, "namespaces": ["no-such-namespace"]})
    assert unknown.status_code == 422 and "no-such-namespace" in unknown.json()["error"]["message"]


def test_mcp_search_tools(server: Running) -> None:
    async def call() -> Any:
        async with Client(server.url + MCP_PATH) as client:
            listed = await client.list_tools()
            return listed, await client.call_tool(SEARCH_TOOL_NAME, {"query": QUERY, "limit": 3})

    listed, result = asyncio.run(asyncio.wait_for(call(), timeout=120))
    assert SEARCH_TOOL_NAME in {tool.name for tool in listed.tools}
    assert not result.is_error
    assert [tool["name"] for tool in result.structured_content["tools"]] == discovered(server, QUERY, 3)



def test_readme_tool_search_examples_run(server: Running) -> None:
    """The README's Anthropic and OpenAI calls, as printed."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    (source,) = [block for block in re.findall(r"```py\n(.*?)```", readme, re.DOTALL) if "/v1/tool-search" in block]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(source.replace("http://127.0.0.1:8000", server.url), "README.md", "exec"), {})
    (anthropic, names), (openai, tools) = (line.split(" ", 1) for line in printed.getvalue().splitlines())
    assert anthropic == "tool_result" and ast.literal_eval(names) == discovered(server, "Will it rain in Oslo?", 3)
    assert openai == "tool_search_output"
    assert ast.literal_eval(tools) == discovered(server, "Convert 100 US dollars to euros", 2)
