"""Which tool finds the identifier another tool requires: the first steps of a chain that a request does not name.

"Who starred in Titanic?" names ``get_movie_credits``, which requires a ``movie_id``; the request gives a title, so
an answer that can be carried out also holds the tool that turns a title into that id, ``get_search_movie``. The
registry says so without labels:

- a tool **needs** an entity when one of its required parameters is an identifier of it (``movie_id``,
  ``playlistId``; a bare ``id`` is the first entity the tool's name holds, ``ids`` the last: ``get_albums_tracks``'s
  ``id`` is an album's, ``delete_me_tracks``'s ``ids`` are tracks');
- a tool **finds** an entity when it searches (a required free-text parameter: ``query``, ``q``, ``keyword``, ...; or
  "search" in its name), holds the entity's word in its name or description, and does not need it itself.

After each tool the answer commits to, the prior of the next adds a bonus to the finders of what the chosen tools need
and no chosen tool finds (``ranker.FollowUp``, weighed ``FOLLOW["chains"]``). A registry with no identifier
parameters, or no search tools, has no chains, and its prior is what it was.

>>> from tooltrie.registry import make_registry
>>> registry = make_registry([
...     {"name": "get_movie_credits", "parameters": {"type": "object", "required": ["movie_id"],
...                                                  "properties": {"movie_id": {"type": "integer"}}}},
...     {"name": "get_search_movie", "description": "Search for movies.", "parameters": {
...         "type": "object", "required": ["query"], "properties": {"query": {"type": "string"}}}},
...     {"name": "get_movie_popular"}], name="films")
>>> chains = Chains.of(registry)
>>> chains.needs[0], [registry.names[t] for t in chains.wanted((0,))]
(frozenset({'movie'}), ['get_search_movie'])
>>> chains.wanted((0, 1)).tolist()  # found already: nothing more wanted
[]
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tooltrie.lexical import STOPWORDS, identifier_words

if TYPE_CHECKING:
    import numpy.typing as npt

    from tooltrie.registry.model import Registry, Tool

IDENTIFIER = ("id", "ids")
FREE_TEXT = frozenset(("query", "q", "search", "keyword", "keywords", "term", "text"))
# What a REST operation's name holds besides its entities: its method and the caller's own resource (``/me/``).
NOT_ENTITIES = frozenset(("get", "put", "post", "patch", "delete", "list", "set", "create", "update", "fetch", "me"))
KEPT = 8  # registries whose chains are kept (a new version of a registry is a new entry)


@functools.lru_cache(maxsize=65536)
def singular(word: str) -> str:
    """A plural's simple singular, so that ``movies`` and ``movie_id`` name one entity.

    >>> [singular(w) for w in ("movies", "tv", "address", "analysis", "status")]
    ['movie', 'tv', 'address', 'analysis', 'status']
    """
    return word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "is", "us")) else word


def _entities(text: str) -> list[str]:
    return [singular(word) for word in identifier_words(text) if word not in STOPWORDS and word not in NOT_ENTITIES]


@functools.lru_cache(maxsize=65536)
def _words(name: str) -> tuple[str, ...]:
    """A parameter's words (``identifier_words``), remembered: a registry repeats its parameters' names."""
    return tuple(identifier_words(name))


def needed(tool: Tool) -> frozenset[str]:
    """The entities whose identifiers ``tool`` requires."""
    entities = set()
    for parameter in tool.parameters:
        words = _words(parameter.name)
        if not parameter.required or not words or words[-1] not in IDENTIFIER:
            continue
        named = [singular(word) for word in words[:-1] if word not in STOPWORDS]
        if not named:  # a bare id: the entity the tool's name is about
            named = _entities(tool.name)
            named = named[:1] if words[-1] == "id" else named[-1:]
        entities.update(named[-1:])
    return frozenset(entities)


def searches(tool: Tool) -> bool:
    """Whether ``tool`` looks things up by free text: a required parameter of that kind, or "search" in its name."""
    return any(parameter.required and FREE_TEXT.intersection(_words(parameter.name))
               for parameter in tool.parameters) or (
        "search" in tool.name.lower() and "search" in identifier_words(tool.name))  # the cheap test first


@dataclass(frozen=True, eq=False)  # compared by identity: it holds arrays
class Chains:
    """A registry's chains: ``needs`` each tool's needed entities, ``finders`` each needed entity's finders (tool
    ids, ascending)."""

    needs: tuple[frozenset[str], ...]
    finders: dict[str, npt.NDArray[np.int64]]

    @classmethod
    def build(cls, tools: Sequence[Tool]) -> Chains:
        """One pass over the tools' parameters, and the words of the few that search."""
        needs = tuple(needed(tool) for tool in tools)
        wanted = set().union(*needs) if needs else set()
        finders: dict[str, list[int]] = {entity: [] for entity in wanted}
        for i, tool in enumerate(tools):
            if wanted and searches(tool):
                for entity in wanted.intersection(_entities(f"{tool.name} {tool.description}")) - needs[i]:
                    finders[entity].append(i)
        return cls(needs, {entity: np.array(found, np.int64) for entity, found in finders.items() if found})

    @classmethod
    def of(cls, registry: Registry) -> Chains:
        """``registry``'s chains, made once per registry version (the last ``KEPT`` kept, whoever asks)."""
        with _lock:
            chains = _kept.get(registry.sha256)
            if chains is not None:
                _kept.move_to_end(registry.sha256)
                return chains
        chains = cls.build(registry.tools)
        with _lock:
            _kept[registry.sha256] = chains
            while len(_kept) > KEPT:
                _kept.popitem(last=False)
        return chains

    def describe(self, names: Sequence[str]) -> dict[str, object]:
        """What ``tooltrie inspect`` prints: how many tools need an identifier, each needed entity's finders by
        name, and the entities nothing finds.

        >>> from tooltrie.registry import make_registry
        >>> registry = make_registry([{"name": "get_order", "parameters": [{"name": "orderId", "required": True}]},
        ...                           {"name": "search_orders"}, {"name": "get_user", "parameters": [
        ...                               {"name": "user_id", "required": True}]}], name="shop")
        >>> Chains.of(registry).describe(registry.names)
        {'tools needing an identifier': 2, 'found': {'order': ['search_orders']}, 'not found': ['user']}
        """
        needed_entities = set().union(*self.needs) if self.needs else set()
        return {"tools needing an identifier": sum(bool(entities) for entities in self.needs),
                "found": {entity: [names[t] for t in self.finders[entity]] for entity in sorted(self.finders)},
                "not found": sorted(needed_entities - set(self.finders))}

    def wanted(self, chosen: tuple[int, ...]) -> npt.NDArray[np.int64]:
        """The tools that find what the ``chosen`` tools need and none of them finds (ascending, unique; chosen
        ones left in: the decode never repeats a tool)."""
        found = [self.finders[entity] for entity in set().union(*(self.needs[t] for t in chosen))
                 if entity in self.finders and not np.isin(self.finders[entity], chosen).any()]
        return np.unique(np.concatenate(found)) if found else np.zeros(0, np.int64)


_kept: OrderedDict[str, Chains] = OrderedDict()
_lock = threading.Lock()

__all__ = ["Chains", "needed", "searches", "singular"]
