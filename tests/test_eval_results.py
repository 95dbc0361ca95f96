"""Evaluation results on disk: what the harness built reads back whole, the answers one line per query, the first
format still reads, bad files are named, and the committed results stay within their line budget."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tooltrie.eval.files import json_text
from tooltrie.eval.results import ANSWERS_FILE, RESULTS_FILE, ResultsError, read_results, write_results_files

REPO = Path(__file__).resolve().parent.parent
COMMITTED = REPO / "bench" / "results"
LINE_BUDGET = 30_000  # every file under bench/results, counted as `cat | wc -l` counts: newline bytes

json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                           | st.text(max_size=30),
                           lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner,
                                                                                         max_size=6),
                           max_leaves=40)
answers = st.lists(st.fixed_dictionaries({"query": st.text(max_size=40), "gold": st.lists(st.text(max_size=8),
                                                                                         min_size=1, max_size=3),
                                          "engine": st.fixed_dictionaries({"text": st.text(max_size=20),
                                                                           "predicted": st.lists(st.text(max_size=8),
                                                                                                 max_size=3)})}),
                   max_size=12)


@settings(max_examples=80, deadline=None)
@given(json_values)
def test_json_text_reads_back_as_the_value(value: Any) -> None:
    assert json.loads(json_text(value)) == value


@settings(max_examples=40, deadline=None)
@given(answers, json_values)
def test_results_read_back_whole_with_one_line_per_answer(tmp_path_factory: pytest.TempPathFactory,
                                                           answered: list[dict[str, Any]], extra: Any) -> None:
    results = {"format": "tooltrie-eval", "version": 2, "settings": {"extra": extra, "queries": len(answered)},
               "arms": {"engine": {"summary": {"exact": 0.5}}}, "answers": answered}
    out = tmp_path_factory.mktemp("run")
    paths = write_results_files(results, out)
    assert read_results(paths["results"]) == results
    assert "answers" not in json.loads(paths["results"].read_text(encoding="utf-8"))
    lines = paths["answers"].read_text(encoding="utf-8").split("\n")[:-1]
    assert [json.loads(line) for line in lines] == answered


def test_the_first_format_still_reads(tmp_path: Path) -> None:
    """Version 1 held the answers inside results.json."""
    first = {"format": "tooltrie-eval", "version": 1, "arms": {"x": {}},
             "answers": [{"query": "q", "gold": ["a"], "x": {"predicted": ["a"]}}]}
    (tmp_path / RESULTS_FILE).write_text(json.dumps(first, indent=1), encoding="utf-8")
    assert read_results(tmp_path / RESULTS_FILE) == first


def test_bad_answers_are_named_by_file_and_line(tmp_path: Path) -> None:
    write_results_files({"format": "tooltrie-eval", "arms": {}, "answers": [{"query": "q"}]}, tmp_path)
    (tmp_path / ANSWERS_FILE).write_text('{"query": "q"}\n{"query": \n', encoding="utf-8")
    with pytest.raises(ResultsError, match=rf"{ANSWERS_FILE}:2: not a JSON answer"):
        read_results(tmp_path / RESULTS_FILE)


def test_committed_results_stay_compact_and_read() -> None:
    """The folder that docs cite stays under its line budget, and each evaluation in it reads, one answer per
    query where its answers were kept."""
    files = [path for path in COMMITTED.rglob("*") if path.is_file() and not path.name.startswith(".")]
    lines = sum(path.read_bytes().count(b"\n") for path in files)
    assert lines < LINE_BUDGET, f"bench/results holds {lines:,} lines (budget {LINE_BUDGET:,})"
    for path in COMMITTED.glob(f"eval/*/{RESULTS_FILE}"):
        results = read_results(path)
        assert results["version"] == 2, path
        assert len(results["answers"]) in (0, results["settings"]["queries"]), path
