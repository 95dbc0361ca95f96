"""The lexical prior (``tooltrie/lexical.py``): identifiers split as documented (hypothesis over generated
identifiers), BM25 scores against a hand-written Lucene BM25, the index kept beside the artifact and rebuilt when the
registry changes, and bad input (empty or all-stop-word queries, tools without descriptions, non-ASCII names,
names with no word at all) scored without NaN or a crash, alone and in the hybrid prior. The index is built with whole
arrays: its words and its matrix are checked against the straightforward build (each tool's words, then bm25s's own
index of them), bit for bit."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.encoders import MadeUpEncoder

from tooltrie.lexical import (
    BM25_PARAMETERS,
    CONVERSATIONAL_STOPWORDS,
    FIELD_WEIGHTS,
    LUCENE_STOPWORDS,
    STOPWORDS,
    LexicalIndex,
    identifier_words,
    tool_words,
)
from tooltrie.ranker import HYBRID, Ranker, lexical_path
from tooltrie.registry import BFCL_PATH, CATALOG_PATH, load_registry, make_registry
from tooltrie.registry.model import Parameter, Registry, Tool

LETTERS = "abcdefghijklmnopqrstuvwxyzéüçñøåжщ"
word = st.text(alphabet=LETTERS, min_size=1, max_size=8)
number = st.integers(min_value=0, max_value=9999).map(str)
SEPARATED = ["_", ".", "-", "/", " ", "__", " - "]
# The first split of a mixed-case word builds the word pattern once (tens of ms, more on a loaded machine): no
# per-example deadline.
SPLITS = settings(deadline=None)


def separated(words: list[str], separator: str) -> str:
    return separator.join(words)


def camel(words: list[str], *, pascal: bool = False) -> str:
    return "".join(w if i == 0 and not pascal else w.capitalize() for i, w in enumerate(words))


@SPLITS
@given(st.lists(st.one_of(word, number), min_size=1, max_size=6), st.sampled_from(SEPARATED))
def test_separators_split_identifiers_into_their_words(words: list[str], separator: str) -> None:
    """``_ . - /`` and spaces separate words; a run of letters next to a run of digits is two words."""
    assert identifier_words(separated(words, separator)) == words


@SPLITS
@given(st.lists(word.filter(lambda w: len(w) > 1), min_size=1, max_size=6), st.booleans(),
       st.lists(number, max_size=6))
def test_case_changes_and_digits_split_camel_case(words: list[str], pascal: bool, numbers: list[str]) -> None:
    """``calculateNetIncome`` and ``CalculateNetIncome`` are calculate, net, income; a number between two words
    (``get2ndItem``) is a word of its own. (One-letter words in a row read as an acronym: ``AB`` is one word.)"""
    parts = [*words]
    for i, n in enumerate(numbers[: len(words) - 1]):
        parts.insert(2 * i + 1, n)
    identifier = "".join(p if p.isdigit() else (p.capitalize() if i > 0 or pascal else p)
                         for i, p in enumerate(parts))
    assert identifier_words(identifier) == parts
    assert identifier_words(camel(words, pascal=pascal)) == words


@SPLITS
@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=2, max_size=6), word.filter(lambda w: len(w) > 1))
def test_an_acronym_ends_before_the_capitalised_word_after_it(acronym: str, after: str) -> None:
    """``HTTPServer`` is http, server; ``getHTTP`` is get, http."""
    assert identifier_words(acronym.upper() + after.capitalize()) == [acronym, after]
    assert identifier_words("get" + acronym.upper()) == ["get", acronym]


@SPLITS
@given(st.text(max_size=40))
def test_any_text_splits_into_casefolded_words_of_one_kind(text: str) -> None:
    """Whatever the text: words are non-empty, case-folded, all digits or no digit at all."""
    for piece in identifier_words(text):
        assert piece and piece == piece.casefold()
        assert piece.isdigit() or not any(c.isdigit() for c in piece)


def lucene_bm25(documents: list[list[str]], query: list[str]) -> list[float]:
    """Lucene's BM25, written out: idf = ln(1 + (N - df + 0.5) / (df + 0.5)), tf scaled by k1 and b."""
    k1, b = BM25_PARAMETERS["k1"], BM25_PARAMETERS["b"]
    n = len(documents)
    average = sum(map(len, documents)) / n
    scores = []
    for document in documents:
        score = 0.0
        for term in query:
            df = sum(term in d for d in documents)
            tf = document.count(term)
            if tf and df:
                idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
                score += idf * tf / (tf + k1 * (1 - b + b * len(document) / average))
        scores.append(score)
    return scores


@pytest.mark.parametrize("query", ["What is the weather in Paris tomorrow?", "convert currency, currency rates",
                                   "getWeather forecast", "Can you tell me how I could book a flight?",
                                   "nothing matches zzz", ""])
@pytest.mark.parametrize("stopwords", [STOPWORDS, LUCENE_STOPWORDS], ids=["shipped", "lucene"])
def test_bm25_scores_match_a_written_out_lucene_bm25(query: str, stopwords: frozenset[str]) -> None:
    """The index's stop words are left out of the tools and the query alike."""
    registry = load_registry(CATALOG_PATH)
    documents = [tool_words(tool, stopwords=stopwords) for tool in registry.tools]
    words = [w for w in identifier_words(query) if w not in stopwords]
    np.testing.assert_allclose(LexicalIndex.build(registry, stopwords=stopwords).scores(query),
                               lucene_bm25(documents, words), rtol=1e-5, atol=1e-6)


def test_a_requests_conversational_words_match_no_tool() -> None:
    """"you", "can", "what" are stop words: a parameter's description that says them ("the city you can name") does
    not draw a request that only speaks to its reader; Lucene's list alone lets it."""
    registry = Registry(name="two", tools=(
        Tool("getWeather", "", "0", parameters=(Parameter("city", description="what city you can name"),)),
        Tool("sendEmail", "", "1")))
    assert STOPWORDS == LUCENE_STOPWORDS | CONVERSATIONAL_STOPWORDS
    assert not LexicalIndex.build(registry).scores("what can you do for me").any()
    assert LexicalIndex.build(registry, stopwords=LUCENE_STOPWORDS).scores("what can you do for me")[0] > 0
    assert {"off", "up", "down", "us", "may"}.isdisjoint(STOPWORDS)  # words that tell tools apart


def bm25s_index(registry: Registry) -> tuple[dict[str, int], dict[str, np.ndarray]]:
    """The straightforward build: each tool's words numbered in order of first appearance, indexed by bm25s."""
    import bm25s

    vocabulary: dict[str, int] = {}
    documents = [[vocabulary.setdefault(w, len(vocabulary)) for w in tool_words(tool)] for tool in registry.tools]
    if not vocabulary:  # bm25s needs one word somewhere
        return vocabulary, {}
    bm25 = bm25s.BM25(**BM25_PARAMETERS)
    bm25.index((documents, vocabulary), create_empty_token=False, show_progress=False)
    return vocabulary, {name: bm25.scores[name] for name in ("data", "indices", "indptr")}


def assert_same_index(index: LexicalIndex, registry: Registry) -> None:
    vocabulary, matrix = bm25s_index(registry)
    bm25 = index._bm25
    assert list(bm25.vocab_dict.items()) == list(vocabulary.items())
    if not vocabulary:
        return
    assert bm25.scores["num_docs"] == len(registry)
    for name, expected in matrix.items():
        assert bm25.scores[name].dtype == expected.dtype
        np.testing.assert_array_equal(bm25.scores[name], expected, err_msg=name)


@pytest.mark.parametrize("path", [CATALOG_PATH, BFCL_PATH], ids=["catalog", "bfcl"])
def test_the_index_is_bm25s_own_bit_for_bit(path: Path) -> None:
    registry = load_registry(path)
    assert_same_index(LexicalIndex.build(registry), registry)


# Few words, stop words among them, and any text: words repeat within a tool and across tools (as parameters' names
# and descriptions do in a registry), and a tool may have none.
POOL = ["get", "Weather", "the", "of", "cityName", "HTTPServer", "ID", "v2", "größe", "天气", "__", "limit"]
text = st.one_of(st.lists(st.sampled_from(POOL), max_size=8).map(" ".join), st.text(max_size=20))
parameter = st.builds(Parameter, name=text, description=text, values=st.lists(text, max_size=3).map(tuple))


@st.composite
def registries(draw: st.DrawFn) -> Registry:
    tools = draw(st.lists(st.tuples(text, text, st.lists(parameter, max_size=3)), min_size=1, max_size=12))
    return Registry(name="generated", tools=tuple(Tool(name, description, str(i), parameters=tuple(parameters))
                                                  for i, (name, description, parameters) in enumerate(tools)))


@settings(deadline=None, max_examples=60)
@given(registries())
def test_the_index_of_any_registry_is_bm25s_own_bit_for_bit(registry: Registry) -> None:
    index = LexicalIndex.build(registry)
    assert_same_index(index, registry)
    for query in POOL:
        assert np.isfinite(index.scores(query)).all()


@SPLITS
@given(st.lists(text, min_size=2, max_size=8))
def test_a_tools_words_are_those_of_its_texts_joined(texts: list[str]) -> None:
    """Each text is split on its own (and each distinct one once): the same words as all of them joined by spaces,
    every field counted once."""
    name, description, *rest = texts
    tool = Tool(name, description, "x", parameters=tuple(Parameter(p) for p in rest))
    once = dict.fromkeys(FIELD_WEIGHTS, 1)
    assert tool_words(tool, fields=once) == [w for w in identifier_words(" ".join(texts)) if w not in STOPWORDS]


def odd_registry() -> Registry:
    """Tools without descriptions, with non-ASCII names, and one whose name holds no word at all."""
    return make_registry([{"name": "天气预报"}, {"name": "größeBerechnen"}, {"name": "ØreSund.bridge_toll"},
                          {"name": "__"}, {"name": "getWeather"}], name="odd")


@pytest.mark.parametrize("query", ["", "   ", "the of and to", "what can you do?", "?!", "天气预报", "Größe berechnen",
                                   "weather"])
@pytest.mark.parametrize("prior", ["lexical", "hybrid", "dense"])
def test_bad_input_is_scored_without_nan(query: str, prior: str) -> None:
    ranker = Ranker(odd_registry(), prior=prior, encoder=MadeUpEncoder(8))
    scores = ranker.prior_scores([query])
    assert scores.shape == (1, 5) and np.isfinite(scores).all()
    assert len(ranker.rank_indices(query, 5)) == 5
    if prior == "lexical" and not {w for w in identifier_words(query) if w not in STOPWORDS} & {
            "天气预报", "größe", "berechnen", "weather"}:
        assert not scores.any()  # no word in common: no evidence, all 0


def test_non_ascii_words_are_found() -> None:
    index = LexicalIndex.build(odd_registry())
    assert int(np.argmax(index.scores("天气预报"))) == 0
    assert int(np.argmax(index.scores("Größe berechnen"))) == 1
    assert int(np.argmax(index.scores("øresund bridge"))) == 2


def test_a_registry_of_wordless_names_scores_zero() -> None:
    registry = make_registry([{"name": "__"}, {"name": "--"}], name="wordless")
    assert not LexicalIndex.build(registry).scores("anything at all").any()
    assert np.isfinite(Ranker(registry, prior="lexical").prior_scores(["x", ""])).all()


class WrittenOutEncoder:
    """Embeddings written out by hand: a 2-d unit vector per text (``tool_text``'s of each tool, and the query's)."""

    def __init__(self, vectors: dict[str, tuple[float, float]]) -> None:
        self.vectors = vectors

    def encode(self, texts: list[str]) -> torch.Tensor:
        return torch.tensor([self.vectors[text] for text in texts], dtype=torch.float32)


def by_hand_z(values: list[float]) -> list[float]:
    """z-scores from the definition: minus the mean, over the population standard deviation."""
    mean, spread = statistics.fmean(values), statistics.pstdev(values)
    return [(value - mean) / spread for value in values]


# Four tools of 2, 2, 4 and 2 words (average length 2.5); the query's words: "weather" (in getWeather and
# weatherAlerts) and "alerts" (in weatherAlerts); "what", "are" and "the" are stop words.
TINY = make_registry([{"name": "getWeather"}, {"name": "convertCurrency"},
                      {"name": "weatherAlerts", "description": "storm warnings"}, {"name": "sendEmail"}], name="tiny")
TINY_QUERY = "What are the weather alerts?"
# Lucene's BM25 with k1 = 3, b = 0.5, a name's words counted 3 times, by hand: the tools' lengths are 6, 6, 8 (3 x 2
# name words and 2 description words) and 6, average 6.5; idf(weather) = ln(1 + (4 - 2 + 0.5) / (2 + 0.5)) = ln 2,
# idf(alerts) = ln(1 + (4 - 1 + 0.5) / (1 + 0.5)) = ln(10/3); a name's word (3 occurrences) counts
# 3 / (3 + 3 * (0.5 + 0.5 * 6 / 6.5)) = 26/51 in a tool of length 6 and 3 / (3 + 3 * (0.5 + 0.5 * 8 / 6.5)) = 26/55
# in the tool of length 8.
TINY_BM25 = [math.log(2) * 26 / 51, 0.0, (math.log(2) + math.log(10 / 3)) * 26 / 55, 0.0]
# The query's cosines with the tools, by the vectors below: 0.8, 0, 0.6, -0.6 (mean 0.2, variance 1.2 / 4 = 0.3).
TINY_VECTORS = {"getWeather": (0.8, 0.6), "convertCurrency": (0.0, 1.0), "weatherAlerts: storm warnings": (0.6, 0.8),
                "sendEmail": (-0.6, 0.8), TINY_QUERY: (1.0, 0.0)}
TINY_DENSE_Z = [value / math.sqrt(0.3) for value in (0.6, -0.2, 0.4, -0.8)]


def test_the_priors_of_a_tiny_registry_are_the_numbers_worked_out_by_hand() -> None:
    """BM25, the z-scores and the hybrid sum against numbers worked out from their definitions (comments above),
    not against the module's own helpers: the tool whose name holds the query's words leads the lexical prior, the
    nearest embedding leads the dense one, and the hybrid prior is the dense z-scores plus ``HYBRID``'s weight times
    the lexical ones."""
    assert (BM25_PARAMETERS["k1"], BM25_PARAMETERS["b"], FIELD_WEIGHTS) == (  # the constants the numbers above use
        3.0, 0.5, {"name": 3, "description": 1, "parameters": 1})
    ranker = Ranker(TINY, encoder=WrittenOutEncoder(TINY_VECTORS))
    np.testing.assert_allclose(ranker.lexical.scores(TINY_QUERY), TINY_BM25, rtol=1e-6)
    lexical_z = by_hand_z(TINY_BM25)
    np.testing.assert_allclose(lexical_z, [0.11127, -0.85190, 1.59253, -0.85190], atol=1e-5)  # by hand, rounded
    expected = {"lexical": lexical_z, "dense": TINY_DENSE_Z,
                "hybrid": [HYBRID["dense"] * d + HYBRID["lexical"] * lex
                           for d, lex in zip(TINY_DENSE_Z, lexical_z, strict=True)]}
    for kind, row in expected.items():
        (scores,) = ranker.prior_scores([TINY_QUERY], kind)
        np.testing.assert_allclose(scores, row, rtol=1e-5, atol=1e-6, err_msg=kind)
    for kind in ("lexical", "dense"):
        (scores,) = ranker.prior_scores([TINY_QUERY], kind).astype(np.float64)
        assert abs(scores.mean()) < 1e-6 and abs(scores.std() - 1) < 1e-6, kind  # mean 0, unit spread
    assert [TINY.names[i] for i in ranker.rank_indices(TINY_QUERY, 2, prior="lexical")] == ["weatherAlerts",
                                                                                          "getWeather"]
    assert ranker.rank_indices(TINY_QUERY, 4, prior="dense") == [0, 2, 1, 3]
    assert ranker.rank_indices(TINY_QUERY, 4) == [0, 2, 1, 3]  # hybrid, the default: 0.15 does not overturn dense
    (nothing,) = ranker.prior_scores(["zzz"], "lexical")  # no word in common: no evidence, all 0, never NaN
    assert not nothing.any()


def test_the_index_is_kept_beside_the_artifact_and_rebuilt_when_the_registry_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = lexical_path(tmp_path / "tools.trie.safetensors")
    assert path.name == "tools.trie.lexical.safetensors"
    builds: list[str] = []
    build = LexicalIndex.build.__func__  # type: ignore[attr-defined]

    def counted(cls: type[LexicalIndex], registry: Registry) -> LexicalIndex:
        builds.append(registry.sha256)
        return build(cls, registry)

    monkeypatch.setattr(LexicalIndex, "build", classmethod(counted))
    catalog = load_registry(CATALOG_PATH)
    query = "What will the weather be in Paris tomorrow?"
    first = Ranker(catalog, lexical_path=path).lexical.scores(query)
    assert path.is_file() and builds == [catalog.sha256]
    again = Ranker(catalog, lexical_path=path).lexical.scores(query)
    np.testing.assert_array_equal(again, first)
    assert builds == [catalog.sha256]  # read back, not built
    changed = make_registry([*(tool.content() for tool in catalog.tools[:-1]),
                             {"name": "ParisWeatherTool", "description": "the weather in Paris"}], name="catalog")
    scores = Ranker(changed, lexical_path=path).lexical.scores(query)
    assert builds == [catalog.sha256, changed.sha256]  # another registry version: built afresh, and kept
    np.testing.assert_array_equal(scores, LexicalIndex.build(changed).scores(query))
    assert int(np.argmax(scores)) == len(changed) - 1
    Ranker(changed, lexical_path=path).lexical.scores(query)
    assert len(builds) == 3  # the one compared with above, then none: the file now holds the changed registry's
    path.write_bytes(b"damaged")
    np.testing.assert_array_equal(Ranker(changed, lexical_path=path).lexical.scores(query), scores)
    assert len(builds) == 4  # a damaged file is rebuilt, never trusted
