"""Which tools a request names: an agent that knows a tool's name gets that tool first, whatever a prior says.

A name is found in any of its spellings: as written, in any case, ``snake_case``, ``camelCase`` or as words (a name is
its words: ``getWeather``, ``get_weather``, ``get-weather``, ``GET WEATHER`` and ``get weather`` are one name), and
in the explicit ``select:NAME[,NAME...]`` form tool-search clients send. A request names a tool when:

- it is ``select:`` followed by names (each must be a tool: an unknown one is an error, not a guess);
- it is, as a whole, a tool's name in some spelling;
- a word of it is an identifier-like spelling (two words or more joined: ``find_symbol``, ``findSymbol``,
  ``weather.get_forecast``) of a tool's name: a request that mentions ``send_email`` and ``get_weather`` names both,
  in the order written. A single plain word (``weather``) names nothing unless it is the whole request.

Where two tools share a spelling (``get_user`` and ``getUser`` in one registry), the one written exactly so is meant;
else both are, in the registry's order.
"""

from __future__ import annotations

import re
from functools import cached_property
from typing import TypeVar

from tooltrie.errors import RegistryError
from tooltrie.registry.model import Registry

SELECT = "select:"
K = TypeVar("K", tuple[str, ...], str)
# A word's humps (getHTTPResponse -> get, HTTP, Response) and digits, whatever joins the words.
_WORDS = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+")
# A request's words: what whitespace and surrounding punctuation leave, joiners inside kept (find_symbol, a.b-c).
_TOKEN = re.compile(r"[\w.\-/:]+")


class UnknownToolNameError(RegistryError):
    """A ``select:`` request names a tool the registry does not have."""


def name_words(name: str) -> tuple[str, ...]:
    """A name's words, lowercase: what every spelling of it shares.

    >>> name_words("getHTTPResponse_v2"), name_words("weather.get_forecast"), name_words("Get Weather")
    (('get', 'http', 'response', 'v', '2'), ('weather', 'get', 'forecast'), ('get', 'weather'))
    """
    return tuple(word.lower() for word in _WORDS.findall(name))


class NameIndex:
    """The tools of ``registry`` by their names' words."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    @cached_property
    def _by_words(self) -> dict[tuple[str, ...], tuple[int, ...]]:
        return _index({i: name_words(name) for i, name in enumerate(self.registry.names)})

    @cached_property
    def _by_letters(self) -> dict[str, tuple[int, ...]]:
        return _index({i: _letters(name) for i, name in enumerate(self.registry.names)})

    def tools_spelled(self, text: str) -> tuple[int, ...]:
        """The tools whose name ``text`` spells (the one written exactly so, else all sharing the spelling; a
        spelling whose humps are lost, ``FINANCETOOL``, by its letters)."""
        exact = self.registry.by_name.get(text.strip())
        if exact is not None:
            return (exact,)
        return self._by_words.get(name_words(text)) or self._by_letters.get(_letters(text), ())

    def named(self, query: str) -> list[int]:
        """The tools ``query`` names, in the order it names them (each once); raises ``UnknownToolNameError`` for a
        ``select:`` name that is no tool."""
        text = query.strip()
        if text.lower().startswith(SELECT):
            return self._selected(text[len(SELECT):])
        whole = self.tools_spelled(text)
        if whole:
            return list(whole)
        found: list[int] = []
        for token in _TOKEN.findall(text):
            token = token.strip(".-/:")
            if len(name_words(token)) < 2 or not _joined(token):
                continue
            found += [i for i in self.tools_spelled(token) if i not in found]
        return found

    def _selected(self, names: str) -> list[int]:
        found: list[int] = []
        unknown: list[str] = []
        for name in (part.strip() for part in names.split(",")):
            ids = self.tools_spelled(name) if name else ()
            if name and not ids:
                unknown.append(name)
            found += [i for i in ids if i not in found]
        if unknown or not found:
            raise UnknownToolNameError(f"{SELECT} names {', '.join(map(repr, unknown)) or 'no tool'}, which "
                                       f"registry {self.registry.name!r} does not have")
        return found


def _letters(text: str) -> str:
    return "".join(name_words(text))


def _index(keys: dict[int, K]) -> dict[K, tuple[int, ...]]:
    """Tool ids by key, in the registry's order (empty keys left out)."""
    found: dict[K, list[int]] = {}
    for i, key in keys.items():
        if key:
            found.setdefault(key, []).append(i)
    return {key: tuple(ids) for key, ids in found.items()}


def _joined(token: str) -> bool:
    """Whether ``token`` is one identifier of several words (joined by _ . - / or humps), not a plain word."""
    return bool(re.search(r"[_.\-/]\w", token) or re.search(r"[a-z][A-Z]", token))


def spellings(name: str) -> dict[str, str]:
    """A name written the four ways a request may write it (as written, snake_case, camelCase, words), for tests
    and the study of names found.

    >>> spellings("get_weather_v2")["camelCase"], spellings("getWeather")["words"]
    ('getWeatherV2', 'get weather')
    """
    words = name_words(name)
    return {"as written": name, "snake_case": "_".join(words),
            "camelCase": words[0] + "".join(word.capitalize() for word in words[1:]) if words else name,
            "words": " ".join(words)}


__all__ = ["SELECT", "NameIndex", "UnknownToolNameError", "name_words", "spellings"]
