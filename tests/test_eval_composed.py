"""Composed compound requests (``eval/composed.py``): 2-4 single-tool requests of distinct tools, of one split only,
joined in order; the same every time."""

from __future__ import annotations

import pytest

from tooltrie.eval.composed import COUNT, SOURCES, composed_split
from tooltrie.eval.datasets import DatasetError, check_labels, load_split, registry_path
from tooltrie.registry import load_registry


@pytest.mark.parametrize("registry", list(SOURCES))
@pytest.mark.parametrize("split", ["validation", "test"])
def test_composed_requests_join_distinct_single_asks_of_their_own_split(registry: str, split: str) -> None:
    queries = load_split(f"{registry}-composed", split)
    assert len(queries) == COUNT and {query.kind for query in queries} == {"compound"}
    check_labels(queries, load_registry(registry_path(f"{registry}-composed")))
    singles = {query.where: query for name in SOURCES[registry] for query in load_split(name, split)}
    other = "test" if split == "validation" else "validation"
    elsewhere = {query.where for name in SOURCES[registry] for query in load_split(name, other)}
    for query in queries:
        sources = query.where.split(" from ", 1)[1].split("; ")
        assert 2 <= query.k <= 4 and len(set(query.tools)) == query.k
        assert [singles[where].tools[0] for where in sources] == list(query.tools)  # in the order asked
        assert not set(sources) & elsewhere
        position = 0
        for where in sources:  # each ask's words, in order (its first letter may be lowered)
            text = singles[where].query.strip().rstrip(".!?")
            found = query.query.find(text[1:], position)
            assert found > position - 1, (text, query.query)
            position = found + len(text) - 1


def test_composed_sets_are_the_same_every_time() -> None:
    composed_split.cache_clear()
    first = composed_split("tmdb", "test")
    composed_split.cache_clear()
    assert composed_split("tmdb", "test") == first


@pytest.mark.parametrize(("name", "split", "message"), [("catalog-composed", "train", "only validation and test"),
                                                        ("catalog-composed", "all", "only validation and test")])
def test_a_composed_set_has_no_train_split(name: str, split: str, message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        load_split(name, split)


def test_the_cli_takes_a_composed_set_as_a_bundled_one() -> None:
    from tooltrie.eval.cli import dataset_parts, dataset_registry

    parts = dataset_parts("tmdb-composed,tmdb-compound:validation")
    assert parts == [("tmdb-composed", "test"), ("tmdb-compound", "validation")]
    assert dataset_registry(parts) == registry_path("tmdb-compound")
