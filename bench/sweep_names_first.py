"""Choose the lexical score that reads names first, then the hybrid's weight over it, leave one registry out (no
language model). Prints tables and writes JSON (machine, versions, settings, each fold's choice, rates, paired
intervals).

    .venv/bin/python bench/sweep_names_first.py -o bench/results/sweep-names-first.json

1. **The lexical score** (``LexicalIndex.build``'s k1, b, the name's weight and the stop words; description and
   parameters count once each, so a name's word weighs as much as or more than theirs, never less): for each of the
   five development registries, the setting with the best mean exact-set rate over the *other four* registries'
   plainly worded validation requests (what word matching is for), scored on the fifth, paired against a plain BM25
   over name + description (bm25s's defaults, Lucene's stop words) and the lexical score before (``PREVIOUS``).
2. **The hybrid's weight** over that fold's lexical score (``z(dense) + w z(lexical)``): the weight with the best mean
   over the other four registries of the mean of two exact-set rates on their validation splits, plainly worded
   requests and need-describing ones (``NEEDS``), each kind counting the same; scored on the fifth, paired against
   the hybrid before (the previous lexical score at 0.15).

The setting chosen on all five together is what ships (``tooltrie.lexical``, ``tooltrie.ranker.HYBRID``). Every
registry counts the same in a mean; ties go to the better mean recall@k, then to the grid's order. Test splits are
scored, never chosen on.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
from _common import print_table, write_results
from sweep_fusion_adaptive import NEEDS, NeedSet
from sweep_prior_loro import CACHE, REGISTRIES, Registryset, fuse, paired, per_query_rates

from tooltrie.eval.compare import RESAMPLES
from tooltrie.eval.datasets import registry_path
from tooltrie.lexical import CONVERSATIONAL_STOPWORDS, LUCENE_STOPWORDS
from tooltrie.ranker import Ranker, embeddings_path
from tooltrie.registry import load_registry

# The stop-word lists a fold may choose: Lucene's (bm25s's "en"), or with the conversational words added. Not longer
# lists such as NLTK's (bm25s's "en_plus"): they leave out "off", "up", "down", "now", words that name what a tool does.
STOP_LISTS = {"Lucene": LUCENE_STOPWORDS, "Lucene + conversational": LUCENE_STOPWORDS | CONVERSATIONAL_STOPWORDS}
Setting = tuple[float, float, tuple[int, int, int], str]  # k1, b, name / description / parameter weights, stop words
PREVIOUS: Setting = (3.0, 0.5, (3, 1, 1), "Lucene")  # the lexical score before: names first, Lucene's stop words
PREVIOUS_WEIGHT = 0.15
LEXICAL_GRID: list[Setting] = [(k1, b, (name, 1, 1), stop) for k1, b, name, stop in itertools.product(
    (0.9, 1.2, 1.5, 2.0, 3.0, 4.0, 6.0), (0.3, 0.5, 0.75, 1.0), (1, 2, 3, 5, 8), STOP_LISTS)]
WEIGHTS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.7, 1.0)
KINDS = ("plain", "need")
SPLITS = ("validation", "test")
GROUPS = {"all": lambda k: True, "k=1": lambda k: k == 1, "k>=2": lambda k: k >= 2}
Table = dict[Any, dict[str, tuple[float, float]]]  # setting -> registry -> (exact, recall@k)


def describe(setting: Setting) -> str:
    k1, b, fields, stop = setting
    return f"k1 {k1:g}, b {b:g}, name {fields[0]}, {stop}"


def best(table: Table, registries: Sequence[str]) -> Any:
    """The setting with the best mean exact set over ``registries`` (then recall@k, then the grid's order)."""
    return max(table, key=lambda s: (round(float(np.mean([table[s][r][0] for r in registries])), 9),
                                     round(float(np.mean([table[s][r][1] for r in registries])), 9)))


class Sets:
    """Each registry's plain and need-describing requests, dense scores cached under build/."""

    def __init__(self) -> None:
        self.data: dict[str, dict[str, Registryset]] = {}
        for name, datasets in REGISTRIES.items():
            registry = load_registry(registry_path(datasets[0]))
            ranker = Ranker(registry, embeddings_path=embeddings_path(CACHE / f"{registry.sha256[:32]}.safetensors"))
            self.data[name] = {"plain": Registryset(name, ranker), "need": NeedSet(name, NEEDS[name], ranker)}
        self.names = list(self.data)

    def rates(self, kind: str, name: str, split: str, lexical: Setting, weight: float | None = None,
              arm: str | None = None) -> dict[str, Any]:
        """Per-request exact / recall@k of the lexical score (``weight`` None), the hybrid over it, or a baseline
        ``arm`` ("plain BM25", "dense")."""
        data = self.data[name][kind]
        if arm == "plain BM25":
            scores = data.plain_bm25(split)
        elif arm == "dense":
            scores = data.dense[split]
        else:
            k1, b, fields, stop = lexical
            scores = data.lexical(split, k1, b, fields, STOP_LISTS[stop])
            if weight is not None:
                scores = fuse(data.dense[split], scores, "z", weight)
        return per_query_rates(scores, data.queries[split], data.registry.names)

    def ks(self, kind: str, name: str, split: str) -> np.ndarray:
        return np.array([q.k for q in self.data[name][kind].queries[split]])


def validation_tables(sets: Sets) -> tuple[Table, dict[Setting, Table]]:
    """The lexical grid on plain validation requests; for each lexical setting a fold may choose, each weight's mean of
    the two kinds."""
    lexical: Table = {s: {} for s in LEXICAL_GRID}
    for setting, name in itertools.product(LEXICAL_GRID, sets.names):
        rates = sets.rates("plain", name, "validation", setting)
        lexical[setting][name] = (rates["exact"].mean(), rates["recall"].mean())
    chosen = {best(lexical, [o for o in sets.names if o != held]) for held in sets.names} | {best(lexical, sets.names)}
    hybrid: dict[Setting, Table] = {}
    for setting in chosen:
        hybrid[setting] = {w: {} for w in WEIGHTS}
        for weight, name in itertools.product(WEIGHTS, sets.names):
            per_kind = [sets.rates(kind, name, "validation", setting, weight) for kind in KINDS]
            hybrid[setting][weight][name] = tuple(float(np.mean([r[rate].mean() for r in per_kind]))
                                                  for rate in ("exact", "recall"))
    return lexical, hybrid


def paired_cells(sets: Sets, held: str, split: str, kind: str, a: dict[str, Any], b: dict[str, Any],
                 seed: int) -> dict[str, Any]:
    ks = sets.ks(kind, held, split)
    cells = {}
    for group, keep in GROUPS.items():
        mask = np.array([keep(k) for k in ks])
        if mask.any():
            cells[group] = {"queries": int(mask.sum()),
                            **{rate: paired(a[rate][mask], b[rate][mask], (seed, list(GROUPS).index(group), i))
                               for i, rate in enumerate(("exact", "recall"))}}
    return cells


def rate_cells(sets: Sets, held: str, split: str, kind: str, rates: dict[str, Any]) -> dict[str, Any]:
    ks = sets.ks(kind, held, split)
    return {group: [round(100 * float(rates[rate][mask].mean()), 2) for rate in ("exact", "recall")]
            for group, keep in GROUPS.items() if (mask := np.array([keep(k) for k in ks])).any()}


def text(cell: dict[str, Any]) -> str:
    return (f"{100 * cell['difference']:+.1f} ({100 * cell['low']:+.1f} to {100 * cell['high']:+.1f}), "
            f"{cell['better']} / {cell['worse']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", default=None, help="JSON file (default bench/results/sweep-names-first.json)")
    args = parser.parse_args(argv)
    sets = Sets()
    lexical, hybrid = validation_tables(sets)
    names = sets.names
    results: dict[str, Any] = {"folds": {}}
    choice_rows, lexical_rows, hybrid_rows = [], [], []
    for seed, held in enumerate([*names, "all five"]):
        others = [o for o in names if o != held]
        lexical_choice = best(lexical, others)
        weight = best(hybrid[lexical_choice], others)
        means = [100 * np.mean([table[o][0] for o in others]) for table in (lexical[lexical_choice],
                                                                             hybrid[lexical_choice][weight])]
        choice_rows.append({"held out": held, "lexical": describe(lexical_choice), "hybrid weight": f"{weight:g}",
                            "validation mean (others)": f"{means[0]:.1f} / {means[1]:.1f}"})
        if held == "all five":
            results["all five"] = {"lexical": describe(lexical_choice), "k1": lexical_choice[0],
                                   "b": lexical_choice[1], "fields": lexical_choice[2], "stop words": lexical_choice[3],
                                   "hybrid weight": weight}
            continue
        fold: dict[str, Any] = {"lexical": describe(lexical_choice), "hybrid weight": weight, "splits": {}}
        for split in SPLITS:
            plain = {arm: sets.rates("plain", held, split, lexical_choice if arm == "chosen" else PREVIOUS,
                                     arm=arm if arm in ("plain BM25", "dense") else None)
                     for arm in ("chosen", "previous", "plain BM25", "dense")}
            cell: dict[str, Any] = {"lexical": {arm: rate_cells(sets, held, split, "plain", r)
                                                for arm, r in plain.items()},
                                    "lexical - plain BM25": paired_cells(sets, held, split, "plain", plain["chosen"],
                                                                         plain["plain BM25"], seed),
                                    "lexical - previous": paired_cells(sets, held, split, "plain", plain["chosen"],
                                                                       plain["previous"], seed + 10)}
            lexical_rows.append({"held out": held, "split": split,
                                 **{arm: f"{100 * r['exact'].mean():.1f}" for arm, r in plain.items()},
                                 "chosen - plain BM25": text(cell["lexical - plain BM25"]["all"]["exact"])})
            for kind in KINDS:
                arms = {"hybrid": sets.rates(kind, held, split, lexical_choice, weight),
                        "previous hybrid": sets.rates(kind, held, split, PREVIOUS, PREVIOUS_WEIGHT),
                        "dense": sets.rates(kind, held, split, PREVIOUS, arm="dense")}
                cell[kind] = {"hybrid": {arm: rate_cells(sets, held, split, kind, r) for arm, r in arms.items()},
                              "hybrid - previous": paired_cells(sets, held, split, kind, arms["hybrid"],
                                                                arms["previous hybrid"], seed + 20)}
                hybrid_rows.append({"held out": held, "split": split, "requests": kind,
                                    **{arm: f"{100 * r['exact'].mean():.1f}" for arm, r in arms.items()},
                                    "hybrid - previous": text(cell[kind]["hybrid - previous"]["all"]["exact"])})
            fold["splits"][split] = cell
        results["folds"][held] = fold
    print_table(choice_rows, title="chosen on the other four (validation mean exact %: lexical / hybrid)")
    print_table(lexical_rows, title="lexical score, plain requests, exact set %")
    print_table(hybrid_rows, title="hybrid, exact set %")
    results["validation"] = {
        "lexical": {describe(s): {r: [round(100 * v, 2) for v in lexical[s][r]] for r in names} for s in LEXICAL_GRID},
        "hybrid": {describe(s): {f"{w:g}": {r: [round(100 * v, 2) for v in cells[r]] for r in names}
                                 for w, cells in table.items()} for s, table in hybrid.items()}}
    settings = {"registries": {name: list(datasets) for name, datasets in REGISTRIES.items()}, "needs": NEEDS,
                "lexical grid": {"k1": sorted({s[0] for s in LEXICAL_GRID}), "b": sorted({s[1] for s in LEXICAL_GRID}),
                                 "name weight": sorted({s[2][0] for s in LEXICAL_GRID}), "description": 1,
                                 "parameters": 1, "stop words": {n: sorted(w) for n, w in STOP_LISTS.items()}},
                "weights": WEIGHTS, "previous": {"lexical": describe(PREVIOUS), "hybrid weight": PREVIOUS_WEIGHT},
                "criterion": {"lexical": "mean exact set over the other four's plain validation requests",
                              "hybrid": "mean over the other four of the mean of the plain and need-describing "
                                        "validation exact-set rates"},
                "ties": "better mean recall@k, then the grid's order", "resamples": RESAMPLES}
    path = write_results("sweep-names-first", settings=settings, results=results, out=args.output, compact=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
