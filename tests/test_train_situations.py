"""The catalog's situations (eval/data/situations/): requests that describe a need, written to train on. Labelled
under the catalog, every tool covered, the wording rule of the needs sets, none of them near a request the needs
sets measure with, all of it train; and the training data made for the catalog carries them with their kind."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tooltrie.eval.datasets import BUNDLED, check_labels, load_split, registry_path
from tooltrie.eval.wording import content_words, overlaps
from tooltrie.registry import CATALOG_PATH, load_registry

NAME = "catalog-situations"
MEASURED = [name for name in BUNDLED if name.endswith("-needs")]


def test_situations_are_the_catalogs_and_all_of_them_train() -> None:
    everything = load_split(NAME, "all")
    catalog = load_registry(CATALOG_PATH)
    assert registry_path(NAME) == CATALOG_PATH
    check_labels(everything, catalog)
    assert {q.kind for q in everything} == {"need"}
    assert len({q.query.casefold() for q in everything}) == len(everything)  # no request twice
    single = Counter(q.tools[0] for q in everything if q.k == 1)
    assert set(single) == set(catalog.names) and min(single.values()) >= 6  # every tool, several ways
    assert {q.k for q in everything} == {1, 2}
    assert (load_split(NAME, "test"), load_split(NAME, "validation")) == ([], [])
    assert load_split(NAME, "train") == everything  # no text of it is held out anywhere


def test_situations_avoid_their_tools_words() -> None:
    failing = [o for o in overlaps(load_split(NAME, "all"), load_registry(CATALOG_PATH)) if not o.passes]
    assert not failing


def test_no_situation_is_near_a_measured_request() -> None:
    """Written apart from the needs sets: no request shares more than a third of its content words (of the two
    requests' together) with one of theirs."""
    measured = [content_words(q.query) for name in MEASURED for q in load_split(name, "all")]
    near = []
    for item in load_split(NAME, "all"):
        words = content_words(item.query)
        for other in measured:
            if len(words & other) / max(1, len(words | other)) > 1 / 3:
                near.append((item.query, sorted(words & other)))
    assert not near


def test_evaluating_a_set_to_train_on_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tooltrie.cli import main

    assert main(["eval", "--dataset", f"metatool-multi:test,{NAME}", "--arms", "retrieval",
                 "-o", str(tmp_path / "out")]) == 2
    assert f"{NAME}:test holds no queries" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
