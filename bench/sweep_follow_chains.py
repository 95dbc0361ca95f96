"""Choose the weight of chains in how the prior follows the answer (``FOLLOW["chains"]``, ``tooltrie/chains.py``)
leave one registry out, with no language model: the answer is the greedy top k of the hybrid prior, each tool the best
by the prior ``FollowUp`` makes from the tools before it (``FOLLOW``'s covered and later weights, the chains' bonus
at each weight of the grid; what the decode answers with the model's weight at 0). The criterion is
``sweep_prior_follow.py --kinds plain,need``'s: a registry's mean of two exact-set rates on its validation split,
plain requests of k >= 2 and need-describing ones of k = 2, each kind counting the same; a fold's choice the best mean
over the other four registries (ties to recall@k, then to the smaller weight). Each held-out registry's test split is
scored, paired against the weight 0 (the prior as it followed the answer before chains), and so is the weight chosen
on all five (what ships). Prints tables and writes one line of JSON.

    .venv/bin/python bench/sweep_follow_chains.py
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
from _common import print_table, write_results
from sweep_fusion_adaptive import NEEDS, NeedSet
from sweep_prior_follow import SPLITS, Answers, pair_text
from sweep_prior_loro import CACHE, REGISTRIES, Registryset, paired

from tooltrie.chains import Chains
from tooltrie.eval.datasets import registry_path
from tooltrie.ranker import FOLLOW, Ranker, embeddings_path
from tooltrie.registry import load_registry

WEIGHTS = (0.0, 0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 10.0)
KINDS = ("plain", "need")
SHIPPED = (FOLLOW["covered"], FOLLOW["lexical"])  # FOLLOW's covered and later weights, under which chains add


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", default=None,
                        help="JSON file (default bench/results/sweep-follow-chains.json)")
    args = parser.parse_args(argv)

    table: dict[tuple[str, str, str, float], dict[str, np.ndarray]] = {}
    counts = {}
    for name, datasets in REGISTRIES.items():
        registry = load_registry(registry_path(datasets[0]))
        ranker = Ranker(registry, embeddings_path=embeddings_path(CACHE / f"{registry.sha256[:32]}.safetensors"))
        chains = Chains.of(registry)
        counts[name] = {"tools needing an identifier": sum(bool(n) for n in chains.needs),
                        "entities found": len(chains.finders)}
        sets = {"plain": Answers(Registryset(name, ranker)), "need": Answers(NeedSet(name, NEEDS[name], ranker))}
        for kind, answers in sets.items():
            for split in SPLITS:
                for weight in WEIGHTS:
                    table[name, kind, split, weight] = answers.rates(split, SHIPPED, chains, weight)
    names = list(REGISTRIES)

    def score(weight: float, registries: list[str]) -> tuple[float, float]:
        return tuple(round(float(np.mean([np.mean([table[r, kind, "validation", weight][rate].mean() for kind in KINDS])
                                          for r in registries])), 9) for rate in ("exact", "recall"))

    def best(registries: list[str]) -> float:
        return max(WEIGHTS, key=lambda w: (*score(w, registries), -w))

    validation = [{"weight": w, **{f"{r} {kind}": round(100 * float(table[r, kind, "validation", w]["exact"].mean()), 1)
                                   for r in names for kind in KINDS},
                   "criterion": round(100 * score(w, names)[0], 2)} for w in WEIGHTS]
    print_table(validation, title="validation exact set (%): plain k >= 2, need-describing k = 2")
    overall = best(names)
    choices = {held: best([r for r in names if r != held]) for held in names}
    results: dict[str, Any] = {"chains": counts, "validation exact (%)": validation, "all five": overall,
                               "folds": {}, "all five, each registry": {}}
    rows = []
    for h, held in enumerate(names):
        for which, weight in (("fold", choices[held]), ("all five", overall)):
            cell: dict[str, Any] = {"weight": weight}
            for k, kind in enumerate(KINDS):
                chosen, off = table[held, kind, "test", weight], table[held, kind, "test", 0.0]
                pair = paired(chosen["exact"], off["exact"], (h, k, which == "fold"))
                cell[kind] = {"n": len(off["exact"]), "exact": 100 * float(chosen["exact"].mean()),
                              "exact, weight 0": 100 * float(off["exact"].mean()),
                              "recall": 100 * float(chosen["recall"].mean()),
                              "recall, weight 0": 100 * float(off["recall"].mean()), "paired": pair}
                rows.append({"held out": held, "choice": f"{which}: {weight:g}", "kind": kind, "n": len(off["exact"]),
                             "exact / recall": f"{cell[kind]['exact']:.1f} / {cell[kind]['recall']:.1f}",
                             "weight 0": f"{cell[kind]['exact, weight 0']:.1f} / {cell[kind]['recall, weight 0']:.1f}",
                             "difference": pair_text(pair)})
            results["folds" if which == "fold" else "all five, each registry"][held] = cell
    print_table(rows, title="held out, test: exact set / recall@k (%), paired with weight 0 (points, 95 % interval, "
                            "better/worse)")
    means = {which: {kind: {arm: round(float(np.mean([results[which][r][kind][arm] for r in names])), 2)
                            for arm in ("exact", "exact, weight 0")} for kind in KINDS}
             for which in ("folds", "all five, each registry")}
    results["means over the five, test exact (%)"] = means
    print_table([{"choice": which, "kind": kind, **value} for which, kinds in means.items()
                 for kind, value in kinds.items()], title="means over the five, test exact set (%)")
    print("folds: " + "; ".join(f"{r}: {choices[r]:g}" for r in names) + f"; all five: {overall:g}")
    settings = {"registries": {name: list(sets) for name, sets in REGISTRIES.items()}, "needs": NEEDS,
                "weights": WEIGHTS, "prior": "hybrid", "FOLLOW": {key: FOLLOW[key] for key in ("covered", "lexical")},
                "requests": {"plain": "k >= 2", "need": "k = 2"},
                "criterion": "best mean over the registries' validation splits (each counted once) of the mean "
                "exact-set rate over the two kinds; ties to recall@k, then to the smaller weight",
                "answer": "greedy top k, each the best unused tool by the prior made from the tools before it"}
    path = write_results("sweep-follow-chains", settings=settings, results=results, out=args.output, compact=True)
    print(f"wrote {Path(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
