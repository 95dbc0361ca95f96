"""``tooltrie proxy``: in front of an OpenAI-compatible server (vLLM's, or any), a chat completion request carrying
many tools goes on with only the few that fit its last user turn.

For each ``POST /v1/chat/completions`` whose ``tools`` outnumber ``k``: its tools are an agent list
(``agent_tools.py``: compiled once per distinct list, kept), the decoder picks ``k`` of them for the text of the last
user message (``DiscoveryService.search``), and the request is forwarded with those, plus the ones it always keeps:
the proxy's pinned tools, tools not deferred where some are (``defer_loading``), tools the conversation already
called, and one ``tool_choice`` names; in the order the client listed them, every other field as sent. A later turn
asks again. A request with no more than ``k`` tools, or no user text, or tools this server cannot search (a name
its registries refuse; too many lists at once), goes on as it came. The upstream's answer
comes back as it is, streamed when it streams, with ``x-tooltrie-tools: SENT/LISTED``; an upstream that cannot be
reached is a 502.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from tooltrie.serve.errors import ServeError
from tooltrie.serve.service import DiscoveryService

__all__ = ["DEFAULT_K", "ChatProxy", "UpstreamError", "last_user_text"]

logger = logging.getLogger(__name__)

DEFAULT_K = 8  # tools forwarded per request (the pinned and kept ones on top)
CHAT_PATH = "/v1/chat/completions"
_HOP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade",
                          "accept-encoding"})


class UpstreamError(ServeError):
    """The server behind the proxy cannot be reached."""

    status = 502
    code = "upstream_unavailable"


@dataclass
class ChatProxy:
    """Forwards chat completions to ``upstream`` (its base URL, without ``/v1``) with the tools ``service`` picks."""

    service: DiscoveryService
    upstream: str
    k: int = DEFAULT_K
    pin: tuple[str, ...] = ()
    timeout_s: float = 600.0
    client: httpx.AsyncClient = field(default_factory=lambda: httpx.AsyncClient(timeout=None))

    async def tools_for(self, body: Mapping[str, Any]) -> list[Any] | None:
        """The tools to forward (None: the request goes on as it came)."""
        tools = body.get("tools")
        query = last_user_text(body.get("messages"))
        if not isinstance(tools, list) or len(tools) <= self.k or not query:
            return None
        try:  # one compile per distinct list; its tools not deferred, where some are, are in the agent's context
            agent = await self.service.agent_list(tools, None)
            found = await self.service.search(query, limit=self.k, registry=agent.name)
        except ServeError as exc:  # a list this server cannot search (or not now): the upstream judges it whole
            logger.warning("forwarding all %d tools: %s", len(tools), exc)
            return None
        picked = (set(self.pin) | _called(body.get("messages")) | _chosen(body.get("tool_choice")) | agent.loaded
                  | {tool["name"] for tool in found["tools"]})
        return [tool for tool in tools if _name(tool) in picked]

    async def forward(self, body: dict[str, Any], headers: Mapping[str, str]) -> tuple[int, dict[str, str],
                                                                                     AsyncIterator[bytes]]:
        """(status, headers, body chunks) of the upstream's answer to ``body`` with its tools narrowed."""
        listed = len(body["tools"]) if isinstance(body.get("tools"), list) else 0
        tools = await self.tools_for(body)
        if tools is not None:
            body = {**body, "tools": tools}
        sent = {key: value for key, value in headers.items() if key.lower() not in _HOP_HEADERS}
        request = self.client.build_request("POST", self.upstream.rstrip("/") + CHAT_PATH, json=body, headers=sent,
                                            timeout=self.timeout_s)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise UpstreamError(f"the upstream server {self.upstream} cannot be reached: {type(exc).__name__}: "
                                f"{exc}") from None
        back = {key: value for key, value in response.headers.items() if key.lower() not in _HOP_HEADERS
                and key.lower() != "content-encoding"}
        back["x-tooltrie-tools"] = f"{len(tools) if tools is not None else listed}/{listed}"

        async def chunks() -> AsyncIterator[bytes]:
            try:  # decoded (its content-encoding is not passed on), as it arrives
                async for chunk in response.aiter_bytes():
                    yield chunk
            finally:
                await response.aclose()

        return response.status_code, back, chunks()

    async def close(self) -> None:
        await self.client.aclose()


def last_user_text(messages: Any) -> str:
    """The text of the last user message (its text parts joined), or "" when there is none."""
    if not isinstance(messages, Sequence):
        return ""
    for message in reversed(messages):
        if not isinstance(message, Mapping) or message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            return content.strip()
        if isinstance(content, Sequence):
            return " ".join(part["text"] for part in content if isinstance(part, Mapping)
                            and part.get("type") == "text" and isinstance(part.get("text"), str)).strip()
        return ""
    return ""


def _name(tool: Any) -> str | None:
    if not isinstance(tool, Mapping):
        return None
    function = tool.get("function")
    name = (function if isinstance(function, Mapping) else tool).get("name")
    return name if isinstance(name, str) else None


def _called(messages: Any) -> set[str]:
    """The tools the conversation's assistant turns called."""
    names: set[str] = set()
    for message in messages if isinstance(messages, Sequence) else ():
        for call in (message.get("tool_calls") or ()) if isinstance(message, Mapping) else ():
            function = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(function, Mapping) and isinstance(function.get("name"), str):
                names.add(function["name"])
    return names


def _chosen(tool_choice: Any) -> set[str]:
    """The tool a ``tool_choice`` names, if it names one."""
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        name = (function if isinstance(function, Mapping) else tool_choice).get("name")
        if isinstance(name, str):
            return {name}
    return set()
