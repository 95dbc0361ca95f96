"""Choose how the prior follows the answer (``tooltrie.ranker.FOLLOW``) leave one registry out, with no language
model: the answer is the greedy top k of the hybrid prior, each tool the best by the prior ``FollowUp`` makes from
the tools before it (what the decode answers with the model's weight at 0, ``tests/test_prior_follow.py``). For each
of the five development registries, the setting (how much a word the chosen tools' names cover still counts; the
lexical z-scores' weight for a later tool) with the best mean exact-set rate over the *other four* registries'
validation requests of k >= 2 is scored on the fifth's validation and test splits, paired against the same prior
without the follow-up. Requests of k = 1 are left out: their answer is the first tool's, which does not follow.
Prints tables and writes JSON (machine, versions, settings, each fold's choice, rates, paired intervals).

    .venv/bin/python bench/sweep_prior_follow.py -o bench/results/sweep-prior-follow.json

With ``--kinds plain,need`` the setting is chosen on requests of both kinds: a registry's criterion is the mean of two
exact-set rates on its validation split, its plain requests of k >= 2 and its need-describing requests of k = 2
(``NEEDS``: catalog-needs, bfcl-needs, tmdb-needs, spotify-needs, toolalpaca-needs; same registries), each kind
counting the same, and a fold's choice the best mean of that over the other four registries (each counted once; ties
to the same mean of recall@k, then to the grid's order: not following first, then covered and later from the
smaller). The grid there is covered {0, 0.25, 0.5, 1} x later {0.15, 0.2, 0.3, 0.45, 0.6, 1} (covered 1 at 0.15: not
following). Each held-out registry's validation and test splits are scored for each kind, exact set and recall@k,
paired (bootstrap interval, requests better/worse) against not following and today's ``FOLLOW``; the setting chosen on
all five together (what would ship) is scored the same way. Test splits are scored, never chosen on.

    .venv/bin/python bench/sweep_prior_follow.py --kinds plain,need -o bench/results/sweep-prior-follow-kinds.json
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import Any

import numpy as np
from _common import print_table, write_results
from sweep_fusion_adaptive import NEEDS, NeedSet
from sweep_prior_loro import CACHE, REGISTRIES, Registryset, paired

from tooltrie.chains import Chains
from tooltrie.eval.datasets import registry_path
from tooltrie.eval.scoring import answer_rates
from tooltrie.lexical import LexicalIndex
from tooltrie.ranker import FOLLOW, HYBRID, FollowUp, Ranker, embeddings_path, standardized
from tooltrie.registry import load_registry

COVERED = (0.0, 0.25, 0.5, 1.0)
LATER = (0.15, 0.3, 0.45, 0.6, 1.0)
OFF = (1.0, HYBRID["lexical"])  # every word counts fully, at the first tool's weight: the prior as it was
GRID = [OFF, *(s for s in itertools.product(COVERED, LATER) if s != OFF)]
SPLITS = ("validation", "test")
# --kinds plain,need: the grid with a later weight between the first tool's (0.15) and 0.3
LATER_KINDS = (0.15, 0.2, 0.3, 0.45, 0.6, 1.0)
GRID_KINDS = [OFF, *(s for s in itertools.product(COVERED, LATER_KINDS) if s != OFF)]
KINDS = ("plain", "need")
RATES = ("exact", "recall")


class Answers:
    """One registry's k >= 2 requests and their answers under each setting, computed once."""

    def __init__(self, data: Registryset) -> None:
        self.data = data
        self.index = LexicalIndex.build(data.registry)  # the ranker's own: the default settings
        self.queries = {split: [(i, q) for i, q in enumerate(data.queries[split]) if q.k >= 2] for split in SPLITS}
        self.first = {split: self._first(split) for split in SPLITS}
        self._rates: dict[tuple[Any, ...], dict[str, np.ndarray]] = {}

    def _first(self, split: str) -> dict[int, np.ndarray]:
        """Each request's hybrid prior, as ``Ranker.prior_scores`` makes it."""
        dense = standardized(self.data.dense[split])
        return {i: HYBRID["dense"] * dense[i] + HYBRID["lexical"] * standardized(self.index.scores(q.query)[None])[0]
                for i, q in self.queries[split]}

    def rates(self, split: str, setting: tuple[float, float], chains: Chains | None = None,
              chain_weight: float = 0.0) -> dict[str, np.ndarray]:
        """Exact set and recall@k of each request of ``split`` under ``setting`` (covered, later) and the ``chains``'
        bonus ``chain_weight`` (none by default)."""
        key = (split, setting, chain_weight if chains is not None else None)
        if key not in self._rates:
            covered, later = setting
            names = self.data.registry.names
            exact, recall = [], []
            for i, query in self.queries[split]:
                follow = FollowUp(self.first[split][i].astype(np.float32), query.query, self.index,
                                  self.data.registry.tools, HYBRID["lexical"], later, covered, chains, chain_weight)
                rates = answer_rates([names[t] for t in follow.top(query.k)], query.tools)
                exact.append(rates["exact"])
                recall.append(rates["recall"])
            self._rates[key] = {"exact": np.array(exact, float), "recall": np.array(recall, float)}
        return self._rates[key]


def best(answers: dict[str, Answers], registries: list[str]) -> tuple[float, float]:
    """The setting with the best mean exact-set rate over ``registries``' validation splits, each counted once; ties
    to the better mean recall@k, then to the grid's order (the prior as it was first)."""
    def score(setting: tuple[float, float]) -> tuple[float, float]:
        rates = [answers[r].rates("validation", setting) for r in registries]
        return (round(float(np.mean([r["exact"].mean() for r in rates])), 9),
                round(float(np.mean([r["recall"].mean() for r in rates])), 9))
    return max(GRID, key=lambda s: (*score(s), -GRID.index(s)))


def describe(setting: tuple[float, float]) -> str:
    return "off" if setting == OFF else f"covered {setting[0]:g}, later {setting[1]:g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", default=None,
                        help="JSON file (default bench/results/sweep-prior-follow.json, with --kinds plain,need "
                        "bench/results/sweep-prior-follow-kinds.json)")
    parser.add_argument("--kinds", default="plain",
                        help="the requests a setting is chosen on: plain (k >= 2; the default) or plain,need (and the "
                        "need-describing requests of k = 2, each kind counting the same)")
    args = parser.parse_args(argv)
    kinds = tuple(dict.fromkeys(k.strip() for k in args.kinds.split(",") if k.strip()))
    if not kinds or set(kinds) - set(KINDS):
        parser.error(f"--kinds: a comma-separated list of {', '.join(KINDS)}")
    if kinds != ("plain",):
        return main_kinds(tuple(k for k in KINDS if k in kinds), args.output)

    answers = {}
    for name, datasets in REGISTRIES.items():
        registry = load_registry(registry_path(datasets[0]))
        kept = CACHE / f"{registry.sha256[:32]}.safetensors"
        answers[name] = Answers(Registryset(name, Ranker(registry, embeddings_path=embeddings_path(kept))))
    names = list(REGISTRIES)
    shipped = (FOLLOW["covered"], FOLLOW["lexical"])
    overall = best(answers, names)
    results: dict[str, Any] = {"all five": describe(overall), "shipped": describe(shipped), "folds": {},
                               "validation grid": {describe(s): {r: round(100 * float(
                                   answers[r].rates("validation", s)["exact"].mean()), 2) for r in names}
                                   for s in GRID}}
    rows, pair_rows = [], []
    means: dict[str, list[float]] = {}
    for held in names:
        choice = best(answers, [r for r in names if r != held])
        fold: dict[str, Any] = {"chosen": describe(choice), "splits": {}}
        for split in SPLITS:
            arms = {"hybrid (off)": OFF, "LORO": choice, "shipped": shipped}
            rates = {arm: answers[held].rates(split, s) for arm, s in arms.items()}
            n = len(answers[held].queries[split])
            fold["splits"][split] = {"queries": n, "arms": {arm: {rate: float(r[rate].mean()) for rate in r}
                                                            for arm, r in rates.items()}, "paired": {}}
            row = {"held out": held, "split": split, "n (k >= 2)": n, "chosen": describe(choice)}
            for arm, r in rates.items():
                row[arm] = f"{100 * r['exact'].mean():.1f} / {100 * r['recall'].mean():.1f}"
                means.setdefault(f"{split} {arm}", []).append(float(r["exact"].mean()))
            rows.append(row)
            for arm in ("LORO", "shipped"):
                cell = paired(rates[arm]["exact"], rates["hybrid (off)"]["exact"],
                              (names.index(held), SPLITS.index(split), ("LORO", "shipped").index(arm)))
                fold["splits"][split]["paired"][f"{arm} - off"] = cell
                pair_rows.append({"held out": held, "split": split, "pair": f"{arm} - off",
                                  "exact diff": f"{100 * cell['difference']:+.1f}",
                                  "95 % interval": f"{100 * cell['low']:+.1f} to {100 * cell['high']:+.1f}",
                                  "better/worse": f"{cell['better']}/{cell['worse']}"})
        results["folds"][held] = fold
    results["means over the five (exact, k >= 2)"] = {key: round(100 * float(np.mean(v)), 2)
                                                     for key, v in means.items()}
    print_table(rows, title="k >= 2: exact set / recall@k (%), the hybrid prior's greedy top k")
    print_table(pair_rows, title="paired differences in exact set (points)")
    print_table([{"mean over the five": key, "exact (%)": value}
                 for key, value in results["means over the five (exact, k >= 2)"].items()])
    print(f"chosen on all five validation splits: {describe(overall)}; shipped: {describe(shipped)}")
    settings = {"registries": {name: list(sets) for name, sets in REGISTRIES.items()},
                "grid": {"covered": COVERED, "later": LATER}, "prior": "hybrid", "first tool's lexical weight":
                HYBRID["lexical"], "criterion": "best mean exact-set rate over the registries' validation requests "
                "of k >= 2, each registry counted once; ties to recall@k, then to the prior as it was"}
    path = write_results("sweep-prior-follow", settings=settings, results=results, out=args.output)
    print(f"wrote {Path(path)}")
    return 0


# -- --kinds plain,need: chosen on plain and need-describing requests alike -----------------------------------------

Kinded = dict[str, dict[str, Answers]]  # kind -> registry -> its requests' answers


def best_kinds(answers: Kinded, kinds: tuple[str, ...], registries: list[str]) -> tuple[float, float]:
    """The setting of ``GRID_KINDS`` with the best mean, over ``registries`` (each counted once), of a registry's
    exact-set rates on its validation requests of each kind, averaged over ``kinds`` (each counted the same); ties to
    the same mean of recall@k, then to the grid's order (not following first, then the smaller settings)."""
    def mean(setting: tuple[float, float], rate: str) -> float:
        return round(float(np.mean([np.mean([answers[kind][r].rates("validation", setting)[rate].mean()
                                             for kind in kinds]) for r in registries])), 9)

    def score(setting: tuple[float, float]) -> tuple[float, float]:
        return mean(setting, "exact"), mean(setting, "recall")
    return max(GRID_KINDS, key=lambda s: (*score(s), -GRID_KINDS.index(s)))


def pair_text(cell: dict[str, float]) -> str:
    return (f"{100 * cell['difference']:+.1f} ({100 * cell['low']:+.1f} to {100 * cell['high']:+.1f}), "
            f"{cell['better']}/{cell['worse']}")


def held_out(answers: Kinded, held: str, choice: tuple[float, float], seed: tuple[int, ...],
             rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``choice`` on ``held``'s validation and test requests of each kind, paired against not following and
    ``FOLLOW`` (exact set and recall@k); a table row per kind and split appended to ``rows``."""
    shipped = (FOLLOW["covered"], FOLLOW["lexical"])
    arms = {"not following": OFF, "FOLLOW": shipped, "chosen": choice}
    out: dict[str, Any] = {}
    for k, kind in enumerate(KINDS):
        out[kind] = {}
        for s, split in enumerate(SPLITS):
            rates = {arm: answers[kind][held].rates(split, setting) for arm, setting in arms.items()}
            entry: dict[str, Any] = {"queries": len(answers[kind][held].queries[split]), "arms": {
                arm: {rate: round(float(r[rate].mean()), 4) for rate in RATES} for arm, r in rates.items()},
                "paired": {}}
            for b, baseline in enumerate(("not following", "FOLLOW")):
                entry["paired"][f"chosen - {baseline}"] = {
                    rate: paired(rates["chosen"][rate], rates[baseline][rate], (*seed, k, s, b, i))
                    for i, rate in enumerate(RATES)}
            out[kind][split] = entry
            rows.append({"held out": held, "kind": kind, "split": split, "n": entry["queries"],
                         **{arm: f"{100 * r['exact'].mean():.1f} / {100 * r['recall'].mean():.1f}"
                            for arm, r in rates.items()},
                         **{f"- {b}": pair_text(entry["paired"][f"chosen - {b}"]["exact"])
                            for b in ("not following", "FOLLOW")}})
    return out


def main_kinds(kinds: tuple[str, ...], output: str | None) -> int:
    answers: Kinded = {kind: {} for kind in KINDS}
    for name, datasets in REGISTRIES.items():
        registry = load_registry(registry_path(datasets[0]))
        ranker = Ranker(registry, embeddings_path=embeddings_path(CACHE / f"{registry.sha256[:32]}.safetensors"))
        answers["plain"][name] = Answers(Registryset(name, ranker))
        assert load_registry(registry_path(NEEDS[name])).sha256 == registry.sha256, name
        answers["need"][name] = Answers(NeedSet(name, NEEDS[name], ranker))  # Answers keeps k >= 2: here k = 2
        assert all(q.k == 2 for split in SPLITS for _, q in answers["need"][name].queries[split]), name
    names = list(REGISTRIES)
    shipped = (FOLLOW["covered"], FOLLOW["lexical"])
    assert OFF in GRID_KINDS and shipped in GRID_KINDS
    # not following is the first tool's prior at every step: its answer is the first prior's top k
    unlike = {kind: sum(int(sorted(np.argsort(-a.first[split][i], kind="stable")[:q.k].tolist())
                            != sorted(FollowUp(a.first[split][i].astype(np.float32), q.query, a.index,
                                               a.data.registry.tools, HYBRID["lexical"], OFF[1], OFF[0]).top(q.k)))
                        for a in answers[kind].values() for split in SPLITS for i, q in a.queries[split])
              for kind in KINDS}

    validation: dict[str, Any] = {}
    for setting in GRID_KINDS:
        row: dict[str, Any] = {}
        for r in names:
            exact = {kind: 100 * float(answers[kind][r].rates("validation", setting)["exact"].mean()) for kind in KINDS}
            row[r] = {**{kind: round(v, 2) for kind, v in exact.items()},
                      "criterion": round(float(np.mean([exact[kind] for kind in kinds])), 2)}
        row["mean"] = {key: round(float(np.mean([row[r][key] for r in names])), 2) for key in (*KINDS, "criterion")}
        validation[describe(setting)] = row
    print_table([{"setting": s, **{f"{r} {kind}": row[r][kind] for r in (*names, "mean") for kind in KINDS},
                  "criterion (mean)": row["mean"]["criterion"]} for s, row in validation.items()],
                title="validation exact set (%): plain k >= 2, need-describing k = 2")

    overall = best_kinds(answers, kinds, names)
    results: dict[str, Any] = {"kinds chosen on": list(kinds), "all five": describe(overall),
                               "FOLLOW": describe(shipped), "not following": describe(OFF),
                               "validation exact (%)": validation, "folds": {},
                               "not following differs from the first prior's top k (requests)": unlike}
    rows: list[dict[str, Any]] = []
    choices = {held: best_kinds(answers, kinds, [r for r in names if r != held]) for held in names}
    for h, held in enumerate(names):
        choice = choices[held]
        results["folds"][held] = {"chosen": describe(choice), "own best": describe(best_kinds(answers, kinds, [held])),
                                  **held_out(answers, held, choice, (0, h), rows)}
    means: dict[str, Any] = {}
    for kind in KINDS:
        for split in SPLITS:
            for rate in RATES:
                values = {arm: np.array([results["folds"][r][kind][split]["arms"][arm][rate] for r in names])
                          for arm in ("not following", "FOLLOW", "chosen")}
                means[f"{kind} {split} {rate}"] = {
                    **{arm: round(100 * float(v.mean()), 2) for arm, v in values.items()},
                    "chosen - not following": round(100 * float((values["chosen"] - values["not following"]).mean()),
                                                    2),
                    "chosen - FOLLOW": round(100 * float((values["chosen"] - values["FOLLOW"]).mean()), 2)}
    results["means over the five (%)"] = means
    # what would ship: the setting chosen on all five validation splits, scored on each registry's test split
    ship_rows: list[dict[str, Any]] = []
    results["all five, each registry"] = {held: held_out(answers, held, overall, (1, h), ship_rows)
                                          for h, held in enumerate(names)}
    results["all five, means over the five (%)"] = {
        f"{kind} {split} {rate}": {arm: round(100 * float(np.mean([
            results["all five, each registry"][r][kind][split]["arms"][arm][rate] for r in names])), 2)
            for arm in ("not following", "FOLLOW", "chosen")}
        for kind in KINDS for split in SPLITS for rate in RATES}
    # every registry's requests together (each request once), the folds' choices
    pooled_rows = []
    for c, (which, chosen) in enumerate((("folds' choices", choices), ("all five", dict.fromkeys(names, overall)))):
        pooled: dict[str, Any] = {}
        arms = {r: {"not following": OFF, "FOLLOW": shipped, "chosen": chosen[r]} for r in names}
        for k, kind in enumerate(KINDS):
            arrays = {arm: np.concatenate([answers[kind][r].rates("test", arms[r][arm])["exact"] for r in names])
                      for arm in ("not following", "FOLLOW", "chosen")}
            entry: dict[str, Any] = {"queries": len(arrays["chosen"]),
                                     "answered": {arm: int(a.sum()) for arm, a in arrays.items()},
                                     "paired": {f"chosen - {b}": paired(arrays["chosen"], arrays[b], (2, c, k, i))
                                                for i, b in enumerate(("not following", "FOLLOW"))}}
            pooled[kind] = entry
            pooled_rows.append({"choice": which, "kind": kind, "n": entry["queries"], **entry["answered"],
                                **{pair: pair_text(cell) for pair, cell in entry["paired"].items()}})
        results[f"pooled test exact, {which}"] = pooled

    print_table([row for row in rows if row["split"] == "test"],
                title="held out (test): exact set / recall@k (%), chosen minus each baseline in exact set (points, "
                      "95 % interval, better/worse)")
    print_table([row for row in rows if row["split"] == "validation"], title="held out (validation)")
    print_table([{"mean over the five": key, **value} for key, value in means.items()],
                title="means over the five, folds' choices (%)")
    print_table([row for row in ship_rows if row["split"] == "test"],
                title=f"the all-five choice ({describe(overall)}) on each test split")
    print_table([{"mean over the five": key, **value} for key, value in results[
        "all five, means over the five (%)"].items()], title="means over the five, the all-five choice (%)")
    print_table(pooled_rows, title="pooled test exact sets (each request once), paired (points)")
    print("folds: " + "; ".join(f"{r}: {results['folds'][r]['chosen']}" for r in names))
    print(f"chosen on all five validation splits: {describe(overall)}; FOLLOW: {describe(shipped)}")
    settings = {"registries": {name: list(sets) for name, sets in REGISTRIES.items()}, "needs": NEEDS,
                "grid": {"covered": COVERED, "later": LATER_KINDS}, "prior": "hybrid",
                "first tool's lexical weight": HYBRID["lexical"], "FOLLOW": FOLLOW, "kinds": list(kinds),
                "requests": {"plain": "k >= 2", "need": "k = 2"},
                "criterion": "best mean over the registries' validation splits (each registry counted once) of the "
                "mean exact-set rate over the kinds (each kind counted the same); ties to the same mean of recall@k, "
                "then to the grid's order (not following first, then covered and later from the smaller)",
                "answer": "greedy top k, each the best unused tool by the prior made from the tools before it"}
    path = write_results("sweep-prior-follow-kinds", settings=settings, results=results, out=output, compact=True)
    print(f"wrote {Path(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
