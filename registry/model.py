"""The validated, format-independent registry: an ordered tuple of tools and its content hash."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from json.encoder import encode_basestring as _json_string  # what json.dumps(..., ensure_ascii=False) writes


@dataclass(frozen=True, slots=True)
class Parameter:
    """One argument of a tool, as its JSON schema describes it: what requests mention and retrieval reads.

    ``values``: the schema's ``enum``, as text.
    """

    name: str
    description: str = ""
    type: str = ""
    required: bool = False
    values: tuple[str, ...] = ()

    def content(self) -> dict[str, object]:
        return {"name": self.name, "description": self.description, "type": self.type, "required": self.required,
                "values": list(self.values)}


@dataclass(frozen=True, slots=True)
class Tool:
    """One registry entry.

    ``pointer`` is what the discovery endpoint hands back (a URI or a ``server/tool`` reference);
    ``where`` says where the tool was read from, for error messages, and is not part of the hash.
    """

    name: str
    description: str
    pointer: str
    tags: tuple[str, ...] = ()
    examples: tuple[str, ...] = ()
    parameters: tuple[Parameter, ...] = ()
    where: str = field(default="", compare=False)

    def content(self) -> dict[str, object]:
        """The tool as the native format writes it (``parameters`` only when it has some, so a registry without
        any hashes the same whether or not its format could carry them)."""
        content: dict[str, object] = {
            "name": self.name,
            "description": self.description,
            "pointer": self.pointer,
            "tags": list(self.tags),
            "examples": list(self.examples),
        }
        if self.parameters:
            content["parameters"] = [parameter.content() for parameter in self.parameters]
        return content

    def content_json(self) -> str:
        """``json.dumps(self.content(), sort_keys=True, ensure_ascii=False)``, written from the strings directly
        (a seventh of the time: no dict, no generic encoder; 100,000 tools are hashed per compile)."""
        parameters = "" if not self.parameters else (
            f'"parameters": {json.dumps([p.content() for p in self.parameters], sort_keys=True, ensure_ascii=False)}, ')
        return (f'{{"description": {_json_string(self.description)}, "examples": {_json_list(self.examples)}, '
                f'"name": {_json_string(self.name)}, {parameters}"pointer": {_json_string(self.pointer)}, '
                f'"tags": {_json_list(self.tags)}}}')


@dataclass(frozen=True)
class Registry:
    """Tools in file order; tool ids are positions in ``tools``."""

    name: str
    tools: tuple[Tool, ...]
    source: str = ""

    @property
    def names(self) -> list[str]:
        return [tool.name for tool in self.tools]

    def __len__(self) -> int:
        return len(self.tools)

    @functools.cached_property
    def content_json(self) -> str:
        """The tools' content as canonical JSON: ``json.dumps([tool.content() for tool in self.tools],
        sort_keys=True, ensure_ascii=False)``, byte for byte (what ``sha256`` hashes and an artifact stores)."""
        return f"[{', '.join([tool.content_json() for tool in self.tools])}]"

    @functools.cached_property
    def sha256(self) -> str:
        """Hash of the tools' content, independent of the file format and its whitespace."""
        return hashlib.sha256(self.content_json.encode("utf-8")).hexdigest()

    def index(self, name: str) -> int:
        return self.by_name[name]

    @functools.cached_property
    def by_name(self) -> dict[str, int]:
        """Tool id by name (names are unique), built once: lookups per request stay O(1) at 100,000 tools."""
        return {tool.name: tool_id for tool_id, tool in enumerate(self.tools)}

    @functools.cached_property
    def by_tag(self) -> dict[str, frozenset[int]]:
        """Tool ids by tag, built once."""
        tagged: dict[str, set[int]] = {}
        for tool_id, tool in enumerate(self.tools):
            for tag in tool.tags:
                tagged.setdefault(tag, set()).add(tool_id)
        return {tag: frozenset(ids) for tag, ids in tagged.items()}


def _json_list(texts: tuple[str, ...]) -> str:
    return json.dumps(list(texts), ensure_ascii=False) if texts else "[]"
