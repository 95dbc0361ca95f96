"""An agent's own tool list as a registry: the tools a tool-search call sends (OpenAI function, custom and namespace
tools, Anthropic tools, MCP ``tools/list`` entries, with ``defer_loading``) searched without a registry file.

The service compiles each distinct list once (keyed by the sha256 of its canonical JSON) and keeps a few
(``ServeLimits.agent_lists``), least recently used first out. A list's namespaces are its tools' tags, so a search's
``namespaces`` and a tenant's ``agent_tools`` grant (``policy.py``) narrow it as they narrow any registry. Where some
tools are deferred (``defer_loading: true``), the others are in the agent's context already: a search never spends a
place of its answer on them. Answers in OpenAI's shape carry the tools as the agent defined them, inside their
namespaces.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tooltrie.registry import Registry, tool_list_registry

PREFIX = "agent-"  # agent lists' registry names: the prefix and 16 hex digits of the list's sha256 (``list_name``)


@dataclass(frozen=True)
class AgentTools:
    """One agent's tool list: its registry, the tools it loads anyway, and each tool's definition as sent."""

    registry: Registry
    loaded: frozenset[str]  # not deferred where others are: already in the agent's context, never an answer
    definitions: Mapping[str, Mapping[str, Any]]  # tool name -> its entry as the agent sent it
    namespaces: Mapping[str, Mapping[str, Any]]  # tool name -> its OpenAI namespace's entry (less its tools)

    @property
    def name(self) -> str:
        return self.registry.name

    def openai_tools(self, names: list[str]) -> list[dict[str, Any]]:
        """The tools ``names`` as a ``tool_search_output`` carries them: each as the agent defined it, the tools of
        one namespace inside one copy of it, in the order of first appearance."""
        out: list[dict[str, Any]] = []
        grouped: dict[str, dict[str, Any]] = {}
        for name in names:
            namespace = self.namespaces.get(name)
            if namespace is None:
                out.append(dict(self.definitions[name]))
                continue
            group = grouped.get(namespace["name"])
            if group is None:
                group = grouped[namespace["name"]] = {**namespace, "tools": []}
                out.append(group)
            group["tools"].append(dict(self.definitions[name]))
        return out


def list_digest(tools: list[Any]) -> str:
    """The sha256 of a tool list's canonical JSON: one compile per distinct list, whatever its key order."""
    text = json.dumps(tools, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def list_name(tools: list[Any]) -> str:
    """The registry name of an agent's tool list: ``agent-`` and 16 hex digits of its digest (one per list)."""
    return PREFIX + list_digest(tools)[:16]


def read_agent_tools(tools: list[Any], *, source: str = "the request's tools",
                     name: str | None = None) -> AgentTools:
    """The registry of an agent's tool list (named ``list_name(tools)``, or ``name`` when the caller has it), its
    platform tools left out. Raises ``RegistryError`` (``RegistryProblems``) naming each bad entry by its index."""
    registry = tool_list_registry(tools, name=name or list_name(tools), source=source)
    definitions: dict[str, Mapping[str, Any]] = {}
    namespaces: dict[str, Mapping[str, Any]] = {}
    deferred: set[str] = set()
    for entry, namespace in _entries(tools):
        nested = entry.get("function")
        function: dict[str, Any] = nested if isinstance(nested, dict) else entry
        name = function.get("name")
        if isinstance(name, str) and name in registry.by_name and name not in definitions:
            definitions[name] = entry
            if namespace is not None:
                namespaces[name] = {key: value for key, value in namespace.items() if key != "tools"}
            if function.get("defer_loading") is True or entry.get("defer_loading") is True:
                deferred.add(name)
    loaded = frozenset(set(registry.names) - deferred) if deferred else frozenset()
    return AgentTools(registry=registry, loaded=loaded, definitions=definitions, namespaces=namespaces)


def _entries(tools: list[Any]) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """Every tool entry of the list, with the namespace entry it sits in (None: at the top)."""
    found: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
    for entry in tools:
        if not isinstance(entry, dict):
            continue
        if entry.get("type") == "namespace" and isinstance(entry.get("tools"), list):
            found += [(inner, entry) for inner in entry["tools"] if isinstance(inner, dict)]
        else:
            found.append((entry, None))
    return found


__all__ = ["PREFIX", "AgentTools", "list_digest", "list_name", "read_agent_tools"]
