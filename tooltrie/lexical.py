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
[0.0, 0.66]

The index is built once per registry version (milliseconds for thousands of tools; ``bench/bench_lexical.py``) and
kept in a file beside the artifact, keyed by the registry's sha256 and ``VERSION`` (``LexicalIndex.cached``).
"""

from __future__ import annotations

import functools
import json
import math
import re
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from tooltrie.registry.model import Registry, Tool

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = ["BM25_PARAMETERS", "CONVERSATIONAL_STOPWORDS", "FIELDS", "FIELD_WEIGHTS", "LUCENE_STOPWORDS", "STOPWORDS",
           "VERSION", "LexicalIndex", "identifier_words", "index_settings", "tool_words"]

# Bumped whenever the words or the scoring change, so that a kept index of an older kind is built afresh.
VERSION = "4"
# Lucene's BM25. k1 3 lets a word's repeats (a name's word counted three times, below) keep adding to its score where
# bm25s's default 1.5 would have it saturate; b 0.5 (0.75 by default) penalises a long parameter list less.
BM25_PARAMETERS: dict[str, Any] = {"k1": 3.0, "b": 0.5, "method": "lucene"}
# A tool's fields, in the order its texts are read: its name; its description; its parameters' names, descriptions
# and enum values.
FIELDS = ("name", "description", "parameters")
# How many times each field's words count in a tool's document: BM25 over the words repeated (a name's word at 3 is
# three occurrences, in the tool's length too: one length normalisation over the weighted fields, BM25F's simple
# form); 0 leaves the field out. Whole numbers, so the index stays bm25s's own over repeated words. Names first: a
# request's words are most often its tool's name's. These, k1, b and the stop words chosen leave one registry out on
# the five development registries' plainly worded validation requests (bench/sweep_names_first.py); b, between the
# settings that choice leaves close, by the answers served (bench/sweep_lexical_fused.py;
# docs/benchmarks.md#a-lexical-score-that-reads-names-first).
FIELD_WEIGHTS: dict[str, int] = {"name": 3, "description": 1, "parameters": 1}
# Lucene's English stop words (bm25s ships them): words that say nothing about which tool is meant.
LUCENE_STOPWORDS = frozenset(("a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "if", "in", "into", "is",
                              "it", "no", "not", "of", "on", "or", "such", "that", "the", "their", "then", "there",
                              "these", "they", "this", "to", "was", "will", "with"))
# A request's words to whoever answers it: pronouns, question words and auxiliaries ("can you tell me what I would
# get"). Tools' parameter descriptions say them too ("the city you want"), so kept, they match a request's manner of
# speaking to the wordiest tools. Not "us" (the US), "may" (the month) or "mine"; and none of the particles longer
# lists leave out ("off", "up", "down", "out", "now", "more"): they tell ``turn_off`` from ``turn_on``.
CONVERSATIONAL_STOPWORDS = frozenset((
    "i", "me", "my", "myself", "you", "your", "yours", "yourself", "we", "our", "ours", "he", "him", "his", "she",
    "her", "hers", "its", "them", "what", "which", "who", "whom", "whose", "when", "where", "why", "how", "am", "been",
    "being", "have", "has", "had", "having", "do", "does", "did", "can", "could", "would", "should", "shall", "might",
    "must"))
# The words BM25 leaves out of tools and requests: Lucene's and the conversational ones (every fold chose them over
# Lucene's alone, with the constants above).
STOPWORDS = LUCENE_STOPWORDS | CONVERSATIONAL_STOPWORDS


_Word = TypeVar("_Word", str, int)  # a word, or its id in a vocabulary
_Value = TypeVar("_Value")

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
    return list(_split(text, _chunk_words))


def _split(text: str, chunk_words: Callable[[str], tuple[_Word, ...]]) -> Iterator[_Word]:
    """The words of ``text`` (or their ids), each run of letters and digits split by ``chunk_words``."""
    return chain.from_iterable(map(chunk_words, _CHUNK.findall(unicodedata.normalize("NFKC", text))))


def _chunk_words(chunk: str) -> tuple[str, ...]:
    """The words of a run of letters and digits."""
    if chunk.isdigit() or (chunk.isalpha() and chunk[1:].islower()):  # most words of prose: one word as it is
        return (chunk.casefold(),)
    return tuple(word.casefold() for word in _word_pattern().findall(chunk))


def _content_words(chunk: str, stopwords: frozenset[str] = STOPWORDS) -> tuple[str, ...]:
    """The words of a run of letters and digits less the ``stopwords``."""
    return tuple(word for word in _chunk_words(chunk) if word not in stopwords)


class _Memo(dict[str, _Value]):
    """A dict that computes a missing key's value once. Its ``__getitem__`` stays dict's own for the keys it holds,
    so mapping it over a registry's texts (which repeat the same parameter names and descriptions, and the same
    few thousand words) costs no Python call per repeat."""

    def __init__(self, compute: Callable[[str], _Value]) -> None:
        super().__init__()
        self._compute = compute

    def __missing__(self, key: str) -> _Value:
        value = self[key] = self._compute(key)
        return value


def _tool_texts(tool: Tool, fields: dict[str, int]) -> list[tuple[str, int]]:
    """A tool's name, description, and its parameters' names, descriptions and enum values, each with its field's
    weight; a field weighted 0 is left out."""
    texts = [(tool.name, fields["name"]), (tool.description, fields["description"])]
    for parameter in tool.parameters:
        texts += [(text, fields["parameters"]) for text in (parameter.name, parameter.description, *parameter.values)]
    return [(text, weight) for text, weight in texts if weight > 0]


def _check_fields(fields: dict[str, int] | None) -> dict[str, int]:
    """``fields`` (None: ``FIELD_WEIGHTS``), each of ``FIELDS`` a whole number, none negative."""
    fields = dict(FIELD_WEIGHTS if fields is None else fields)
    if sorted(fields) != sorted(FIELDS) or not all(type(w) is int and w >= 0 for w in fields.values()):
        raise ValueError(f"field weights must give each of {', '.join(FIELDS)} a whole number >= 0, got {fields}")
    return fields


def tool_words(tool: Tool, *, fields: dict[str, int] | None = None,
               stopwords: frozenset[str] = STOPWORDS) -> list[str]:
    """What BM25 reads of a tool: its name, description, parameters (names, descriptions, enum values), each split
    by ``identifier_words``, ``stopwords`` left out, each field's words repeated its weight's times (``fields``;
    None: ``FIELD_WEIGHTS``).

    >>> from tooltrie.registry.model import Parameter
    >>> tool = Tool("getWeather", "The forecast for a city.", "x", parameters=(Parameter("unit", values=("C",)),))
    >>> tool_words(tool, fields={"name": 1, "description": 1, "parameters": 1})
    ['get', 'weather', 'forecast', 'city', 'unit', 'c']
    >>> tool_words(tool, fields={"name": 2, "description": 1, "parameters": 0})
    ['get', 'weather', 'get', 'weather', 'forecast', 'city']
    """
    content_words = functools.partial(_content_words, stopwords=stopwords)
    return [word for text, weight in _tool_texts(tool, _check_fields(fields))
            for word in list(_split(text, content_words)) * weight]


def _tool_word_ids(tools: Sequence[Tool], fields: dict[str, int], stopwords: frozenset[str]) -> tuple[
        npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], dict[str, int]]:
    """``tool_words`` of every tool as one array of word ids (numbered in order of first appearance, each word once
    where it occurs), the tool of each, its field's weight (how many times it counts), and the vocabulary. Each
    distinct text is split once, each distinct run of letters and digits in it once."""
    vocabulary: _Memo[int] = _Memo(lambda word: len(vocabulary))  # a new word's id: the next one
    chunk_ids = _Memo(lambda chunk: tuple(map(vocabulary.__getitem__, _content_words(chunk, stopwords))))
    text_ids = _Memo(lambda text: tuple(_split(text, chunk_ids.__getitem__)))
    texts = [_tool_texts(tool, fields) for tool in tools]
    flat = list(chain.from_iterable(texts))
    ids_of_texts = [text_ids[text] for text, _ in flat]
    text_lengths = np.fromiter(map(len, ids_of_texts), dtype=np.int64, count=len(ids_of_texts))
    text_weights = np.fromiter((weight for _, weight in flat), dtype=np.int64, count=len(flat))
    text_tools = np.repeat(np.arange(len(texts)), np.fromiter(map(len, texts), dtype=np.int64, count=len(texts)))
    ids = np.fromiter(chain.from_iterable(ids_of_texts), dtype=np.int64, count=int(text_lengths.sum()))
    return ids, np.repeat(text_tools, text_lengths), np.repeat(text_weights, text_lengths), dict(vocabulary)


def _bm25_matrix(ids: npt.NDArray[np.int64], tools: npt.NDArray[np.int64], weights: npt.NDArray[np.int64],
                 n_tools: int, n_words: int, *, k1: float, b: float) -> dict[str, npt.NDArray[Any]]:
    """bm25s's index (``BM25.build_index_from_ids``: a word-by-tool CSC matrix of Lucene BM25 scores) of the words
    ``ids`` of ``tools``, each counted ``weights`` times (as if repeated), computed with whole arrays where bm25s
    loops over the tools in Python (most of the build's time at 100,000 tools). The same operations in the same
    precision, so the same float32 scores, bit for bit (``tests/test_lexical.py`` compares it with bm25s's own over
    the repeated words)."""
    pairs, inverse = np.unique(ids * n_tools + tools, return_inverse=True)  # sorted by word, then tool: CSC order
    counts = np.bincount(inverse.ravel(), weights=weights, minlength=len(pairs))
    word, tool = np.divmod(pairs, n_tools)
    frequencies = np.bincount(word, minlength=n_words)  # tools per word
    # idf with math.log (not np.log, which may differ in the last bit), float64 rounded to float32 as bm25s does
    distinct, where = np.unique(frequencies, return_inverse=True)
    idf_of = np.array([math.log(1 + (n_tools - df + 0.5) / (df + 0.5)) for df in distinct.tolist()], np.float64)
    idf = idf_of.astype(np.float32)[where]
    lengths = np.bincount(tools, weights=weights, minlength=n_tools).astype(np.int64)
    # bm25s's _score_tfc_robertson: tf (float32) / (k1 * ((1 - b) + b * l_d / l_avg) + tf), in float64
    tf = counts.astype(np.float32)
    tfc = tf / (k1 * ((1 - b) + b * lengths[tool] / lengths.mean()) + tf)
    indptr = np.zeros(n_words + 1, dtype=np.int64)
    np.cumsum(frequencies, out=indptr[1:])
    return {"data": (idf[word] * tfc).astype(np.float32), "indices": tool.astype(np.int32), "indptr": indptr}


class LexicalIndex:
    """BM25 scores of a registry's tools for a query (``scores``): one float per tool, 0 where no word matches."""

    def __init__(self, vocabulary: dict[str, int], matrix: dict[str, npt.NDArray[Any]], n_tools: int,
                 settings: dict[str, Any] | None = None) -> None:
        """A bm25s index of ``n_tools`` tools from its ``vocabulary`` and its CSC ``matrix`` (data, indices, indptr;
        empty when the vocabulary is: a registry of wordless names, where every query's words are unknown);
        ``settings`` what it was built with (None: the defaults, ``index_settings()``)."""
        import bm25s

        self.settings = index_settings() if settings is None else settings
        self._bm25, self.n_tools = bm25s.BM25(**self.settings["bm25"]), n_tools
        self._content_words = functools.partial(_content_words, stopwords=frozenset(self.settings["stopwords"]))
        self._bm25.vocab_dict = vocabulary
        if vocabulary:  # what bm25s.BM25.index leaves (and BM25.load restores)
            self._bm25.scores = {**matrix, "num_docs": n_tools}
            self._bm25.nonoccurrence_array = None  # lucene's BM25 has none
            self._bm25.unique_token_ids_set = set(vocabulary.values())

    @classmethod
    def build(cls, registry: Registry, *, k1: float | None = None, b: float | None = None,
              fields: dict[str, int] | None = None, stopwords: frozenset[str] | None = None) -> LexicalIndex:
        """Index ``registry``'s tools (``tool_words``): bm25s's own index of them, built with whole arrays. ``k1``,
        ``b``, ``fields``, ``stopwords``: BM25's constants, the field weights and the words left out of tools and
        queries alike (None: ``BM25_PARAMETERS``'s, ``FIELD_WEIGHTS``, ``STOPWORDS``)."""
        settings = index_settings(k1=k1, b=b, fields=fields, stopwords=stopwords)
        ids, tools, weights, vocabulary = _tool_word_ids(registry.tools, settings["fields"],
                                                         frozenset(settings["stopwords"]))
        bm25 = settings["bm25"]
        matrix = _bm25_matrix(ids, tools, weights, len(registry), len(vocabulary), k1=bm25["k1"],
                              b=bm25["b"]) if vocabulary else {}
        return cls(vocabulary, matrix, len(registry), settings)

    def scores(self, query: str) -> npt.NDArray[np.float32]:
        """[tools] BM25 scores of ``query``'s words (``identifier_words``, stop words out); all 0 for a query with no
        word the tools have."""
        ids = self.words(query)
        if not ids:
            return np.zeros(self.n_tools, dtype=np.float32)
        scores: npt.NDArray[np.float32] = np.asarray(self._bm25.get_scores_from_ids(ids), dtype=np.float32)
        return scores

    def words(self, text: str) -> list[int]:
        """The ids of ``text``'s words that the tools have, as BM25 reads a query: split by ``identifier_words``,
        the index's stop words out, a word said twice counted twice."""
        vocabulary = self._bm25.vocab_dict
        return [vocabulary[word] for word in _split(text, self._content_words) if word in vocabulary]

    def weighted_scores(self, words: Sequence[int], weights: npt.ArrayLike) -> npt.NDArray[np.float32]:
        """[tools] BM25 scores of the query ``words`` (ids, from :meth:`words`), each word's part times its weight:
        with every weight 1, :meth:`scores` (to float32 rounding). One pass over the words' postings, so its cost
        is theirs and one array of the tools (``bench/bench_lexical.py``)."""
        if not len(words):
            return np.zeros(self.n_tools, dtype=np.float32)
        matrix = self._bm25.scores
        indptr, starts = matrix["indptr"], np.asarray(words, dtype=np.int64)
        lengths = indptr[starts + 1] - indptr[starts]
        # the postings of every word, one after the other: positions start..start+length of each
        positions = np.repeat(indptr[starts] - np.cumsum(lengths) + lengths, lengths) + np.arange(lengths.sum())
        values = matrix["data"][positions] * np.repeat(np.asarray(weights, dtype=np.float32), lengths)
        total = np.bincount(matrix["indices"][positions], weights=values, minlength=self.n_tools)
        return total.astype(np.float32)

    @classmethod
    def cached(cls, registry: Registry, path: str | Path | None) -> LexicalIndex:
        """The index of ``registry``: read from ``path`` when it holds this registry version's, else built (and
        written there: a cache, so a write that fails is logged and the index still answers; ``tooltrie/kept.py``)."""
        if path is None:
            return cls.build(registry)
        path = Path(path)
        kept = cls.read(registry, path)
        if kept is not None:
            return kept
        index = cls.build(registry)
        index._write(path, registry.sha256)
        return index

    def _write(self, path: Path, registry_sha256: str) -> None:
        from tooltrie.kept import keep

        bm25 = self._bm25
        arrays = {name: bm25.scores[name] for name in ("data", "indices", "indptr")} if (
            bm25.vocab_dict) else {"data": np.zeros(0, dtype=np.float32)}
        keep(path, arrays, {"registry_sha256": registry_sha256, "version": VERSION, "tools": str(self.n_tools),
                            "parameters": json.dumps(self.settings), "vocabulary": json.dumps(bm25.vocab_dict)},
             what="lexical index")

    @classmethod
    def read(cls, registry: Registry, path: Path) -> LexicalIndex | None:
        """The index of ``registry`` kept at ``path``, or None when there is none of this registry version and these
        settings (or it cannot be read)."""
        from tooltrie.kept import read_kept

        def accept(arrays: dict[str, npt.NDArray[Any]], meta: dict[str, str]) -> LexicalIndex:
            vocabulary = json.loads(meta["vocabulary"])
            matrix = {name: arrays[name] for name in ("data", "indices", "indptr")} if vocabulary else {}
            _check_index(vocabulary, matrix, len(registry))
            return cls(vocabulary, matrix, len(registry))

        expected = {"registry_sha256": registry.sha256, "version": VERSION,
                    "parameters": json.dumps(index_settings()), "tools": str(len(registry))}
        return read_kept(path, expected, accept, what="lexical index")


def index_settings(*, k1: float | None = None, b: float | None = None, fields: dict[str, int] | None = None,
              stopwords: frozenset[str] | None = None) -> dict[str, Any]:
    """What an index is built with: bm25s's parameters (``BM25_PARAMETERS`` less what is given), the field weights
    and the stop words; what a kept index's file records, and must match to be read back."""
    bm25 = {**BM25_PARAMETERS, **({} if k1 is None else {"k1": float(k1)}), **({} if b is None else {"b": float(b)})}
    return {"bm25": bm25, "fields": _check_fields(fields),
            "stopwords": sorted(STOPWORDS if stopwords is None else stopwords)}


def _check_index(vocabulary: Any, matrix: dict[str, npt.NDArray[Any]], n_tools: int) -> None:
    """Raise ``ValueError`` unless a kept index is one ``LexicalIndex.build`` could have made for ``n_tools`` tools:
    the word ids 0..n_words-1, a CSC matrix of n_words columns (``indptr``: n_words + 1 offsets from 0 to the number
    of entries, never decreasing) whose entries are tools in ``[0, n_tools)`` with finite scores, none negative
    (Lucene's idf is positive). A well-formed file that breaks one of these would fail, or answer wrongly, on every
    query."""
    if not isinstance(vocabulary, dict) or not all(isinstance(word, str) and type(word_id) is int
                                                   for word, word_id in vocabulary.items()):
        raise ValueError("its vocabulary is not a map of words to ids")
    if sorted(vocabulary.values()) != list(range(len(vocabulary))):
        raise ValueError(f"its {len(vocabulary)} word ids are not 0..{len(vocabulary) - 1}")
    if not vocabulary:
        return
    data, indices, indptr = matrix["data"], matrix["indices"], matrix["indptr"]
    kinds = (("data", data, np.float32), ("indices", indices, np.int32), ("indptr", indptr, np.int64))
    for name, array, dtype in kinds:
        if array.ndim != 1 or array.dtype != dtype:
            raise ValueError(f"{name} is {array.dtype}{list(array.shape)}, not a vector of {np.dtype(dtype)}")
    if len(indptr) != len(vocabulary) + 1 or indptr[0] != 0 or indptr[-1] != len(data) or len(indices) != len(data):
        raise ValueError(f"its matrix of {len(indptr)} offsets (to {indptr[-1] if len(indptr) else None}), "
                         f"{len(indices)} tool ids and {len(data)} scores does not fit {len(vocabulary)} words")
    if (np.diff(indptr) < 0).any():
        raise ValueError("its column offsets decrease")
    if len(indices) and (indices.min() < 0 or indices.max() >= n_tools):
        raise ValueError(f"its tool ids run from {indices.min()} to {indices.max()}, outside 0..{n_tools - 1}")
    if not (np.isfinite(data) & (data >= 0)).all():
        raise ValueError("its scores are not all finite and non-negative")
