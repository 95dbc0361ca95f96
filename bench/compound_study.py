"""One tool per ask, measured as users get it: every arm on every kind of request of the five development registries,
before and after, paired.

For each registry and kind (``_study.SETS``: plainly worded, need-describing, compound written by hand, composed),
test split, two runs of ``tooltrie eval`` (the engine as ``tooltrie serve`` answers, ``--ranker auto``):

- *after*: the arms ``retrieval`` (dense), ``lexical``, ``hybrid`` (static top k), ``clauses`` (the clause-split
  baseline: each ask by the 1:1 sum of dense and lexical z-scores, one tool per ask), ``prior`` (the default prior
  alone, following the answer: what ``--ranker retrieval`` answers) and ``engine`` (the default);
- *before*: ``prior`` and ``engine`` with ``--no-asks`` (a request ranked as one ask: the release before).

Each arm's exact-set and recall@k rates, over every answer and for k = 1 and k >= 2 apart, per registry and pooled
over the five (one paired comparison of all their answers), against the default before (``tooltrie.eval.compare``);
and the default after against the clause-split baseline.

Then whether the model undoes the prior where it leads (the catalog, where the shipped adapter is fused at its own
weights): on the catalog's validation splits of each kind, the default (fused) against the prior alone, and against
the two mixed as a rule ``auto`` could follow (the prior alone for a request of several asks, ``Ranker.asks_of``;
fused for the rest), by the mean of the four kinds' exact-set rates. The evaluations are kept under
``build/compound-study/`` and read again when present.

    .venv/bin/python bench/compound_study.py [--kinds plain,need,compound,composed] [--out ...]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import REPO_DIR, eval_once, print_table, write_results
from _study import KINDS, REGISTRIES, SETS

from tooltrie.eval.compare import ArmAnswers, compare
from tooltrie.eval.results import read_results
from tooltrie.eval.scoring import answer_rates
from tooltrie.ranker import Ranker
from tooltrie.registry import CATALOG_PATH, load_registry

AFTER = ("retrieval", "lexical", "hybrid", "clauses", "prior", "engine")
BEFORE = ("prior", "engine")
# The arms as reported: (label, run, arm)
ARMS = (("dense", "after", "retrieval"), ("lexical", "after", "lexical"), ("hybrid", "after", "hybrid"),
        ("clauses", "after", "clauses"), ("prior before", "before", "prior"), ("prior after", "after", "prior"),
        ("default before", "before", "engine"), ("default after", "after", "engine"))
BASELINE = "default before"
GROUPS = {"all": lambda k: True, "k=1": lambda k: k == 1, "k>=2": lambda k: k >= 2}


def evaluations(kind: str) -> dict[str, dict[str, ArmAnswers]]:
    """Each registry's answers of ``kind`` by every reported arm (its two runs made once, kept under build/)."""
    found: dict[str, dict[str, ArmAnswers]] = {}
    for registry in REGISTRIES:
        dataset = ",".join(f"{name}:test" for name in SETS[registry][kind])
        runs = {"after": eval_once(REPO_DIR / "build" / "compound-study" / f"{registry}-{kind}-after",
                                   ["--dataset", dataset, "--arms", ",".join(AFTER), "--ranker", "auto"]),
                "before": eval_once(REPO_DIR / "build" / "compound-study" / f"{registry}-{kind}-before",
                                    ["--dataset", dataset, "--arms", ",".join(BEFORE), "--ranker", "auto",
                                     "--no-asks"])}
        results = {run: read_results(path / "results.json") for run, path in runs.items()}
        found[registry] = {label: ArmAnswers.of(results[run], arm, where=runs[run] / "results.json")
                           for label, run, arm in ARMS}
    return found


def pooled(answers: Sequence[ArmAnswers], label: str) -> ArmAnswers:
    """One arm's answers over several registries, as one set (keys made distinct by the registry)."""
    keys, predicted, kinds = [], [], []
    for registry, arm in zip(REGISTRIES, answers, strict=True):
        keys += [(f"{registry}: {query}", gold, n) for query, gold, n in arm.keys]
        predicted += arm.predicted
        kinds += arm.kinds
    return ArmAnswers(label, tuple(keys), tuple(predicted), tuple(kinds))


def only(answers: ArmAnswers, group: str) -> ArmAnswers | None:
    """``answers`` of the k ``group`` admits (None: none)."""
    chosen = [i for i, key in enumerate(answers.keys) if GROUPS[group](len(key[1]))]
    if not chosen:
        return None
    return ArmAnswers(answers.label, tuple(answers.keys[i] for i in chosen),
                      tuple(answers.predicted[i] for i in chosen),
                      tuple(answers.kinds[i] for i in chosen) if answers.kinds else ())


def against(a: ArmAnswers, b: ArmAnswers) -> dict[str, Any]:
    """``a``'s exact-set and recall rates against ``b``'s, over the same answers: difference and 95 % interval."""
    rows = [row for row in compare(a, b, rates=("exact", "recall")) if row.k is None and row.kind is None]
    return {row.rate: {"rate": round(row.a, 4), "difference": round(row.difference, 4),
                       "interval": [round(row.low, 4), round(row.high, 4)], "answers": row.answers}
            for row in rows}


def table(answers: dict[str, ArmAnswers]) -> dict[str, Any]:
    """Every arm against the default before, and the default after against the clause-split baseline, per k group."""
    result: dict[str, Any] = {}
    for group in GROUPS:
        picked = {label: only(arm, group) for label, arm in answers.items()}
        base = picked[BASELINE]
        if base is None:
            continue
        result[group] = {label: against(arm, base) for label, arm in picked.items() if arm is not None}
        after, clauses = picked["default after"], picked["clauses"]
        if after is not None and clauses is not None:
            result[group]["default after - clauses"] = against(after, clauses)
    return result


def catalog_by_kind(kinds: Sequence[str]) -> dict[str, Any]:
    """On the catalog's validation splits, per kind: exact-set rates of the default (fused), the prior alone, and the
    prior alone for requests of several asks with fused for the rest; and the three's mean over the kinds."""
    asks = Ranker(load_registry(CATALOG_PATH))  # only its splitter is used: nothing is embedded
    rates: dict[str, dict[str, float]] = {}
    for kind in kinds:
        dataset = ",".join(f"{name}:validation" for name in SETS["catalog"][kind])
        path = eval_once(REPO_DIR / "build" / "compound-study" / f"catalog-{kind}-validation",
                         ["--dataset", dataset, "--arms", "prior,engine", "--ranker", "auto"])
        answers = read_results(path / "results.json")["answers"]
        several = [bool(asks.asks_of(answer["query"], len(answer["gold"]))) for answer in answers]
        rules = {"fused": ["engine"] * len(answers), "prior": ["prior"] * len(answers),
                 "prior for several asks": ["prior" if split else "engine" for split in several]}
        rates[kind] = {"answers": len(answers), "several asks": sum(several),
                       **{rule: _exact(answers, arms) for rule, arms in rules.items()}}
    means = {rule: round(sum(rates[kind][rule] for kind in kinds) / len(kinds), 2)
             for rule in ("fused", "prior", "prior for several asks")}
    return {"validation": rates, "mean": means}


def _exact(answers: Sequence[dict[str, Any]], arms: Sequence[str]) -> float:
    """The exact-set rate, %, of each answer taken from its own arm."""
    return round(100 * sum(answer_rates(answer[arm]["predicted"], answer["gold"])["exact"]
                           for answer, arm in zip(answers, arms, strict=True)) / len(answers), 2)


def run(kinds: Sequence[str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for kind in kinds:
        found = evaluations(kind)
        results[kind] = {"per_registry": {registry: table(arms) for registry, arms in found.items()},
                         "pooled": table({label: pooled([found[r][label] for r in REGISTRIES], label)
                                          for label, _, _ in ARMS})}
    results["catalog_by_kind"] = catalog_by_kind(kinds)
    return results


def _difference(cell: dict[str, Any]) -> str:
    low, high = cell["interval"]
    return f"{100 * cell['difference']:+.1f} ({100 * low:+.1f} to {100 * high:+.1f})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    kinds = [kind.strip() for kind in args.kinds.split(",") if kind.strip()]
    results = run(kinds)
    for kind in kinds:
        rows = []
        for scope, groups in [*results[kind]["per_registry"].items(), ("pooled", results[kind]["pooled"])]:
            for group, arms in groups.items():
                rows.append({"registry": scope, "k": group, "n": arms[BASELINE]["exact"]["answers"],
                             **{label: f"{100 * arms[label]['exact']['rate']:.1f} "
                                       f"({100 * arms[label]['recall']['rate']:.0f})"
                                for label, _, _ in ARMS if label in arms},
                             "after - before": _difference(arms["default after"]["exact"]),
                             "after - clauses": _difference(arms["default after - clauses"]["exact"])})
        print_table(rows, title=f"{kind} requests (test): exact set % (recall@k %), paired differences in points")
    by_kind = results["catalog_by_kind"]
    print_table([{"kind": kind, **cells}
                 for kind, cells in [*by_kind["validation"].items(), ("mean", by_kind["mean"])]],
                title="the catalog's validation splits: exact set %, the default (fused) and the prior alone")
    path = write_results("compound_study", settings={"kinds": kinds, "after": AFTER, "before": BEFORE,
                                                     "ranker": "auto"},
                         results=results, out=args.out, compact=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
