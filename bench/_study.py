"""What a leave-one-registry-out study needs, in one place: the five development registries and their labelled sets by
kind of request, the choice made on four registries and scored on the fifth, and paired differences.

A study declares its candidates and its criterion (a score of a candidate over some registries, on validation
requests) and asks :func:`choose` for each fold's choice; it scores the choice on the held-out registry's test
requests with :func:`paired`. The ranker takes the candidates' settings as values (``Ranker.prior_scores`` with a
prior's parts). Older sweeps keep their own copies of these tables; new ones use this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from tooltrie.eval.compare import bootstrap_interval, sign_test

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


__all__ = ["KINDS", "REGISTRIES", "SETS", "choose", "paired"]
