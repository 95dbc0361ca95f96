"""Choose between settings of the prior by the answers that are served: the fused ranker's (the shipped adapter at
the weights ``--ranker auto`` gives it), leave one registry out. A sweep over the prior alone leaves its best
candidates close; the answer a user gets is the model's re-ranking of that prior, so those are decided here.

For each of the five development registries, the candidate with the best mean, over the *other four* registries
(each counted once), of the mean of two exact-set rates on their validation requests (plainly worded and
need-describing, each kind counting the same) is scored on the fifth's test requests, paired against the first
candidate (today's); ties go to the candidate listed first. A candidate is a ``tooltrie eval`` run under a
``runner``: Python source that sets the candidate up from ``sys.argv[1:1 + len(args)]`` and then runs the CLI on the
rest. Each run is kept under ``work`` and not run again when its results are there.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from _common import REPO_DIR, print_table
from sweep_fusion_adaptive import NEEDS
from sweep_prior_loro import paired

from tooltrie.eval.compare import ArmAnswers
from tooltrie.eval.datasets import registry_path
from tooltrie.eval.scoring import answer_rates

PLAIN = {"bfcl": ("bfcl",), "catalog": ("metatool-single", "metatool-multi"), "restbench-tmdb": ("restbench-tmdb",),
         "restbench-spotify": ("restbench-spotify",), "toolalpaca": ("toolalpaca",)}
KINDS = ("plain", "need")
CRITERION = ("mean over the other four registries of the mean of the plain and the need-describing validation "
             "exact-set rates; ties to the candidate listed first")


@dataclass(frozen=True)
class Candidate:
    """A setting: the runner's arguments for it, and the folder its runs are kept in (under ``work``)."""

    args: tuple[str, ...]
    folder: str


def rates(out: Path) -> dict[str, np.ndarray]:
    """Each request's exact set and recall@k, in the run's order."""
    answers = ArmAnswers.load(f"{out}:fused")
    cells = [answer_rates(list(predicted), list(key[1])) for key, predicted in zip(answers.keys, answers.predicted,
                                                                                   strict=True)]
    return {rate: np.array([cell[rate] for cell in cells], float) for rate in ("exact", "recall")}


def choose(candidates: Mapping[str, Candidate], runner: str, work: Path, batch: int) -> dict[str, Any]:
    """Every fold's choice and its held-out test rates against the first candidate; prints the tables."""
    names, before = list(PLAIN), next(iter(candidates))

    def scored(name: str, kind: str, split: str, candidate: str) -> dict[str, np.ndarray]:
        out = work / candidates[candidate].folder / f"{name}-{kind}-{split}"
        if not (out / "results.json").is_file():
            datasets = PLAIN[name] if kind == "plain" else (NEEDS[name],)
            subprocess.run([sys.executable, "-c", runner, *candidates[candidate].args, "eval",
                            "--dataset", ",".join(f"{d}:{split}" for d in datasets),
                            "--registry", str(registry_path(PLAIN[name][0])), "--arms", "fused", "--batch", str(batch),
                            "--no-plots", "-o", str(out)], check=True, cwd=REPO_DIR)
        return rates(out)

    validation = {(name, candidate): {kind: scored(name, kind, "validation", candidate)["exact"].mean()
                                      for kind in KINDS} for name in names for candidate in candidates}

    def criterion(candidate: str, registries: Sequence[str]) -> float:
        return round(float(np.mean([np.mean(list(validation[r, candidate].values())) for r in registries])), 9)

    def best(registries: Sequence[str]) -> str:
        return max(candidates, key=lambda c: (criterion(c, registries), -list(candidates).index(c)))

    grid_rows = [{"candidate": c, **{f"{r} {kind}": f"{100 * validation[r, c][kind]:.1f}" for r in names
                                     for kind in KINDS}, "criterion, all five": f"{100 * criterion(c, names):.2f}"}
                 for c in candidates]
    folds = {held: best([r for r in names if r != held]) for held in names}
    overall = best(names)
    results: dict[str, Any] = {"all five": overall, "folds": {}, "validation": {
        c: {r: {kind: round(100 * float(validation[r, c][kind]), 2) for kind in KINDS} for r in names}
        for c in candidates}}
    rows = []
    for i, held in enumerate(names):
        results["folds"][held] = {"chosen": folds[held]}
        first = {kind: scored(held, kind, "test", before) for kind in KINDS}
        for label, candidate in (("fold", folds[held]), ("all five", overall)):
            cell: dict[str, Any] = {"candidate": candidate}
            for j, kind in enumerate(KINDS):
                chosen = scored(held, kind, "test", candidate)
                cell[kind] = {"queries": len(chosen["exact"]), **{rate: {
                    "chosen": float(chosen[rate].mean()), "before": float(first[kind][rate].mean()),
                    "paired": paired(chosen[rate], first[kind][rate], (i, j, len(rate)))}
                    for rate in ("exact", "recall")}}
                pair = cell[kind]["exact"]["paired"]
                rows.append({"held out": held, "choice": label, "candidate": candidate, "requests": kind,
                             "n": cell[kind]["queries"], "chosen": f"{100 * cell[kind]['exact']['chosen']:.1f}",
                             "before": f"{100 * cell[kind]['exact']['before']:.1f}",
                             "difference": f"{100 * pair['difference']:+.1f} ({100 * pair['low']:+.1f} to "
                                           f"{100 * pair['high']:+.1f}), {pair['better']} / {pair['worse']}"})
            results["folds"][held][label] = cell
    print_table(grid_rows, title="validation, fused: exact set (%) by candidate")
    print_table(rows, title=f"test, fused, held out: exact set (%), paired with {before}")
    print(f"folds: {', '.join(f'{r}: {c}' for r, c in folds.items())}; all five: {overall}")
    return results
