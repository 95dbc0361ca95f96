"""Choose how the hybrid retrieval prior combines its two scores, on validation splits (no language model): dense
(all-MiniLM-L6-v2 cosine) and lexical (BM25 over identifier-split words) alone, their z-scores summed at several
lexical weights, min-max-scaled scores summed, and reciprocal-rank fusion (RRF, k = 60). Each is scored by the top k
tools it ranks first (exact set, top-1, recall@k). Prints a table and writes JSON (machine, versions, settings).

    .venv/bin/python bench/sweep_prior.py \
        --datasets bfcl:validation,metatool-single:validation,metatool-multi:validation
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
from _common import print_table, write_results

from tooltrie.compiler.cache import default_cache_dir
from tooltrie.eval.datasets import load_split, registry_path
from tooltrie.eval.scoring import answer_rates
from tooltrie.ranker import Ranker, embeddings_path, lexical_path, standardized
from tooltrie.registry import load_registry

Scores = npt.NDArray[np.float32]


def min_max(scores: Scores) -> Scores:
    low, high = scores.min(axis=1, keepdims=True), scores.max(axis=1, keepdims=True)
    result: Scores = np.divide(scores - low, high - low, out=np.zeros_like(scores), where=high > low)
    return result


def reciprocal_ranks(scores: Scores, k: int = 60) -> Scores:
    ranks = np.argsort(np.argsort(-scores, axis=1, kind="stable"), axis=1, kind="stable")
    result: Scores = (1.0 / (k + 1 + ranks)).astype(np.float32)
    return result


def combinations(weights: list[float]) -> dict[str, Callable[[Scores, Scores], Scores]]:
    """Each way of combining (dense, lexical) tried, by name."""
    ways: dict[str, Callable[[Scores, Scores], Scores]] = {
        "dense": lambda dense, lexical: dense,
        "lexical": lambda dense, lexical: lexical,
    }
    for w in weights:
        ways[f"z dense + {w:g} z lexical"] = (
            lambda dense, lexical, w=w: standardized(dense) + w * standardized(lexical))
    ways["min-max sum"] = lambda dense, lexical: min_max(dense) + min_max(lexical)
    ways["reciprocal-rank fusion"] = lambda dense, lexical: reciprocal_ranks(dense) + reciprocal_ranks(lexical)
    return ways


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", default="bfcl:validation,metatool-single:validation,metatool-multi:validation",
                        help="comma-separated NAME:SPLIT of bundled sets (never a test split for choosing)")
    parser.add_argument("--weights", default="0.1,0.15,0.2,0.25,0.3,0.4,0.5,1",
                        help="lexical z-score weights (dense's at 1)")
    parser.add_argument("-o", "--output", default=None, help="JSON file (default bench/results/sweep-prior.json)")
    args = parser.parse_args(argv)

    ways = combinations([float(w) for w in args.weights.split(",")])
    results: dict[str, Any] = {}
    rows: list[dict[str, object]] = []
    for dataset in args.datasets.split(","):
        name, _, split = dataset.partition(":")
        queries = load_split(name, split or "validation")
        registry = load_registry(registry_path(name))
        kept = default_cache_dir() / f"{registry.sha256[:32]}.safetensors"  # where `tooltrie eval` keeps them too
        ranker = Ranker(registry, embeddings_path=embeddings_path(kept), lexical_path=lexical_path(kept))
        texts = [q.query for q in queries]
        dense = ranker.similarities(texts)
        lexical = ranker.prior_scores(texts, "lexical")  # z-scores: the same order as BM25's
        names = registry.names
        results[dataset] = {}
        for way, combine in ways.items():
            combined = combine(dense, lexical)
            rates = {"exact": 0.0, "top1": 0.0, "recall": 0.0}
            for query, row in zip(queries, combined, strict=True):
                top = [names[i] for i in np.argsort(-row, kind="stable")[: query.k]]
                for rate, value in answer_rates(top, query.tools).items():
                    rates[rate] += value / len(queries)
            results[dataset][way] = rates
            rows.append({"dataset": dataset, "queries": len(queries), "prior": way,
                         **{rate: round(100 * value, 1) for rate, value in rates.items()}})
    print_table(rows, title="retrieval priors alone (%)")
    path = write_results("sweep-prior", settings={"datasets": args.datasets, "weights": args.weights},
                         results=results, out=args.output)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
