"""Which tools one request may be answered with: its tenant's view of the registry, narrowed by the request.

A request narrows, never widens::

    allowed = (tenant allow - tenant deny) & (request allow, or everything) - (request deny)

and the retrieval pre-filter (``prefilter.py``) then keeps the top N of ``allowed``. The request's entries resolve
*within the tenant's view*: a name or tag outside it is refused with the same message as one that does not exist, so
a tenant cannot probe which forbidden tools there are; a tag resolves to the tenant's tools that carry it. Refusals
(an unknown entry, an empty result) are ``InvalidRequestError`` (422), before the request reaches a batch.

>>> from tooltrie.registry import make_registry
>>> registry = make_registry([{"name": "get_weather", "tags": ["weather"]}, {"name": "get_news", "tags": ["news"]},
...                           {"name": "get_forecast", "tags": ["weather"]}], name="demo")
>>> view = ToolView.of(registry, Grant(deny=("get_forecast",)))
>>> sorted(view.narrow(allow=("weather",), deny=()))   # the tag, as far as the tenant sees it
[0]
>>> view.narrow(allow=("get_forecast",), deny=())  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
tooltrie.serve.errors.InvalidRequestError: allow names 'get_forecast', which is neither a tool nor a tag you may use...
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tooltrie.registry import Registry
from tooltrie.registry.subsets import resolve_entries, select_tools
from tooltrie.serve.errors import InvalidRequestError
from tooltrie.serve.policy import Grant


@dataclass(frozen=True)
class ToolView:
    """The tools of ``registry`` a tenant may use (``grant``; None: every tool), indexed for resolving requests."""

    registry: Registry
    visible: frozenset[int]
    by_name: Mapping[str, int]
    by_tag: Mapping[str, frozenset[int]]
    restricted: bool  # a tenant's grant applies (messages say "you may use")

    @classmethod
    def of(cls, registry: Registry, grant: Grant | None, *, where: str = "policy") -> ToolView:
        """Raises ``RegistryError`` when the grant names a tool or tag ``registry`` does not have."""
        selected = select_tools(registry, grant.allow, grant.deny, where=where) if grant is not None else None
        visible = frozenset(range(len(registry))) if selected is None else selected
        by_tag: dict[str, set[int]] = {}
        for index in sorted(visible):
            for tag in registry.tools[index].tags:
                by_tag.setdefault(tag, set()).add(index)
        return cls(registry=registry, visible=visible,
                   by_name={registry.tools[index].name: index for index in visible},
                   by_tag={tag: frozenset(indices) for tag, indices in by_tag.items()},
                   restricted=grant is not None)

    def narrow(self, *, allow: Sequence[str] | None, deny: Sequence[str]) -> frozenset[int]:
        """The visible tools in ``allow`` (all when None) and not in ``deny``; refuses unknown entries and an empty
        result."""
        allowed = self.visible if allow is None else self._resolve(allow, "allow")
        allowed -= self._resolve(deny, "deny")
        if not allowed:
            said = "allow is empty" if allow is not None and not allow else "no tool is left once deny is applied"
            raise InvalidRequestError(f"{said}; an answer needs at least k tools "
                                      f"{'you may use' if self.restricted else 'of'} registry {self.registry.name!r}")
        return allowed

    def _resolve(self, entries: Sequence[str], field: str) -> frozenset[int]:
        def refuse(entry: object) -> InvalidRequestError:
            scope = "you may use in" if self.restricted else "of"
            return InvalidRequestError(f"{field} names {str(entry)[:80]!r}, which is neither a tool nor a tag {scope} "
                                       f"registry {self.registry.name!r}")

        return resolve_entries(entries, self.by_name, self.by_tag, refuse=refuse)
