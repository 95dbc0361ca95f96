"""The lexical prior (``tooltrie/lexical.py``): identifiers split as documented (hypothesis over generated
identifiers), BM25 scores against a hand-written Lucene BM25, the index kept beside the artifact and rebuilt when the
registry changes, and bad input (empty or all-stop-word queries, tools without descriptions, non-ASCII names,
names with no word at all) scored without NaN or a crash, alone and in the hybrid prior."""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tooltrie.lexical import BM25_PARAMETERS, STOPWORDS, LexicalIndex, identifier_words, tool_words
from tooltrie.ranker import HYBRID, Ranker, lexical_path, standardized
from tooltrie.registry import CATALOG_PATH, load_registry, make_registry
from tooltrie.registry.model import Registry

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


def odd_registry() -> Registry:
    """Tools without descriptions, with non-ASCII names, and one whose name holds no word at all."""
    return make_registry([{"name": "天气预报"}, {"name": "größeBerechnen"}, {"name": "ØreSund.bridge_toll"},
                          {"name": "__"}, {"name": "getWeather"}], name="odd")


class MadeUpEncoder:
    """A unit vector per text, fixed by its checksum (no model is loaded)."""

    def encode(self, texts: list[str]) -> object:
        import torch

        rows = [np.random.default_rng(zlib.crc32(t.encode())).standard_normal(8) for t in texts]
        return torch.nn.functional.normalize(torch.tensor(np.array(rows), dtype=torch.float32), dim=-1)


@pytest.mark.parametrize("query", ["", "   ", "the of and to", "?!", "天气预报", "Größe berechnen", "weather"])
@pytest.mark.parametrize("prior", ["lexical", "hybrid", "dense"])
def test_bad_input_is_scored_without_nan(query: str, prior: str) -> None:
    ranker = Ranker(odd_registry(), prior=prior, encoder=MadeUpEncoder())
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
    ranker = Ranker(registry, encoder=MadeUpEncoder())
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
