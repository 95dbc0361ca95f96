"""Which tools a request may name: ``allow`` and ``deny`` lists of tool names or tags, resolved to tool indices.

An entry is a tool's name, or a tag (every tool carrying it); a name wins when a string is both. The allowed set is
``allow`` (everything when absent) minus ``deny``. Unknown entries are an error, not silently ignored: a typo in a
permission must not widen or empty it unnoticed.

>>> from tooltrie.registry import make_registry
>>> registry = make_registry([{"name": "get_weather", "tags": ["weather"]}, {"name": "get_news", "tags": ["news"]},
...                           {"name": "get_forecast", "tags": ["weather"]}], name="demo")
>>> sorted(select_tools(registry, allow=["weather"], deny=["get_forecast"]))
[0]
>>> select_tools(registry) is None  # the whole registry
True
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Set

from tooltrie.errors import RegistryError
from tooltrie.registry.model import Registry


def select_tools(registry: Registry, allow: Iterable[str] | None = None, deny: Iterable[str] = (),
                 *, where: str = "request") -> frozenset[int] | None:
    """The indices of the tools allowed, or None when that is every tool (no limit to apply)."""
    deny = tuple(deny)
    if allow is None and not deny:  # the common request: no set built, whatever the registry's size
        return None
    allowed = _resolve(registry, allow, "allow", where) if allow is not None else frozenset(range(len(registry)))
    allowed -= _resolve(registry, deny, "deny", where)
    return None if len(allowed) == len(registry) else allowed


def resolve_entries(entries: Iterable[object], by_name: Mapping[str, int], by_tag: Mapping[str, Set[int]],
                    *, refuse: Callable[[object], Exception]) -> frozenset[int]:
    """The tool indices ``entries`` name: a tool's name, or a tag (every tool carrying it in ``by_tag``); a name wins
    when a string is both. ``refuse(entry)`` is raised for an entry that is not a string, or neither a name nor a
    tag. Also what a tenant's view resolves requests with (``tooltrie.serve.access``)."""
    chosen: set[int] = set()
    for entry in entries:
        if isinstance(entry, str) and entry in by_name:
            chosen.add(by_name[entry])
        elif isinstance(entry, str) and entry in by_tag:
            chosen |= by_tag[entry]
        else:
            raise refuse(entry)
    return frozenset(chosen)


def _resolve(registry: Registry, entries: Iterable[str], field: str, where: str) -> frozenset[int]:
    def refuse(entry: object) -> RegistryError:
        if not isinstance(entry, str):
            return RegistryError(f"{where}: {field} entries are tool names or tags (strings), got {entry!r}")
        return RegistryError(f"{where}: {field} names {entry!r}, which is neither a tool nor a tag of "
                             f"registry {registry.name!r}")

    return resolve_entries(entries, registry.by_name, registry.by_tag, refuse=refuse)
