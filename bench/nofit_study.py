""""No tool fits" from the retrieval prior alone: how well a calibrated confidence that a registry serves a request,
made of what the prior sees of it, tells the requests no tool serves from the ones some tool does, leave one
registry out.

The features of a request (``features``), over the registry's tools: the best tool's cosine similarity to it, how far
that tool stands out of the others (its z-score among the similarities), and how far the best BM25 score stands out
of the others; with the lexical prior alone (no sentence encoder), the last.

For each of the five development registries: the requests it serves (its plain, need-describing and compound sets)
and the hand-written requests none of its tools serves (``<registry>-nofit``, near misses and unrelated), each
split in halves. Per fold, a logistic model is fitted on the other four registries' validation requests (served: 1,
not served: 0; each registry's two classes weighted equally), and ``min_confidence`` is the highest value that keeps
``KEEP`` of their plain validation requests (averaged over the four, each registry alike); the held-out registry's
test requests then say what it does there: no-fit requests answered with no tool, plain (need-describing, compound)
requests that keep their answer. Also the model fitted on all five registries, and its threshold.

    .venv/bin/python bench/nofit_study.py [--output FILE]
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from _common import print_table, write_results
from _study import REGISTRIES, registry_of, requests

from tooltrie.ranker import Ranker

FEATURES = {"dense": ("best cosine", "dense standing out", "lexical standing out"),
            "lexical": ("lexical standing out",)}
SERVED = ("plain", "need", "compound")
KEEP = 0.975  # plain requests that keep their answer, on the folds' validation requests (the target: 97 % on test)
L2 = 1e-3


def features(ranker: Ranker, query: str, *, dense: bool = True) -> np.ndarray:
    """``FEATURES["dense"]`` of ``query`` over the ranker's tools, or with ``dense=False`` ``FEATURES["lexical"]``."""
    found = [standing_out(ranker.lexical.scores(query).astype(np.float64))]
    if dense:
        similarities = ranker.similarities([query])[0].astype(np.float64)
        found = [float(similarities.max()), standing_out(similarities), *found]
    return np.array(found)


def standing_out(scores: np.ndarray) -> float:
    """How many standard deviations the best score is above the mean (0 where they are all equal)."""
    spread = float(scores.std())
    return 0.0 if spread == 0 else float((scores.max() - scores.mean()) / spread)


def probability(values: np.ndarray, weights: tuple[float, ...]) -> float:
    logit = weights[0] + float(np.dot(weights[1:], values))
    return 1.0 / (1.0 + math.exp(-logit)) if logit >= 0 else math.exp(logit) / (1.0 + math.exp(logit))


def request_features(kind_of_model: str) -> dict[str, dict[str, dict[str, np.ndarray]]]:
    """[registry][split][kind] -> [requests, features]; kinds: SERVED and "nofit"."""
    out: dict[str, dict[str, dict[str, np.ndarray]]] = {}
    for registry_name in REGISTRIES:
        ranker = Ranker(registry_of(registry_name))
        out[registry_name] = {split: {kind: np.array([features(ranker, q.query, dense=kind_of_model == "dense")
                                                      for q in requests(registry_name, kind, split)])
                                      for kind in (*SERVED, "nofit")}
                              for split in ("validation", "test")}
    return out


def fit(x: np.ndarray, y: np.ndarray, weight: np.ndarray) -> tuple[float, ...]:
    """Weighted logistic regression by Newton's method (a small L2 on the weights, not the intercept)."""
    design = np.hstack([np.ones((len(x), 1)), x])
    beta = np.zeros(design.shape[1])
    penalty = np.diag([0.0, *[L2] * x.shape[1]])
    for _ in range(100):
        p = 1 / (1 + np.exp(-design @ beta))
        gradient = design.T @ (weight * (p - y)) + penalty @ beta
        hessian = (design * (weight * p * (1 - p))[:, None]).T @ design + penalty
        step = np.linalg.solve(hessian, gradient)
        beta -= step
        if np.abs(step).max() < 1e-10:
            break
    return tuple(float(b) for b in beta)


def training_data(data: Any, registries: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    xs, ys, ws = [], [], []
    for name in registries:
        served = np.vstack([data[name]["validation"][kind] for kind in SERVED])
        nofit = data[name]["validation"]["nofit"]
        for x, label in ((served, 1.0), (nofit, 0.0)):
            xs.append(x)
            ys.append(np.full(len(x), label))
            ws.append(np.full(len(x), 1.0 / (len(x) * len(registries))))
    return np.vstack(xs), np.concatenate(ys), np.concatenate(ws) * len(np.concatenate(ys)) / 2


def confidences(weights: tuple[float, ...], x: np.ndarray) -> np.ndarray:
    return np.array([probability(row, weights) for row in x])


def threshold(data: Any, registries: Sequence[str], weights: tuple[float, ...]) -> float:
    """The highest min_confidence keeping ``KEEP`` of the plain validation requests, averaged over ``registries``."""
    scored = [confidences(weights, data[name]["validation"]["plain"]) for name in registries]
    candidates = sorted({0.0, *np.concatenate(scored).tolist()})
    best = 0.0
    for value in candidates:
        if np.mean([(s >= value).mean() for s in scored]) >= KEEP:
            best = value
    return best


def wilson(hits: int, n: int) -> tuple[float, float]:
    if n == 0:
        return math.nan, math.nan
    z, p = 1.959964, hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def study(kind_of_model: str) -> dict[str, Any]:
    data = request_features(kind_of_model)
    folds, tallies = {}, {kind: [0, 0] for kind in (*SERVED, "nofit")}
    for held in REGISTRIES:
        train = [name for name in REGISTRIES if name != held]
        weights = fit(*training_data(data, train))
        cut = threshold(data, train, weights)
        test = data[held]["test"]
        result = {"weights": weights, "min_confidence": cut}
        for kind in (*SERVED, "nofit"):
            scored = confidences(weights, test[kind])
            hits = int((scored < cut).sum()) if kind == "nofit" else int((scored >= cut).sum())
            result[kind] = {"n": len(scored), "hits": hits}
            tallies[kind][0] += hits
            tallies[kind][1] += len(scored)
        folds[held] = result
    weights = fit(*training_data(data, REGISTRIES))
    pooled = {kind: {"n": n, "rate": hits / n, "interval": wilson(hits, n)} for kind, (hits, n) in tallies.items()}
    return {"features": FEATURES[kind_of_model], "folds": folds, "pooled": pooled,
            "all five": {"weights": weights, "min_confidence": threshold(data, REGISTRIES, weights)}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    results = {kind: study(kind) for kind in FEATURES}
    for kind, result in results.items():
        rows = [{"held out": held, "min_confidence": f"{fold['min_confidence']:.3f}",
                 "no-fit → none": f"{fold['nofit']['hits']}/{fold['nofit']['n']}",
                 **{f"{k} kept": f"{fold[k]['hits']}/{fold[k]['n']}" for k in SERVED}}
                for held, fold in result["folds"].items()]
        pooled = result["pooled"]
        rows.append({"held out": "pooled", "min_confidence": "",
                     "no-fit → none": f"{100 * pooled['nofit']['rate']:.1f} %",
                     **{f"{k} kept": f"{100 * pooled[k]['rate']:.1f} %" for k in SERVED}})
        print_table(rows, title=f"no tool fits, {kind} features, leave one registry out (test requests)")
        print(f"all five: weights {tuple(round(w, 4) for w in result['all five']['weights'])}, "
              f"min_confidence {result['all five']['min_confidence']:.4f}")
    path = write_results("nofit", settings={"keep": KEEP, "l2": L2}, results=results, out=args.output, compact=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
