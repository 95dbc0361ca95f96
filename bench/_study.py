"""What a leave-one-registry-out study needs, in one place: the five development registries and their labelled sets by
kind of request, the choice made on four registries and scored on the fifth, and paired differences.

A study declares its candidates and its criterion (a score of a candidate over some registries, on validation
requests) and asks :func:`choose` for each fold's choice; it scores the choice on the held-out registry's test
requests with :func:`paired`. The ranker takes the candidates' settings as values (``Ranker.prior_scores`` with a
prior's parts). Older sweeps keep their own copies of these tables; new ones use this module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tooltrie.eval.compare import bootstrap_interval, sign_test
from tooltrie.eval.datasets import LabelledQuery, load_split, registry_path
from tooltrie.registry import Registry, load_registry

RESAMPLES = 10_000
KINDS = ("plain", "need", "compound", "composed")
# Each development registry's labelled sets, by kind of request (``tooltrie.eval.datasets``; the registry is the
# first plain set's): plainly worded, need-describing, and requests that ask several things, written by hand
# (``compound``) and joined from single-tool requests (``composed``, ``eval/composed.py``).
SETS: dict[str, dict[str, tuple[str, ...]]] = {
    "catalog": {"plain": ("metatool-single", "metatool-multi"), "need": ("catalog-needs",),
                "compound": ("catalog-compound",), "composed": ("catalog-composed",)},
    "bfcl": {"plain": ("bfcl",), "need": ("bfcl-needs",), "compound": ("bfcl-compound",),
             "composed": ("bfcl-composed",)},
    "tmdb": {"plain": ("restbench-tmdb",), "need": ("tmdb-needs",), "compound": ("tmdb-compound",),
             "composed": ("tmdb-composed",)},
    "spotify": {"plain": ("restbench-spotify",), "need": ("spotify-needs",), "compound": ("spotify-compound",),
                "composed": ("spotify-composed",)},
    "toolalpaca": {"plain": ("toolalpaca",), "need": ("toolalpaca-needs",), "compound": ("toolalpaca-compound",),
                   "composed": ("toolalpaca-composed",)},
}
REGISTRIES = tuple(SETS)


def registry_file(name: str) -> Path:
    """The file of development registry ``name`` (its first plain set's)."""
    return registry_path(SETS[name]["plain"][0])


def registry_of(name: str) -> Registry:
    return load_registry(registry_file(name))


def requests(name: str, kind: str, split: str = "test") -> list[LabelledQuery]:
    """Registry ``name``'s labelled requests of ``kind`` (``KINDS``, or ``nofit``: the ones no tool serves) in
    ``split``."""
    sets = (f"{name}-nofit",) if kind == "nofit" else SETS[name][kind]
    return [query for labelled in sets for query in load_split(labelled, split)]


def choose(candidates: Sequence[str], criterion: Callable[[str, Sequence[str]], float]) -> dict[str, Any]:
    """Each registry's fold: the candidate with the best ``criterion`` over the other four (ties to the candidate
    listed first); and the choice over all five.

    >>> scores = {"a": {"catalog": 1.0}, "b": {"catalog": 0.0}}
    >>> choose(["a", "b"], lambda c, rs: sum(scores[c].get(r, 0.5) for r in rs))["all five"]
    'a'
    """
    def best(registries: Sequence[str]) -> str:
        return max(candidates, key=lambda c: (round(criterion(c, registries), 9), -list(candidates).index(c)))

    return {"folds": {held: best([r for r in REGISTRIES if r != held]) for held in REGISTRIES},
            "all five": best(REGISTRIES)}


def paired(a: npt.NDArray[Any], b: npt.NDArray[Any], seed: Sequence[int]) -> dict[str, float]:
    """``a`` against ``b``, answer by answer: the mean difference, its 95 % bootstrap interval, wins and losses."""
    low, high = bootstrap_interval(a - b, resamples=RESAMPLES, rng=np.random.default_rng(list(seed)))
    wins, losses = int((a > b).sum()), int((a < b).sum())
    return {"difference": float((a - b).mean()), "low": low, "high": high, "better": wins, "worse": losses,
            "p": sign_test(wins, losses)}


def paired_by_kind(ours: Mapping[str, Mapping[str, npt.NDArray[Any]]],
                   base: Mapping[str, Mapping[str, npt.NDArray[Any]]], labels: tuple[str, str], seed: int
                   ) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """Two arms' per-request rates (registry -> kind -> [requests]) paired: pooled over the registries per kind (each
    with both means under ``labels``: ours, base), per registry and kind, and the pooled table's rows."""
    pooled: dict[str, Any] = {}
    rows = []
    for j, kind in enumerate(KINDS):
        a = np.concatenate([ours[r][kind] for r in REGISTRIES])
        b = np.concatenate([base[r][kind] for r in REGISTRIES])
        cell = pooled[kind] = {"n": len(a), labels[1]: float(b.mean()), labels[0]: float(a.mean()),
                               **paired(a, b, (seed, j))}
        rows.append({"kind": kind, "n": cell["n"], f"{labels[1]} %": 100 * cell[labels[1]],
                     f"{labels[0]} %": 100 * cell[labels[0]], "difference": f"{100 * cell['difference']:+.2f}",
                     "95% interval": f"{100 * cell['low']:+.2f}..{100 * cell['high']:+.2f}",
                     "better/worse": f"{cell['better']}/{cell['worse']}"})
    by_registry = {r: {kind: paired(ours[r][kind], base[r][kind], (i, j)) for j, kind in enumerate(KINDS)}
                   for i, r in enumerate(REGISTRIES)}
    return pooled, by_registry, rows


__all__ = ["KINDS", "REGISTRIES", "SETS", "choose", "paired", "paired_by_kind", "registry_file", "registry_of",
           "requests"]
