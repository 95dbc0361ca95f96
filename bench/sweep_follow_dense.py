"""A dense counterpart of how the prior follows the answer, chosen leave one registry out with no language model.

``ranker.FollowUp`` scores the lexical part again once the answer has committed to tools; the dense part never
changes, so the second tool is chosen by the same embedding similarity that chose the first. Here the dense part moves
too, after the chosen tools C (raw cosines s = q . E, E the tools' normalised embeddings, ``Ranker.tool_embeddings``):

- ``mean``: the query less what is answered, q' = q - a mean(e_c): s' = s - a mean_c(E e_c);
- ``project``: the query less its projection on the chosen tools' span, q' = q - a P_C q: s' = s - a G_C^-1 s_C . E_C E
  (for one chosen tool q - a (q . e_c) e_c);
- ``neighbour`` (MMR-like): s' = s - b max_c(E e_c), the chosen tools' near neighbours pushed down.

Renormalising q' changes nothing: s' is z-scored per request, and a positive scale leaves z-scores as they are. The
later tool's prior is today's follow-up plus the dense z-scores' move, ``FollowUp(chosen) + z(s') - z(s)``, so a = 0 is
today's follow-up exactly. The answer is the greedy top k (``FollowUp.top``'s rule, ties to the lower tool id), as in
``bench/sweep_prior_follow.py``, whose loading, caches and fold rule this reuses. Two grids: the dense move with
today's lexical constants (``FOLLOW``), and jointly with the lexical grid (covered, later). For each of the five
registries the setting with the best mean exact-set rate over the *other four* registries' validation requests of
k >= 2 (each registry counted once; ties to recall@k, then the grid's order, no dense move first) is scored on the
fifth's validation and test splits and on its need-describing requests of k = 2 (never chosen on), paired against the
prior that does not follow and today's lexical follow-up. Last, the cost of the dense move per finished tool at
100,000 tools x 384 dimensions, one core, full and restricted to the first prior's top 1,024 tools.

    .venv/bin/python bench/sweep_follow_dense.py -o bench/results/sweep-follow-dense.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from _common import print_table, summarize, take_turns, write_results
from sweep_fusion_adaptive import NEEDS, NeedSet
from sweep_prior_follow import GRID as LEXICAL_GRID
from sweep_prior_follow import OFF, Answers
from sweep_prior_loro import CACHE, REGISTRIES, Registryset, paired

from tooltrie.eval.compare import RESAMPLES
from tooltrie.eval.datasets import registry_path
from tooltrie.eval.scoring import answer_rates
from tooltrie.ranker import FOLLOW, HYBRID, FollowUp, Ranker, embeddings_path, standardized
from tooltrie.registry import load_registry

SPLITS = ("validation", "test")
VARIANTS = ("mean", "project", "neighbour")
STRENGTHS = (0.1, 0.25, 0.5, 0.75, 1.0)
SHIPPED = (FOLLOW["covered"], FOLLOW["lexical"])
NO_MOVE = ("none", 0.0)
DENSE = [NO_MOVE, *((variant, strength) for variant in VARIANTS for strength in STRENGTHS)]
Setting = tuple[float, float, str, float]  # covered, later, dense variant, its strength (a or b)
GRIDS: dict[str, list[Setting]] = {
    # the dense move alone, the lexical part as the first tool's (no move first: the prior that does not follow)
    "dense alone, lexical off": [(*OFF, *move) for move in DENSE],
    # today's lexical follow-up, the dense move swept (no move first: today's)
    "dense, FOLLOW fixed": [(*SHIPPED, *move) for move in DENSE],
    # jointly: the lexical grid without a dense move first (the prior as it was first), then every move
    "dense x lexical": [(*lexical, *NO_MOVE) for lexical in LEXICAL_GRID]
    + [(*lexical, *move) for move in DENSE[1:] for lexical in LEXICAL_GRID],
}
BASELINES: dict[str, Setting] = {"not following": (*OFF, *NO_MOVE), "lexical follow-up (FOLLOW)": (*SHIPPED, *NO_MOVE)}
COST_TOOLS, COST_DIM, COST_TOP = 100_000, 384, 1024


def describe(setting: Setting) -> str:
    covered, later, variant, strength = setting
    lexical = "lexical off" if (covered, later) == OFF else f"covered {covered:g}, later {later:g}"
    return lexical if variant == "none" else f"{lexical}; {variant} {strength:g}"


class Followed(Answers):
    """One registry's requests of k >= 2 (plain or need-describing) and their greedy answers under each setting; a
    setting without a dense move is ``Answers``' own (``sweep_prior_follow``), exactly."""

    def __init__(self, data: Registryset, embeddings: npt.NDArray[np.float32]) -> None:
        super().__init__(data)
        self.embeddings = embeddings.astype(np.float64)
        self._rows: dict[int, npt.NDArray[np.float64]] = {}
        self._moved: dict[tuple[str, Setting], dict[str, np.ndarray]] = {}

    def row(self, tool: int) -> npt.NDArray[np.float64]:
        """The cosines of every tool to ``tool`` (E e_c)."""
        if tool not in self._rows:
            self._rows[tool] = self.embeddings @ self.embeddings[tool]
        return self._rows[tool]

    def moved(self, dense: npt.NDArray[np.float64], chosen: list[int], variant: str,
              strength: float) -> npt.NDArray[np.float64]:
        """The raw cosines after the chosen tools (before the z-scores)."""
        rows = np.array([self.row(c) for c in chosen])
        if variant == "mean":
            return dense - strength * rows.mean(axis=0)
        if variant == "neighbour":
            return dense - strength * rows.max(axis=0)
        if variant == "project":  # q - a P_C q, P_C the projection on the chosen tools' span
            gram = rows[:, chosen]
            coefficients = np.linalg.lstsq(gram, dense[chosen], rcond=None)[0]
            return dense - strength * (coefficients @ rows)
        raise ValueError(variant)

    def answer(self, split: str, i: int, setting: Setting) -> list[int]:
        covered, later, variant, strength = setting
        query = self.data.queries[split][i]
        follow = FollowUp(self.first[split][i].astype(np.float32), query.query, self.index,
                          self.data.registry.tools, HYBRID["lexical"], later, covered)
        dense = self.data.dense[split][i].astype(np.float64)
        z = standardized(dense[None])[0].astype(np.float64)
        chosen: list[int] = []
        for _ in range(query.k):
            prior = np.array(follow(tuple(chosen)), np.float64)
            if chosen and variant != "none":
                prior += standardized(self.moved(dense, chosen, variant, strength)[None])[0] - z
            prior[chosen] = -np.inf
            chosen.append(int(np.argmax(prior)))
        return chosen

    def rates4(self, split: str, setting: Setting) -> dict[str, np.ndarray]:
        if setting[2] == "none":
            return self.rates(split, setting[:2])
        key = (split, setting)
        if key not in self._moved:
            names = self.data.registry.names
            exact, recall = [], []
            for i, query in self.queries[split]:
                rates = answer_rates([names[t] for t in self.answer(split, i, setting)], query.tools)
                exact.append(rates["exact"])
                recall.append(rates["recall"])
            self._moved[key] = {"exact": np.array(exact, float), "recall": np.array(recall, float)}
        return self._moved[key]


def best(grid: list[Setting], answers: dict[str, Followed], registries: list[str]) -> Setting:
    """The setting with the best mean exact-set rate over ``registries``' validation requests of k >= 2, each
    registry counted once; ties to the better mean recall@k, then to the grid's order."""
    def score(setting: Setting) -> tuple[float, float]:
        rates = [answers[r].rates4("validation", setting) for r in registries]
        return (round(float(np.mean([r["exact"].mean() for r in rates])), 9),
                round(float(np.mean([r["recall"].mean() for r in rates])), 9))
    return max(grid, key=lambda s: (*score(s), -grid.index(s)))


def cell(rates: dict[str, np.ndarray]) -> str:
    return f"{100 * rates['exact'].mean():.1f} / {100 * rates['recall'].mean():.1f}"


def pair_text(pair: dict[str, float]) -> str:
    return (f"{100 * pair['difference']:+.1f} ({100 * pair['low']:+.1f} to {100 * pair['high']:+.1f}), "
            f"{pair['better']}/{pair['worse']}")


# -- the cost of the dense move ---------------------------------------------------------------------------------------

def cost(repeats: int) -> dict[str, Any]:
    """Per finished tool, at 100,000 tools x 384 dimensions (float32): the cosines to the tool (a matvec over the
    tools' embeddings), the running mean (``mean``; ``neighbour``'s running maximum costs the same), the z-scores and
    the sum with the lexical part; over every tool, and over the first prior's top 1,024 only (their rows gathered
    once, when the request is admitted: timed apart)."""
    rng = np.random.default_rng(0)
    embeddings = rng.standard_normal((COST_TOOLS, COST_DIM), dtype=np.float32)
    embeddings /= np.linalg.norm(embeddings, axis=1, keepdims=True)
    query = rng.standard_normal(COST_DIM).astype(np.float32)
    dense = embeddings @ (query / np.linalg.norm(query))
    lexical = standardized(rng.random((1, COST_TOOLS), dtype=np.float32))[0]
    first = standardized(dense[None])[0] + np.float32(HYBRID["lexical"]) * lexical
    tool = int(np.argmax(first))
    state: dict[str, Any] = {}

    def admit() -> None:
        top = np.argpartition(-first, COST_TOP)[:COST_TOP]
        state["top"], state["rows"] = top, embeddings[top]
        state["dense_top"], state["lexical_top"] = dense[top], lexical[top]

    def step(matrix: npt.NDArray[np.float32], scores: npt.NDArray[np.float32],
             lexical_part: npt.NDArray[np.float32]) -> Callable[[], object]:
        running = np.zeros(len(matrix), np.float32)

        def run() -> npt.NDArray[np.float32]:
            running[:] += matrix @ embeddings[tool]  # one finished tool: its cosines to the rest
            moved = scores - np.float32(0.5) * running  # a = 0.5, one tool chosen (the mean of one)
            result: npt.NDArray[np.float32] = lexical_part + standardized(moved[None])[0]
            running[:] = 0
            return result
        return run

    admit()
    arms: dict[str, Callable[[], object]] = {
        "full: matvec": lambda: embeddings @ embeddings[tool],
        "full: dense move (matvec, mean, z-scores, sum)": step(embeddings, dense, lexical),
        "top 1,024: matvec": lambda: state["rows"] @ embeddings[tool],
        "top 1,024: dense move": step(state["rows"], state["dense_top"], state["lexical_top"]),
        "admission: top 1,024 and their rows": admit,
    }
    times = take_turns(arms, repeats, warmup=3)
    return {"tools": COST_TOOLS, "dim": COST_DIM, "top": COST_TOP, "repeats": repeats,
            "threads": {key: os.environ.get(key) for key in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")},
            "ms": {arm: {key: round(1000 * summarize(t.samples["wall"])[key], 4) for key in ("median", "min", "max")}
                   for arm, t in times.items()}}


def cost_in_one_thread(repeats: int) -> dict[str, Any]:
    """``cost`` in a fresh process whose BLAS runs on one thread (the budget is per core)."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, __file__, "--cost-worker", str(repeats)], capture_output=True, text=True,
                          env=env, timeout=600, check=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# -- the sweep --------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", default=None,
                        help="JSON file (default bench/results/sweep-follow-dense.json)")
    parser.add_argument("--cost-repeats", type=int, default=200)
    parser.add_argument("--cost-worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cost_worker is not None:
        print(json.dumps(cost(args.cost_worker)))
        return 0

    began = time.perf_counter()
    plain, needs = {}, {}
    for name, datasets in REGISTRIES.items():
        registry = load_registry(registry_path(datasets[0]))
        ranker = Ranker(registry, embeddings_path=embeddings_path(CACHE / f"{registry.sha256[:32]}.safetensors"))
        embeddings = ranker.tool_embeddings
        norms = np.linalg.norm(embeddings, axis=1)
        assert np.allclose(norms, 1.0, atol=1e-3), (name, norms.min(), norms.max())
        plain[name] = Followed(Registryset(name, ranker), embeddings)
        assert load_registry(registry_path(NEEDS[name])).sha256 == registry.sha256, name
        needs[name] = Followed(NeedSet(name, NEEDS[name], ranker), embeddings)
        assert all(q.k == 2 for _, q in needs[name].queries["test"]), name  # need sets hold k = 1 and 2
    names = list(REGISTRIES)
    # A setting without a dense move is sweep_prior_follow's: the same answers (its results file, validation grid).
    for name in names:
        for setting in GRIDS["dense, FOLLOW fixed"][:1]:
            a = plain[name].rates4("validation", setting)["exact"]
            b = plain[name].rates("validation", setting[:2])["exact"]
            assert (a == b).all()

    results: dict[str, Any] = {"grids": {}, "tables": {}}
    for g, (grid_name, grid) in enumerate(GRIDS.items()):
        validation = {describe(s): {r: round(100 * float(plain[r].rates4("validation", s)["exact"].mean()), 2)
                                    for r in names} for s in grid}
        for row in validation.values():
            row["mean"] = round(float(np.mean([row[r] for r in names])), 2)
        results["grids"][grid_name] = {"validation exact, k >= 2 (%)": validation}
        shown = validation if len(grid) <= 20 else dict(sorted(validation.items(), key=lambda kv: -kv[1]["mean"])[:15])
        print_table([{"setting": s, **row} for s, row in shown.items()],
                    title=f"{grid_name}: validation exact set, k >= 2 (%)")
        table: dict[str, Any] = {"all five": describe(best(grid, plain, names)), "folds": {}}
        rows, pair_rows, need_rows = [], [], []
        means: dict[str, list[float]] = {}
        pooled: dict[tuple[str, str, str], list[np.ndarray]] = {}
        for h, held in enumerate(names):
            choice = best(grid, plain, [r for r in names if r != held])
            arms = {**BASELINES, "chosen": choice}
            fold: dict[str, Any] = {"chosen": describe(choice), "own best": describe(best(grid, plain, [held])),
                                    "plain": {}, "needs k = 2": {}}
            for kind, sets in (("plain", plain), ("needs k = 2", needs)):
                for s, split in enumerate(SPLITS):
                    rates = {arm: sets[held].rates4(split, setting) for arm, setting in arms.items()}
                    n = len(sets[held].queries[split])
                    entry: dict[str, Any] = {"queries": n, "arms": {
                        arm: {rate: round(float(v.mean()), 4) for rate, v in r.items()} for arm, r in rates.items()},
                        "paired": {}}
                    for b, baseline in enumerate(BASELINES):
                        entry["paired"][f"chosen - {baseline}"] = {
                            rate: paired(rates["chosen"][rate], rates[baseline][rate],
                                         (g, ("plain", "needs").index(kind.split()[0]), h, s, b, i))
                            for i, rate in enumerate(("exact", "recall"))}
                    fold[kind][split] = entry
                    for arm, r in rates.items():
                        pooled.setdefault((kind, split, arm), []).append(r["exact"])
                        for rate in ("exact", "recall"):
                            means.setdefault(f"{kind} {split} {arm} {rate}", []).append(float(r[rate].mean()))
                    row = {"held out": held, "split": split, "n": n,
                           **{arm: cell(r) for arm, r in rates.items()}, "chosen setting": describe(choice)}
                    pairs = {f"- {baseline}": pair_text(entry["paired"][f"chosen - {baseline}"]["exact"])
                             for baseline in BASELINES}
                    if kind == "plain":
                        rows.append(row)
                        pair_rows.append({"held out": held, "split": split, **pairs})
                    else:
                        need_rows.append({**row, **pairs})
            table["folds"][held] = fold
        table["means over the five (%)"] = {key: round(100 * float(np.mean(v)), 2) for key, v in means.items()}
        for kind in ("plain", "needs k = 2"):
            for split in SPLITS:
                for rate in ("exact", "recall"):
                    values = {arm: np.array(means[f"{kind} {split} {arm} {rate}"]) for arm in (*BASELINES, "chosen")}
                    table["means over the five (%)"][f"{kind} {split} chosen - not following {rate}"] = round(
                        100 * float((values["chosen"] - values["not following"]).mean()), 2)
                    table["means over the five (%)"][f"{kind} {split} chosen - lexical follow-up {rate}"] = round(
                        100 * float((values["chosen"] - values["lexical follow-up (FOLLOW)"]).mean()), 2)
        # every registry's requests together, each request once (a registry counts by its number of requests)
        table["pooled over the five, exact"] = {}
        pooled_rows = []
        for k, kind in enumerate(("plain", "needs k = 2")):
            for s, split in enumerate(SPLITS):
                arrays = {arm: np.concatenate(pooled[(kind, split, arm)]) for arm in (*BASELINES, "chosen")}
                entry = {"queries": len(arrays["chosen"]),
                         "answered": {arm: int(a.sum()) for arm, a in arrays.items()}, "paired": {}}
                for b, baseline in enumerate(BASELINES):
                    entry["paired"][f"chosen - {baseline}"] = paired(arrays["chosen"], arrays[baseline],
                                                                     (g, 9, k, s, b))
                entry["paired"]["lexical follow-up (FOLLOW) - not following"] = paired(
                    arrays["lexical follow-up (FOLLOW)"], arrays["not following"], (9, 9, k, s, 2))
                table["pooled over the five, exact"][f"{kind} {split}"] = entry
                pooled_rows.append({"requests": f"{kind} {split}", "n": entry["queries"],
                                    **{arm: n for arm, n in entry["answered"].items()},
                                    **{pair: pair_text(cell) for pair, cell in entry["paired"].items()}})
        results["tables"][grid_name] = table
        print_table(rows, title=f"{grid_name}: held out, k >= 2, exact set / recall@k (%)")
        print_table(pair_rows, title=f"{grid_name}: chosen minus each baseline, exact set (points, 95 % interval, "
                                     "better/worse)")
        print_table(need_rows, title=f"{grid_name}: need-describing requests, k = 2, the fold's choice")
        print_table([{"mean over the five": key, "%": value}
                     for key, value in table["means over the five (%)"].items() if "validation" not in key
                     or "plain" in key])
        print_table(pooled_rows, title=f"{grid_name}: pooled over the five, exact sets answered, paired (points)")
        print(f"{grid_name}: chosen on all five validation splits: {table['all five']}", flush=True)
    results["sweep_s"] = round(time.perf_counter() - began, 1)
    results["cost per finished tool"] = cost_in_one_thread(args.cost_repeats)
    print_table([{"arm": arm, **t} for arm, t in results["cost per finished tool"]["ms"].items()],
                title="the dense move per finished tool, 100,000 tools x 384, one thread (ms)")
    settings = {"registries": {name: list(sets) for name, sets in REGISTRIES.items()}, "needs": NEEDS,
                "variants": {"mean": "s - a mean_c(E e_c)", "project": "s - a (G_CC^-1 s_C) . E_C E",
                             "neighbour": "s - b max_c(E e_c)"},
                "strengths": STRENGTHS, "lexical grid (covered, later)": [list(s) for s in LEXICAL_GRID],
                "FOLLOW": FOLLOW, "first tool": HYBRID,
                "later tool's prior": "FollowUp(chosen) + z(s') - z(s); z per request over every tool",
                "criterion": "best mean exact-set rate over the other four registries' validation requests of k >= 2, "
                "each registry counted once; ties to recall@k, then the grid's order (no dense move first)",
                "answer": "greedy top k, each the best unused tool by the prior made from the tools before it",
                "resamples": RESAMPLES}
    path = write_results("sweep-follow-dense", settings=settings, results=results, out=args.output, compact=True)
    print(f"wrote {Path(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
