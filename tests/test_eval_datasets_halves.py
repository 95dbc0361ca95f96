"""The three small development registries (RestBench TMDB and Spotify, ToolAlpaca): each set split once in halves,
validation and test, stratified by gold set, with its own bundled registry."""

from __future__ import annotations

import pytest

from tooltrie.eval.datasets import (
    BUNDLED,
    DATA_DIR,
    check_labels,
    held_out_hashes,
    load_split,
    registry_path,
    split_digest,
)
from tooltrie.registry import load_registry

# (name, tools in its registry, test, validation, digest of the test split): a changed rule or file shows up here.
HALVES = [
    ("restbench-tmdb", 54, 50, 50, "469277dc75e906b44e84aec41feea3fcc2bdd0fe5209fc962b87be241ec9de92"),
    ("restbench-spotify", 40, 28, 28, "b917f33ae4ef12faa5e52a99799d004ee75a1bfb4f236876192568de5dab8bae"),
    ("toolalpaca", 94, 104, 104, "84e8143e098493c06a4871e6d9cb9e4664bdf901d67c7b9d6dc0e630e6607ebc"),
]
NAMES = [row[0] for row in HALVES]


@pytest.mark.parametrize(("name", "tools", "test", "validation", "digest"), HALVES)
def test_halves_sizes_and_test_digest_are_fixed(name: str, tools: int, test: int, validation: int,
                                                digest: str) -> None:
    assert BUNDLED[name].halves
    assert len(load_registry(registry_path(name), require_descriptions=True)) == tools
    assert (len(load_split(name, "test")), len(load_split(name, "validation")), len(load_split(name, "train"))) == (
        test, validation, 0)
    assert split_digest(load_split(name, "test")) == digest


@pytest.mark.parametrize("name", NAMES)
def test_halves_cover_the_set_once_and_split_each_gold_set_evenly(name: str) -> None:
    test, validation = load_split(name, "test"), load_split(name, "validation")
    everything = load_split(name, "all")
    assert sorted(q.where for q in test + validation) == sorted(q.where for q in everything)
    assert not held_out_hashes() & {q.text_hash for q in validation}
    # each gold set's queries differ in count between the halves by at most one
    for tools in {frozenset(q.tools) for q in everything}:
        in_test = sum(frozenset(q.tools) == tools for q in test)
        in_validation = sum(frozenset(q.tools) == tools for q in validation)
        assert abs(in_test - in_validation) <= 1, (sorted(tools), in_test, in_validation)
    # the gold sets seen once fall about evenly between the halves (within a tenth of them)
    once = [q for q in everything if sum(frozenset(r.tools) == frozenset(q.tools) for r in everything) == 1]
    in_test = sum(q in test for q in once)
    assert abs(2 * in_test - len(once)) <= len(once) // 10, (in_test, len(once))
    assert abs(len(test) - len(validation)) <= 1


@pytest.mark.parametrize("name", NAMES)
def test_halves_do_not_depend_on_the_file_order(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import tooltrie.eval.datasets as datasets

    before = [q.query for q in load_split(name, "test")]
    reversed_set = tuple(reversed(datasets._read_bundled(name)))
    for cached in (datasets._read_bundled, datasets._test, datasets._splits):
        cached.cache_clear()
    monkeypatch.setattr(datasets, "_read_bundled", lambda _: reversed_set)
    try:
        assert sorted(q.query for q in load_split(name, "test")) == sorted(before)
    finally:
        for cached in (datasets._test, datasets._splits):
            cached.cache_clear()


@pytest.mark.parametrize("name", NAMES)
def test_halves_labels_name_tools_of_their_bundled_registry_and_are_attributed(name: str) -> None:
    registry = load_registry(registry_path(name))
    check_labels(load_split(name, "all"), registry)
    assert registry_path(name).parent == DATA_DIR / name
    assert (DATA_DIR / name / "LICENSE").stat().st_size > 500
    attribution = (DATA_DIR / "ATTRIBUTION.md").read_text(encoding="utf-8")
    assert f"`{name}/queries.jsonl`" in attribution and f"`{name}/{name}.json`" in attribution
