"""Label-free fusions of the retrieval prior's two scores whose constant should not need to move from one registry to
another, each chosen leave one registry out (no language model). Today's prior is ``z(dense) + 0.15 z(lexical)``
(``tooltrie.ranker.HYBRID``); ``bench/sweep_prior_loro.py`` found that the best (normalisation, lexical weight)
moves by registry. Here each candidate fusion is one function over the [queries, tools] dense and lexical (today's
BM25) scores, with one or two constants on a small grid:

- ``z sum``: today's form, ``z(dense) + w z(lexical)``, the reference family;
- ``confidence, top-2 gap`` and ``confidence, top-10 gap``: each score weighed per query by how decisive it is, its
  top z-score less the second's (or less the mean of its top 10): ``z(dense) + w (c_lex / c_dense)^g z(lexical)``;
- ``name coverage``: a weight the registry sets from its own text, ``w = a r``, ``r`` the mean share of a tool's
  description words (stop words out) that its name holds;
- ``self-retrieval``: a weight the registry sets from its own text, ``w = m w_self``: each tool's description cut in
  halves, the first half a pseudo-request and the second the tool's description in a copy of the registry (so the
  request cannot match its own words), ``w_self`` the lexical weight of the z sum whose mean reciprocal rank of the
  source tool is best;
- ``top-N z``: each score standardised over its top N tools, the rest held at the N-th (BM25's tail of zeros no
  longer sets the scale): ``zN(dense) + w zN(lexical)``;
- ``CombMNZ``: ``(minmax(dense) + w minmax(lexical))`` times the number of the two lists that hold the tool in their
  top K (a lexical score of 0 holds none);
- ``softmax mixture``: ``softmax(z(dense) / T) + w softmax(z(lexical) / T)``, each score a per-query distribution.

For each held-out registry, the setting with the best mean exact-set rate over the *other four* validation splits
(each registry counted once; ties to recall@k, then the grid's order) is scored on its test split, paired against
today's hybrid (k = 1 and k >= 2 apart); each registry's own best setting and the band of the main constant within
one answer of it show how flat the optimum is. The need-describing sets of the same registries are scored with the
fold's choice, never chosen on. Prints tables and writes one line of JSON.

    .venv/bin/python bench/sweep_fusion_adaptive.py -o bench/results/sweep-fusion-adaptive.json

Test splits are only scored, never chosen on. Dense similarities are cached under build/sweep-prior-loro.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt
from _common import print_table, write_results
from sweep_prior import min_max
from sweep_prior_loro import CACHE, GROUPS, REGISTRIES, TODAY, Registryset, check_rates, paired, per_query_rates

from tooltrie.eval.compare import RESAMPLES
from tooltrie.eval.datasets import LabelledQuery, load_split, registry_path
from tooltrie.lexical import STOPWORDS, LexicalIndex, identifier_words
from tooltrie.ranker import HYBRID, Ranker, embeddings_path, standardized
from tooltrie.registry import load_registry
from tooltrie.registry.model import Registry

Scores = npt.NDArray[np.float32]
NEEDS = {"bfcl": "bfcl-needs", "catalog": "catalog-needs", "restbench-tmdb": "tmdb-needs",
         "restbench-spotify": "spotify-needs", "toolalpaca": "toolalpaca-needs"}
SPLITS = ("validation", "test")
WEIGHTS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0, 1.5, 2.0)
FLOOR = 0.05  # the least dense confidence a ratio divides by (z units): a fixed guard, not swept
HALF_MIN_WORDS = 4  # a description of fewer words makes no pseudo-request


# -- what a fusion sees: one registry's scores of some requests, and what the registry says of itself --------------

@dataclass(frozen=True)
class Context:
    """What a registry decides at index time from its own text (no labels)."""

    coverage: float  # the mean share of a tool's description words that its name holds
    self_weight: float  # the lexical weight whose z sum retrieves the pseudo-requests' source tools best


class Pair:
    """The dense and lexical scores of some requests, with what the fusions derive from them computed once."""

    def __init__(self, dense: Scores, lexical: Scores, context: Context) -> None:
        self.dense, self.lexical, self.context = dense, lexical, context
        self._memo: dict[tuple[Any, ...], Any] = {}

    def memo(self, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    @cached_property
    def z(self) -> tuple[Scores, Scores]:
        return standardized(self.dense), standardized(self.lexical)

    @cached_property
    def sorted_z(self) -> tuple[Scores, Scores]:
        """Each row's ten best z-scores, best first."""
        return tuple(-np.sort(-z, axis=1)[:, :10] for z in self.z)  # type: ignore[return-value]

    def confidence(self, kind: str) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """Per query, how decisive each score is: its top z-score less the second's (``gap``) or less the mean of
        its top ten (``top10``); 0 for a row with no spread (a request no tool's word matches)."""
        def one(top: Scores) -> npt.NDArray[np.float64]:
            second = top[:, 1] if kind == "gap" else top.mean(axis=1)
            return np.asarray(top[:, 0], np.float64) - second
        dense, lexical = (one(top) for top in self.sorted_z)
        return dense, lexical

    def ratio(self, kind: str) -> npt.NDArray[np.float64]:
        def make() -> npt.NDArray[np.float64]:
            dense, lexical = self.confidence(kind)
            return lexical / np.maximum(dense, FLOOR)
        result: npt.NDArray[np.float64] = self.memo(("ratio", kind), make)
        return result


# -- the candidate fusions -----------------------------------------------------------------------------------------

def top_z(scores: Scores, n: int) -> Scores:
    """Each row standardised over its top ``n`` values, every value below the n-th raised to it."""
    n = min(n, scores.shape[1])
    values = np.asarray(scores, np.float64)
    top = -np.sort(-values, axis=1)[:, :n]
    mean, spread = top.mean(axis=1, keepdims=True), top.std(axis=1, keepdims=True)
    clipped = np.maximum(values, top[:, -1:])
    result: Scores = np.divide(clipped - mean, spread, out=np.zeros_like(values),
                               where=spread > 1e-12).astype(np.float32)
    return result


def in_top(scores: Scores, k: int, positive: bool) -> npt.NDArray[np.float64]:
    """1 where a tool is among the row's top ``k`` (ties to the lower id; with ``positive``, only a score > 0)."""
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    held = np.zeros(scores.shape, np.float64)
    np.put_along_axis(held, order, 1.0, axis=1)
    return held * (scores > 0) if positive else held


def softmax(z: Scores, temperature: float) -> npt.NDArray[np.float64]:
    logits = np.asarray(z, np.float64) / temperature
    exp = np.exp(logits - logits.max(axis=1, keepdims=True))
    result: npt.NDArray[np.float64] = exp / exp.sum(axis=1, keepdims=True)
    return result


def z_sum(pair: Pair, setting: tuple[float, ...]) -> Scores:
    (w,) = setting
    dense, lexical = pair.z
    return dense + np.float32(w) * lexical


def confident(kind: str) -> Callable[[Pair, tuple[float, ...]], Scores]:
    def fuse(pair: Pair, setting: tuple[float, ...]) -> Scores:
        w, power = setting
        dense, lexical = pair.z
        weight = (w * pair.ratio(kind) ** power).astype(np.float32)[:, None]
        return dense + weight * lexical
    return fuse


def name_coverage(pair: Pair, setting: tuple[float, ...]) -> Scores:
    (a,) = setting
    return z_sum(pair, (a * pair.context.coverage,))


def self_retrieval(pair: Pair, setting: tuple[float, ...]) -> Scores:
    (m,) = setting
    return z_sum(pair, (m * pair.context.self_weight,))


def top_n(pair: Pair, setting: tuple[float, ...]) -> Scores:
    w, n = setting
    dense, lexical = pair.memo(("top z", n), lambda: (top_z(pair.dense, int(n)), top_z(pair.lexical, int(n))))
    result: Scores = dense + np.float32(w) * lexical
    return result


def comb_mnz(pair: Pair, setting: tuple[float, ...]) -> Scores:
    w, k = setting
    dense, lexical, count = pair.memo(("mnz", k), lambda: (
        min_max(pair.dense), min_max(pair.lexical),
        in_top(pair.dense, int(k), False) + in_top(pair.lexical, int(k), True)))
    result: Scores = ((dense + w * lexical) * count).astype(np.float32)
    return result


def softmax_mixture(pair: Pair, setting: tuple[float, ...]) -> Scores:
    w, temperature = setting
    dense, lexical = pair.memo(("softmax", temperature), lambda: tuple(softmax(z, temperature) for z in pair.z))
    result: Scores = (dense + w * lexical).astype(np.float32)
    return result


@dataclass(frozen=True)
class Family:
    """A candidate fusion: its function, its constants' names and grid (the first the main one, swept for bands)."""

    name: str
    definition: str
    constants: tuple[str, ...]
    grid: tuple[tuple[float, ...], ...]
    fuse: Callable[[Pair, tuple[float, ...]], Scores]

    def describe(self, setting: tuple[float, ...]) -> str:
        return ", ".join(f"{c} {v:g}" for c, v in zip(self.constants, setting, strict=True))


def grid(*axes: Sequence[float]) -> tuple[tuple[float, ...], ...]:
    """The settings, the main constant varying fastest within each value of the second."""
    if len(axes) == 1:
        return tuple((v,) for v in axes[0])
    return tuple((v, s) for s in axes[1] for v in axes[0])


FAMILIES = (
    Family("z sum", "z(dense) + w z(lexical): today's form (the hybrid is w 0.15)", ("w",), grid(WEIGHTS), z_sum),
    Family("confidence, top-2 gap", "z(dense) + w (c_lex / max(c_dense, 0.05))^g z(lexical), c = top-1 z less "
           "top-2 z, per query", ("w", "g"), grid(WEIGHTS, (0.25, 0.5, 1.0)), confident("gap")),
    Family("confidence, top-10 gap", "z(dense) + w (c_lex / max(c_dense, 0.05))^g z(lexical), c = top-1 z less the "
           "mean of the top-10 z, per query", ("w", "g"), grid(WEIGHTS, (0.25, 0.5, 1.0)), confident("top10")),
    Family("name coverage", "z sum at w = a r, r the registry's mean share of description words its name holds",
           ("a",), grid((0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)), name_coverage),
    Family("self-retrieval", "z sum at w = m w_self, w_self the weight that best retrieves the registry's own "
           "half-description pseudo-requests", ("m",), grid((0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)),
           self_retrieval),
    Family("top-N z", "zN(dense) + w zN(lexical), each standardised over its top N tools, the rest at the N-th",
           ("w", "N"), grid(WEIGHTS, (5, 10, 20)), top_n),
    Family("CombMNZ", "(minmax(dense) + w minmax(lexical)) x the number of the two lists with the tool in their "
           "top K (lexical > 0)", ("w", "K"), grid((0.25, 0.5, 0.75, 1.0, 1.5, 2.0), (5, 10)), comb_mnz),
    Family("softmax mixture", "softmax(z(dense) / T) + w softmax(z(lexical) / T)", ("w", "T"),
           grid((0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0), (0.5, 1.0, 2.0)), softmax_mixture),
)
HYBRID_ARM = "hybrid (z, 0.15)"


def hybrid(pair: Pair) -> Scores:
    return HYBRID["dense"] * standardized(pair.dense) + np.float32(HYBRID["lexical"]) * standardized(pair.lexical)


# -- what each registry decides from its own text -------------------------------------------------------------------

def content_words(text: str) -> list[str]:
    return [w for w in identifier_words(text) if w not in STOPWORDS]


def coverage(registry: Registry) -> float:
    shares = []
    for tool in registry.tools:
        name, words = set(content_words(tool.name)), content_words(tool.description)
        if words:
            shares.append(np.mean([w in name for w in words]))
    return float(np.mean(shares)) if shares else 0.0


def halved(registry: Registry) -> tuple[Registry, list[str], list[int]]:
    """The registry with each description of ``HALF_MIN_WORDS`` words or more cut to its second half, the first
    halves (the pseudo-requests) and their source tools."""
    tools, queries, sources = [], [], []
    for i, tool in enumerate(registry.tools):
        words = tool.description.split()
        if len(words) >= HALF_MIN_WORDS:
            half = len(words) // 2
            queries.append(" ".join(words[:half]))
            sources.append(i)
            tool = replace(tool, description=" ".join(words[half:]))
        tools.append(tool)
    return Registry(f"{registry.name} (halved)", tuple(tools), registry.source), queries, sources


def cached_similarities(ranker: Ranker, name: str, texts: list[str]) -> Scores:
    digest = hashlib.sha256("\0".join([ranker.registry.sha256, *texts]).encode()).hexdigest()[:16]
    path = CACHE / f"dense-{name}-{digest}.npy"
    if path.is_file():
        cached: Scores = np.load(path)
        return cached
    scores = ranker.similarities(texts)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, scores)
    return scores


def self_retrieval_curve(name: str, registry: Registry) -> dict[str, Any]:
    """The pseudo-requests' mean reciprocal rank and top-1 of their source tool under the z sum at each weight."""
    copy, queries, sources = halved(registry)
    kept = CACHE / f"{copy.sha256[:32]}.safetensors"
    dense = cached_similarities(Ranker(copy, embeddings_path=embeddings_path(kept)), f"{name}-halves", queries)
    index = LexicalIndex.build(copy)
    lexical = np.array([index.scores(q) for q in queries], np.float32).reshape(len(queries), len(copy))
    pair = Pair(dense, lexical, Context(0.0, 0.0))
    rows = np.arange(len(sources))
    curve = {}
    for w in WEIGHTS:
        scores = z_sum(pair, (w,))
        rank = (scores > scores[rows, sources][:, None]).sum(axis=1)  # tools strictly above the source
        curve[w] = (float(np.mean(1.0 / (1 + rank))), float(np.mean(rank == 0)))
    chosen = max(WEIGHTS, key=lambda w: (round(curve[w][0], 9), -WEIGHTS.index(w)))
    return {"pseudo-requests": len(queries), "weight": chosen,
            "mrr": {f"{w:g}": round(v[0], 4) for w, v in curve.items()},
            "top1": {f"{w:g}": round(v[1], 4) for w, v in curve.items()}}


# -- the requests of each registry ----------------------------------------------------------------------------------

class NeedSet(Registryset):
    """A registry's need-describing validation and test requests (``eval/data/needs``), its dense scores cached."""

    def __init__(self, name: str, dataset: str, ranker: Ranker) -> None:  # not Registryset's: it loads the plain sets
        self.name, self.ranker, self.registry = f"needs-{name}", ranker, ranker.registry
        self.queries = {split: list(load_split(dataset, split)) for split in SPLITS}
        self.dense = {split: self._dense(split) for split in SPLITS}
        self._lexical: dict[tuple[Any, ...], dict[str, Scores]] = {}


@dataclass
class Registrydata:
    name: str
    context: Context
    plain: dict[str, Pair]
    needs: dict[str, Pair]
    queries: dict[str, list[LabelledQuery]]
    need_queries: dict[str, list[LabelledQuery]]
    names: list[str]


def load(name: str, curves: dict[str, Any]) -> Registrydata:
    datasets = REGISTRIES[name]
    registry = load_registry(registry_path(datasets[0]))
    ranker = Ranker(registry, embeddings_path=embeddings_path(CACHE / f"{registry.sha256[:32]}.safetensors"))
    plain = Registryset(name, ranker)
    needs = NeedSet(name, NEEDS[name], ranker)
    assert load_registry(registry_path(NEEDS[name])).sha256 == registry.sha256, name
    curves[name] = self_retrieval_curve(name, registry)
    context = Context(coverage(registry), curves[name]["weight"])
    index = LexicalIndex.build(registry)  # today's
    needs_lexical = {s: np.array([index.scores(q.query) for q in needs.queries[s]], np.float32).reshape(
        len(needs.queries[s]), len(registry)) for s in SPLITS}
    return Registrydata(
        name, context,
        {s: Pair(plain.dense[s], plain.lexical(s, *TODAY), context) for s in SPLITS},
        {s: Pair(needs.dense[s], needs_lexical[s], context) for s in SPLITS},
        plain.queries, needs.queries, registry.names)


# -- choosing and scoring ---------------------------------------------------------------------------------------------

Table = dict[str, dict[tuple[float, ...], tuple[float, float, int]]]  # registry -> setting -> exact, recall, hits


def sweep(family: Family, data: dict[str, Registrydata]) -> Table:
    table: Table = {}
    for name, d in data.items():
        queries = d.queries["validation"]
        table[name] = {}
        for setting in family.grid:
            rates = per_query_rates(family.fuse(d.plain["validation"], setting), queries, d.names)
            table[name][setting] = (float(rates["exact"].mean()), float(rates["recall"].mean()),
                                    int(rates["exact"].sum()))
    return table


def best(family: Family, table: Table, registries: Sequence[str]) -> tuple[float, ...]:
    """The best mean exact-set rate over ``registries``' validation splits, each counted once; ties to recall@k, then
    to the grid's order."""
    def key(setting: tuple[float, ...]) -> tuple[float, float, int]:
        return (round(float(np.mean([table[r][setting][0] for r in registries])), 9),
                round(float(np.mean([table[r][setting][1] for r in registries])), 9), -family.grid.index(setting))
    return max(family.grid, key=key)


def band(family: Family, table: Table, registry: str, second: float | None) -> list[float]:
    """The main constant's values (the second held at ``second``) whose validation exact sets are within one answer
    of the best of them."""
    settings = [s for s in family.grid if second is None or s[1] == second]
    top = max(table[registry][s][2] for s in settings)
    return [s[0] for s in settings if table[registry][s][2] >= top - 1]


def effective_weight(family: Family, setting: tuple[float, ...], pair: Pair) -> float | None:
    """The lexical weight the setting gives the z-scores on these requests (the median over them, where it moves)."""
    if family.fuse is z_sum:
        return setting[0]
    if family.name == "name coverage":
        return setting[0] * pair.context.coverage
    if family.name == "self-retrieval":
        return setting[0] * pair.context.self_weight
    if family.name.startswith("confidence"):
        kind = "gap" if "top-2" in family.name else "top10"
        return float(np.median(setting[0] * pair.ratio(kind) ** setting[1]))
    return None


def group_rates(rates: dict[str, Any], ks: Sequence[int]) -> dict[str, Any]:
    out = {}
    for group, keep in GROUPS.items():
        mask = np.array([keep(k) for k in ks])
        if mask.any():
            out[group] = {"queries": int(mask.sum()), **{r: round(float(rates[r][mask].mean()), 5)
                                                         for r in ("exact", "recall")}}
    return out


def group_pairs(a: dict[str, Any], b: dict[str, Any], ks: Sequence[int], seed: list[int]) -> dict[str, Any]:
    """Paired differences (``a`` minus ``b``) by group of k: exact sets, and recall@k where k >= 2 (for k = 1 it is
    the exact set)."""
    out = {}
    for g, (group, keep) in enumerate(GROUPS.items()):
        mask = np.array([keep(k) for k in ks])
        if mask.any():
            out[group] = {rate: {key: round(value, 5) if isinstance(value, float) else value for key, value in
                                 paired(a[rate][mask], b[rate][mask], (*seed, g, r)).items()}
                          for r, rate in enumerate(("exact", "recall") if group == "k>=2" else ("exact",))}
    return out


def span(values: list[float]) -> str:
    return f"{values[0]:g}" if len(values) == 1 else f"{values[0]:g}-{values[-1]:g} ({len(values)})"


def cell(rates: dict[str, Any], group: str) -> str:
    value = rates.get(group)
    if value is None:
        return ""
    if group == "k=1":
        return f"{100 * value['exact']:.1f}"
    return f"{100 * value['exact']:.1f} / {100 * value['recall']:.1f}"


def pair_cell(pairs: dict[str, Any], group: str) -> str:
    value = pairs.get(group)
    if value is None:
        return ""
    e = value["exact"]
    return (f"{100 * e['difference']:+.1f} ({100 * e['low']:+.1f} to {100 * e['high']:+.1f}) "
            f"{e['better']}/{e['worse']}")


SHORT = {"bfcl": "BFCL", "catalog": "catalog", "restbench-tmdb": "TMDB", "restbench-spotify": "Spotify",
         "toolalpaca": "ToolAlpaca"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", default=None,
                        help="JSON file (default bench/results/sweep-fusion-adaptive.json)")
    args = parser.parse_args(argv)
    began = time.perf_counter()

    curves: dict[str, Any] = {}
    data = {name: load(name, curves) for name in REGISTRIES}
    names = list(REGISTRIES)
    print(f"loaded the five registries in {time.perf_counter() - began:.0f} s", flush=True)
    context_rows = [{"registry": SHORT[n], "name coverage r": round(data[n].context.coverage, 3),
                     "pseudo-requests": curves[n]["pseudo-requests"], "w_self": f"{curves[n]['weight']:g}",
                     "MRR at w_self": curves[n]["mrr"][f"{curves[n]['weight']:g}"],
                     "MRR at 0.15": curves[n]["mrr"]["0.15"],
                     "top-1 at w_self": curves[n]["top1"][f"{curves[n]['weight']:g}"]} for n in names]
    print_table(context_rows, title="what each registry decides from its own text (no labels)")
    print_table([{"registry": SHORT[n], **curves[n]["mrr"]} for n in names],
                title="self-retrieval: the pseudo-requests' mean reciprocal rank of their source tool, by lexical "
                "weight")

    results: dict[str, Any] = {"registries": {SHORT[n]: {"name coverage": round(data[n].context.coverage, 4),
                                                         "self-retrieval": curves[n]} for n in names},
                               HYBRID_ARM: {SHORT[n]: {} for n in names}, "families": {}}
    # today's hybrid on every split, and each family's held-out answers
    answers: dict[tuple[str, str, str], dict[str, Any]] = {}
    for n in names:
        d = data[n]
        for split in SPLITS:
            for kind, pairs, queries in (("plain", d.plain, d.queries), ("needs", d.needs, d.need_queries)):
                rates = per_query_rates(hybrid(pairs[split]), queries[split], d.names)
                check_rates(rates, queries[split], d.names)
                answers[(n, kind, split)] = rates
                results[HYBRID_ARM][SHORT[n]][f"{kind} {split}"] = group_rates(rates, [q.k for q in queries[split]])
    choice_rows, test_rows, pair_rows, flat_rows, need_rows, weight_rows = [], [], [], [], [], []
    for n in names:
        ks = np.array([q.k for q in data[n].queries["test"]])
        for group in ("k=1", "k>=2"):
            test_rows.append({"registry": SHORT[n], "k": group, "n": int(sum(GROUPS[group](k) for k in ks)),
                              HYBRID_ARM: cell(group_rates(answers[(n, "plain", "test")], ks), group)})
    for f, family in enumerate(FAMILIES):
        table = sweep(family, data)
        folds = {n: best(family, table, [r for r in names if r != n]) for n in names}
        overall = best(family, table, names)
        own = {n: best(family, table, [n]) for n in names}
        second = overall[1] if len(family.constants) > 1 else None
        result: dict[str, Any] = {
            "definition": family.definition,
            "all five": family.describe(overall), "folds": {}, "own best": {}, "bands": {},
            "validation exact (%)": {SHORT[n]: {family.describe(s): round(100 * table[n][s][0], 2)
                                                for s in family.grid} for n in names}}
        choice_rows.append({"family": family.name, **{SHORT[n]: family.describe(folds[n]) for n in names},
                            "all five": family.describe(overall)})
        bands = {}
        regrets = []
        for i, n in enumerate(names):
            d, chosen = data[n], folds[n]
            bands[n] = band(family, table, n, second)
            regret = 100 * (table[n][own[n]][0] - table[n][chosen][0])
            regrets.append(regret)
            result["own best"][SHORT[n]] = {"setting": family.describe(own[n]),
                                            "validation exact (%)": round(100 * table[n][own[n]][0], 2),
                                            "at the fold's choice (%)": round(100 * table[n][chosen][0], 2)}
            result["bands"][SHORT[n]] = bands[n]
            fold: dict[str, Any] = {"chosen": family.describe(chosen),
                                    "effective lexical weight (validation median)": effective_weight(
                                        family, chosen, d.plain["validation"]), "splits": {}}
            for kind, pairs, queries in (("plain", d.plain, d.queries), ("needs", d.needs, d.need_queries)):
                for split in SPLITS:
                    rates = per_query_rates(family.fuse(pairs[split], chosen), queries[split], d.names)
                    check_rates(rates, queries[split], d.names)
                    base = answers[(n, kind, split)]
                    ks = np.array([q.k for q in queries[split]])
                    seed = [f, i, ("plain", "needs").index(kind), SPLITS.index(split)]
                    fold["splits"][f"{kind} {split}"] = {
                        "rates": group_rates(rates, ks),
                        "minus hybrid": group_pairs(rates, base, ks, seed)}
                    here = fold["splits"][f"{kind} {split}"]
                    if kind == "plain" and split == "test":
                        for row in test_rows:
                            if row["registry"] == SHORT[n]:
                                row[family.name] = cell(here["rates"], row["k"])
                        pair_rows.append({"family": family.name, "held out": SHORT[n],
                                          "chosen": family.describe(chosen),
                                          **{f"{group} diff (95 % interval) better/worse": pair_cell(
                                              here["minus hybrid"], group) for group in ("k=1", "k>=2", "all")}})
                    if kind == "needs":
                        need_rows.append({"family": family.name, "registry": SHORT[n], "split": split,
                                          "hybrid": cell(results[HYBRID_ARM][SHORT[n]][f"needs {split}"], "all"),
                                          "fused": cell(here["rates"], "all"),
                                          "exact diff (95 % interval) better/worse": pair_cell(
                                              here["minus hybrid"], "all")})
            result["folds"][SHORT[n]] = fold
        common = sorted(set.intersection(*(set(b) for b in bands.values())))
        result["bands in common"] = common
        result["mean validation regret of the fold's choice (points)"] = round(float(np.mean(regrets)), 2)
        flat_rows.append({"family": family.name, "main": family.constants[0] + (
                              "" if second is None else f" ({family.constants[1]} {second:g})"),
                          **{SHORT[n]: f"{family.describe(own[n])}; {span(bands[n])}" for n in names},
                          "in common": ",".join(f"{v:g}" for v in common) or "none",
                          "mean regret": round(float(np.mean(regrets)), 1)})
        weight_rows.append({"family": family.name, **{SHORT[n]: "" if (w := result["folds"][SHORT[n]][
            "effective lexical weight (validation median)"]) is None else f"{w:.3g}" for n in names}})
        result["band note"] = ("the main constant's values within one validation answer of the registry's best, the "
                               f"second constant at the all-five choice ({second:g})" if second is not None else
                               "the constant's values within one validation answer of the registry's best")
        results["families"][family.name] = result
        print(f"swept {family.name}: {len(family.grid)} settings ({time.perf_counter() - began:.0f} s)", flush=True)

    # the hybrid's test rates in the plain table, each registry counted once in a mean
    means = {}
    for arm in (HYBRID_ARM, *(fam.name for fam in FAMILIES)):
        values = []
        for n in names:
            if arm == HYBRID_ARM:
                values.append(float(answers[(n, "plain", "test")]["exact"].mean()))
            else:
                values.append(results["families"][arm]["folds"][SHORT[n]]["splits"]["plain test"]["rates"]["all"][
                    "exact"])
        means[arm] = round(100 * float(np.mean(values)), 2)
    results["test exact, mean over the five (%)"] = means
    needs_means = {}
    for split in SPLITS:
        for arm in (HYBRID_ARM, *(fam.name for fam in FAMILIES)):
            values = []
            for n in names:
                if arm == HYBRID_ARM:
                    values.append(float(answers[(n, "needs", split)]["exact"].mean()))
                else:
                    values.append(results["families"][arm]["folds"][SHORT[n]]["splits"][f"needs {split}"]["rates"][
                        "all"]["exact"])
            needs_means[f"{split} {arm}"] = round(100 * float(np.mean(values)), 2)
    results["needs exact, mean over the five (%)"] = needs_means

    print_table(choice_rows, title="constants chosen on the other four registries' validation splits")
    print_table(test_rows, title="test splits, held out: exact set (k = 1) or exact set / recall@k (k >= 2), %")
    print_table([{"arm": arm, "mean test exact (%)": value} for arm, value in means.items()],
                title="test exact set, all k, mean over the five registries (each counted once)")
    print_table(pair_rows, title="test splits: held-out choice minus today's hybrid, exact set (points)")
    print_table(flat_rows, title="each registry's own best setting (validation); the main constant's values within "
                "one answer of its best (the second constant at the all-five choice), those in common to all five; "
                "mean regret of the fold's choice on the held-out validation split (points)")
    print_table(weight_rows, title="the lexical z-scores' weight at each fold's choice (median over the held-out "
                "validation requests, where it moves)")
    print_table(need_rows, title="need-describing sets (never chosen on), the fold's choice: exact set / recall@k, "
                "all k (%)")
    print_table([{"arm": key, "mean exact (%)": value} for key, value in needs_means.items()],
                title="need-describing sets, exact set, mean over the five")

    elapsed = time.perf_counter() - began
    results["seconds"] = round(elapsed, 1)
    settings = {"registries": {name: list(sets) for name, sets in REGISTRIES.items()},
                "needs": NEEDS, "lexical": "today's (BM25 k1, b and field weights at their defaults)",
                "weights": WEIGHTS, "confidence floor": FLOOR, "pseudo-request least words": HALF_MIN_WORDS,
                "criterion": "best mean exact-set rate over the other four registries' validation splits, each "
                "registry counted once; ties to the better mean recall@k, then the grid's order",
                "baseline": f"z(dense) + {HYBRID['lexical']:g} z(lexical)", "resamples": RESAMPLES}
    path = write_results("sweep-fusion-adaptive", settings=settings, results=results, out=args.output, compact=True)
    print(f"wrote {path} ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
