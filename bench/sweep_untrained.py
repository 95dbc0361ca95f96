"""The fused ranker's weights for a model that never saw the registry (``ranker.UNTRAINED``), chosen on plainly
worded and need-describing requests alike, leave one registry out. The shipped adapter is trained on the catalog;
on the four other development registries (BFCL, RestBench's TMDB and Spotify, ToolAlpaca) ``auto`` answers fused at
the model's weight 1 and the prior's ``UNTRAINED`` weight. Each candidate, the prior's weight 5, 10, 20 or 50, or the
prior alone (the ``hybrid`` arm), is scored on each registry's validation split by the mean of two exact-set rates
(plain requests, need-describing ones: each kind counts the same); for each held-out registry the candidate with the
best mean over the *other three* (each counted once; ties to today's weight, then the heavier model) is scored on
its test split, paired against today's weight and the best retrieval arm. Every ``tooltrie eval`` run is kept under
``--work`` and not run again when its results are there. Prints tables and writes JSON.

    .venv/bin/python bench/sweep_untrained.py -o bench/results/sweep-untrained.json

Test splits are only scored, never chosen on.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from _common import REPO_DIR, eval_once, print_table, write_results

from tooltrie.eval.compare import ArmAnswers, as_json, compare
from tooltrie.ranker import UNTRAINED

REGISTRIES = {"bfcl": ("bfcl", "bfcl-needs"), "restbench-tmdb": ("restbench-tmdb", "tmdb-needs"),
              "restbench-spotify": ("restbench-spotify", "spotify-needs"),
              "toolalpaca": ("toolalpaca", "toolalpaca-needs")}
WEIGHTS = (5.0, 10.0, 20.0, 50.0)
KINDS = ("plain", "need")
PRIOR_ALONE = "prior alone"
RETRIEVAL_ARMS = ("retrieval", "hybrid")  # dense, and the hybrid prior: the best a user would pick


def run(name: str, split: str, weight: float, work: Path, batch: int) -> Path:
    """One ``tooltrie eval`` of the fused arm at the prior's ``weight`` (and, at the first weight, the retrieval
    arms) over ``name``'s plain and need-describing ``split``."""
    arms = ",".join(("fused", *RETRIEVAL_ARMS)) if weight == WEIGHTS[0] else "fused"
    return eval_once(work / f"{name}-{split}-{weight:g}", [
        "--dataset", ",".join(f"{dataset}:{split}" for dataset in REGISTRIES[name]), "--arms", arms,
        "--fused-weights", f"1,{weight:g}", "--batch", str(batch)])


def arm_specs(name: str, split: str, work: Path, batch: int) -> dict[str, str]:
    """Each candidate's and retrieval arm's answers (``RESULTS:ARM``) on ``name``'s ``split``."""
    specs = {f"fused {weight:g}": f"{run(name, split, weight, work, batch)}:fused" for weight in WEIGHTS}
    first = run(name, split, WEIGHTS[0], work, batch)
    specs |= {arm: f"{first}:{arm}" for arm in RETRIEVAL_ARMS}
    specs[PRIOR_ALONE] = specs["hybrid"]
    return specs


def rates(spec: str) -> dict[str, dict[str, float]]:
    """Exact set and recall@k by kind of request, from a run's results."""
    directory, _, arm = spec.rpartition(":")
    by_kind = json.loads((Path(directory) / "results.json").read_text(encoding="utf-8"))["arms"][arm]["by_kind"]
    return {kind: {"exact": by_kind[kind]["exact"], "recall": by_kind[kind]["recall"]} for kind in KINDS}


def criterion(spec: str) -> float:
    by_kind = rates(spec)
    return sum(by_kind[kind]["exact"] for kind in KINDS) / len(KINDS)


def paired(a: str, b: str) -> dict[str, Any]:
    """Exact-set difference by kind and over all requests (95 % bootstrap interval, answers better / worse)."""
    answers_a, answers_b = ArmAnswers.load(a), ArmAnswers.load(b)
    rows = as_json(answers_a, answers_b, compare(answers_a, answers_b, rates=["exact"], seed=0))["differences"]
    return {row["kind"] or "all": {key: row[key] for key in ("answers", "a", "b", "low", "high", "a_better",
                                                              "b_better")}
            for row in rows if row["k"] is None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=REPO_DIR / "build" / "sweep-untrained")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("-o", "--output", default=None, help="JSON file (default bench/results/sweep-untrained.json)")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)

    specs = {split: {name: arm_specs(name, split, args.work, args.batch) for name in REGISTRIES}
             for split in ("validation", "test")}
    candidates = [*(f"fused {weight:g}" for weight in WEIGHTS), PRIOR_ALONE]
    today = f"fused {UNTRAINED.retrieval:g}"
    order = [today, *(c for c in candidates if c != today)]  # ties: today's weight, then the heavier model
    validation = {name: {c: criterion(specs["validation"][name][c]) for c in candidates} for name in REGISTRIES}
    rows = [{"candidate": c, **{name: f"{100 * validation[name][c]:.1f}" for name in REGISTRIES},
             "mean": f"{100 * sum(validation[n][c] for n in REGISTRIES) / len(REGISTRIES):.1f}"} for c in candidates]
    print_table(rows, title="validation: mean of the plain and need-describing exact-set rates (%)")

    def best(names: list[str]) -> str:
        return max(order, key=lambda c: (round(sum(validation[n][c] for n in names), 9), -order.index(c)))

    results: dict[str, Any] = {"validation criterion": validation, "folds": {}, "test": {}}
    results["chosen on all four"] = best(list(REGISTRIES))
    fold_rows, pair_rows = [], []
    for name in REGISTRIES:
        chosen = best([n for n in REGISTRIES if n != name])
        test = specs["test"][name]
        arms = {arm: rates(test[arm]) for arm in (*candidates, *RETRIEVAL_ARMS)}
        best_retrieval = {kind: max(RETRIEVAL_ARMS, key=lambda arm: arms[arm][kind]["exact"]) for kind in KINDS}
        results["folds"][name] = {"chosen": chosen, "own best": best([name])}
        results["test"][name] = {
            "rates": arms,
            "chosen - today": paired(test[chosen], test[today]),
            **{f"chosen - {best_retrieval[kind]} ({kind})": paired(test[chosen], test[best_retrieval[kind]])
               for kind in KINDS},
        }
        fold_rows.append({"held out": name, "chosen on the other three": chosen, "own best": best([name]),
                          **{f"{kind}: today / chosen / best retrieval": (
                              f"{100 * arms[today][kind]['exact']:.1f} / {100 * arms[chosen][kind]['exact']:.1f} / "
                              f"{100 * arms[best_retrieval[kind]][kind]['exact']:.1f}") for kind in KINDS}})
        for label, cells in results["test"][name].items():
            if label == "rates":
                continue
            for kind, cell in cells.items():
                pair_rows.append({"registry": name, "pair": label, "requests": kind, "n": cell["answers"],
                                  "exact diff": f"{100 * (cell['a'] - cell['b']):+.1f}",
                                  "95 % interval": f"{100 * cell['low']:+.1f} to {100 * cell['high']:+.1f}",
                                  "better / worse": f"{cell['a_better']} / {cell['b_better']}"})
    print_table(fold_rows, title="each fold's choice, scored on the held-out test split (exact set %)")
    print_table(pair_rows, title="paired on the test splits")
    print(f"chosen on all four: {results['chosen on all four']} (today: {today})")
    path = write_results("sweep-untrained", settings={"registries": REGISTRIES, "weights": WEIGHTS,
                                                      "model weight": 1.0, "batch": args.batch, "today": today},
                         results=results, out=args.output, compact=True)
    print(f"wrote {Path(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
