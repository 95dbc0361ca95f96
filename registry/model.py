"""The validated, format-independent registry: an ordered tuple of tools and its content hash."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
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
    where: str = field(default="", compare=False)

    def content(self) -> dict[str, object]:
        return {
            "name": self.name,
            "description": self.description,
            "pointer": self.pointer,
            "tags": list(self.tags),
            "examples": list(self.examples),
        }


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
    def sha256(self) -> str:
        """Hash of the tools' content, independent of the file format and its whitespace."""
        canonical = json.dumps([tool.content() for tool in self.tools], sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    def index(self, name: str) -> int:
        for tool_id, tool in enumerate(self.tools):
            if tool.name == name:
                return tool_id
        raise KeyError(name)
