"""``tooltrie compare``: answers paired across runs, the rates the harness reports, the sign test against brute force
over every outcome, the bootstrap interval against the normal approximation, and clear errors."""

from __future__ import annotations

import itertools
import json
import math
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tooltrie.cli import main
from tooltrie.compiler import Contract
from tooltrie.eval.compare import ArmAnswers, answers_needed, bootstrap_interval, compare, sign_test
from tooltrie.eval.report import markdown
from tooltrie.eval.results import ResultsError, write_results_files
from tooltrie.eval.scoring import score, summarize

TOOLS = ["a", "b", "c", "d", "e"]


def results_file(path: Path, answers: list[dict[str, Any]]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    arms = sorted({key for answer in answers for key in answer} - {"query", "gold", "where"})
    write_results_files({"format": "tooltrie-eval", "arms": {arm: {} for arm in arms}, "answers": answers}, path)
    return path


def random_answers(rng: random.Random, n: int, arms: tuple[str, ...] = ("x", "y")) -> list[dict[str, Any]]:
    answers = []
    for i in range(n):
        gold = rng.sample(TOOLS, rng.randint(1, 3))
        answers.append({"query": f"q{i % max(1, n // 2)}", "gold": gold,  # repeated queries on purpose
                        **{arm: {"predicted": rng.sample(TOOLS, len(gold))} for arm in arms}})
    return answers


@pytest.mark.parametrize("n", range(0, 11))
def test_sign_test_equals_every_outcome_enumerated(n: int) -> None:
    """p = the share of the 2^n equally likely splits at least as uneven as the observed one."""
    for wins in range(n + 1):
        losses = n - wins
        extreme = sum(abs(sum(signs) - n / 2) >= abs(wins - n / 2) for signs in itertools.product((0, 1), repeat=n))
        assert sign_test(wins, losses) == pytest.approx(extreme / 2**n)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 40))
def test_means_and_counts_are_the_harness_s(seed: int, n: int) -> None:
    """Each arm's mean is what the harness's own scorer summarises over the same answers, and the counts of answers
    each arm scores higher are those of the scorer's outcomes, whatever order the second run lists them in."""
    rng = random.Random(seed)
    answers = random_answers(rng, n)
    # Another order of the same queries; a query asked twice keeps its two answers in order, as a rerun lists them.
    place = {(a["query"], tuple(a["gold"])): rng.random() for a in answers}
    shuffled = sorted(answers, key=lambda a: place[a["query"], tuple(a["gold"])])
    contract, names = Contract(), set(TOOLS)
    outcomes = {arm: [score(contract.render(a[arm]["predicted"]), a["gold"], names=names, contract=contract)
                      for a in answers] for arm in ("x", "y")}
    summaries = {arm: summarize(outcomes[arm], [1.0] * n) for arm in outcomes}
    with tempfile.TemporaryDirectory() as tmp:
        first = ArmAnswers.load(f"{results_file(Path(tmp, 'a'), answers)}:x")
        second = ArmAnswers.load(f"{results_file(Path(tmp, 'b'), shuffled)}:y")
    for row in compare(first, second, resamples=200):
        if row.k is not None:
            continue
        x = [float(getattr(o, row.rate)) for o in outcomes["x"]]
        y = [float(getattr(o, row.rate)) for o in outcomes["y"]]
        assert (row.a, row.b) == (pytest.approx(summaries["x"][row.rate]), pytest.approx(summaries["y"][row.rate]))
        pairs = list(zip(x, y, strict=True))
        assert (row.a_better, row.b_better) == (sum(p > q for p, q in pairs), sum(p < q for p, q in pairs))
        assert row.p == sign_test(row.a_better, row.b_better)


def test_an_arm_against_itself_differs_by_nothing(tmp_path: Path) -> None:
    run = results_file(tmp_path / "run", random_answers(random.Random(1), 30))
    arm = ArmAnswers.load(f"{run}:x")
    for row in compare(arm, arm, resamples=100):
        assert (row.difference, row.low, row.high, row.a_better, row.b_better, row.p) == (0, 0, 0, 0, 0, 1.0)


def test_rows_per_k_only_where_there_are_several(tmp_path: Path) -> None:
    answers = [{"query": f"q{i}", "gold": ["a"] if i % 3 else ["a", "b"], "x": {"predicted": ["a"]},
                "y": {"predicted": ["c"]}} for i in range(9)]
    run = results_file(tmp_path / "run", answers)
    rows = compare(ArmAnswers.load(f"{run}:x"), ArmAnswers.load(f"{run}:y"), rates=["top1"], resamples=50)
    assert [(row.k, row.answers, row.a_better, row.b_better) for row in rows] == [(None, 9, 9, 0), (1, 6, 6, 0),
                                                                                   (2, 3, 3, 0)]
    single = results_file(tmp_path / "single", answers[1:3])
    assert [row.k for row in compare(ArmAnswers.load(f"{single}:x"), ArmAnswers.load(f"{single}:y"),
                                     resamples=50)] == [None, None, None]


def test_the_bootstrap_interval_matches_the_normal_approximation() -> None:
    rng = np.random.default_rng(3)
    differences = rng.choice([-1.0, 0.0, 0.0, 0.0, 1.0, 1.0], size=400)
    low, high = bootstrap_interval(differences, resamples=20_000, rng=np.random.default_rng(0))
    half = 1.96 * differences.std() / np.sqrt(len(differences))
    assert low == pytest.approx(differences.mean() - half, abs=0.15 * half)
    assert high == pytest.approx(differences.mean() + half, abs=0.15 * half)
    again = bootstrap_interval(differences, resamples=20_000, rng=np.random.default_rng(0))
    assert again == (low, high)
    assert bootstrap_interval(np.full(7, 0.25), resamples=100, rng=rng) == (0.25, 0.25)


def test_bad_inputs_are_named(tmp_path: Path) -> None:
    run = results_file(tmp_path / "run", random_answers(random.Random(2), 6))
    with pytest.raises(ResultsError, match="holds the arms x, y; name one"):
        ArmAnswers.load(run)
    with pytest.raises(ResultsError, match="no arm 'z'; it holds x, y"):
        ArmAnswers.load(f"{run}:z")
    with pytest.raises(ResultsError, match="no results file"):
        ArmAnswers.load(f"{tmp_path / 'nowhere'}:x")
    (tmp_path / "other.json").write_text('{"format": "something else"}')
    with pytest.raises(ResultsError, match="not the results of `tooltrie eval`"):
        ArmAnswers.load(f"{tmp_path / 'other.json'}:x")
    (tmp_path / "broken.json").write_text('{"format": ')
    with pytest.raises(ResultsError, match="not readable as JSON"):
        ArmAnswers.load(f"{tmp_path / 'broken.json'}:x")
    fewer = results_file(tmp_path / "fewer", random_answers(random.Random(2), 6)[:4])
    with pytest.raises(ResultsError, match=r"different queries \(2 only in the first, 0 only in the second\)"):
        compare(ArmAnswers.load(f"{run}:x"), ArmAnswers.load(f"{fewer}:y"))
    with pytest.raises(ResultsError, match="unknown rate 'f1'"):
        compare(ArmAnswers.load(f"{run}:x"), ArmAnswers.load(f"{run}:y"), rates=["f1"])


def test_the_command_prints_the_table_and_the_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    answers = [{"query": f"q{i}", "gold": ["a"], "x": {"predicted": ["a"]}, "y": {"predicted": ["a" if i < 2 else "b"]}}
               for i in range(12)]
    run = results_file(tmp_path / "run", answers)
    assert main(["compare", f"{run}:x", f"{run / 'results.json'}:y", "--rates", "exact"]) == 0
    out = capsys.readouterr().out
    assert f"A: {run}:x" in out
    assert "| exact set | all | 12 | 100.0% | 16.7% | +83.3 |" in out and "| 10 | 0 | 0.00195 |" in out
    assert main(["compare", f"{run}:x", f"{run}:y", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [row["rate"] for row in report["differences"]] == ["exact", "top1", "recall"]
    assert main(["compare", f"{run}:x", f"{run}:nope"]) == 2
    assert "no arm 'nope'" in capsys.readouterr().err


def test_the_report_pairs_every_arm_with_retrieval() -> None:
    answers = random_answers(random.Random(5), 40, arms=("engine", "fused", "retrieval"))
    contract, names = Contract(), set(TOOLS)
    arms = {}
    for arm in ("engine", "fused", "retrieval"):
        outcomes = [score(contract.render(a[arm]["predicted"]), a["gold"], names=names, contract=contract)
                    for a in answers]
        arms[arm] = {"summary": summarize(outcomes, [1.0] * len(outcomes)), "by_k": {}}
    results = {"format": "tooltrie-eval", "arms": arms, "answers": answers,
               "settings": {"dataset": "d", "ks": [1], "registry": {"name": "r", "tools": 5, "sha256": "0" * 64},
                            "artifact_sha256": "0" * 64}}
    report = markdown(results)
    retrieval = ArmAnswers.of(results, "retrieval", where=Path("results.json"))
    for arm in ("engine", "fused"):
        row = compare(ArmAnswers.of(results, arm, where=Path("results.json")), retrieval, rates=["exact"])[0]
        assert (f"| {arm} | {row.a:.1%} | {row.b:.1%} | {100 * row.difference:+.1f} points "
                f"({100 * row.low:+.1f} to {100 * row.high:+.1f}) | {row.a_better} | {row.b_better} | {row.p:.3g} |"
                in report)
    assert "\n| retrieval | " not in report.split("against the retrieval arm")[1]
    del answers[0]["fused"]  # answers without every arm's (e.g. trimmed): nothing to pair, no table
    assert "against the retrieval arm" not in markdown(results)
    del arms["retrieval"]
    assert "against the retrieval arm" not in markdown(results)


def test_a_rows_interval_does_not_depend_on_the_other_rows(tmp_path: Path) -> None:
    answers = random_answers(random.Random(7), 60)
    run = results_file(tmp_path / "run", answers)
    x, y = ArmAnswers.load(f"{run}:x"), ArmAnswers.load(f"{run}:y")
    every = {(row.rate, row.k): row for row in compare(x, y, resamples=500)}
    for rate in ("recall", "top1"):
        for row in compare(x, y, rates=[rate], resamples=500):
            assert row == every[rate, row.k]
    assert compare(x, y, resamples=500, seed=1) != list(every.values())


@settings(max_examples=200, deadline=None)
@given(st.floats(-0.5, 0.5), st.floats(0.0, 1.0), st.floats(0.001, 0.2))
def test_answers_needed_is_the_fewest_whose_lower_bound_reaches_the_margin(difference: float, spread: float,
                                                                          margin: float) -> None:
    needed = answers_needed(difference, spread, margin)
    if difference + margin <= 0:
        assert needed is None
        return
    assert needed is not None

    def lower_bound(n: int) -> float:
        return difference - 1.96 * spread / math.sqrt(n)

    assert needed >= 1 and lower_bound(needed) >= -margin - 1e-9
    if needed > 1:
        assert lower_bound(needed - 1) < -margin


def test_answers_needed_agrees_with_the_bootstrap() -> None:
    """Repeat a set of per-answer differences until there are as many as it says: the bootstrap interval's lower
    bound then reaches the margin, and with a fifth fewer it does not."""
    differences = np.array([1.0] * 9 + [-1.0] * 8 + [0.0] * 83)  # +1 point, 17 of 100 answers differ
    needed = answers_needed(float(differences.mean()), float(differences.std(ddof=1)), 0.02)
    assert needed is not None and 400 < needed < 1000
    for copies, reaches in ((math.ceil(1.1 * needed / 100), True), (math.floor(0.8 * needed / 100), False)):
        low, _ = bootstrap_interval(np.tile(differences, copies), resamples=20_000, rng=np.random.default_rng(0))
        assert (low >= -0.02) == reaches


def test_the_command_says_how_many_answers_a_margin_needs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    answers = [{"query": f"q{i}", "gold": ["a"], "x": {"predicted": ["a" if i % 10 else "b"]},
                "y": {"predicted": ["a" if i % 10 != 1 else "b"]}} for i in range(40)]  # 4 answers each way
    run = results_file(tmp_path / "run", answers)
    x, y = ArmAnswers.load(f"{run}:x"), ArmAnswers.load(f"{run}:y")
    row = compare(x, y, rates=["exact"], resamples=100)[0]
    assert row.spread == pytest.approx(np.std([1.0] * 4 + [-1.0] * 4 + [0.0] * 32, ddof=1))
    assert row.answers_needed(0.02) == answers_needed(0.0, row.spread, 0.02) == 1971
    assert main(["compare", f"{run}:x", f"{run}:y", "--rates", "exact", "--margin", "2"]) == 0
    out = capsys.readouterr().out
    assert "| answers for A >= B - 2 |" in out and "| 4 | 4 | 1 | 1971 |" in out
    assert main(["compare", f"{run}:x", f"{run}:y", "--rates", "exact", "--margin", "2", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["margin"] == 0.02 and report["differences"][0]["answers_needed"] == 1971
    assert main(["compare", f"{run}:x", f"{run}:y", "--margin", "200"]) == 2
    assert "--margin 200: give points between 0 and 100" in capsys.readouterr().err
