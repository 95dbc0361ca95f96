"""The bundled labelled query sets: fixed test splits that never leak into train or validation, labels that fit the
bundled registries, and user JSONL files read with file:line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from tooltrie.eval.datasets import (
    BUNDLED,
    DATA_DIR,
    SPLITS,
    DatasetError,
    LabelledQuery,
    check_labels,
    held_out_hashes,
    load_queries,
    load_split,
    normalize,
    registry_path,
    split_digest,
)
from tooltrie.registry import Registry, load_registry

# (name, test, validation, train, digest of the test split): a changed rule or file shows up here.
SPLIT_SIZES = [
    ("metatool-single", 470, 507, 9638, "b3cd5114743f77c1188bee0d46e26f19f0caa49faddfb83992e34b62ba7e7172"),
    ("metatool-multi", 118, 19, 360, "f079f054a07687aee130cd7336f742043b0249082f9efcf3ac35a1e47cff94e7"),
    ("bfcl", 250, 112, 2137, "13508ba448b2a52dc40e459b01c482517b67a30af866a8f254badccb12cd5849"),
]


@pytest.mark.parametrize(("name", "test", "validation", "train", "digest"), SPLIT_SIZES)
def test_split_sizes_and_test_digest_are_fixed(name: str, test: int, validation: int, train: int, digest: str) -> None:
    splits = {split: load_split(name, split) for split in SPLITS}
    assert (len(splits["test"]), len(splits["validation"]), len(splits["train"])) == (test, validation, train)
    assert split_digest(splits["test"]) == digest


@pytest.mark.parametrize("name", list(BUNDLED))
def test_no_test_text_leaks_into_any_train_or_validation_split(name: str) -> None:
    tested = held_out_hashes()  # every bundled set's test texts
    train, validation = load_split(name, "train"), load_split(name, "validation")
    assert not tested & {q.text_hash for q in train}
    assert not tested & {q.text_hash for q in validation}
    assert not {q.text_hash for q in validation} & {q.text_hash for q in train}
    # every query is in exactly one split, or left out only because its text is tested or validated elsewhere
    placed = [q.where for q in train + validation + load_split(name, "test")]
    assert len(placed) == len(set(placed))
    placed_set, withheld = set(placed), tested | {q.text_hash for q in validation}
    assert all(q.where in placed_set or q.text_hash in withheld for q in load_split(name, "all"))


def test_metatool_single_test_split_has_ten_queries_per_catalog_tool(catalog: Registry) -> None:
    test = load_split("metatool-single", "test")
    per_tool: dict[str, int] = {}
    for query in test:
        per_tool[query.tools[0]] = per_tool.get(query.tools[0], 0) + 1
    assert per_tool == dict.fromkeys(catalog.names, 10)


def test_split_is_ordered_by_hash_of_normalized_text() -> None:
    test = load_split("metatool-single", "test")
    first_tool = [q for q in test if q.tools == test[0].tools]
    all_for_tool = sorted((q for q in load_split("metatool-single", "all") if q.tools == test[0].tools),
                          key=lambda q: q.text_hash)
    assert [q.query for q in first_tool] == [q.query for q in all_for_tool[:10]]


def test_bundled_labels_name_tools_of_their_registry(catalog: Registry, bfcl: Registry) -> None:
    registries = {"metatool-single": catalog, "metatool-multi": catalog, "bfcl": bfcl}
    for name in BUNDLED:
        queries = load_split(name, "all")
        registry = registries.get(name) or load_registry(registry_path(name))
        check_labels(queries, registry)  # unknown, repeated, or k out of range would raise
        if name.startswith("metatool"):
            assert {q.k for q in queries} == {1 if name.endswith("single") else 2}


def test_bundled_data_have_licenses_and_attribution() -> None:
    for folder in ("metatool", "bfcl"):
        assert (DATA_DIR / folder / "LICENSE").stat().st_size > 500
    attribution = (DATA_DIR / "ATTRIBUTION.md").read_text(encoding="utf-8")
    assert "MIT" in attribution and "Apache-2.0" in attribution
    for spec in BUNDLED.values():
        assert f"`{spec.file}`" in attribution


def test_normalize_folds_case_width_and_whitespace() -> None:
    full_width_what = "\uff37\uff28\uff21\uff34"
    assert normalize(f"  {full_width_what} is\n the  Weather? ") == "what is the weather?"
    assert LabelledQuery("What  IS it", ("a",)).text_hash == LabelledQuery("what is it", ("a",)).text_hash


def test_user_jsonl_file_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text('{"query": "weather in Paris", "tools": ["WeatherTool"]}\n\n'
                    '{"query": "news and stocks", "tools": ["NewsTool", "FinanceTool"], "k": 2}\n', encoding="utf-8")
    queries = load_split(str(path), "all")
    assert [(q.query, q.tools, q.where) for q in queries] == [
        ("weather in Paris", ("WeatherTool",), f"{path}:1"),
        ("news and stocks", ("NewsTool", "FinanceTool"), f"{path}:3"),
    ]
    with pytest.raises(DatasetError, match="only a bundled set"):
        load_split(str(path), "test")


BAD_LINES = [  # (line, what the error says)
    ("not json", "not JSON"),
    ('["a"]', "expected an object"),
    ('{"tools": ["a"]}', "'query' must be a non-empty string"),
    ('{"query": "q", "tools": "a"}', "'tools' must be a list"),
    ('{"query": "q", "tools": []}', "'tools' is empty"),
    ('{"query": "q", "tools": ["a"], "k": 2}', "'k' is 2 but 1 tools"),
]


@pytest.mark.parametrize(("line", "message"), BAD_LINES)
def test_bad_user_line_is_refused_with_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"query": "fine", "tools": ["a"]}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(DatasetError, match=rf"bad\.jsonl:2: .*{message}"):
        load_queries(path)


LABELS = [  # (tools, what the error says)
    (("NewsTol",), "'NewsTol' is not in registry 'catalog' \\(did you mean 'NewsTool'\\?\\)"),
    (("NewsTool", "NewsTool"), "NewsTool named more than once"),
]


@pytest.mark.parametrize(("tools", "message"), LABELS)
def test_labels_the_trie_cannot_express_are_refused(catalog: Registry, tools: tuple[str, ...], message: str) -> None:
    with pytest.raises(DatasetError, match=rf"x\.jsonl:7: .*{message}"):
        check_labels([LabelledQuery("q", tools, where="x.jsonl:7")], catalog)


def test_an_empty_label_is_refused(catalog: Registry) -> None:
    # (more tools than the registry has always names an unknown or a repeated tool first)
    with pytest.raises(DatasetError, match=r"q\.jsonl:1: 0 tools; an answer has 1 to 47"):
        check_labels([LabelledQuery("q", (), where="q.jsonl:1")], catalog)


def test_unknown_set_and_split_are_refused() -> None:
    with pytest.raises(DatasetError, match="no such labelled query file"):
        load_split("metatool-everything", "all")
    with pytest.raises(DatasetError, match="unknown split 'dev'"):
        load_split("bfcl", "dev")
