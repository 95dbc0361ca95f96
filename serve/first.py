"""The tools an answer starts with, decided at admission and not decoded: those the request names, and those pinned.

- **Named** (``registry/named.py``): a request that is a tool's name in any spelling, ``select:NAME,...``, or that
  writes a tool's identifier (``find_symbol``) gets that tool first, whatever the prior says, at every k.
- **Pinned**: tools always in the answer, per tenant and registry (the policy's ``pin``) and per request (``pin``).
  Counted within k by default (the answer still holds exactly k tools, the pinned among them); with
  ``pin_within_k: false`` on top of k (k decoded or named tools, then the pinned: k + pins in all).

The decode then adds the rest: ``k`` less the named and (within k) pinned tools, from the allowed tools without them,
so the whole answer still has no repeats and exactly the promised count. The answer lists the named tools first, then
the pinned, then the decoded, each saying how it was chosen (``chosen_by``); a tool chosen for certain has score 0
(the log-probability of a choice that had no alternative).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tooltrie.registry import Registry
from tooltrie.registry.named import SELECT, NameIndex, UnknownToolNameError
from tooltrie.serve.errors import InvalidRequestError
from tooltrie.serve.request import Answer, ToolChoice

if TYPE_CHECKING:
    from tooltrie.compiler.artifact import Artifact


@dataclass(frozen=True)
class First:
    """What admission decided: ``named`` and ``pinned`` tool ids (disjoint, in answer order) and ``decoded``, how
    many tools the decode adds after them."""

    named: tuple[int, ...] = ()
    pinned: tuple[int, ...] = ()
    decoded: int = 0

    @property
    def tools(self) -> tuple[int, ...]:
        return self.named + self.pinned


def first_tools(names: NameIndex, query: str, k: int, *, allowed: frozenset[int] | None,
                pins: tuple[str, ...], pin_within_k: bool) -> First:
    """The answer's first tools for ``query`` (asking ``k``) over ``names``' registry: named ones the caller may use
    (``allowed``: None, every tool), then ``pins`` (names; each must be a tool the caller may use). Raises
    ``InvalidRequestError`` for a ``select:`` or pinned name that is no tool the caller may use, more pins than k
    within it, or fewer allowed tools than the answer needs."""
    registry = names.registry

    def usable(i: int) -> bool:
        return allowed is None or i in allowed

    try:
        named = names.named(query)
    except UnknownToolNameError as exc:
        raise InvalidRequestError(str(exc)) from None
    if query.strip().lower().startswith(SELECT) and not all(usable(i) for i in named):  # as unknown: no leak
        hidden = [registry.names[i] for i in named if not usable(i)]
        raise InvalidRequestError(f"{SELECT} names {', '.join(map(repr, hidden))}, which registry "
                                  f"{registry.name!r} does not have")
    pinned: list[int] = []
    for name in pins:
        i = registry.by_name.get(name)
        if i is None or not usable(i):
            raise InvalidRequestError(f"pin names {name!r}, which is not a tool of registry {registry.name!r} the "
                                      "caller may use")
        if i not in pinned:
            pinned.append(i)
    if pin_within_k and len(pinned) > k:
        raise InvalidRequestError(f"{len(pinned)} tools are pinned within k={k}; ask for k >= {len(pinned)}, or pin "
                                  "on top of k (pin_within_k: false)")
    kept: list[int] = []  # the named tools the answer has room for (a pinned one is there anyway)
    for i in (i for i in named if usable(i)):
        room = len(set(kept) | set(pinned)) < k if pin_within_k else len(kept) < k
        if i in pinned or room:
            kept.append(i)
    first = First(named=tuple(kept), pinned=tuple(i for i in pinned if i not in kept))
    first = replace(first, decoded=k - (len(first.tools) if pin_within_k else len(first.named)))
    available = (len(registry) if allowed is None else len(allowed)) - len(first.tools)
    if first.decoded > available:
        total = len(first.tools) + first.decoded
        raise InvalidRequestError(f"the answer needs {total} distinct tools ({first.decoded} decoded after "
                                  f"{len(first.tools)} named or pinned) but registry {registry.name!r} has "
                                  f"{len(first.tools) + available} the caller may use")
    return first


def nothing_decoded(artifact: Artifact) -> Answer:
    """The decode's part of an answer whose named and pinned tools make all of it."""
    return Answer(tools=[], finish_reason="stop", token_ids=[], text="", forward_passes=0, decision_points=0,
                  prompt_tokens=0, latency_ms=0.0, artifact=artifact)


def with_first(answer: Answer, first: First, registry: Registry) -> Answer:
    """``answer`` (the decoded tools) with ``first``'s tools before it, ranked from 1."""
    ahead = [ToolChoice(rank=rank, name=registry.tools[i].name, pointer=registry.tools[i].pointer, score=0.0,
                        margin=float("inf"), chosen_by="named" if i in first.named else "pinned")
             for rank, i in enumerate(first.tools, start=1)]
    return replace(answer, tools=[*ahead, *(replace(tool, rank=tool.rank + len(ahead)) for tool in answer.tools)])


__all__ = ["First", "first_tools", "nothing_decoded", "with_first"]
