"""The lexical prior (``tooltrie/lexical.py``): identifiers split as documented (hypothesis over generated
identifiers), BM25 scores against a hand-written Lucene BM25, the index kept beside the artifact and rebuilt when the
registry changes, and bad input (empty or all-stop-word queries, tools without descriptions, non-ASCII names,
names with no word at all) scored without NaN or a crash, alone and in the hybrid prior. The index is built with whole
arrays: its words and its matrix are checked against the straightforward build (each tool's words, then bm25s's own
index of them), bit for bit."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.encoders import MadeUpEncoder

from tooltrie.lexical import BM25_PARAMETERS, STOPWORDS, LexicalIndex, identifier_words, tool_words
from tooltrie.ranker import HYBRID, Ranker, lexical_path, standardized
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
                                   "getWeather forecast", "nothing matches zzz", ""])
def test_bm25_scores_match_a_written_out_lucene_bm25(query: str) -> None:
    registry = load_registry(CATALOG_PATH)
    documents = [tool_words(tool) for tool in registry.tools]
    words = [w for w in identifier_words(query) if w not in STOPWORDS]
    np.testing.assert_allclose(LexicalIndex.build(registry).scores(query), lucene_bm25(documents, words),
                               rtol=1e-5, atol=1e-6)


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
    """Each text is split on its own (and each distinct one once): the same words as all of them joined by spaces."""
    name, description, *rest = texts
    tool = Tool(name, description, "x", parameters=tuple(Parameter(p) for p in rest))
    assert tool_words(tool) == [w for w in identifier_words(" ".join(texts)) if w not in STOPWORDS]


def odd_registry() -> Registry:
    """Tools without descriptions, with non-ASCII names, and one whose name holds no word at all."""
    return make_registry([{"name": "天气预报"}, {"name": "größeBerechnen"}, {"name": "ØreSund.bridge_toll"},
                          {"name": "__"}, {"name": "getWeather"}], name="odd")


@pytest.mark.parametrize("query", ["", "   ", "the of and to", "?!", "天气预报", "Größe berechnen", "weather"])
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


def test_the_hybrid_prior_is_the_weighted_sum_of_the_two_z_scores() -> None:
    registry = load_registry(CATALOG_PATH)
    ranker = Ranker(registry, encoder=MadeUpEncoder(8))
    queries = ["What will the weather be in Paris?", "convert 100 dollars to euros", ""]
    expected = (HYBRID["dense"] * standardized(ranker.similarities(queries))
                + HYBRID["lexical"] * standardized(np.array([ranker.lexical.scores(q) for q in queries])))
    np.testing.assert_allclose(ranker.prior_scores(queries), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ranker.prior_scores(queries, "lexical"),
                               standardized(np.array([ranker.lexical.scores(q) for q in queries])))


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
