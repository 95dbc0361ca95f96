"""The requests no tool serves (eval/data/nofit/): read as such (no gold tools, k = 0), their near tools named in
their registries, half near misses, the fixed halves balanced between the two, and a request without tools refused
anywhere else."""

from __future__ import annotations

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
from tooltrie.registry import load_registry

NAMES = ["catalog-nofit", "bfcl-nofit", "tmdb-nofit", "spotify-nofit", "toolalpaca-nofit"]


def test_every_nofit_set_is_bundled() -> None:
    assert sorted(name for name in BUNDLED if name.endswith("-nofit")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_a_nofit_set_is_read_checked_and_split_in_balanced_halves(name: str) -> None:
    everything = load_split(name, "all")
    check_labels(everything, load_registry(registry_path(name)))
    assert len(everything) == 48 and {(q.kind, q.k, q.tools) for q in everything} == {("none", 0, ())}
    assert sum(bool(q.near) for q in everything) == 24
    assert len({q.query.casefold() for q in everything}) == 48
    test, validation = load_split(name, "test"), load_split(name, "validation")
    assert (len(test), len(validation), len(load_split(name, "train"))) == (24, 24, 0)
    assert sum(bool(q.near) for q in test) == sum(bool(q.near) for q in validation) == 12
    assert split_digest(test) != split_digest(validation)


def test_a_request_without_tools_is_one_no_tool_serves(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "q.jsonl"
    path.write_text('{"query": "a", "tools": []}\n', encoding="utf-8")
    with pytest.raises(DatasetError, match='no tool serves says "kind": "none"'):
        load_queries(path)
    path.write_text('{"query": "a", "tools": ["x"], "kind": "none"}\n', encoding="utf-8")
    with pytest.raises(DatasetError, match="but tools are given"):
        load_queries(path)
    path.write_text('{"query": "a", "tools": [], "kind": "none", "near": ["nowhere"]}\n', encoding="utf-8")
    with pytest.raises(DatasetError, match="near names"):
        check_labels(load_queries(path), load_registry(registry_path("catalog-nofit")))
