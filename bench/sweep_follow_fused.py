"""Choose how the prior follows the answer (``tooltrie.ranker.FOLLOW``) on the answers that are served: the fused
ranker's (the shipped adapter at the weights ``--ranker auto`` gives it: 1 and 10 where it never saw the tools, its
record's 1 and 1 on the catalog), leave one registry out. ``bench/sweep_prior_follow.py`` chooses on the prior's own
greedy answers, which the model's logits then re-rank; this sweep runs the model.

For each of the five development registries, the setting (covered, later) with the best mean, over the *other
four* registries (each counted once), of the mean of two exact-set rates on their validation requests (plainly
worded ones of k >= 2 and need-describing ones of k = 2, each kind counting the same) is scored on the fifth's test
requests, paired against not following (``tooltrie eval --no-follow``); ties go to not following, then to the grid's
order. The setting chosen on all five is scored on every test split too. Each ``tooltrie eval`` run is kept under
``--work`` and not run again when its results are there. Prints tables and writes JSON.

    .venv/bin/python bench/sweep_follow_fused.py -o bench/results/sweep-follow-fused.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from _common import REPO_DIR, print_table, write_results
from sweep_fusion_adaptive import NEEDS
from sweep_prior_loro import paired

from tooltrie.eval.compare import ArmAnswers
from tooltrie.eval.datasets import load_split, registry_path
from tooltrie.eval.scoring import answer_rates
from tooltrie.ranker import FOLLOW

REGISTRIES = {"bfcl": ("bfcl",), "catalog": ("metatool-multi",), "restbench-tmdb": ("restbench-tmdb",),
              "restbench-spotify": ("restbench-spotify",), "toolalpaca": ("toolalpaca",)}
OFF = None  # not following: every tool's prior is the first tool's
GRID: list[tuple[float, float] | None] = [OFF, (1.0, 0.3), (0.5, 0.2), (0.5, 0.3), (0.5, 0.6), (0.25, 0.6), (0.0, 0.3),
                                          (1.0, 0.6)]
SPLITS = ("validation", "test")
KINDS = ("plain", "need")
# Runs tooltrie eval with FOLLOW set to the setting under test (a JSON object in argv[1]).
RUNNER = ("import json, sys; from tooltrie import ranker; ranker.FOLLOW.update(json.loads(sys.argv[1])); "
          "from tooltrie.cli import main; sys.exit(main(sys.argv[2:]))")


def describe(setting: tuple[float, float] | None) -> str:
    return "not following" if setting is None else f"covered {setting[0]:g}, later {setting[1]:g}"


def requests_file(name: str, split: str, work: Path) -> Path:
    """``name``'s plain requests of k >= 2 and its need-describing ones of k = 2 in ``split``, one JSONL file."""
    path = work / f"{name}-k2-{split}.jsonl"
    plain = [q for dataset in REGISTRIES[name] for q in load_split(dataset, split) if q.k >= 2]
    need = [q for q in load_split(NEEDS[name], split) if q.k >= 2]
    with path.open("w") as f:
        for query in (*plain, *need):
            f.write(json.dumps({"query": query.query, "tools": list(query.tools), "kind": query.kind}) + "\n")
    return path


def run(name: str, split: str, setting: tuple[float, float] | None, work: Path, batch: int) -> Path:
    out = work / f"{name}-{split}-{describe(setting).replace(', ', '-').replace(' ', '')}"
    if not (out / "results.json").is_file():
        follow = ["--no-follow"] if setting is None else []
        constants = json.dumps({"covered": setting[0], "lexical": setting[1]} if setting else FOLLOW)
        subprocess.run([sys.executable, "-c", RUNNER, constants, "eval", "--dataset",
                        str(requests_file(name, split, work)), "--registry", str(registry_path(REGISTRIES[name][0])),
                        "--arms", "fused", *follow, "--batch", str(batch), "--no-plots", "-o", str(out)],
                       check=True, cwd=REPO_DIR)
    return out


def rates(out: Path, kinds: dict[str, str]) -> dict[str, dict[str, np.ndarray]]:
    """Per kind, each request's exact set and recall@k, in the file's order."""
    answers = ArmAnswers.load(f"{out}:fused")
    per: dict[str, dict[str, list[float]]] = {kind: {"exact": [], "recall": []} for kind in KINDS}
    for key, predicted in zip(answers.keys, answers.predicted, strict=True):
        query, gold = key[0], key[1]
        rate = answer_rates(list(predicted), list(gold))
        kind = kinds[query] or "plain"
        per[kind]["exact"].append(rate["exact"])
        per[kind]["recall"].append(rate["recall"])
    return {kind: {r: np.array(v) for r, v in cells.items()} for kind, cells in per.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=REPO_DIR / "build" / "sweep-follow-fused")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("-o", "--output", default=None,
                        help="JSON file (default bench/results/sweep-follow-fused.json)")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    names = list(REGISTRIES)
    kinds = {split: {name: {json.loads(line)["query"]: json.loads(line)["kind"]
                            for line in requests_file(name, split, args.work).open()} for name in names}
             for split in SPLITS}

    def scored(name: str, split: str, setting: tuple[float, float] | None) -> dict[str, dict[str, np.ndarray]]:
        return rates(run(name, split, setting, args.work, args.batch), kinds[split][name])

    validation = {name: {setting: scored(name, "validation", setting) for setting in GRID} for name in names}

    def criterion(setting: tuple[float, float] | None, registries: list[str]) -> float:
        return round(float(np.mean([np.mean([validation[r][setting][kind]["exact"].mean() for kind in KINDS])
                                    for r in registries])), 9)

    def best(registries: list[str]) -> tuple[float, float] | None:
        return max(GRID, key=lambda s: (criterion(s, registries), -GRID.index(s)))

    grid_rows = [{"setting": describe(s), **{f"{r} {kind}": f"{100 * validation[r][s][kind]['exact'].mean():.1f}"
                                               for r in names for kind in KINDS},
                  "criterion, all five": f"{100 * criterion(s, names):.2f}"} for s in GRID]
    folds = {held: best([r for r in names if r != held]) for held in names}
    overall = best(names)
    results: dict[str, Any] = {"all five": describe(overall), "folds": {}, "validation": {
        describe(s): {r: {kind: round(100 * float(validation[r][s][kind]["exact"].mean()), 2) for kind in KINDS}
                      for r in names} for s in GRID}}
    rows = []
    for i, held in enumerate(names):
        results["folds"][held] = {"chosen": describe(folds[held]), "test": {}}
        off = scored(held, "test", OFF)
        for label, setting in (("fold", folds[held]), ("all five", overall)):
            chosen = scored(held, "test", setting)
            cell: dict[str, Any] = {"setting": describe(setting)}
            for j, kind in enumerate(KINDS):
                if not len(off[kind]["exact"]):
                    continue
                cell[kind] = {"queries": len(off[kind]["exact"]), **{rate: {
                    "chosen": float(chosen[kind][rate].mean()), "off": float(off[kind][rate].mean()),
                    "paired": paired(chosen[kind][rate], off[kind][rate], (i, j, len(rate)))}
                    for rate in ("exact", "recall")}}
                pair = cell[kind]["exact"]["paired"]
                rows.append({"held out": held, "choice": label, "setting": describe(setting), "requests": kind,
                             "n": cell[kind]["queries"], "following": f"{100 * cell[kind]['exact']['chosen']:.1f}",
                             "not": f"{100 * cell[kind]['exact']['off']:.1f}",
                             "difference": f"{100 * pair['difference']:+.1f} ({100 * pair['low']:+.1f} to "
                                           f"{100 * pair['high']:+.1f}), {pair['better']} / {pair['worse']}"})
            results["folds"][held][label] = cell
    for label in ("fold", "all five"):
        results[f"mean over the five, {label}"] = {
            kind: {side: round(100 * float(np.mean([results["folds"][r][label][kind]["exact"][side] for r in names
                                                    if kind in results["folds"][r][label]])), 2)
                   for side in ("chosen", "off")} for kind in KINDS}
    print_table(grid_rows, title="validation, fused: exact set (%) by setting")
    print_table(rows, title="test, fused, held out: exact set (%), paired with not following")
    print(json.dumps({k: v for k, v in results.items() if k.startswith("mean")}))
    print(f"folds: {', '.join(f'{r}: {describe(s)}' for r, s in folds.items())}; all five: {describe(overall)}")
    settings = {"registries": REGISTRIES, "needs": NEEDS, "grid": [describe(s) for s in GRID], "batch": args.batch,
                "arm": "fused (the shipped adapter, the registry's weights)",
                "criterion": "mean over the other four registries of the mean of the plain (k >= 2) and the "
                             "need-describing (k = 2) validation exact-set rates; ties to not following, then the "
                             "grid's order"}
    path = write_results("sweep-follow-fused", settings=settings, results=results, out=args.output, compact=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
