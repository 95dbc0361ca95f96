"""Tool search the way agent platforms already call it: the agent lists its tools as deferred, a search tool is called
with the user's words, and only the tools it returns are loaded into the model's context. ``POST /v1/tool-search``
and the MCP tool ``search_tools`` take that call (the query, an optional limit and namespaces) and answer with
tooltrie's tools in the shape the caller's platform expects:

- ``anthropic``: a ``tool_result`` block answering the search's ``tool_use`` (``call_id``: its id) whose content is
  one ``tool_reference`` block per tool, as Anthropic's Messages API takes from a client's own tool search;
- ``openai``: a ``tool_search_output`` item answering a client-executed ``tool_search_call`` (``call_id``: its
  call id), carrying the tools' definitions, as OpenAI's Responses API takes them;
- ``plain``: ``{"tools": [{"name", "description", "pointer", "score", "chosen_by", "parameters"}]}``, for the rest
  (LangGraph's bigtool, MCP gateways, a script).

A search is a discovery request (``service.py``: the same admission, policy, named and pinned tools, decode): its
limit is k, clamped to the tools the caller may use (a search answers up to ``limit``); namespaces are tags (an agent's
own tool list, sent as ``tools``, maps each namespace to a tag: ``agent_tools.py``), which narrow the search as
``allow`` does.
"""

from __future__ import annotations

from typing import Any, Literal

from tooltrie.registry import Registry, Tool
from tooltrie.registry.model import Parameter
from tooltrie.serve.agent_tools import AgentTools

Format = Literal["anthropic", "openai", "plain"]
FORMATS: tuple[Format, ...] = ("anthropic", "openai", "plain")
DEFAULT_LIMIT = 5  # what the platforms' own searches return: three to five tools


def json_schema(parameters: tuple[Parameter, ...]) -> dict[str, Any]:
    """A tool's parameters as the JSON schema object the platforms' tool definitions carry."""
    properties: dict[str, Any] = {}
    for parameter in parameters:
        schema: dict[str, Any] = {"type": parameter.type} if parameter.type else {}
        if parameter.description:
            schema["description"] = parameter.description
        if parameter.values:
            schema["enum"] = list(parameter.values)
        properties[parameter.name] = schema
    required = [parameter.name for parameter in parameters if parameter.required]
    return {"type": "object", "properties": properties, **({"required": required} if required else {})}


def shaped(answer: dict[str, Any], registry: Registry, form: Format, call_id: str | None, *,
           agent: AgentTools | None = None) -> dict[str, Any]:
    """The discovery ``answer`` (``Answer.response``) as ``form`` answers a search call ``call_id``; over an agent's
    own list (``agent``), OpenAI's shape carries the tools as the agent defined them."""
    tools = [registry.tools[registry.index(tool["name"])] for tool in answer["tools"]]
    if form == "anthropic":
        return {"type": "tool_result", "tool_use_id": call_id,
                "content": [{"type": "tool_reference", "tool_name": tool.name} for tool in tools]}
    if form == "openai":
        definitions = agent.openai_tools([tool.name for tool in tools]) if agent is not None else [
            _openai_function(tool) for tool in tools]
        return {"type": "tool_search_output", "call_id": call_id, "execution": "client", "status": "completed",
                "tools": definitions}
    return {"tools": [{"name": tool.name, "description": tool.description, "pointer": tool.pointer,
                       "score": found["score"], "chosen_by": found["chosen_by"],
                       "parameters": json_schema(tool.parameters)} for tool, found in zip(tools, answer["tools"],
                                                                                        strict=True)],
            "registry": answer["registry"], "registry_sha256": answer["registry_sha256"]}


def _openai_function(tool: Tool) -> dict[str, Any]:
    return {"type": "function", "name": tool.name, "description": tool.description,
            "parameters": json_schema(tool.parameters)}


__all__ = ["DEFAULT_LIMIT", "FORMATS", "Format", "json_schema", "shaped"]
