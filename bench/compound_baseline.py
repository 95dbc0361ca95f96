"""Requests that ask several things at once, on the five development registries: every retrieval arm, the clause-split
baseline and the default, per registry and pooled, paired.

The test halves of the ``-compound`` sets (``eval/data/compound/``: 2-4 asks, one tool per ask, k = the asks) and
the test splits of the ``-composed`` sets (``eval/composed.py``: 2-4 single-tool requests joined), each
evaluated once by ``tooltrie eval`` (``--ranker auto``: the engine answers as ``tooltrie serve`` does) with the
arms ``retrieval`` (dense), ``lexical``, ``hybrid`` (today's prior, static top k), ``clauses`` (the request cut into
its asks, each ranked by the 1:1 sum of dense and lexical z-scores, one tool per ask: ``eval/backends.ClausesArm``)
and ``engine`` (the default). Then each arm's exact-set and recall rates per registry, and pooled over the five (the
answers of all five in one paired comparison: ``tooltrie.eval.compare``), against the default.

    .venv/bin/python bench/compound_baseline.py [--split test] [--sets compound,composed]

The evaluations are kept under ``build/compound/`` and read again when present.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import REPO_DIR, eval_once, print_table, write_results
from _study import REGISTRIES

from tooltrie.eval.compare import ArmAnswers, compare
from tooltrie.eval.results import read_results

ARMS = ("retrieval", "lexical", "hybrid", "clauses", "engine")
BASELINE = "engine"  # the default, what the others are compared with


def pooled(answers: Sequence[ArmAnswers], label: str) -> ArmAnswers:
    """One arm's answers over several registries, as one set (keys made distinct by the registry)."""
    keys, predicted, kinds = [], [], []
    for registry, arm in zip(REGISTRIES, answers, strict=True):
        keys += [(f"{registry}: {query}", gold, n) for query, gold, n in arm.keys]
        predicted += arm.predicted
        kinds += arm.kinds
    return ArmAnswers(label, tuple(keys), tuple(predicted), tuple(kinds))


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for kind in args.sets.split(","):
        runs = {registry: eval_once(REPO_DIR / "build" / "compound" / f"{registry}-{kind}-{args.split}",
                                    ["--dataset", f"{registry}-{kind}:{args.split}", "--arms", ",".join(ARMS),
                                     "--ranker", "auto"])
                for registry in REGISTRIES}
        answers = {registry: {arm: ArmAnswers.of(read_results(path / "results.json"), arm,
                                                 where=path / "results.json") for arm in ARMS}
                   for registry, path in runs.items()}
        results[kind] = {"per_registry": {registry: {arm: _rows(arms[arm], arms[BASELINE]) for arm in ARMS}
                                          for registry, arms in answers.items()},
                         "pooled": {arm: _rows(pooled([answers[r][arm] for r in REGISTRIES], arm),
                                               pooled([answers[r][BASELINE] for r in REGISTRIES], BASELINE))
                                    for arm in ARMS}}
    return results


def _rows(a: ArmAnswers, b: ArmAnswers) -> dict[str, Any]:
    """``a``'s exact-set and recall rates over all its answers, against ``b``'s: difference and 95 % interval."""
    rows = [row for row in compare(a, b, rates=("exact", "recall")) if row.k is None and row.kind is None]
    return {row.rate: {"rate": round(row.a, 4), "against_default": round(row.difference, 4),
                       "interval": [round(row.low, 4), round(row.high, 4)], "answers": row.answers}
            for row in rows}


def _difference(row: dict[str, Any]) -> str:
    low, high = row["interval"]
    return f"{100 * row['against_default']:+.1f} ({100 * low:+.1f} to {100 * high:+.1f})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", default="test", choices=("test", "validation"))
    parser.add_argument("--sets", default="compound,composed", help="compound (hand-written), composed, or both")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    results = run(args)
    for kind, found in results.items():
        table = []
        for scope, rows in [*found["per_registry"].items(), ("pooled", found["pooled"])]:
            for arm in ARMS:
                exact, recall = rows[arm]["exact"], rows[arm]["recall"]
                table.append({"registry": scope, "arm": arm, "answers": exact["answers"],
                              "exact %": round(100 * exact["rate"], 1), "recall %": round(100 * recall["rate"], 1),
                              "exact vs default": _difference(exact)})
        print_table(table, title=f"{kind} requests ({args.split}), exact set and recall@k")
    path = write_results("compound_baseline", settings={**vars(args), "arms": ARMS}, results=results, out=args.out,
                         compact=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
