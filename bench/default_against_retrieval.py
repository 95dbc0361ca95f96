"""The default answer against the retrieval a user would pick, on the five development registries' test requests,
plainly worded (their test splits) and need-describing (``NEEDS``' test halves) apart: the answers of ``tooltrie
eval`` runs (the arm ``--ranker auto`` resolves to for the shipped adapter: fused, at the catalog's own weights on
the catalog) paired, request by request, with dense retrieval, the lexical and hybrid priors, a plain BM25 over
name + description (bm25s's defaults) and that BM25 and the dense scores z-scored and summed 1:1 (no model;
``sweep_prior_loro.py``'s arms). Exact set and recall@k, k = 1 and k >= 2 apart, 95 % bootstrap intervals, and how
many requests like these an interval would need to show the default at most ``MARGIN`` below the other arm. Prints
tables and writes JSON.

    .venv/bin/python bench/default_against_retrieval.py \\
        --default bfcl=build/eval/bfcl:fused,build/eval/bfcl-needs-test:fused \\
        --default catalog=build/eval/catalog-test:fused ... -o bench/results/default-against-retrieval.json
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
from _common import print_table, write_results
from sweep_fusion_adaptive import NEEDS, NeedSet
from sweep_prior_loro import CACHE, GROUPS, REGISTRIES, Registryset, fuse, paired, per_query_rates

from tooltrie.eval.compare import ArmAnswers, answers_needed, spread
from tooltrie.eval.datasets import registry_path
from tooltrie.eval.scoring import answer_rates
from tooltrie.lexical import LexicalIndex
from tooltrie.ranker import HYBRID, Ranker, embeddings_path, standardized
from tooltrie.registry import load_registry

BASELINES = ("dense", "lexical", "hybrid", "plain BM25", "plain BM25 + dense")
MARGIN = 0.02  # "at least the best retrieval arm": a paired lower bound of -2 points or better


def baseline_scores(data: Registryset) -> dict[str, np.ndarray]:
    """[test requests, tools] scores of each of ``BASELINES``: the lexical index and the plain BM25 built once."""
    dense, plain = data.dense["test"], data.plain_bm25("test")
    index = LexicalIndex.build(data.registry)
    lexical = np.array([index.scores(q.query) for q in data.queries["test"]], np.float32)
    return {"dense": dense, "lexical": lexical, "hybrid": fuse(dense, lexical, "z", HYBRID["lexical"]),
            "plain BM25": plain, "plain BM25 + dense": standardized(dense) + standardized(plain)}


def default_rates(data: Registryset, specs: list[str]) -> dict[str, np.ndarray]:
    """The default's exact set and recall@k per test request, read from eval runs over the same requests."""
    answered: dict[tuple[str, tuple[str, ...], int], tuple[str, ...]] = {}
    for spec in specs:
        arm = ArmAnswers.load(spec)
        answered.update(zip(arm.keys, arm.predicted, strict=True))
    exact, recall, seen = [], [], {}
    for query in data.queries["test"]:
        pair = (query.query, tuple(query.tools))
        seen[pair] = seen.get(pair, 0) + 1
        rates = answer_rates(list(answered[(*pair, seen[pair])]), query.tools)
        exact.append(rates["exact"])
        recall.append(rates["recall"])
    return {"exact": np.array(exact, float), "recall": np.array(recall, float)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--default", action="append", required=True, metavar="REGISTRY=RESULTS:ARM[,RESULTS:ARM]",
                        help="the default's answers for a registry's test requests, plain and need-describing "
                        "(repeat per registry)")
    parser.add_argument("-o", "--output", default=None,
                        help="JSON file (default bench/results/default-against-retrieval.json)")
    args = parser.parse_args(argv)
    defaults = {name: specs.split(",") for name, _, specs in (d.partition("=") for d in args.default)}
    unknown = sorted(set(defaults) - set(REGISTRIES))
    if unknown:
        parser.error(f"unknown registries {unknown}; choose from {sorted(REGISTRIES)}")

    results: dict[str, Any] = {}
    rows, pair_rows = [], []
    for name, specs in defaults.items():
        registry = load_registry(registry_path(REGISTRIES[name][0]))
        ranker = Ranker(registry, embeddings_path=embeddings_path(CACHE / f"{registry.sha256[:32]}.safetensors"))
        results[name] = {"default": specs}
        for kind, data in (("plain", Registryset(name, ranker)), ("need", NeedSet(name, NEEDS[name], ranker))):
            queries, names = data.queries["test"], registry.names
            per_arm = {arm: per_query_rates(scores, queries, names) for arm, scores in baseline_scores(data).items()}
            per_arm["default"] = default_rates(data, specs)
            ks = np.array([q.k for q in queries])
            cell: dict[str, Any] = {"arms": {}, "paired": {}}
            best = max(BASELINES, key=lambda arm: (per_arm[arm]["exact"].mean(), per_arm[arm]["recall"].mean()))
            for group, keep in GROUPS.items():
                mask = np.array([keep(k) for k in ks])
                if not mask.any():
                    continue
                row: dict[str, Any] = {"registry": name, "requests": kind, "k": group, "n": int(mask.sum())}
                for arm, rates in per_arm.items():
                    cell["arms"].setdefault(arm, {})[group] = {r: float(rates[r][mask].mean())
                                                               for r in ("exact", "recall")}
                    row[arm] = f"{100 * rates['exact'][mask].mean():.1f} / {100 * rates['recall'][mask].mean():.1f}"
                rows.append(row)
                for other in dict.fromkeys((best, "plain BM25 + dense")):  # the best may be the 1:1 sum
                    ours, theirs = per_arm["default"]["exact"][mask], per_arm[other]["exact"][mask]
                    seed = (list(REGISTRIES).index(name), list(GROUPS).index(group), BASELINES.index(other),
                            ("plain", "need").index(kind))
                    pair: dict[str, Any] = paired(ours, theirs, seed)
                    pair["requests needed"] = answers_needed(pair["difference"], spread(ours - theirs), MARGIN)
                    cell["paired"].setdefault(f"default - {other}", {})[group] = pair
                    pair_rows.append({"registry": name, "requests": kind, "k": group,
                                      "pair": f"default - {other}",
                                      "exact diff": f"{100 * pair['difference']:+.1f}",
                                      "95 % interval": f"{100 * pair['low']:+.1f} to {100 * pair['high']:+.1f}",
                                      "better/worse": f"{pair['better']}/{pair['worse']}",
                                      f"n for >= -{100 * MARGIN:g}": pair["requests needed"] or "never"})
            results[name][kind] = cell
    print_table(rows, title="test splits: exact set / recall@k (%)")
    print_table(pair_rows, title="paired: the default against the best retrieval arm and the plain 1:1 sum")
    settings = {"registries": REGISTRIES, "needs": NEEDS, "baselines": BASELINES, "margin": MARGIN}
    path = write_results("default-against-retrieval", settings=settings, results=results, out=args.output, compact=True)
    print(f"wrote {Path(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
