"""The MCP face of the discovery service: one tool, ``discover_tools``, over MCP's streamable HTTP transport.

It takes the same arguments as ``POST /v1/discover`` and returns the same object as structured content (and as JSON
text, for clients that read only text); a refused request is a tool error whose text says what is wrong. The
transport runs stateless with JSON responses: each call is one POST, with no session held on the server.
"""

from __future__ import annotations

from typing import Annotated

from mcp.server import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import Field

from tooltrie.serve.errors import ServeError
from tooltrie.serve.schema import K_HELP, QUERY_HELP, REGISTRY_HELP, DiscoverResponse
from tooltrie.serve.service import DiscoveryRequest, DiscoveryService

MCP_PATH = "/mcp"
TOOL_NAME = "discover_tools"


def mcp_server(service: DiscoveryService) -> MCPServer:
    """An MCP server whose ``discover_tools`` asks ``service``."""
    served = ", ".join(f"{summary['name']} ({summary['tools']} tools)" for summary in service.registries())
    server: MCPServer = MCPServer(
        "tooltrie", instructions="Call discover_tools to find which registry tools answer a request.",
        log_level="WARNING")

    @server.tool(name=TOOL_NAME, annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False),
                 description=("Find the k tools of a tool registry that best answer a request, most relevant first: "
                              "exactly k distinct tools that exist in the registry, each with a pointer to where "
                              f"it lives. Registries served: {served}; default: {service.default_registry}."))
    async def discover_tools(
        query: Annotated[str, Field(description=QUERY_HELP, strict=True)],
        k: Annotated[int, Field(description=K_HELP, strict=True)],
        registry: Annotated[str | None, Field(description=REGISTRY_HELP, strict=True)] = None,
    ) -> DiscoverResponse:
        try:
            body = await service.discover(DiscoveryRequest(query, k, registry))
        except ServeError as exc:
            raise ToolError(str(exc)) from exc
        return DiscoverResponse.model_validate(body)

    return server
