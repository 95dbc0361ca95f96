"""Does a need-describing request avoid its gold tools' words? The check behind ``eval/data/needs/``.

A request in a needs set states a situation or a goal; it should not reach its tools by sharing their words. Words
are compared as *content words*: the text split at non-letters and at identifier boundaries (``getArtistAlbums``,
``get_artist_albums`` -> get, artist, album), lower-cased, with ``STOP_WORDS`` and one-letter words left out and a
simple plural stripped (``es`` after s, x, z, ch, sh; else a final ``s`` not after ``s``, ``u`` or ``i``), then a
final ``y`` or ``ie`` read as ``i`` and a final ``e`` dropped (``stem``). The rule (``ALLOWED_DESCRIPTION_WORDS``):
a request shares **no** content word with its gold tools' names and **at most one** with their descriptions (all
gold tools together). Parameters are not compared: a request naturally gives arguments (a city, a date) that a
parameter's description names.

Run ``python -m tooltrie.eval.wording`` to check every bundled needs set: it prints the distribution of shared
words per set and each request that breaks the rule, and exits 1 if any does.

>>> sorted(content_words("Get an artist's albums: getArtistAlbums"))
['album', 'artist']
>>> shared_words("Not sure whether I should pack an umbrella for Lisbon",
...              [("WeatherTool", "Provide you with the latest weather information.")])
((), ())
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ALLOWED_DESCRIPTION_WORDS = 1  # shared with the gold tools' descriptions, all together; none with their names

# Function words and the generic words of a tool listing ("tool", "api", "function", the HTTP methods "get", "put",
# "post" that begin REST operation names): sharing one of them says nothing about the tool.
_STOP_TEXT = """
a about above after again all also am an and any are as at be been before being below between both but by can
could did do does doing down during each few for from further had has have having he her here hers him his how i
if in into is it its itself just let me more most my no nor not now of off on once only or other our ours out over
own same she should so some such than that the their theirs them then there these they this those through to too
under until up very was we were what when where which while who whom why will with would you your yours yourself
us via per many much ll re ve don isn aren wasn weren doesn didn won one two
tool tools api apis function functions method get put post set use using used given provide provides etc e g ie eg
"""
STOP_WORDS = frozenset(_STOP_TEXT.split())

_PARTS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+")  # identifier parts: "getHTTPResponse" -> get, HTTP, Response


def stem(word: str) -> str:
    """A lower-case word's comparison form: a simple plural stripped, a final ``y`` or ``ie`` read as ``i``, a final
    ``e`` dropped (so that "movies" meets "movie", and "cities" "city").

    >>> [stem(w) for w in ("albums", "movies", "movie", "cities", "boxes", "searches", "houses", "news", "status")]
    ['album', 'movi', 'movi', 'citi', 'box', 'search', 'hous', 'news', 'status']
    """
    if (len(word) > 4 and word.endswith("es") and word[-3] in "sxz") or word.endswith(("ches", "shes")):
        word = word[:-2]
    elif len(word) > 3 and word.endswith("s") and word[-2] not in "sui" and word != "news":
        word = word[:-1]
    if len(word) > 3 and word.endswith(("y", "ie")):
        return word.removesuffix("e")[:-1] + "i"
    return word[:-1] if len(word) > 3 and word.endswith("e") else word


def content_words(text: str) -> set[str]:
    """The content words of ``text`` (a request, a tool name or a description), plurals stripped."""
    words = set()
    for chunk in re.findall(r"[A-Za-z]+", text):  # an apostrophe splits: "what's" -> what, s
        for part in _PARTS.findall(chunk) or [chunk]:
            word = part.lower()
            if len(word) > 1 and word not in STOP_WORDS:
                words.add(stem(word))
    return words


def shared_words(query: str, tools: Iterable[tuple[str, str]]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(words shared with the tools' names, other words shared with their descriptions), each sorted."""
    words = content_words(query)
    names: set[str] = set()
    descriptions: set[str] = set()
    for name, description in tools:
        names |= content_words(name)
        descriptions |= content_words(description)
    return tuple(sorted(words & names)), tuple(sorted((words & descriptions) - names))


@dataclass(frozen=True)
class Overlap:
    query: str
    tools: tuple[str, ...]
    from_names: tuple[str, ...]
    from_descriptions: tuple[str, ...]

    @property
    def passes(self) -> bool:
        return not self.from_names and len(self.from_descriptions) <= ALLOWED_DESCRIPTION_WORDS


def overlaps(queries: Sequence[object], registry: object) -> list[Overlap]:
    """Each labelled query's shared words with its gold tools in ``registry`` (a ``Registry``)."""
    tools = {tool.name: tool for tool in registry.tools}  # type: ignore[attr-defined]
    found = []
    for item in queries:
        gold = tuple(item.tools)  # type: ignore[attr-defined]
        names, descriptions = shared_words(item.query,  # type: ignore[attr-defined]
                                           [(name, tools[name].description) for name in gold])
        found.append(Overlap(item.query, gold, names, descriptions))  # type: ignore[attr-defined]
    return found


def main(argv: Sequence[str] | None = None) -> int:
    from tooltrie.eval.datasets import BUNDLED, load_split, registry_path
    from tooltrie.registry import load_registry

    names = list(argv) if argv else [name for name in BUNDLED if name.endswith("-needs")]
    failed = 0
    for name in names:
        found = overlaps(load_split(name, "all"), load_registry(registry_path(name)))
        counts = Counter(len(o.from_names) + len(o.from_descriptions) for o in found)
        words = Counter(word for o in found for word in (*o.from_names, *o.from_descriptions))
        print(f"{name}: {len(found)} requests; shared content words per request: "
              + ", ".join(f"{n}: {counts[n]}" for n in sorted(counts))
              + ("; words shared: " + ", ".join(f"{w} {c}" for w, c in words.most_common()) if words else ""))
        for overlap in found:
            if not overlap.passes:
                failed += 1
                print(f"  FAILS {overlap.query!r} -> {', '.join(overlap.tools)}: names {list(overlap.from_names)}, "
                      f"descriptions {list(overlap.from_descriptions)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
