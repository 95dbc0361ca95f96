"""The discovery endpoint's wire format, one definition for HTTP (request body, response, OpenAPI) and MCP (the
``discover_tools`` tool's input and structured output).

Types are strict: ``"3"`` is not a k, ``3.0`` is not a k, ``true`` is not a k; unknown fields are refused (a
misspelt ``registy`` would otherwise be ignored silently).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tooltrie.ranker import PriorName, RankerName
from tooltrie.serve.limits import ServeLimits
from tooltrie.serve.tool_search import DEFAULT_LIMIT, Format

_DEFAULTS = ServeLimits()
QUERY_HELP = (f"What the agent wants to do, in words; non-empty, at most {_DEFAULTS.max_query_chars:,} characters "
              "(the server's default limit).")
K_HELP = "How many tools to return: 1 to the number of tools in the registry; every answer has exactly k."
REGISTRY_HELP = ("The name of a registry this server serves (GET /v1/registries); by default, the first one (with "
                 "a policy: the tenant's default).")
ALLOW_HELP = ("Tool names or tags the answer may use (a tag: every tool carrying it). Narrows, never widens: with a "
              "policy, an entry outside the tenant's tools is refused like one that does not exist.")
DENY_HELP = "Tool names or tags the answer may not use."
PREFILTER_HELP = ("Keep the top N tools (of those allowed) by the retrieval prior for the query, then decode within "
                  "them; N >= k, at most the registry's --prefilter setting. Default: that setting, else none.")


PIN_HELP = ("Tool names always in the answer (with a policy, added to the tenant's own pins): counted within k, "
            "unless pin_within_k is false.")
PIN_WITHIN_K_HELP = ("Whether pinned tools count within k (the answer holds exactly k tools) or come on top of it "
                     "(k tools, then the pinned ones not among them).")
QUERY_NAMES_HELP = ("A query that is a tool's name (any case, snake_case, camelCase or words), `select:NAME,...`, or "
                    "that writes a tool's identifier (find_symbol) gets that tool first, whatever else ranks it.")
RANKER_HELP = ("What the answer ranks tools by: model (the model's scores), retrieval (the retrieval prior alone) or "
               "fused (both, inside the constrained decode). Default: the server's --ranker.")
PRIOR_HELP = ("The retrieval prior: dense (embedding similarity of the query to each tool), lexical (BM25 over the "
              "words inside the tools' names and text) or hybrid (both). Dense and hybrid need the server's embedding "
              "model; lexical does not. Default: the server's --prior.")


class DiscoverBody(BaseModel):
    """``POST /v1/discover``: a query and how many tools it needs."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "examples": [{"query": "What will the weather be in Paris tomorrow?", "k": 3}]})

    query: str = Field(description=f"{QUERY_HELP} {QUERY_NAMES_HELP}")
    k: int = Field(description=K_HELP)
    registry: str | None = Field(default=None, description=REGISTRY_HELP)
    allow: list[str] | None = Field(default=None, description=ALLOW_HELP)
    deny: list[str] = Field(default_factory=list, description=DENY_HELP)
    prefilter: int | None = Field(default=None, description=PREFILTER_HELP)
    ranker: RankerName | None = Field(default=None, description=RANKER_HELP)
    prior: PriorName | None = Field(default=None, description=PRIOR_HELP)
    pin: list[str] = Field(default_factory=list, description=PIN_HELP)
    pin_within_k: bool = Field(default=True, description=PIN_WITHIN_K_HELP)


SEARCH_QUERY_HELP = "The search tool's query: the user's words, or a tool's name (`select:NAME,...`)."
LIMIT_HELP = f"At most this many tools (default {DEFAULT_LIMIT}; fewer only where fewer may be used)."
NAMESPACES_HELP = "Search only these namespaces: tags of the registry (an agent's namespaces are tags)."
AGENT_TOOLS_HELP = ("The agent's own tool list, searched instead of a registry: OpenAI function, custom and namespace "
                    "tools, Anthropic tools or MCP tools/list entries, as the agent sends them to its model (platform "
                    "tools are left out; where some have defer_loading, only those are searched). Compiled once per "
                    "distinct list and kept.")
FORMAT_HELP = ("anthropic: a tool_result block of tool_reference blocks (Messages API); openai: a tool_search_output "
               "item (Responses API, client-executed tool search); plain: a list of tools with their definitions.")
CALL_ID_HELP = ("The search call being answered: the tool_use block's id (anthropic) or the tool_search_call's "
                "call_id (openai); required for those formats.")


class ToolSearchBody(BaseModel):
    """``POST /v1/tool-search``: a search tool's call, answered in its platform's shape."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "examples": [{"query": "weather in Paris tomorrow", "limit": 3, "format": "anthropic",
                      "call_id": "toolu_01A09q90qw90lq917835lq9"}]})

    query: str = Field(description=SEARCH_QUERY_HELP)
    limit: int = Field(default=DEFAULT_LIMIT, ge=1, description=LIMIT_HELP)
    namespaces: list[str] | None = Field(default=None, description=NAMESPACES_HELP)
    registry: str | None = Field(default=None, description=REGISTRY_HELP)
    format: Format = Field(default="plain", description=FORMAT_HELP)
    call_id: str | None = Field(default=None, description=CALL_ID_HELP)
    pin: list[str] = Field(default_factory=list, description=PIN_HELP)
    tools: list[dict[str, Any]] | None = Field(default=None, description=AGENT_TOOLS_HELP)

    @model_validator(mode="after")
    def _answers_a_call(self) -> ToolSearchBody:
        if self.format != "plain" and not self.call_id:
            raise ValueError(f"format {self.format!r} answers a search call: give its call_id")
        if self.tools is not None and self.registry is not None:
            raise ValueError("give a registry or the agent's tools, not both")
        return self


class ToolPointer(BaseModel):
    rank: int = Field(description="1 for the most relevant")
    name: str = Field(description="the tool's name in the registry")
    pointer: str = Field(description="where to find the tool (a URI or server/tool)")
    score: float = Field(description="log-probability of choosing this tool, given the ones ranked before it (0 for "
                                     "a tool named or pinned: chosen for certain)")
    chosen_by: Literal["named", "pinned", "decoded"] = Field(
        default="decoded", description="named: the query names it; pinned: always in the answer; decoded: chosen "
                                       "by the decoder")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    forward_passes: int
    decision_points: int
    speculated: int = Field(description="decisions made on a run fed speculatively, without a pass of their own")


class DiscoverResponse(BaseModel):
    """Exactly k distinct tools of the registry, most relevant first (``finish_reason`` ``"stop"``)."""

    tools: list[ToolPointer]
    finish_reason: str = Field(description='"stop" when the answer is complete; "error" when decoding failed')
    registry: str
    registry_sha256: str = Field(description="the version of the registry that answered (it changes on reload)")
    usage: Usage
    ranker: dict[str, float] = Field(description="the weights the answer's choices used: model and retrieval")
    latency_ms: float = Field(description="decoding time in the engine, from admission to the answer")


class ErrorDetail(BaseModel):
    code: str = Field(description="invalid_request, malformed_json, body_too_large, unauthorized, forbidden, "
                                  "unknown_registry, queue_full, timeout, ...")
    message: str = Field(description="what is wrong, in words")


class ErrorBody(BaseModel):
    error: ErrorDetail
