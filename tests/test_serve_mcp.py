"""The discovery endpoint over MCP: the real server (uvicorn on a loopback port, in a thread) called by the official
SDK's client session over streamable HTTP.

Checked: the ``discover_tools`` tool is listed with its input schema; its answers are exactly k distinct registry
tools and the same as ``POST /v1/discover`` gives for the same request, one at a time and many at once; a refused
request is a tool error whose text says what is wrong; a request from a foreign origin is refused (DNS rebinding);
the README's MCP example runs as written.
The model is the tiny random Llama with SmolLM2's vocabulary. No network beyond loopback.
"""

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
import pytest
from mcp import Client
from support.serve_http import (
    Running,
    catalog,
    catalog_tools,
    check_answer,
    running_server,
    same_answer,
    tiny_service,
    write_registry,
)

from tooltrie.registry import CATALOG_PATH, Registry
from tooltrie.serve.mcp_tools import MCP_PATH, TOOL_NAME

pytestmark = pytest.mark.usefixtures("loopback_only")

ASKS = [("What will the weather be in Paris tomorrow?", 3), ("Convert 100 US dollars to euros", 1),
        ("Find remote software engineering jobs in Berlin", 2), ("hi", 3), ("Play some relaxing jazz music", 2)]


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Registry]:
    path = tmp_path_factory.mktemp("registries") / "small.yaml"
    return path, write_registry(path, "small", catalog_tools(10, 20))


@pytest.fixture(scope="module")
def server(small: tuple[Path, Registry], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    with running_server(tiny_service([CATALOG_PATH, small[0]], tmp_path_factory.mktemp("cache"))) as running:
        yield running


@pytest.fixture(scope="module")
def over_http(server: Running) -> dict[tuple[str, int], dict[str, Any]]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        return {(query, k): client.post("/v1/discover", json={"query": query, "k": k}).json() for query, k in ASKS}


async def _with_client(server: Running, calls: list[dict[str, Any]]) -> tuple[Any, list[Any]]:
    async with Client(server.url + MCP_PATH) as client:
        tools = await client.list_tools()
        results = await asyncio.gather(*(client.call_tool(TOOL_NAME, arguments) for arguments in calls))
        return tools, list(results)


def call(server: Running, calls: list[dict[str, Any]]) -> tuple[Any, list[Any]]:
    return asyncio.run(asyncio.wait_for(_with_client(server, calls), timeout=120))


def test_discover_tools_is_listed_with_its_schema(server: Running) -> None:
    tools, _ = call(server, [])
    (tool,) = [tool for tool in tools.tools if tool.name == TOOL_NAME]
    schema = tool.input_schema
    assert set(schema["properties"]) == {"query", "k", "registry", "allow", "deny", "prefilter", "ranker", "prior",
                                         "pin", "pin_within_k"}
    assert sorted(schema["required"]) == ["k", "query"]
    assert "catalog (47 tools)" in (tool.description or "") and "small (10 tools)" in (tool.description or "")
    assert tool.annotations is not None and tool.annotations.read_only_hint


def test_answers_match_http_alone_and_together(server: Running, over_http: dict[tuple[str, int], Any],
                                               small: tuple[Path, Registry]) -> None:
    calls = [{"query": query, "k": k} for query, k in ASKS]
    _, alone = call(server, calls[:1])
    _, together = call(server, calls * 3 + [{"query": "hi", "k": 10, "registry": "small"}])
    for (query, k), result in zip(ASKS[:1] + ASKS * 3, [*alone, *together[:-1]], strict=True):
        assert not result.is_error, result.content
        body = result.structured_content
        check_answer(body, catalog(), k)
        assert same_answer(body, over_http[query, k])
    everything = together[-1]
    assert not everything.is_error
    check_answer(everything.structured_content, small[1], 10)


def test_a_request_chooses_its_ranker_as_over_http(server: Running) -> None:
    if not server.service.retrieval:
        pytest.skip("the retrieval ranker needs all-MiniLM-L6-v2")
    asks = [{"query": query, "k": k, "ranker": ranker} for query, k in ASKS[:2] for ranker in ("retrieval", "fused")]
    _, results = call(server, asks)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for ask, result in zip(asks, results, strict=True):
            assert not result.is_error, result.content
            over_http = client.post("/v1/discover", json=ask).json()
            assert same_answer(result.structured_content, over_http)
            assert result.structured_content["ranker"] == over_http["ranker"] != {"model": 1.0, "retrieval": 0.0}


BAD_CALLS = [
    ({"query": "hi", "k": 0}, "k must be between 1 and 47"),
    ({"query": "hi", "k": 48}, "got 48"),
    ({"query": "", "k": 1}, "query is empty"),
    ({"query": "x" * 2001, "k": 1}, "the limit is 2,000"),
    ({"query": "hi", "k": 1, "registry": "nope"}, "unknown registry 'nope'"),
    ({"query": "hi", "k": "2"}, "k"),
    ({"query": "hi"}, "k"),
    ({"query": "hi", "k": 1, "ranker": "best"}, "ranker"),
]


def test_refusals_are_tool_errors_that_say_what_is_wrong(server: Running) -> None:
    _, results = call(server, [arguments for arguments, _ in BAD_CALLS])
    for (arguments, phrase), result in zip(BAD_CALLS, results, strict=True):
        assert result.is_error, arguments
        text = " ".join(getattr(block, "text", "") for block in result.content)
        assert phrase in text, (arguments, text)


def test_foreign_origin_is_refused(server: Running) -> None:
    """On loopback, MCP refuses a browser page from elsewhere (DNS rebinding protection)."""
    request = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    reply = httpx.post(server.url + MCP_PATH, json=request, timeout=30,
                       headers={"Origin": "http://attacker.example", "Accept": "application/json, text/event-stream"})
    assert 400 <= reply.status_code < 500


README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_mcp_example_runs(server: Running) -> None:
    (source,) = [block for block in re.findall(r"```py\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)
                 if TOOL_NAME in block]
    assert "http://127.0.0.1:8000/mcp" in source
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(source.replace("http://127.0.0.1:8000/mcp", server.url + MCP_PATH), str(README), "exec"), {})
    (line,) = printed.getvalue().splitlines()
    found = ast.literal_eval(line)
    assert len(found) == len(set(found)) == 2 and set(found) <= set(catalog().names)
