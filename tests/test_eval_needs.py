"""The need-describing request sets (eval/data/needs/): labels under their registries, the mix of k and of tools,
the fixed halves, and the wording rule (no word of a gold tool's name, at most one of its description)."""

from __future__ import annotations

from collections import Counter

import pytest

from tooltrie.eval.datasets import (
    BUNDLED,
    DatasetError,
    check_labels,
    load_queries,
    load_split,
    registry_path,
    split_digest,
)
from tooltrie.eval.wording import ALLOWED_DESCRIPTION_WORDS, content_words, main, overlaps, shared_words, stem
from tooltrie.registry import load_registry

# (name, requests, distinct gold tools at least, test, validation, digest of the test split): a changed file or rule
# shows up here.
NEEDS = [
    ("catalog-needs", 69, 47, 35, 34, "1459e8b53c462462cd430aa7000428586493a16020cd75755dedbf7642cae7fe"),
    ("bfcl-needs", 65, 60, 33, 32, "fe79041c82875e3891e8783d84d3b1c9c40254d7fb372eec5026fc5989874e88"),
    ("tmdb-needs", 64, 40, 32, 32, "eb8c55fb9d3f78958f1498ff7eaca65d4701c70d5743d25d65ef96db708980ef"),
    ("spotify-needs", 64, 35, 32, 32, "6f3e4ab1da2bda04df99f32ea6f824b52dd131a1dcc24cdd1613774214305e31"),
    ("toolalpaca-needs", 66, 65, 33, 33, "9c5a78fb778a2a27f32a0817b1525f8bcae66aebdcdf186b94c668184790fcf4"),
]
NAMES = [row[0] for row in NEEDS]


def test_every_needs_set_is_bundled() -> None:
    assert sorted(name for name in BUNDLED if name.endswith("-needs")) == sorted(NAMES)


@pytest.mark.parametrize(("name", "requests", "distinct", "test", "validation", "digest"), NEEDS)
def test_needs_set_is_labelled_under_its_registry_and_split_in_fixed_halves(
        name: str, requests: int, distinct: int, test: int, validation: int, digest: str) -> None:
    everything = load_split(name, "all")
    check_labels(everything, load_registry(registry_path(name)))
    assert len(everything) == requests >= 60
    assert {q.kind for q in everything} == {"need"}
    assert len({q.query.casefold() for q in everything}) == len(everything)  # no request twice
    ks = Counter(q.k for q in everything)
    assert set(ks) == {1, 2} and 0.6 <= ks[1] / len(everything) <= 0.75, ks  # about two thirds k = 1
    assert len({tool for q in everything for tool in q.tools}) >= distinct
    halves = load_split(name, "test"), load_split(name, "validation")
    assert (len(halves[0]), len(halves[1]), len(load_split(name, "train"))) == (test, validation, 0)
    assert sorted(q.where for q in halves[0] + halves[1]) == sorted(q.where for q in everything)
    assert split_digest(halves[0]) == digest


@pytest.mark.parametrize("name", NAMES)
def test_needs_requests_avoid_their_tools_words(name: str) -> None:
    found = overlaps(load_split(name, "all"), load_registry(registry_path(name)))
    failing = [(o.query, o.from_names, o.from_descriptions) for o in found if not o.passes]
    assert not failing


@pytest.mark.parametrize(("word", "form"), [
    ("albums", "album"), ("movies", "movi"), ("movie", "movi"), ("cities", "citi"), ("city", "citi"),
    ("boxes", "box"), ("searches", "search"), ("houses", "hous"), ("house", "hous"), ("news", "news"),
    ("status", "status"), ("bus", "bus"),
])
def test_stem_meets_singular_and_plural(word: str, form: str) -> None:
    assert stem(word) == form


@pytest.mark.parametrize(("text", "words"), [
    ("getArtistAlbums", {"artist", "album"}),
    ("get_person_movie_credits", {"person", "movi", "credit"}),
    ("Nager_Date_PublicHolidayIsTodayPublicHoliday", {"nager", "dat", "public", "holidai", "todai"}),
    ("What's the weather like in the city?", {"weather", "lik", "citi"}),
    ("PDF&URLTool", {"pdf", "url"}),
])
def test_content_words_split_identifiers_and_drop_stop_words(text: str, words: set[str]) -> None:
    assert content_words(text) == words


def test_shared_words_counts_a_name_word_and_description_words_apart() -> None:
    tools = [("WeatherTool", "Provide you with the latest weather information.")]
    assert shared_words("Weather in Lisbon, latest information please", tools) == (("weather",), ("information",
                                                                                                  "latest"))
    assert shared_words("Should I pack an umbrella for Lisbon?", tools) == ((), ())
    assert ALLOWED_DESCRIPTION_WORDS == 1


def test_wording_check_names_a_failing_request(tmp_path: pytest.TempPathFactory,
                                               capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import tooltrie.eval.datasets as datasets

    plain = '{"query": "What is the latest weather information in Lisbon?", "tools": ["WeatherTool"]}\n'
    path = tmp_path / "plain.jsonl"  # type: ignore[operator]
    path.write_text(plain, encoding="utf-8")
    monkeypatch.setitem(datasets.BUNDLED, "plain-needs", datasets._Bundled(str(path), datasets.CATALOG_PATH,
                                                                           "tool-set", halves=True))
    datasets._read_bundled.cache_clear()
    try:
        assert main(["plain-needs"]) == 1
        assert main(["catalog-needs"]) == 0
    finally:
        datasets._read_bundled.cache_clear()
    out = capsys.readouterr().out
    assert "FAILS 'What is the latest weather information in Lisbon?' -> WeatherTool" in out
    assert "catalog-needs: 69 requests" in out


def test_kind_is_read_and_must_be_text(tmp_path: pytest.TempPathFactory) -> None:
    path = tmp_path / "kinds.jsonl"  # type: ignore[operator]
    path.write_text('{"query": "a", "tools": ["x"], "kind": "need"}\n{"query": "b", "tools": ["x"]}\n',
                    encoding="utf-8")
    assert [q.kind for q in load_queries(path)] == ["need", ""]
    path.write_text('{"query": "a", "tools": ["x"], "kind": 1}\n', encoding="utf-8")
    with pytest.raises(DatasetError, match=r"kinds.jsonl:1: 'kind' must be a string"):
        load_queries(path)
