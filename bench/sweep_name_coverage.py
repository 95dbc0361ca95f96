"""Does a bonus for covering a tool's name help the lexical score? Chosen leave one registry out (no language model).
Prints tables and writes JSON (machine, versions, settings, each fold's choice, rates, paired intervals).

    .venv/bin/python bench/sweep_name_coverage.py -o bench/results/sweep-name-coverage.json

BM25 adds up the request's words one by one; it does not see that a request holds *all* of a short name
(``get_movie_popular`` in "the most popular movie") while it holds one rare word of another (``now`` of
``get_movie_now_playing`` in "right now"). The candidate: the shipped lexical score plus ``weight * coverage``,
coverage the share of a tool's name words (stop words out) that the request holds, the weight either in BM25's own
units ("absolute") or times the request's best lexical score ("relative"), 0 the score as shipped. For each of the
five development registries, the candidate with the best mean exact-set rate over the *other four* registries'
plainly worded validation requests (as ``sweep_names_first.py``'s stage 1; ties to the better recall@k, then to the
grid's order, so to no bonus), scored on the fifth's test split, paired with the plain BM25 over name + description
and with the score as shipped.
"""

from __future__ import annotations

import argparse
import functools
import itertools
from typing import Any

import numpy as np
from _common import print_table, write_results
from sweep_names_first import Sets, best, paired_cells, rate_cells, text
from sweep_prior_loro import REGISTRIES, per_query_rates

from tooltrie.lexical import BM25_PARAMETERS, FIELD_WEIGHTS, STOPWORDS, identifier_words

FORMS = ("absolute", "relative")
GRID = [(form, weight) for form in FORMS for weight in (0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0)]
Candidate = tuple[str, float]


def label(candidate: Candidate) -> str:
    return f"{candidate[0]} {candidate[1]:g}"


@functools.cache
def coverage(sets: Sets, name: str, kind: str, split: str) -> np.ndarray:
    """[requests, tools]: the share of each tool's name words (stop words out) that the request holds."""
    data = sets.data[name][kind]
    names = [{w for w in identifier_words(tool.name) if w not in STOPWORDS} for tool in data.registry.tools]
    rows = []
    for query in data.queries[split]:
        words = {w for w in identifier_words(query.query) if w not in STOPWORDS}
        rows.append([len(words & n) / len(n) if n else 0.0 for n in names])
    return np.array(rows, dtype=np.float32)


def rates(sets: Sets, name: str, kind: str, split: str, candidate: Candidate) -> dict[str, Any]:
    data = sets.data[name][kind]
    lexical = data.lexical(split, BM25_PARAMETERS["k1"], BM25_PARAMETERS["b"], tuple(FIELD_WEIGHTS.values()),
                           STOPWORDS)
    form, weight = candidate
    scale = 1.0 if form == "absolute" else lexical.max(axis=1, keepdims=True)
    return per_query_rates(lexical + weight * scale * coverage(sets, name, kind, split), data.queries[split],
                           data.registry.names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", default=None,
                        help="JSON file (default bench/results/sweep-name-coverage.json)")
    args = parser.parse_args(argv)
    sets = Sets()
    names = sets.names
    table: dict[Candidate, dict[str, tuple[float, float]]] = {c: {} for c in GRID}
    for candidate, name in itertools.product(GRID, names):
        r = rates(sets, name, "plain", "validation", candidate)
        table[candidate][name] = (float(r["exact"].mean()), float(r["recall"].mean()))
    shipped = GRID[0]
    results: dict[str, Any] = {"validation": {label(c): {n: round(100 * table[c][n][0], 2) for n in names}
                                              for c in GRID},
                               "all five": label(best(table, names)), "folds": {}}
    rows = []
    for seed, held in enumerate(names):
        choice = best(table, [o for o in names if o != held])
        fold: dict[str, Any] = {"chosen": label(choice)}
        for kind in ("plain", "need"):
            data = sets.data[held][kind]
            arms = {"chosen": rates(sets, held, kind, "test", choice),
                    "shipped": rates(sets, held, kind, "test", shipped),
                    "plain BM25": per_query_rates(data.plain_bm25("test"), data.queries["test"], data.registry.names)}
            fold[kind] = {"rates": {arm: rate_cells(sets, held, "test", kind, r) for arm, r in arms.items()},
                          "chosen - plain BM25": paired_cells(sets, held, "test", kind, arms["chosen"],
                                                              arms["plain BM25"], seed),
                          "chosen - shipped": paired_cells(sets, held, "test", kind, arms["chosen"], arms["shipped"],
                                                           seed + 10)}
            rows.append({"held out": held, "requests": kind, "chosen": fold["chosen"],
                         **{arm: f"{100 * r['exact'].mean():.1f}" for arm, r in arms.items()},
                         "chosen - plain BM25": text(fold[kind]["chosen - plain BM25"]["all"]["exact"]),
                         "chosen - shipped": text(fold[kind]["chosen - shipped"]["all"]["exact"])})
        results["folds"][held] = fold
    print_table([{"candidate": label(c), **{n: f"{100 * table[c][n][0]:.1f}" for n in names},
                  "mean": f"{100 * np.mean([table[c][n][0] for n in names]):.2f}"} for c in GRID],
                title="plain validation requests, lexical arm, exact set %")
    print_table(rows, title="held out, test, exact set % (chosen on the other four)")
    settings = {"registries": {name: list(datasets) for name, datasets in REGISTRIES.items()}, "grid": GRID,
                "lexical": {**BM25_PARAMETERS, "fields": FIELD_WEIGHTS}}
    write_results("sweep-name-coverage", settings=settings, results=results, out=args.output, compact=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
