"""The lexical prior: BM25 (the ``bm25s`` library) over the words inside the tools' identifiers and text.

Tool registries are not prose: a request says "net income" where the tool is ``calculateNetIncome``, "quadratic
roots" where it is ``algebra.quadratic_roots``. So a tool's words are its name split at case changes, digits and
punctuation (``identifier_words``), its description, its parameters' names and descriptions and their enum values,
all split the same way; the query is split the same way too, so that "getWeather" in a request meets ``get_weather``.

>>> identifier_words("calculateNetIncome algebra.quadratic_roots HTTPServer2Go")
['calculate', 'net', 'income', 'algebra', 'quadratic', 'roots', 'http', 'server', '2', 'go']
>>> from tooltrie.registry import make_registry
>>> index = LexicalIndex.build(make_registry([{"name": "getWeather"}, {"name": "calculateNetIncome"}], name="demo"))
>>> [round(float(s), 3) for s in index.scores("What is the net income?")]
[0.0, 0.509]

The index is built once per registry version (milliseconds for thousands of tools; ``bench/bench_lexical.py``) and
kept in a file beside the artifact, keyed by the registry's sha256 and ``VERSION`` (``LexicalIndex.cached``).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import unicodedata
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tooltrie.errors import ArtifactError
from tooltrie.registry.model import Registry, Tool

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = ["BM25_PARAMETERS", "STOPWORDS", "VERSION", "LexicalIndex", "identifier_words", "tool_words"]

# Bumped whenever the words or the scoring change, so that a kept index of an older kind is built afresh.
VERSION = "1"
# Lucene's BM25 with its usual constants (bm25s's defaults).
BM25_PARAMETERS: dict[str, Any] = {"k1": 1.5, "b": 0.75, "method": "lucene"}
# Lucene's English stop words (bm25s ships them): words that say nothing about which tool is meant.
STOPWORDS = frozenset(("a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "if", "in", "into", "is", "it",
                       "no", "not", "of", "on", "or", "such", "that", "the", "their", "then", "there", "these", "they",
                       "this", "to", "was", "will", "with"))


# Runs of letters and digits (Python's \w less the underscore): what the words are split out of.
_CHUNK = re.compile(r"[^\W_]+")


@functools.cache
def _word_pattern() -> re.Pattern[str]:
    """A word: an upper-case run that ends before a capitalised word (``HTTP`` in ``HTTPServer``), a capital and the
    lower-case letters after it, a run of capitals, or a run of digits. Python's ``re`` has no Unicode case classes,
    so they are spelled out once from the Basic Multilingual Plane (about 30 ms): letters beyond it separate words."""
    upper: list[int] = []
    other: list[int] = []
    digit: list[int] = []
    for code in range(0x10000):
        character = chr(code)
        if character.isdigit():
            digit.append(code)
        elif character.isalpha():
            (upper if character.isupper() else other).append(code)
    u, lower, d = _character_class(upper), _character_class(other), _character_class(digit)
    return re.compile(f"{u}+(?={u}{lower})|{u}?{lower}+|{u}+|{d}+")


def _character_class(codes: list[int]) -> str:
    """``[...]`` of the code points, as ranges."""
    ranges: list[str] = []
    first = previous = codes[0]
    for code in [*codes[1:], -1]:
        if code != previous + 1:
            ranges.append(re.escape(chr(first)) if first == previous else
                          f"{re.escape(chr(first))}-{re.escape(chr(previous))}")
            first = code
        previous = code
    return f"[{''.join(ranges)}]"


def identifier_words(text: str) -> list[str]:
    """The words of ``text`` (NFKC-normalised), case-folded: split at anything neither a letter nor a digit
    (``_ . - /``, spaces, punctuation), between letters and digits, and at case changes (``netIncome`` -> net,
    income; ``HTTPServer`` -> http, server: a run of capitals ends before the capital that starts the next word).
    Letters of any script count; a script without case is one word until a digit or a separator.

    >>> identifier_words("get_user-ID/v2.listItems")
    ['get', 'user', 'id', 'v', '2', 'list', 'items']
    >>> identifier_words("Größe_berechnen wetterAPI")
    ['grösse', 'berechnen', 'wetter', 'api']
    """
    return [word for chunk in _CHUNK.findall(unicodedata.normalize("NFKC", text)) for word in _chunk_words(chunk)]


def _chunk_words(chunk: str) -> tuple[str, ...]:
    """The words of a run of letters and digits."""
    if chunk.isdigit() or (chunk.isalpha() and chunk[1:].islower()):  # most words of prose: one word as it is
        return (chunk.casefold(),)
    return tuple(word.casefold() for word in _word_pattern().findall(chunk))


def _words(texts: Iterable[str], known: dict[str, tuple[str, ...]]) -> list[str]:
    """The words of ``texts`` less the stop words; ``known`` remembers each run's words (a registry repeats the same
    few thousand: splitting each once halves the index's build time)."""
    words: list[str] = []
    for chunk in _CHUNK.findall(unicodedata.normalize("NFKC", " ".join(texts))):
        found = known.get(chunk)
        if found is None:
            found = known[chunk] = tuple(word for word in _chunk_words(chunk) if word not in STOPWORDS)
        words += found
    return words


def tool_words(tool: Tool, *, known: dict[str, tuple[str, ...]] | None = None) -> list[str]:
    """What BM25 reads of a tool: its name, description, parameters (names, descriptions, enum values), split by
    ``identifier_words``, stop words left out.

    >>> from tooltrie.registry.model import Parameter
    >>> tool_words(Tool("getWeather", "The forecast for a city.", "x", parameters=(Parameter("unit", values=("C",)),)))
    ['get', 'weather', 'forecast', 'city', 'unit', 'c']
    """
    texts = [tool.name, tool.description]
    for parameter in tool.parameters:
        texts += [parameter.name, parameter.description, *parameter.values]
    return _words(texts, {} if known is None else known)


class LexicalIndex:
    """BM25 scores of a registry's tools for a query (``scores``): one float per tool, 0 where no word matches."""

    def __init__(self, bm25: Any, n_tools: int) -> None:
        self._bm25, self.n_tools = bm25, n_tools

    @classmethod
    def build(cls, registry: Registry) -> LexicalIndex:
        """Index ``registry``'s tools (``tool_words``)."""
        import bm25s

        known: dict[str, tuple[str, ...]] = {}
        vocabulary: dict[str, int] = {}
        documents = [[vocabulary.setdefault(word, len(vocabulary)) for word in tool_words(tool, known=known)]
                     for tool in registry.tools]
        bm25 = bm25s.BM25(**BM25_PARAMETERS)
        bm25.vocab_dict = vocabulary
        if vocabulary:  # bm25s needs one word somewhere; a registry of wordless names scores 0 everywhere
            bm25.index((documents, vocabulary), create_empty_token=False, show_progress=False)
        return cls(bm25, len(registry))

    def scores(self, query: str) -> npt.NDArray[np.float32]:
        """[tools] BM25 scores of ``query``'s words (``identifier_words``, stop words out); all 0 for a query with no
        word the tools have."""
        vocabulary = self._bm25.vocab_dict
        ids = [vocabulary[word] for word in _words([query], {}) if word in vocabulary]
        if not ids:
            return np.zeros(self.n_tools, dtype=np.float32)
        scores: npt.NDArray[np.float32] = np.asarray(self._bm25.get_scores_from_ids(ids), dtype=np.float32)
        return scores

    @classmethod
    def cached(cls, registry: Registry, path: str | Path | None) -> LexicalIndex:
        """The index of ``registry``: read from ``path`` when it holds this registry version's, else built (and
        written there: a cache, so a write that fails is logged and the index still answers)."""
        if path is None:
            return cls.build(registry)
        path = Path(path)
        kept = cls._read(path, registry)
        if kept is not None:
            return kept
        index = cls.build(registry)
        try:
            index._write(path, registry.sha256)
        except ArtifactError as exc:
            logging.getLogger(__name__).warning("the tools' lexical index was not cached: %s", exc)
        return index

    def _write(self, path: Path, registry_sha256: str) -> None:
        from safetensors.numpy import save

        from tooltrie.compiler.artifact import write_atomically

        bm25 = self._bm25
        arrays = {name: np.ascontiguousarray(bm25.scores[name]) for name in ("data", "indices", "indptr")} if (
            bm25.vocab_dict) else {"data": np.zeros(0, dtype=np.float32)}
        write_atomically(path, save(arrays, metadata={
            "registry_sha256": registry_sha256, "version": VERSION, "tools": str(self.n_tools),
            "parameters": json.dumps(BM25_PARAMETERS), "vocabulary": json.dumps(bm25.vocab_dict)}))

    @classmethod
    def _read(cls, path: Path, registry: Registry) -> LexicalIndex | None:
        if not path.is_file():
            return None
        import bm25s
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="numpy") as f:
                meta = f.metadata() or {}
                if (meta.get("registry_sha256") != registry.sha256 or meta.get("version") != VERSION
                        or meta.get("parameters") != json.dumps(BM25_PARAMETERS)
                        or meta.get("tools") != str(len(registry))):
                    return None  # another registry version or another kind of index: built afresh
                vocabulary = json.loads(meta["vocabulary"])
                arrays = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
        except Exception:  # a damaged cache file is rebuilt, never trusted
            return None
        bm25 = bm25s.BM25(**BM25_PARAMETERS)
        bm25.vocab_dict = vocabulary
        if vocabulary:  # what bm25s.BM25.load restores
            bm25.scores = {**{name: arrays[name] for name in ("data", "indices", "indptr")}, "num_docs": len(registry)}
            bm25.nonoccurrence_array = None  # lucene's BM25 has none
            bm25.unique_token_ids_set = set(vocabulary.values())
        return cls(bm25, len(registry))
