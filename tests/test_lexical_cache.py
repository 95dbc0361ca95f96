"""The lexical index kept beside an artifact (``LexicalIndex.cached``, ``Ranker.lexical``):

- built once per ranker, whichever thread asks first, the others waiting for it; a ranker building its index never
  holds up another ranker's;
- a well-formed cache file whose arrays do not fit together (lengths, offsets, tool ids out of range, negative or
  NaN scores, dtypes, shapes, word ids) is rebuilt, as a damaged one is, and the query answers as a fresh index does.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save

from tooltrie.lexical import LexicalIndex
from tooltrie.ranker import Ranker
from tooltrie.registry import CATALOG_PATH, load_registry, make_registry
from tooltrie.registry.model import Registry

QUERIES = ("What will the weather be in Paris tomorrow?", "convert 100 dollars to euros", "send an email to Bob")


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The registries (sha256) whose index is built, in order."""
    built: list[str] = []
    build = LexicalIndex.build.__func__  # type: ignore[attr-defined]

    def counted(cls: type[LexicalIndex], registry: Registry) -> LexicalIndex:
        built.append(registry.sha256)
        return build(cls, registry)

    monkeypatch.setattr(LexicalIndex, "build", classmethod(counted))
    return built


def test_threads_racing_for_a_rankers_index_build_it_once(builds: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    catalog = load_registry(CATALOG_PATH)
    ranker = Ranker(catalog)
    counted = LexicalIndex.build.__func__  # type: ignore[attr-defined]
    start = threading.Barrier(8)

    def slow(cls: type[LexicalIndex], registry: Registry) -> LexicalIndex:
        threading.Event().wait(0.3)  # long enough for every thread to arrive while it builds
        return counted(cls, registry)  # type: ignore[no-any-return]

    monkeypatch.setattr(LexicalIndex, "build", classmethod(slow))
    got: list[LexicalIndex] = []

    def ask() -> None:
        start.wait(10)
        got.append(ranker.lexical)

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert builds == [catalog.sha256]
    assert len(got) == 8 and all(index is got[0] for index in got)


def test_a_ranker_building_its_index_never_holds_up_another_rankers(monkeypatch: pytest.MonkeyPatch) -> None:
    catalog = load_registry(CATALOG_PATH)
    other = make_registry([{"name": "getWeather"}, {"name": "sendEmail"}], name="other")
    build = LexicalIndex.build.__func__  # type: ignore[attr-defined]
    building, released = threading.Event(), threading.Event()

    def held(cls: type[LexicalIndex], registry: Registry) -> LexicalIndex:
        if registry.sha256 == catalog.sha256:
            building.set()
            released.wait(10)
        return build(cls, registry)  # type: ignore[no-any-return]

    monkeypatch.setattr(LexicalIndex, "build", classmethod(held))
    slow = threading.Thread(target=lambda: Ranker(catalog).lexical)
    slow.start()
    try:
        assert building.wait(10)
        quick = threading.Thread(target=lambda: Ranker(other).lexical)
        quick.start()
        quick.join(5)
        assert not quick.is_alive(), "the second ranker waited for the first one's build"
    finally:
        released.set()
        slow.join(30)


def _edit(path: Path, change: Callable[[dict[str, Any], dict[str, str]], None]) -> None:
    """Rewrite the kept index at ``path`` with its arrays and metadata changed by ``change``: still a well-formed
    safetensors file, of this registry version and kind."""
    with safe_open(str(path), framework="numpy") as f:
        arrays = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)
        meta = dict(f.metadata())
    change(arrays, meta)
    path.write_bytes(save({name: np.ascontiguousarray(array) for name, array in arrays.items()}, metadata=meta))


def _set(name: str, value: Callable[[Any], Any]) -> Callable[[dict[str, Any], dict[str, str]], None]:
    def change(arrays: dict[str, Any], meta: dict[str, str]) -> None:
        arrays[name] = value(arrays[name])

    return change


def _with(name: str, where: Callable[[Any], Any], value: Any) -> Callable[[dict[str, Any], dict[str, str]], None]:
    def changed(array: Any) -> Any:
        array = array.copy()
        array[where(array)] = value
        return array

    return _set(name, changed)


def _vocabulary(change: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any], dict[str, str]], None]:
    def edit(arrays: dict[str, Any], meta: dict[str, str]) -> None:
        vocabulary = json.loads(meta["vocabulary"])
        change(vocabulary)
        meta["vocabulary"] = json.dumps(vocabulary)

    return edit


def _first_word(vocabulary: dict[str, Any], value: Any) -> None:
    vocabulary[next(iter(vocabulary))] = value


def _not_a_map(arrays: dict[str, Any], meta: dict[str, str]) -> None:
    meta["vocabulary"] = json.dumps(sorted(json.loads(meta["vocabulary"])))


def _past_the_entries(arrays: dict[str, Any], meta: dict[str, str]) -> None:
    indptr = arrays["indptr"].copy()
    indptr[-1] += 1
    arrays["indptr"] = indptr


INCONSISTENT: dict[str, Callable[[dict[str, Any], dict[str, str]], None]] = {
    "tool id past the last tool": _with("indices", lambda a: len(a) // 2, 47),
    "negative tool id": _with("indices", lambda a: 0, -1),
    "negative score": _with("data", lambda a: len(a) // 2, -1.0),
    "NaN score": _with("data", lambda a: 0, np.nan),
    "infinite score": _with("data", lambda a: 0, np.inf),
    "one offset missing": _set("indptr", lambda a: a[:-1]),
    "one offset too many": _set("indptr", lambda a: np.append(a, a[-1])),
    "last offset past the entries": _past_the_entries,
    "first offset not 0": _with("indptr", lambda a: 0, 1),
    "offsets decreasing": _set("indptr", lambda a: np.concatenate([a[:1], a[2:3], a[1:2], a[3:]])),
    "one score missing": _set("data", lambda a: a[:-1]),
    "one tool id missing": _set("indices", lambda a: a[:-1]),
    "scores as a matrix": _set("data", lambda a: a.reshape(1, -1)),
    "tool ids as int64": _set("indices", lambda a: a.astype(np.int64)),
    "scores as float64": _set("data", lambda a: a.astype(np.float64)),
    "word id past the vocabulary": _vocabulary(lambda v: _first_word(v, len(v))),
    "word id repeated": _vocabulary(lambda v: _first_word(v, 1)),
    "word id not a number": _vocabulary(lambda v: _first_word(v, "0")),
    "vocabulary not a map": _not_a_map,
}


@pytest.mark.parametrize("inconsistency", list(INCONSISTENT))
def test_a_well_formed_cache_whose_arrays_do_not_fit_is_rebuilt(tmp_path: Path, builds: list[str],
                                                                inconsistency: str) -> None:
    catalog = load_registry(CATALOG_PATH)
    assert len(catalog) == 47  # the tool id just past the last, above
    path = tmp_path / "tools.trie.lexical.safetensors"
    fresh = Ranker(catalog, lexical_path=path).lexical
    assert builds == [catalog.sha256]
    _edit(path, INCONSISTENT[inconsistency])
    kept = Ranker(catalog, lexical_path=path).lexical
    assert builds == [catalog.sha256] * 2  # rebuilt, never trusted
    for query in QUERIES:
        np.testing.assert_array_equal(kept.scores(query), fresh.scores(query), err_msg=query)
    Ranker(catalog, lexical_path=path).lexical.scores(QUERIES[0])
    assert len(builds) == 2  # the rebuilt index replaced the inconsistent file


def test_an_unchanged_cache_is_read_back_not_rebuilt(tmp_path: Path, builds: list[str]) -> None:
    """The checks pass what ``build`` writes: an edit that changes nothing keeps it (the test above would pass with
    a check that refused every file)."""
    catalog = load_registry(CATALOG_PATH)
    path = tmp_path / "tools.trie.lexical.safetensors"
    fresh = Ranker(catalog, lexical_path=path).lexical
    _edit(path, lambda arrays, meta: None)
    kept = Ranker(catalog, lexical_path=path).lexical
    assert builds == [catalog.sha256]
    for query in QUERIES:
        np.testing.assert_array_equal(kept.scores(query), fresh.scores(query), err_msg=query)
