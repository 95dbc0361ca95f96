"""The MCP face of the discovery service, over MCP's streamable HTTP transport: ``discover_tools`` takes the same
arguments as ``POST /v1/discover`` and returns the same object as structured content (and as JSON text, for clients
that read only text); ``search_tools`` is tool search as MCP gateways expose it (``POST /v1/tool-search``'s plain
form). A refused request is a tool error whose text says what is wrong. The
transport runs stateless with JSON responses: each call is one POST, with no session held on the server.

With a policy, the server's authentication middleware has already resolved the POST's ``Authorization: Bearer`` header
to a tenant (or answered 401) and left it in the ASGI scope under ``TENANT_SCOPE_KEY``; the tool reads it from the
HTTP request the transport hands to the call's context. With a policy the tool's description names no registry (a
tenant lists its own with ``GET /v1/registries``).
"""

from __future__ import annotations

from typing import Annotated, Any

from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import Field

from tooltrie.ranker import PriorName, RankerName
from tooltrie.serve.errors import ServeError
from tooltrie.serve.policy import Tenant
from tooltrie.serve.request import Request
from tooltrie.serve.schema import (
    AGENT_TOOLS_HELP,
    ALLOW_HELP,
    DENY_HELP,
    K_HELP,
    LIMIT_HELP,
    NAMESPACES_HELP,
    PIN_HELP,
    PIN_WITHIN_K_HELP,
    PREFILTER_HELP,
    PRIOR_HELP,
    QUERY_HELP,
    QUERY_NAMES_HELP,
    RANKER_HELP,
    REGISTRY_HELP,
    SEARCH_QUERY_HELP,
    DiscoverResponse,
)
from tooltrie.serve.service import DiscoveryService
from tooltrie.serve.tool_search import DEFAULT_LIMIT

MCP_PATH = "/mcp"
TOOL_NAME = "discover_tools"
SEARCH_TOOL_NAME = "search_tools"  # tool search in the shape MCP gateways expose it (serve/tool_search.py)
TENANT_SCOPE_KEY = "tooltrie.tenant"  # where the authentication middleware leaves the request's tenant


def mcp_server(service: DiscoveryService) -> MCPServer:
    """An MCP server whose ``discover_tools`` asks ``service``."""
    served = ("the ones your API key may use (GET /v1/registries)" if service.policy is not None else
              ", ".join(f"{summary['name']} ({summary['tools']} tools)" for summary in service.registries())
              + f"; default: {service.default_registry}")
    server: MCPServer = MCPServer(
        "tooltrie", instructions="Call discover_tools to find which registry tools answer a request.",
        log_level="WARNING")

    @server.tool(name=TOOL_NAME, annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False),
                 description=("Find the k tools of a tool registry that best answer a request, most relevant first: "
                              "exactly k distinct tools that exist in the registry, each with a pointer to where "
                              f"it lives. Registries served: {served}."))
    async def discover_tools(
        query: Annotated[str, Field(description=f"{QUERY_HELP} {QUERY_NAMES_HELP}", strict=True)],
        k: Annotated[int, Field(description=K_HELP, strict=True)],
        ctx: Context,
        registry: Annotated[str | None, Field(description=REGISTRY_HELP, strict=True)] = None,
        allow: Annotated[list[str] | None, Field(description=ALLOW_HELP, strict=True)] = None,
        deny: Annotated[list[str] | None, Field(description=DENY_HELP, strict=True)] = None,
        prefilter: Annotated[int | None, Field(description=PREFILTER_HELP, strict=True)] = None,
        ranker: Annotated[RankerName | None, Field(description=RANKER_HELP)] = None,
        prior: Annotated[PriorName | None, Field(description=PRIOR_HELP)] = None,
        pin: Annotated[list[str] | None, Field(description=PIN_HELP, strict=True)] = None,
        pin_within_k: Annotated[bool, Field(description=PIN_WITHIN_K_HELP, strict=True)] = True,
    ) -> DiscoverResponse:
        scope = getattr(ctx.request_context.request, "scope", {})
        tenant = scope.get(TENANT_SCOPE_KEY)
        ask = Request(query, k, registry, allow=None if allow is None else tuple(allow), deny=tuple(deny or ()),
                      prefilter=prefilter, ranker=ranker, prior_kind=prior, pin=tuple(pin or ()),
                      pin_within_k=pin_within_k, tenant=tenant if isinstance(tenant, Tenant) else None)
        try:
            body = await service.discover(ask)
        except ServeError as exc:
            raise ToolError(str(exc)) from exc
        return DiscoverResponse.model_validate(body)

    @server.tool(name=SEARCH_TOOL_NAME, annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False),
                 description=("Search the tools of a tool registry for a request, as an agent's tool search does: up "
                              "to `limit` tools that answer it, each with its description and parameters (its full "
                              f"definition), most relevant first. Registries served: {served}."))
    async def search_tools(
        query: Annotated[str, Field(description=SEARCH_QUERY_HELP, strict=True)],
        ctx: Context,
        limit: Annotated[int, Field(description=LIMIT_HELP, strict=True, ge=1)] = DEFAULT_LIMIT,
        namespaces: Annotated[list[str] | None, Field(description=NAMESPACES_HELP, strict=True)] = None,
        registry: Annotated[str | None, Field(description=REGISTRY_HELP, strict=True)] = None,
        tools: Annotated[list[dict[str, Any]] | None, Field(description=AGENT_TOOLS_HELP)] = None,
    ) -> dict[str, Any]:
        tenant = getattr(ctx.request_context.request, "scope", {}).get(TENANT_SCOPE_KEY)
        try:
            return await service.search(query, limit=limit, namespaces=None if namespaces is None else tuple(
                namespaces), registry=registry, tenant=tenant if isinstance(tenant, Tenant) else None, tools=tools)
        except ServeError as exc:
            raise ToolError(str(exc)) from exc

    return server
