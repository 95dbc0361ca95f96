"""``tooltrie proxy`` (``serve/proxy.py``) against a stand-in upstream that records what it receives: a request with
many tools goes on with the k the decoder picks for its last user turn (the same k tools a tool search of that list
answers), plus the pinned, the not-deferred, the already-called and the chosen ones, in the client's order, every
other field as sent; a few tools, no user text or a list the server cannot search go on as they came; the answer
comes back as the upstream sent it, streamed too; an unreachable upstream is a 502. The same through vLLM's own
server: ``tests/test_vllm_serve_remote.py``."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.serve_http import Running, catalog, running_server, tiny_service

from tooltrie.registry import CATALOG_PATH
from tooltrie.serve.proxy import ChatProxy, last_user_text
from tooltrie.serve.server import create_app
from tooltrie.serve.tool_search import json_schema

QUERY = "Will it rain in Paris tomorrow?"
COMPLETION = {"id": "chatcmpl-1", "object": "chat.completion", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "Let me check."}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}}
STREAM = [b'data: {"choices": [{"delta": {"content": "Let"}}]}\n\n', b'data: {"choices": [{"delta": {"content": '
          b'" me"}}]}\n\n', b"data: [DONE]\n\n"]


def chat_tools(deferred: bool | None = None) -> list[dict[str, Any]]:
    """The catalog's tools as a Chat Completions request lists them."""
    extra = {} if deferred is None else {"defer_loading": deferred}
    return [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                              "parameters": json_schema(tool.parameters)}, **extra}
            for tool in catalog().tools]


class Upstream:
    """Records each forwarded request; answers JSON, or server-sent events when the request streams."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.headers: list[httpx.Headers] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.received.append(body)
        self.headers.append(request.headers)
        if body.get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=httpx.ByteStream(
                b"".join(STREAM)))
        return httpx.Response(200, json=COMPLETION)


@pytest.fixture(scope="module")
def upstream() -> Upstream:
    return Upstream()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, upstream: Upstream) -> Iterator[Running]:
    service = tiny_service([CATALOG_PATH], tmp_path_factory.mktemp("cache"))
    proxy = ChatProxy(service, "http://upstream.invalid", k=3, pin=("MapTool",),
                      client=httpx.AsyncClient(transport=httpx.MockTransport(upstream)))
    with running_server(service, app=create_app(service, proxy=proxy)) as running:
        yield running


def chat(server: Running, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)


def names(body: dict[str, Any]) -> list[str]:
    return [tool["function"]["name"] for tool in body["tools"]]


def test_many_tools_go_on_as_the_k_a_search_picks_plus_the_kept_ones(server: Running, upstream: Upstream) -> None:
    tools = chat_tools()
    messages = [{"role": "user", "content": "What is the exchange rate of the euro?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "ExchangeTool", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "1.08"},
                {"role": "user", "content": [{"type": "text", "text": QUERY}]}]
    body = {"model": "m", "messages": messages, "tools": tools, "temperature": 0.2,
            "tool_choice": {"type": "function", "function": {"name": "NewsTool"}}}
    reply = chat(server, body, authorization="Bearer upstream-key")
    assert reply.status_code == 200 and reply.json() == COMPLETION
    sent = upstream.received[-1]
    assert {key: value for key, value in sent.items() if key != "tools"} == {
        key: value for key, value in body.items() if key != "tools"}  # the rest as sent
    searched = httpx.post(server.url + "/v1/tool-search", json={"query": QUERY, "limit": 3, "tools": tools},
                          timeout=120).json()
    picked = {tool["name"] for tool in searched["tools"]}
    assert set(names(sent)) == picked | {"MapTool", "ExchangeTool", "NewsTool"}
    order = [tool["function"]["name"] for tool in tools]
    assert names(sent) == sorted(names(sent), key=order.index)  # the client's order
    assert all(tool in tools for tool in sent["tools"])  # each as the client defined it
    assert reply.headers["x-tooltrie-tools"] == f"{len(sent['tools'])}/47"
    assert upstream.headers[-1]["authorization"] == "Bearer upstream-key"


def test_tools_not_deferred_always_go_on(server: Running, upstream: Upstream) -> None:
    tools = chat_tools(deferred=True)
    tools[10]["defer_loading"] = False
    chat(server, {"model": "m", "messages": [{"role": "user", "content": QUERY}], "tools": tools})
    sent = names(upstream.received[-1])
    assert tools[10]["function"]["name"] in sent and len(sent) <= 3 + 2  # k, the pinned and the loaded one


def test_what_is_not_narrowed_goes_on_as_it_came(server: Running, upstream: Upstream) -> None:
    few = {"model": "m", "messages": [{"role": "user", "content": QUERY}], "tools": chat_tools()[:3]}
    nobody = {"model": "m", "messages": [{"role": "system", "content": "Be brief."}], "tools": chat_tools()}
    unsearchable = {"model": "m", "messages": [{"role": "user", "content": QUERY}],
                    "tools": [{"type": "function", "function": {"name": "twice"}} for _ in range(5)]}  # refused
    for body in (few, nobody, unsearchable, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}):
        reply = chat(server, body)
        assert reply.status_code == 200 and upstream.received[-1] == body


def test_a_stream_comes_back_as_it_went(server: Running) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": QUERY}], "tools": chat_tools(), "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        assert b"".join(reply.iter_raw()) == b"".join(STREAM)


def test_an_unreachable_upstream_is_a_502(tmp_path: Path) -> None:
    service = tiny_service([CATALOG_PATH], tmp_path / "cache")

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    proxy = ChatProxy(service, "http://upstream.invalid", client=httpx.AsyncClient(transport=httpx.MockTransport(
        refuse)))
    with running_server(service, app=create_app(service, proxy=proxy)) as running:
        reply = chat(running, {"model": "m", "messages": [{"role": "user", "content": QUERY}]})
        assert reply.status_code == 502 and reply.json()["error"]["code"] == "upstream_unavailable"
        assert "upstream.invalid" in reply.json()["error"]["message"]


def test_the_last_user_text_is_what_is_searched() -> None:
    assert last_user_text([{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
                           {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                                        {"type": "text", "text": "second"}]}]) == "second"
    assert last_user_text([{"role": "system", "content": "s"}]) == "" and last_user_text(None) == ""


def test_readme_proxy_example_runs(server: Running, upstream: Upstream) -> None:
    """The README's client, pointed at the proxy: of its 100 tools, k (3) forwarded (the tiny model picks them)."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    (source,) = [block for block in re.findall(r"```py\n(.*?)```", readme, re.DOTALL) if "chat.completions" in block]
    exec(compile(source.replace("http://127.0.0.1:8000", server.url), "README.md", "exec"), {})
    sent = names(upstream.received[-1])
    assert len(sent) == 3 and upstream.received[-1]["model"] == "served-model"
