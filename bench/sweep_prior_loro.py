"""Choose every constant of the retrieval prior leave one registry out (no language model): for each of the five
development registries, the lexical score's constants (BM25's k1 and b, the name / description / parameter field
weights) and the fusion's (normalisation, lexical weight) are those with the best mean exact-set rate over the
*other four* registries' validation splits; they are then scored on the fifth's validation and test splits, paired
against dense, today's lexical, a plain BM25 over name + description and today's hybrid. Prints tables and writes
JSON (machine, versions, settings, each fold's choice, per-arm rates by k, paired intervals).

    .venv/bin/python bench/sweep_prior_loro.py -o bench/results/sweep-prior-loro.json

Registries: BFCL, the MetaTool catalog (its two labelled sets, k = 1 and k = 2, as one registry), RestBench's TMDB
and Spotify, ToolAlpaca. Every registry counts the same in a mean, whatever its size. Test splits are only scored,
never chosen on.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from _common import REPO_DIR, print_table, write_results
from sweep_prior import min_max, reciprocal_ranks  # the same normalisations the first sweep tried

from tooltrie.eval.compare import RESAMPLES, bootstrap_interval, sign_test
from tooltrie.eval.datasets import LabelledQuery, load_split, registry_path
from tooltrie.eval.scoring import answer_rates
from tooltrie.lexical import BM25_PARAMETERS, FIELD_WEIGHTS, LUCENE_STOPWORDS, STOPWORDS, LexicalIndex, identifier_words
from tooltrie.ranker import HYBRID, Ranker, embeddings_path, standardized
from tooltrie.registry import load_registry
from tooltrie.registry.model import Registry

Scores = npt.NDArray[np.float32]
REGISTRIES = {"bfcl": ("bfcl",), "catalog": ("metatool-single", "metatool-multi"),
              "restbench-tmdb": ("restbench-tmdb",), "restbench-spotify": ("restbench-spotify",),
              "toolalpaca": ("toolalpaca",)}
CACHE = REPO_DIR / "build" / "sweep-prior-loro"


# -- the ways of combining the dense and the lexical scores, each one function over [queries, tools] arrays --------

NORMALISATIONS: dict[str, Callable[[Scores], Scores]] = {
    "z": standardized,  # today's: z-scores per query
    "z-sqrt": lambda lexical: standardized(np.sqrt(lexical)),  # BM25's long tail pulled in before the z-scores
    "min-max": min_max,
    "rrf": reciprocal_ranks,  # reciprocal-rank fusion, k = 60
}
FUSION_WEIGHTS = {"z": (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0, 1.5),
                  "z-sqrt": (0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0, 1.5),
                  "min-max": (0.1, 0.25, 0.5, 1.0, 2.0), "rrf": (0.25, 0.5, 1.0, 2.0, 4.0)}


def fuse(dense: Scores, lexical: Scores, normalisation: str, weight: float) -> Scores:
    """The dense score's and the lexical one's, each normalised per query, the lexical weighted ``weight``."""
    normalise = NORMALISATIONS[normalisation]
    dense_part = standardized(dense) if normalisation == "z-sqrt" else normalise(dense)
    result: Scores = dense_part + np.float32(weight) * normalise(lexical)
    return result


# -- scoring ---------------------------------------------------------------------------------------------------

def per_query_rates(scores: Scores, queries: Sequence[LabelledQuery], names: Sequence[str]) -> dict[str, Any]:
    """Each query's exact set, recall@k and top-1 (0-1 arrays) for the top k tools by ``scores`` (ties to the
    lower tool id, as ``Ranker.rank_indices``)."""
    order = np.argsort(-scores, axis=1, kind="stable")
    index = {name: i for i, name in enumerate(names)}
    exact, recall, top1 = (np.zeros(len(queries)) for _ in range(3))
    for k in sorted({q.k for q in queries}):
        rows = np.array([i for i, q in enumerate(queries) if q.k == k])
        gold = np.array([[index[name] for name in queries[i].tools] for i in rows])
        hits = (order[rows, :k, None] == gold[:, None, :]).any(axis=2).sum(axis=1)
        exact[rows], recall[rows] = hits == k, hits / k
        top1[rows] = (order[rows, :1] == gold).any(axis=1)
    return {"exact": exact, "recall": recall, "top1": top1, "top": order[:, : max(q.k for q in queries)]}


def check_rates(rates: dict[str, Any], queries: Sequence[LabelledQuery], names: Sequence[str]) -> None:
    """The vectorised rates equal ``answer_rates``'s, query by query (the harness's own scoring)."""
    for i, query in enumerate(queries):
        expected = answer_rates([names[j] for j in rates["top"][i, : query.k]], query.tools)
        assert all(expected[rate] == rates[rate][i] for rate in ("exact", "recall", "top1")), (query, expected)


# -- the scores of each registry's queries (cached under build/) -------------------------------------------------

class Registryset:
    """One registry and its validation and test queries, with the dense similarities computed once."""

    def __init__(self, name: str, ranker: Ranker) -> None:
        self.name, self.ranker = name, ranker
        self.registry: Registry = ranker.registry
        self.queries = {split: [q for dataset in REGISTRIES[name] for q in load_split(dataset, split)]
                        for split in ("validation", "test")}
        self.dense = {split: self._dense(split) for split in self.queries}
        self._lexical: dict[tuple[Any, ...], dict[str, Scores]] = {}

    def _dense(self, split: str) -> Scores:
        texts = [q.query for q in self.queries[split]]
        digest = hashlib.sha256("\0".join([self.registry.sha256, *texts]).encode()).hexdigest()[:16]
        path = CACHE / f"dense-{self.name}-{split}-{digest}.npy"
        if path.is_file():
            cached: Scores = np.load(path)
            return cached
        scores = self.ranker.similarities(texts)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, scores)
        return scores

    def lexical(self, split: str, k1: float, b: float, fields: tuple[int, int, int],
                stopwords: frozenset[str] = STOPWORDS) -> Scores:
        key = (k1, b, fields, stopwords)
        if key not in self._lexical:
            index = LexicalIndex.build(self.registry, k1=k1, b=b, fields=dict(zip(FIELD_WEIGHTS, fields, strict=True)),
                                       stopwords=stopwords)
            self._lexical[key] = {s: np.array([index.scores(q.query) for q in qs], dtype=np.float32).reshape(
                len(qs), len(self.registry)) for s, qs in self.queries.items()}
        return self._lexical[key][split]

    def plain_bm25(self, split: str) -> Scores:
        """The baseline a user would write: bm25s, its default k1 and b, over the identifier-split words of each
        tool's name and description (Lucene's stop words out, as bm25s's "en"), the query split the same way."""
        import bm25s

        documents = [[w for w in identifier_words(f"{tool.name} {tool.description}") if w not in LUCENE_STOPWORDS]
                     for tool in self.registry.tools]
        bm25 = bm25s.BM25()
        bm25.index(documents, show_progress=False)
        rows = []
        for query in self.queries[split]:
            words = [w for w in identifier_words(query.query) if w not in LUCENE_STOPWORDS and w in bm25.vocab_dict]
            rows.append(bm25.get_scores(words) if words else np.zeros(len(self.registry)))
        return np.array(rows, dtype=np.float32)


# -- the grid ----------------------------------------------------------------------------------------------------

LEXICAL_GRID = [(k1, b, (name, 1, parameters)) for k1, b, name, parameters in itertools.product(
    (0.9, 1.2, 1.5, 2.0), (0.3, 0.5, 0.75, 1.0), (1, 2, 3, 5), (1, 0))]
TODAY = (BM25_PARAMETERS["k1"], BM25_PARAMETERS["b"], tuple(FIELD_WEIGHTS.values()))


def fusion_grid() -> list[tuple[str, float]]:
    return [(normalisation, weight) for normalisation, weights in FUSION_WEIGHTS.items() for weight in weights]


def describe(setting: tuple[Any, ...]) -> str:
    k1, b, fields = setting[:3]
    text = f"k1 {k1:g}, b {b:g}, fields {'/'.join(map(str, fields))}"
    return text if len(setting) == 3 else f"{text}; {setting[3]} x {setting[4]:g}"


def sweep(sets: dict[str, Registryset]) -> dict[str, dict[tuple[Any, ...], tuple[float, float]]]:
    """Every setting's (exact, recall@k) on each registry's validation split: lexical alone (k1, b, fields) and
    fused (k1, b, fields, normalisation, weight)."""
    table: dict[str, dict[tuple[Any, ...], tuple[float, float]]] = {}
    for name, data in sets.items():
        queries, names, dense = data.queries["validation"], data.registry.names, data.dense["validation"]
        table[name] = {}
        for setting in LEXICAL_GRID:
            lexical = data.lexical("validation", *setting)
            rates = per_query_rates(lexical, queries, names)
            table[name][setting] = (rates["exact"].mean(), rates["recall"].mean())
            for way in fusion_grid():
                rates = per_query_rates(fuse(dense, lexical, *way), queries, names)
                table[name][(*setting, *way)] = (rates["exact"].mean(), rates["recall"].mean())
        print(f"swept {name}: {len(table[name])} settings", flush=True)
    return table


def best(table: dict[str, dict[tuple[Any, ...], tuple[float, float]]], registries: Sequence[str],
         fused: bool) -> tuple[Any, ...]:
    """The setting with the best mean exact-set rate over ``registries``' validation splits (then recall@k, then the
    grid's order)."""
    return best_of(table, [s for s in table[registries[0]] if (len(s) == 5) == fused], registries)


def best_of(table: dict[str, dict[tuple[Any, ...], tuple[float, float]]], settings: Sequence[tuple[Any, ...]],
            registries: Sequence[str]) -> tuple[Any, ...]:
    return max(settings, key=lambda s: (round(float(np.mean([table[r][s][0] for r in registries])), 9),
                                        round(float(np.mean([table[r][s][1] for r in registries])), 9)))


# -- the report ----------------------------------------------------------------------------------------------------

def arm_scores(data: Registryset, split: str, arm: str, choice: dict[str, tuple[Any, ...]]) -> Scores:
    dense = data.dense[split]
    if arm == "dense":
        return dense
    if arm == "lexical":
        return data.lexical(split, *TODAY)
    if arm == "plain BM25":
        return data.plain_bm25(split)
    if arm == "hybrid":
        return fuse(dense, data.lexical(split, *TODAY), "z", HYBRID["lexical"])
    if arm == "LORO lexical":
        return data.lexical(split, *choice["lexical"])
    setting = choice["prior"]
    return fuse(dense, data.lexical(split, *setting[:3]), *setting[3:])


ARMS = ("dense", "lexical", "plain BM25", "hybrid", "LORO lexical", "LORO prior")
BASELINES = ("dense", "lexical", "plain BM25", "hybrid")
GROUPS: dict[str, Callable[[int], bool]] = {"all": lambda k: True, "k=1": lambda k: k == 1, "k>=2": lambda k: k >= 2}


def paired(a: npt.NDArray[Any], b: npt.NDArray[Any], seed: Sequence[int]) -> dict[str, float]:
    low, high = bootstrap_interval(a - b, resamples=RESAMPLES, rng=np.random.default_rng(list(seed)))
    wins, losses = int((a > b).sum()), int((a < b).sum())
    return {"difference": float((a - b).mean()), "low": low, "high": high, "better": wins, "worse": losses,
            "p": sign_test(wins, losses)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", default=None, help="JSON file (default bench/results/sweep-prior-loro.json)")
    args = parser.parse_args(argv)

    sets = {}
    for name, datasets in REGISTRIES.items():
        registry = load_registry(registry_path(datasets[0]))
        kept = CACHE / f"{registry.sha256[:32]}.safetensors"
        sets[name] = Registryset(name, Ranker(registry, embeddings_path=embeddings_path(kept)))
    table = sweep(sets)
    names = list(REGISTRIES)
    folds: dict[str, dict[str, tuple[Any, ...]]] = {}
    for held in names:
        others = [r for r in names if r != held]
        folds[held] = {"lexical": best(table, others, fused=False), "prior": best(table, others, fused=True)}
    overall = {"lexical": best(table, names, fused=False), "prior": best(table, names, fused=True)}

    results: dict[str, Any] = {"folds": {}, "all five": {kind: describe(s) for kind, s in overall.items()}}
    choice_rows, rate_rows, pair_rows = [], [], []
    for held in names:
        data, choice = sets[held], folds[held]
        fold: dict[str, Any] = {"chosen": {kind: describe(s) for kind, s in choice.items()},
                                "chosen on": [r for r in names if r != held], "splits": {}}
        choice_rows.append({"held out": held, "LORO lexical": describe(choice["lexical"]),
                            "LORO prior": describe(choice["prior"]),
                            "its own best prior": describe(best(table, [held], fused=True))})
        for split in ("validation", "test"):
            queries, registry_names = data.queries[split], data.registry.names
            per_arm = {arm: per_query_rates(arm_scores(data, split, arm, choice), queries, registry_names)
                       for arm in ARMS}
            for rates in per_arm.values():
                check_rates(rates, queries, registry_names)
            ks = np.array([q.k for q in queries])
            split_result: dict[str, Any] = {"queries": len(queries), "arms": {}, "paired": {}}
            means = {arm: (per_arm[arm]["exact"].mean(), per_arm[arm]["recall"].mean()) for arm in BASELINES}
            best_baseline = max(BASELINES, key=means.__getitem__)  # the best retrieval arm a user could pick
            for arm in ARMS:
                split_result["arms"][arm] = {}
                for group, keep in GROUPS.items():
                    mask = np.array([keep(k) for k in ks])
                    if mask.any():
                        split_result["arms"][arm][group] = {
                            "queries": int(mask.sum()),
                            **{rate: float(per_arm[arm][rate][mask].mean()) for rate in ("exact", "recall", "top1")}}
                row = {"held out": held, "split": split, "arm": arm}
                for group in GROUPS:
                    cell = split_result["arms"][arm].get(group)
                    row[group] = "" if cell is None else f"{100 * cell['exact']:.1f} / {100 * cell['recall']:.1f}"
                rate_rows.append(row)
            for a, b in (("LORO prior", best_baseline), ("LORO lexical", "plain BM25"), ("LORO prior", "hybrid")):
                key = f"{a} - {b}"
                split_result["paired"][key] = {}
                for group, keep in GROUPS.items():
                    mask = np.array([keep(k) for k in ks])
                    if not mask.any():
                        continue
                    split_result["paired"][key][group] = {
                        rate: paired(per_arm[a][rate][mask], per_arm[b][rate][mask],
                                     (names.index(held), ("validation", "test").index(split), list(GROUPS).index(group),
                                      ("exact", "recall").index(rate)))
                        for rate in ("exact", "recall")}
                    cell = split_result["paired"][key][group]["exact"]
                    pair_rows.append({"held out": held, "split": split, "pair": key, "k": group,
                                      "exact diff": f"{100 * cell['difference']:+.1f}",
                                      "95 % interval": f"{100 * cell['low']:+.1f} to {100 * cell['high']:+.1f}",
                                      "better/worse": f"{cell['better']}/{cell['worse']}"})
            fold["splits"][split] = split_result
        results["folds"][held] = fold
    print_table(choice_rows, title="constants chosen on the other four registries' validation splits")
    print_table(rate_rows, title="exact set / recall@k (%)")
    print_table(pair_rows, title="paired differences in exact set (points)")
    # The weight alone: today's lexical score, z-scores, only the lexical weight chosen (each registry's best, and each
    # fold's choice over the other four): how far the best weight moves from one registry to another.
    weights = [(*TODAY, "z", w) for w in FUSION_WEIGHTS["z"]]
    by_weight = {r: {f"{s[4]:g}": round(100 * table[r][s][0], 2) for s in weights} for r in names}
    weight_rows = [{"registry": r, **by_weight[r],
                    "own best": f"{max(weights, key=lambda s, r=r: table[r][s])[4]:g}",
                    "chosen on the other four": f"{best_of(table, weights, [o for o in names if o != r])[4]:g}"}
                   for r in names]
    print_table(weight_rows, title="z dense + w z lexical (today's lexical): validation exact set (%) by w")
    results["today's lexical, z weight"] = weight_rows
    results["validation means"] = {
        describe(s): {r: [round(100 * v, 2) for v in table[r][s]] for r in names}
        for s in sorted({*overall.values(), *(c for f in folds.values() for c in f.values()), TODAY,
                         (*TODAY, "z", HYBRID["lexical"])}, key=str)}
    settings = {"registries": {name: list(sets) for name, sets in REGISTRIES.items()},
                "lexical grid": {"k1": sorted({s[0] for s in LEXICAL_GRID}), "b": sorted({s[1] for s in LEXICAL_GRID}),
                                 "fields (name/description/parameters)": sorted({s[2] for s in LEXICAL_GRID})},
                "fusion grid": FUSION_WEIGHTS, "criterion": "best mean exact-set rate over the registries' "
                "validation splits, each registry counted once; ties to the better mean recall@k",
                "resamples": RESAMPLES}
    path = write_results("sweep-prior-loro", settings=settings, results=results, out=args.output)
    print(f"wrote {Path(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
