"""Compound requests composed from labelled single-tool ones: the ``<registry>-composed`` sets.

Hand-written compound requests are few (``eval/data/compound/``, 24 a half); these are many and made the same way
every time. A composed request joins 2-4 single-tool requests of distinct tools of one registry (its plainly worded
and need-describing sets' k = 1 requests of the same split: validation requests only from validation, test only from
test), in the order drawn, by one of ``JOINS``: separate sentences, "then", "after that", "also", "and", an
enumeration. Half of the later asks are drawn from tools near the previous one in the registry's order (the same API
or the same domain in the development registries: TMDB's movie operations, one ToolAlpaca API), the others from any
tool. The draw is seeded by the registry and the split (``random.Random("composed:<registry>:<split>")``).

>>> queries = composed_split("catalog", "test")
>>> len(queries), sorted({query.k for query in queries}), queries[0].kind
(60, [2, 3, 4], 'compound')
"""

from __future__ import annotations

import functools
import random

from tooltrie.eval.datasets import DatasetError, LabelledQuery, load_split

COUNT = 60  # requests a split
ASKS = (2, 2, 3, 3, 4)  # drawn: as many of 2 and 3 asks as the hand-written sets hold, fewer of 4
NEAR = 8  # a "near" tool: within this many places of the previous ask's tool in the registry's order
# The single-tool sets a registry's composed requests are drawn from (plain, need-describing).
SOURCES = {"catalog": ("metatool-single", "catalog-needs"), "bfcl": ("bfcl", "bfcl-needs"),
           "tmdb": ("restbench-tmdb", "tmdb-needs"), "spotify": ("restbench-spotify", "spotify-needs"),
           "toolalpaca": ("toolalpaca", "toolalpaca-needs")}
SUFFIX = "-composed"
# How asks are joined: a template of two (the text so far, the next ask), and whether it joins them inside one
# sentence (the text so far loses its final stop, the next ask its capital) or after a sentence's end.
JOINS = (("{} {}", False), ("{}, then {}", True), ("{} After that, {}", False), ("{} Also, {}", False),
         ("{}, and {}", True), ("enumeration", False))

def is_composed(name: str) -> bool:
    return name.endswith(SUFFIX) and name.removesuffix(SUFFIX) in SOURCES


@functools.cache
def composed_split(registry: str, split: str) -> tuple[LabelledQuery, ...]:
    """``COUNT`` composed requests of ``registry`` (a key of ``SOURCES``) from its single-tool requests of
    ``split`` (validation or test); each one's ``where`` names the requests it was joined from."""
    if registry not in SOURCES:
        raise DatasetError(f"no composed set for {registry!r}; choose one of {', '.join(SOURCES)}")
    if split not in ("validation", "test"):
        raise DatasetError(f"{registry}{SUFFIX}: only validation and test splits, asked for {split!r}")
    from tooltrie.eval.datasets import registry_path
    from tooltrie.registry import load_registry

    order = {name: i for i, name in enumerate(load_registry(registry_path(SOURCES[registry][0])).names)}
    singles = [query for name in SOURCES[registry] for query in load_split(name, split) if query.k == 1]
    by_tool: dict[str, list[LabelledQuery]] = {}
    for query in singles:
        by_tool.setdefault(query.tools[0], []).append(query)
    tools = sorted(by_tool, key=order.__getitem__)
    rng = random.Random(f"composed:{registry}:{split}")
    result: list[LabelledQuery] = []
    while len(result) < COUNT:
        asks = [rng.choice(by_tool[rng.choice(tools)])]
        for _ in range(1, min(rng.choice(ASKS), len(tools))):
            used = {ask.tools[0] for ask in asks}
            place = tools.index(asks[-1].tools[0])
            near = [t for t in tools[max(0, place - NEAR): place + NEAR + 1] if t not in used]
            pool = near if near and rng.random() < 0.5 else [t for t in tools if t not in used]
            asks.append(rng.choice(by_tool[rng.choice(pool)]))
        text = _joined([ask.query for ask in asks], rng.choice(JOINS))
        result.append(LabelledQuery(text, tuple(ask.tools[0] for ask in asks), kind="compound",
                                    where=f"{registry}{SUFFIX}:{split}:{len(result) + 1} from "
                                          + "; ".join(ask.where for ask in asks)))
    return tuple(result)


def _joined(texts: list[str], join: tuple[str, bool]) -> str:
    """The asks' texts joined by ``join`` (``JOINS``): an enumeration numbers them; the others join the text so far
    and each next ask by the template.

    >>> _joined(["What's the weather in Oslo?", "Find flights to Rome."], ("{}, then {}", True))
    "What's the weather in Oslo, then find flights to Rome."
    >>> _joined(["What's the weather in Oslo?", "Find flights to Rome"], ("{} After that, {}", False))
    "What's the weather in Oslo? After that, find flights to Rome."
    >>> _joined(["Weather in Oslo", "flights to Rome", "news"], ("enumeration", False))
    '1) Weather in Oslo 2) flights to Rome 3) news'
    """
    template, mid_sentence = join
    asks = [text.strip() for text in texts]
    if template == "enumeration":
        return " ".join(f"{i}) {ask}" for i, ask in enumerate(asks, 1))
    text = asks[0]
    for ask in asks[1:]:
        left = text.rstrip(".!?;, ") if mid_sentence else _ended(text)
        text = template.format(left, _lower(ask) if mid_sentence or template != "{} {}" else ask)
    return _ended(text)


def _ended(text: str) -> str:
    return text if text.endswith((".", "?", "!")) else text + "."


def _lower(ask: str) -> str:
    """An ask's first letter lowered, as inside a sentence ("Find" -> "find"), but for "I" and its forms and a first
    word in capitals (an acronym, a name written so).

    >>> [_lower(ask) for ask in ("Find a flight", "I need a taxi", "NASA images", "If it rains")]
    ['find a flight', 'I need a taxi', 'NASA images', 'if it rains']
    """
    first = ask.split(" ", 1)[0]
    keep = first in ("I", "I'm", "I'd", "I've", "I'll") or (len(first) > 1 and first[:2].isupper())
    return ask if keep or not ask else ask[0].lower() + ask[1:]


__all__ = ["COUNT", "JOINS", "SOURCES", "composed_split", "is_composed"]
