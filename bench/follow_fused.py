"""What following the answer adds to the fused ranker (the default answer where the shipped adapter never saw the
tools): the engine's fused arm with the prior following the answer and without (``tooltrie eval --no-follow``), on
the test requests of k >= 2 of the five development registries (k = 1 answers are the first tool's, the same
either way), paired answer by answer (``tooltrie compare``). Prints a table and writes JSON. Each ``tooltrie eval``
run is kept under ``--work`` and not run again when its results are there.

    .venv/bin/python bench/follow_fused.py -o bench/results/follow-fused.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from _common import REPO_DIR, eval_once, print_table, write_results

from tooltrie.eval.compare import ArmAnswers, as_json, compare
from tooltrie.eval.datasets import load_split, registry_path

REGISTRIES = {"bfcl": ("bfcl",), "catalog": ("metatool-multi",), "restbench-tmdb": ("restbench-tmdb",),
              "restbench-spotify": ("restbench-spotify",), "toolalpaca": ("toolalpaca",)}
MODES = {"follow": [], "static": ["--no-follow"]}


def run(name: str, mode: str, work: Path, batch: int) -> Path:
    """One ``tooltrie eval`` of the fused and hybrid arms over ``name``'s k >= 2 test requests."""
    out = work / f"{name}-{mode}"
    queries = work / f"{name}-k2-test.jsonl"
    with queries.open("w") as f:  # the same file each time: the split is fixed
        for query in (q for dataset in REGISTRIES[name] for q in load_split(dataset, "test") if q.k >= 2):
            f.write(json.dumps({"query": query.query, "tools": list(query.tools)}) + "\n")
    return eval_once(out, ["--dataset", str(queries), "--registry", str(registry_path(REGISTRIES[name][0])),
                           "--arms", "fused,hybrid", *MODES[mode], "--batch", str(batch)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=REPO_DIR / "build" / "follow-fused")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("-o", "--output", default=None, help="JSON file (default bench/results/follow-fused.json)")
    args = parser.parse_args(argv)

    args.work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    rows = []
    for name in REGISTRIES:
        runs = {mode: run(name, mode, args.work, args.batch) for mode in MODES}
        a, b = ArmAnswers.load(f"{runs['follow']}:fused"), ArmAnswers.load(f"{runs['static']}:fused")
        paired = as_json(a, b, compare(a, b, rates=["exact", "recall"], seed=0))
        results[name] = paired["differences"]
        for row in paired["differences"]:
            if row["k"] is None and row["kind"] is None:  # all the registry's requests
                rows.append({"registry": name, "rate": row["rate"], "requests": row["answers"],
                             "following": f"{100 * row['a']:.1f}", "not": f"{100 * row['b']:.1f}",
                             "difference": f"{100 * (row['a'] - row['b']):+.1f}",
                             "95 % interval": f"{100 * row['low']:+.1f} to {100 * row['high']:+.1f}",
                             "better / worse": f"{row['a_better']} / {row['b_better']}"})
    print_table(rows, title="the fused ranker, k >= 2 test requests: the prior following the answer or not")
    results["mean difference over the five"] = {
        rate: round(100 * sum(row["a"] - row["b"] for name in REGISTRIES for row in results[name]
                              if row["rate"] == rate and row["k"] is None and row["kind"] is None) / len(REGISTRIES), 2)
        for rate in ("exact", "recall")}
    print(f"mean difference over the five registries (points): {results['mean difference over the five']}")
    path = write_results("follow-fused", settings={"registries": REGISTRIES, "batch": args.batch,
                                                   "arms": "fused (the shipped adapter, the registry's weights)"},
                         results=results, out=args.output, compact=True)
    print(f"wrote {Path(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
