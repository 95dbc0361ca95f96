"""Plain and need-describing requests in one run: the harness summarises every arm per kind, the report shows a
table per kind and pairs each arm with retrieval per kind, and ``tooltrie compare`` adds a row per kind."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.serve import tiny_model

from tooltrie.compiler import Artifact, TokenizerInfo
from tooltrie.eval.backends import EvalSetup
from tooltrie.eval.compare import ArmAnswers, compare
from tooltrie.eval.compare import markdown as compare_markdown
from tooltrie.eval.datasets import load_split
from tooltrie.eval.harness import evaluate
from tooltrie.eval.report import markdown, write_results
from tooltrie.eval.results import read_results
from tooltrie.serve.prompt import Prompt


@pytest.fixture(scope="module")
def setup(catalog_artifact: Artifact, smollm: TokenizerInfo) -> EvalSetup:
    return EvalSetup(model=tiny_model(), tokenizer=smollm, artifact=catalog_artifact, prompt=Prompt.style("short"),
                     batch_size=4, max_new_tokens=8)


@pytest.fixture(scope="module")
def mixed(setup: EvalSetup) -> dict[str, Any]:
    queries = load_split("metatool-single", "test")[:4] + load_split("catalog-needs", "test")[:6]
    return evaluate(queries, ["lexical"], setup, progress=False, meta={"dataset": "mixed", "split": "test"})


def test_every_arm_is_summarised_per_kind(mixed: dict[str, Any]) -> None:
    groups = mixed["arms"]["lexical"]["by_kind"]
    assert list(groups) == ["need", "plain"] == mixed["settings"]["kinds"]
    assert (groups["need"]["answers"], groups["plain"]["answers"]) == (6, 4)
    answers = mixed["answers"]
    need = [a["lexical"]["exact"] for a in answers if a.get("kind") == "need"]
    plain = [a["lexical"]["exact"] for a in answers if "kind" not in a]
    assert (groups["need"]["exact"], groups["plain"]["exact"]) == (sum(need) / 6, sum(plain) / 4)


def test_one_kind_has_no_kind_table(setup: EvalSetup) -> None:
    results = evaluate(load_split("metatool-single", "test")[:2], ["lexical"], setup, progress=False)
    assert "by_kind" not in results["arms"]["lexical"]
    assert "By kind" not in markdown(results)
    assert all("kind" not in answer for answer in results["answers"])


def test_the_report_has_a_row_per_arm_and_kind(mixed: dict[str, Any], tmp_path: Path) -> None:
    paths = write_results(mixed, tmp_path / "run", plots=False)
    report = paths["report"].read_text(encoding="utf-8")
    table = report.split("By kind")[1]
    groups = mixed["arms"]["lexical"]["by_kind"]
    for kind in ("need", "plain"):
        assert f"| lexical | {kind} | {groups[kind]['answers']} | {groups[kind]['exact']:.1%} |" in table
    assert read_results(paths["results"])["answers"][4]["kind"] == "need"  # the kind survives the answers file


def _answers(rows: list[tuple[str, str | None, bool, bool]]) -> dict[str, Any]:
    """A results object with arms x and retrieval: (query, kind, x exact, retrieval exact) per answer."""
    answers = []
    for query, kind, x_right, r_right in rows:
        answer: dict[str, Any] = {"query": query, "gold": ["A"],
                                  "x": {"predicted": ["A" if x_right else "B"]},
                                  "retrieval": {"predicted": ["A" if r_right else "B"]}}
        if kind:
            answer["kind"] = kind
        answers.append(answer)
    arms = {arm: {"summary": {"answers": len(rows)}, "by_k": {}} for arm in ("x", "retrieval")}
    return {"format": "tooltrie-eval", "arms": arms, "answers": answers,
            "settings": {"dataset": "d", "ks": [1], "registry": {"name": "r", "tools": 2, "sha256": "0" * 64},
                         "artifact_sha256": "0" * 64}}


def test_compare_adds_a_row_per_kind_and_the_report_pairs_per_kind(tmp_path: Path) -> None:
    # x is right on every plain answer and wrong on every need; retrieval the other way round
    results = _answers([(f"plain {i}", None, True, False) for i in range(6)]
                       + [(f"need {i}", "need", False, True) for i in range(4)])
    x = ArmAnswers.of(results, "x", where=Path("results.json"))
    retrieval = ArmAnswers.of(results, "retrieval", where=Path("results.json"))
    rows = compare(x, retrieval, rates=["exact"], resamples=200)
    assert [(row.kind, row.answers, row.a, row.b, row.a_better, row.b_better) for row in rows] == [
        (None, 10, 0.6, 0.4, 6, 4), ("need", 4, 0.0, 1.0, 0, 4), ("plain", 6, 1.0, 0.0, 6, 0)]
    text = compare_markdown(x, retrieval, rows)
    assert "| exact set | need | 4 | 0.0% | 100.0% | -100.0 |" in text
    assert "| exact set | plain | 6 | 100.0% | 0.0% | +100.0 |" in text
    report = markdown(results)
    assert "| x (need) | 0.0% | 100.0% | -100.0 points" in report
    assert "| x (plain) | 100.0% | 0.0% | +100.0 points" in report
    # one kind only: no kind rows, the overall row as before
    plain_only = _answers([(f"plain {i}", None, i % 2 == 0, False) for i in range(6)])
    rows = compare(ArmAnswers.of(plain_only, "x", where=Path("r.json")),
                   ArmAnswers.of(plain_only, "retrieval", where=Path("r.json")), rates=["exact"], resamples=200)
    assert [row.kind for row in rows] == [None]


def test_tooltrie_compare_reads_the_kinds_from_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tooltrie.cli import main
    from tooltrie.eval.results import write_results_files

    results = _answers([(f"plain {i}", None, True, True) for i in range(3)]
                       + [(f"need {i}", "need", False, True) for i in range(3)])
    write_results_files(json.loads(json.dumps(results)), tmp_path)
    assert main(["compare", f"{tmp_path}:x", f"{tmp_path}:retrieval", "--rates", "exact"]) == 0
    out = capsys.readouterr().out
    assert "| exact set | need | 3 | 0.0% | 100.0% |" in out and "| exact set | plain | 3 | 100.0% | 100.0% |" in out
