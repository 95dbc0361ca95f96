"""Choose between lexical scores by the answers that are served: the fused ranker's (the shipped adapter at the
weights ``--ranker auto`` gives it), leave one registry out. ``bench/sweep_names_first.py`` chooses the lexical
score's constants by the lexical arm alone, whose optimum over k1 and b is flat (a third of a point between its
best settings); the answer a user gets is the model's re-ranking of a prior with the lexical score a 0.15 share in
it, so the candidates it leaves close are decided here, on what is served.

For each of the five development registries, the candidate with the best mean, over the *other four* registries
(each counted once), of the mean of two exact-set rates on their validation requests (plainly worded and
need-describing, each kind counting the same) is scored on the fifth's test requests, paired against the lexical
score before; ties go to the candidate listed first. Each ``tooltrie eval`` run is kept under ``--work`` and not run
again when its results are there. Prints tables and writes JSON.

    .venv/bin/python bench/sweep_lexical_fused.py -o bench/results/sweep-lexical-fused.json
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from _common import REPO_DIR, print_table, write_results
from sweep_fusion_adaptive import NEEDS
from sweep_prior_loro import paired

from tooltrie.eval.compare import ArmAnswers
from tooltrie.eval.datasets import registry_path
from tooltrie.eval.scoring import answer_rates

PLAIN = {"bfcl": ("bfcl",), "catalog": ("metatool-single", "metatool-multi"), "restbench-tmdb": ("restbench-tmdb",),
         "restbench-spotify": ("restbench-spotify",), "toolalpaca": ("toolalpaca",)}
KINDS = ("plain", "need")
# name: (stop words, b); k1 3 and the name's words three times in each. The first is the score before.
CANDIDATES = {"Lucene's stop words, b 0.5": ("lucene", 0.5),
              "conversational stop words, b 0.75": ("conversational", 0.75),
              "conversational stop words, b 0.5": ("conversational", 0.5)}
BEFORE = next(iter(CANDIDATES))
# Runs tooltrie eval with the lexical score's stop words and b set to a candidate's (argv[1], argv[2]).
RUNNER = ("import sys; from tooltrie import chains, lexical as lx; words = lx.LUCENE_STOPWORDS; "
          "words = words if sys.argv[1] == 'lucene' else words | lx.CONVERSATIONAL_STOPWORDS; "
          "lx.STOPWORDS = chains.STOPWORDS = words; lx.BM25_PARAMETERS['b'] = float(sys.argv[2]); "
          "from tooltrie.cli import main; sys.exit(main(sys.argv[3:]))")


def run(name: str, kind: str, split: str, candidate: str, work: Path, batch: int) -> Path:
    """One ``tooltrie eval`` of the fused arm over ``name``'s requests of ``kind`` in ``split``."""
    datasets = PLAIN[name] if kind == "plain" else (NEEDS[name],)
    stop, b = CANDIDATES[candidate]
    out = work / f"{stop}-b{b:g}" / f"{name}-{kind}-{split}"
    if not (out / "results.json").is_file():
        subprocess.run([sys.executable, "-c", RUNNER, stop, str(b), "eval",
                        "--dataset", ",".join(f"{d}:{split}" for d in datasets),
                        "--registry", str(registry_path(PLAIN[name][0])), "--arms", "fused", "--batch", str(batch),
                        "--no-plots", "-o", str(out)], check=True, cwd=REPO_DIR)
    return out


def rates(out: Path) -> dict[str, np.ndarray]:
    """Each request's exact set and recall@k, in the run's order."""
    answers = ArmAnswers.load(f"{out}:fused")
    cells = [answer_rates(list(predicted), list(key[1])) for key, predicted in zip(answers.keys, answers.predicted,
                                                                                   strict=True)]
    return {rate: np.array([cell[rate] for cell in cells], float) for rate in ("exact", "recall")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=REPO_DIR / "build" / "sweep-lexical-fused")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("-o", "--output", default=None,
                        help="JSON file (default bench/results/sweep-lexical-fused.json)")
    args = parser.parse_args(argv)
    names = list(PLAIN)

    def scored(name: str, kind: str, split: str, candidate: str) -> dict[str, np.ndarray]:
        return rates(run(name, kind, split, candidate, args.work, args.batch))

    validation = {(name, candidate): {kind: scored(name, kind, "validation", candidate)["exact"].mean()
                                      for kind in KINDS} for name in names for candidate in CANDIDATES}

    def criterion(candidate: str, registries: list[str]) -> float:
        return round(float(np.mean([np.mean(list(validation[r, candidate].values())) for r in registries])), 9)

    def best(registries: list[str]) -> str:
        return max(CANDIDATES, key=lambda c: (criterion(c, registries), -list(CANDIDATES).index(c)))

    grid_rows = [{"candidate": c, **{f"{r} {kind}": f"{100 * validation[r, c][kind]:.1f}" for r in names
                                     for kind in KINDS}, "criterion, all five": f"{100 * criterion(c, names):.2f}"}
                 for c in CANDIDATES]
    folds = {held: best([r for r in names if r != held]) for held in names}
    overall = best(names)
    results: dict[str, Any] = {"all five": overall, "folds": {}, "validation": {
        c: {r: {kind: round(100 * float(validation[r, c][kind]), 2) for kind in KINDS} for r in names}
        for c in CANDIDATES}}
    rows = []
    for i, held in enumerate(names):
        results["folds"][held] = {"chosen": folds[held]}
        before = {kind: scored(held, kind, "test", BEFORE) for kind in KINDS}
        for label, candidate in (("fold", folds[held]), ("all five", overall)):
            cell: dict[str, Any] = {"candidate": candidate}
            for j, kind in enumerate(KINDS):
                chosen = scored(held, kind, "test", candidate)
                cell[kind] = {"queries": len(chosen["exact"]), **{rate: {
                    "chosen": float(chosen[rate].mean()), "before": float(before[kind][rate].mean()),
                    "paired": paired(chosen[rate], before[kind][rate], (i, j, len(rate)))}
                    for rate in ("exact", "recall")}}
                pair = cell[kind]["exact"]["paired"]
                rows.append({"held out": held, "choice": label, "candidate": candidate, "requests": kind,
                             "n": cell[kind]["queries"], "chosen": f"{100 * cell[kind]['exact']['chosen']:.1f}",
                             "before": f"{100 * cell[kind]['exact']['before']:.1f}",
                             "difference": f"{100 * pair['difference']:+.1f} ({100 * pair['low']:+.1f} to "
                                           f"{100 * pair['high']:+.1f}), {pair['better']} / {pair['worse']}"})
            results["folds"][held][label] = cell
    print_table(grid_rows, title="validation, fused: exact set (%) by candidate")
    print_table(rows, title="test, fused, held out: exact set (%), paired with the lexical score before")
    print(f"folds: {', '.join(f'{r}: {c}' for r, c in folds.items())}; all five: {overall}")
    settings = {"registries": PLAIN, "needs": NEEDS, "candidates": {c: {"stop words": s, "b": b, "k1": 3, "name": 3}
                                                                     for c, (s, b) in CANDIDATES.items()},
                "batch": args.batch, "arm": "fused (the shipped adapter, the registry's weights)",
                "criterion": "mean over the other four registries of the mean of the plain and the need-describing "
                             "validation exact-set rates; ties to the candidate listed first"}
    path = write_results("sweep-lexical-fused", settings=settings, results=results, out=args.output, compact=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
