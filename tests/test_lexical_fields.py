"""The lexical index's field weights and BM25 constants (``LexicalIndex.build(k1=, b=, fields=)``): each field's
words counted its weight's times is bm25s's own index over the words repeated, bit for bit; a tiny registry's scores
equal numbers worked out by hand; a field weighted 0 is not read; a kept index built with other settings is rebuilt;
bad weights are refused."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from tooltrie.lexical import BM25_PARAMETERS, FIELD_WEIGHTS, STOPWORDS, LexicalIndex, tool_words
from tooltrie.registry import BFCL_PATH, CATALOG_PATH, load_registry, make_registry
from tooltrie.registry.model import Parameter, Registry, Tool

# (k1, b, name, description, parameters): the field weights and constants checked against bm25s
SETTINGS = [(1.5, 0.75, 1, 1, 1), (1.5, 0.75, 3, 1, 0), (0.9, 0.3, 2, 1, 1), (2.0, 1.0, 5, 2, 0), (1.2, 0.5, 1, 0, 1)]


def bm25s_index(registry: Registry, k1: float, b: float, fields: dict[str, int]) -> tuple[dict[str, int],
                                                                                           dict[str, np.ndarray]]:
    """The straightforward build: each tool's words, each field's repeated, numbered in order of first appearance
    and indexed by bm25s."""
    import bm25s

    vocabulary: dict[str, int] = {}
    documents = [[vocabulary.setdefault(w, len(vocabulary)) for w in tool_words(tool, fields=fields)]
                 for tool in registry.tools]
    bm25 = bm25s.BM25(**{**BM25_PARAMETERS, "k1": k1, "b": b})
    bm25.index((documents, vocabulary), create_empty_token=False, show_progress=False)
    return vocabulary, {name: bm25.scores[name] for name in ("data", "indices", "indptr")}


@pytest.mark.parametrize("path", [CATALOG_PATH, BFCL_PATH], ids=["catalog", "bfcl"])
@pytest.mark.parametrize(("k1", "b", "name", "description", "parameters"), SETTINGS)
def test_a_weighted_index_is_bm25s_own_over_the_repeated_words(path: Path, k1: float, b: float, name: int,
                                                              description: int, parameters: int) -> None:
    registry = load_registry(path)
    fields = {"name": name, "description": description, "parameters": parameters}
    index = LexicalIndex.build(registry, k1=k1, b=b, fields=fields)
    vocabulary, matrix = bm25s_index(registry, k1, b, fields)
    assert list(index._bm25.vocab_dict.items()) == list(vocabulary.items())
    for part, expected in matrix.items():
        np.testing.assert_array_equal(index._bm25.scores[part], expected, err_msg=part)
    assert index.settings == {"bm25": {**BM25_PARAMETERS, "k1": k1, "b": b}, "fields": fields,
                              "stopwords": sorted(STOPWORDS)}


# Four tools: getWeather (get, weather), convertCurrency, weatherAlerts described "storm warnings" (weather, alerts,
# storm, warnings), sendEmail. The query's words: weather (in two tools: idf ln(1 + 2.5 / 2.5) = ln 2) and alerts (in
# one: idf ln(1 + 3.5 / 1.5) = ln(10/3)).
TINY = make_registry([{"name": "getWeather"}, {"name": "convertCurrency"},
                      {"name": "weatherAlerts", "description": "storm warnings"}, {"name": "sendEmail"}], name="tiny")
TINY_QUERY = "What are the weather alerts?"
# The name's words counted twice: lengths 4, 4, 2 * 2 + 2 = 6, 4 (average 4.5). A name's word found twice in a tool
# of 4 counts 2 / (2 + 1.5 * (0.25 + 0.75 * 4 / 4.5)) = 2 / 3.375; in the tool of 6, 2 / (2 + 1.5 * (0.25 + 0.75 *
# 6 / 4.5)) = 2 / 3.875.
NAME_TWICE = [math.log(2) * 2 / 3.375, 0.0, (math.log(2) + math.log(10 / 3)) * 2 / 3.875, 0.0]
# k1 = 1.2, b = 0.5, every field once: lengths 2, 2, 4, 2 (average 2.5); a word once in a tool of 2 counts
# 1 / (1 + 1.2 * (0.5 + 0.5 * 2 / 2.5)) = 1 / 2.08, in the tool of 4, 1 / (1 + 1.2 * (0.5 + 0.5 * 4 / 2.5)) = 1 / 2.56.
K1_B = [math.log(2) / 2.08, 0.0, (math.log(2) + math.log(10 / 3)) / 2.56, 0.0]
# The description left out: weatherAlerts is 2 words long like the others, no word counts for storm.
NO_DESCRIPTION = [math.log(2) / 2.5, 0.0, (math.log(2) + math.log(10 / 3)) / 2.5, 0.0]


@pytest.mark.parametrize(("k1", "b", "fields", "expected"), [
    (1.5, 0.75, {"name": 2, "description": 1, "parameters": 1}, NAME_TWICE),
    (1.2, 0.5, {"name": 1, "description": 1, "parameters": 1}, K1_B),
    (1.5, 0.75, {"name": 1, "description": 0, "parameters": 1}, NO_DESCRIPTION),
], ids=["name-twice", "k1-b", "no-description"])
def test_a_tiny_registrys_weighted_scores_are_the_numbers_worked_out_by_hand(
        k1: float, b: float, fields: dict[str, int], expected: list[float]) -> None:
    index = LexicalIndex.build(TINY, k1=k1, b=b, fields=fields)
    np.testing.assert_allclose(index.scores(TINY_QUERY), expected, rtol=1e-6)
    storm = index.scores("storm")
    assert (storm[2] > 0) == (fields["description"] > 0) and not np.delete(storm, 2).any()


def test_a_field_weighted_zero_is_not_read() -> None:
    city = Parameter("city", values=("Paris",))
    tools = (Tool("getWeather", "", "0", parameters=(city,)), Tool("sendEmail", "", "1"))
    registry = Registry(name="fields", tools=tools)
    assert LexicalIndex.build(registry).scores("Paris")[0] > 0
    index = LexicalIndex.build(registry, fields={"name": 1, "description": 1, "parameters": 0})
    assert not index.scores("Paris city").any() and index.scores("weather")[0] > 0
    assert "paris" not in index._bm25.vocab_dict


@pytest.mark.parametrize("fields", [{"name": 1, "description": 1}, {"name": 1.5, "description": 1, "parameters": 1},
                                    {"name": -1, "description": 1, "parameters": 1},
                                    {"name": 1, "description": 1, "parameters": 1, "title": 1}])
def test_bad_field_weights_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="field weights must give each of name, description, parameters"):
        LexicalIndex.build(TINY, fields=fields)  # type: ignore[arg-type]


def test_a_kept_index_built_with_other_settings_is_built_afresh(tmp_path: Path) -> None:
    path = tmp_path / "tiny.lexical.safetensors"
    other = {name: weight + 2 for name, weight in FIELD_WEIGHTS.items()}
    LexicalIndex.build(TINY, k1=0.9, fields=other)._write(path, TINY.sha256)
    kept = LexicalIndex.cached(TINY, path)
    assert kept.settings == LexicalIndex.build(TINY).settings
    np.testing.assert_array_equal(kept.scores(TINY_QUERY), LexicalIndex.build(TINY).scores(TINY_QUERY))
    again = LexicalIndex.cached(TINY, path)  # the defaults' index was written back, and is read as it is
    np.testing.assert_array_equal(again.scores(TINY_QUERY), kept.scores(TINY_QUERY))
