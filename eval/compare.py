"""Two evaluated arms, answer by answer: is the difference between them more than noise?

Two arms scored on the same queries (two arms of one ``results.json``, or of two runs) agree on most answers; only
the answers they score differently say which is better. ``compare`` pairs the answers (by query and gold tools, in
order, so a repeated query pairs with its own repetition) and reports, per rate (exact set, top-1, recall@k), overall,
per k and, where the answers are of several kinds (plainly worded and need-describing requests), per kind:

- both arms' means and the difference;
- a 95 % interval for the difference from a paired bootstrap (seeded per row: the same files give the same
  interval, whichever other rows are asked for);
- how many answers each arm scores higher, and the exact two-sided sign test's p-value on those counts (McNemar's
  exact test for the 0/1 rates): the chance of a split at least this uneven between two arms that are equally good;
- with a margin (``--margin``), how many answers like these an interval needs to show A no more than the margin below B.

On a test split of a few hundred queries a few points are often within noise; this says which, and how many queries
it would take.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tooltrie.eval.results import ANSWERS_FILE, RESULTS_FILE, ResultsError, read_results
from tooltrie.eval.scoring import answer_rates

RATES = {"exact": "exact set", "top1": "top-1", "recall": "recall@k"}
RESAMPLES = 10_000


@dataclass(frozen=True)
class ArmAnswers:
    """One arm's answers in one results file, keyed so two runs over the same queries pair up."""

    label: str
    keys: tuple[tuple[str, tuple[str, ...], int], ...]  # (query, gold tools, occurrence of this pair)
    predicted: tuple[tuple[str, ...], ...]
    kinds: tuple[str, ...] = ()  # per answer: "plain", "need" (the answer's "kind"; "plain" where it has none)

    @classmethod
    def load(cls, spec: str | Path) -> ArmAnswers:
        """``RESULTS:ARM``, RESULTS a ``results.json`` or the directory ``tooltrie eval -o`` wrote it in; ``:ARM``
        may be left out where the file holds one arm."""
        path, arm = _split_spec(str(spec))
        results = read_results(path)
        arms = list(results.get("arms", {}))
        if arm is None:
            if len(arms) != 1:
                raise ResultsError(f"{path}: holds the arms {', '.join(arms)}; name one as {spec}:ARM")
            arm = arms[0]
        return cls.of(results, arm, where=path)

    @classmethod
    def of(cls, results: dict[str, Any], arm: str, *, where: Path) -> ArmAnswers:
        """``arm``'s answers in a results object (``where``: the file it came from, for messages and the label)."""
        arms = list(results.get("arms", {}))
        if arm not in arms:
            raise ResultsError(f"{where}: no arm {arm!r}; it holds {', '.join(arms) or 'none'}")
        keys, predicted, kinds = [], [], []
        seen: dict[tuple[str, tuple[str, ...]], int] = {}
        for number, answer in enumerate(results.get("answers", []), 1):
            try:
                pair = (str(answer["query"]), tuple(answer["gold"]))
                names = tuple(answer[arm]["predicted"])
            except (KeyError, TypeError) as exc:
                raise ResultsError(f"{where}: answer {number} lacks {exc} for arm {arm!r}") from None
            seen[pair] = seen.get(pair, 0) + 1
            keys.append((*pair, seen[pair]))
            predicted.append(names)
            kinds.append(str(answer.get("kind") or "plain"))
        if not keys:
            raise ResultsError(f"{where}: holds no answers (none in the {ANSWERS_FILE} beside it)")
        return cls(f"{where.parent if where.name == RESULTS_FILE else where}:{arm}", tuple(keys), tuple(predicted),
                   tuple(kinds))

    def rates(self, rate: str) -> dict[tuple[str, tuple[str, ...], int], float]:
        return {key: answer_rates(names, key[1])[rate] for key, names in zip(self.keys, self.predicted, strict=True)}


@dataclass(frozen=True)
class Difference:
    """One rate of arm A against arm B over the same answers (rates as fractions, 0-1)."""

    rate: str
    k: int | None  # None: every answer
    answers: int
    a: float
    b: float
    low: float  # the difference's 95 % bootstrap interval
    high: float
    a_better: int
    b_better: int
    p: float  # the exact two-sided sign test on a_better against b_better
    kind: str | None = None  # a row of one kind's answers ("plain", "need"); None: every kind
    spread: float = 0.0  # the standard deviation of the per-answer differences

    @property
    def difference(self) -> float:
        return self.a - self.b

    def answers_needed(self, margin: float) -> int | None:
        return answers_needed(self.difference, self.spread, margin)


def compare(a: ArmAnswers, b: ArmAnswers, *, rates: Sequence[str] = tuple(RATES), resamples: int = RESAMPLES,
            seed: int = 0) -> list[Difference]:
    """Each rate over every answer, then per k where the answers have more than one k, then per kind (plain,
    need) where they have more than one kind (the kinds of ``a``'s answers)."""
    unknown = [rate for rate in rates if rate not in RATES]
    if unknown:
        raise ResultsError(f"unknown rate {unknown[0]!r}; choose from {', '.join(RATES)}")
    if set(a.keys) != set(b.keys):
        only_a, only_b = len(set(a.keys) - set(b.keys)), len(set(b.keys) - set(a.keys))
        raise ResultsError(f"{a.label} and {b.label} answered different queries ({only_a} only in the first, "
                           f"{only_b} only in the second): compare arms evaluated on the same split")
    keys = sorted(a.keys)
    ks = sorted({len(key[1]) for key in keys})
    groups: list[tuple[int | None, str | None, list[Any]]] = [(None, None, keys)]
    if len(ks) > 1:
        groups += [(k, None, [key for key in keys if len(key[1]) == k]) for k in ks]
    kind_of = dict(zip(a.keys, a.kinds, strict=True)) if a.kinds else {}
    kinds = sorted(set(kind_of.values()))
    if len(kinds) > 1:
        groups += [(None, kind, [key for key in keys if kind_of[key] == kind]) for kind in kinds]
    rows = []
    for rate in rates:
        values_a, values_b = a.rates(rate), b.rates(rate)
        for k, kind, chosen in groups:
            x = np.array([values_a[key] for key in chosen])
            y = np.array([values_b[key] for key in chosen])
            # a row's own generator, whatever else is asked
            entropy = [seed, list(RATES).index(rate), k or 0, *([1 + kinds.index(kind)] if kind else [])]
            low, high = bootstrap_interval(x - y, resamples=resamples, rng=np.random.default_rng(entropy))
            wins, losses = int((x > y).sum()), int((x < y).sum())
            rows.append(Difference(rate, k, len(chosen), float(x.mean()), float(y.mean()), low, high, wins, losses,
                                   sign_test(wins, losses), kind, spread(x - y)))
    return rows


def spread(differences: np.ndarray) -> float:
    """The sample standard deviation of per-answer differences (0 for fewer than two)."""
    return float(differences.std(ddof=1)) if len(differences) > 1 else 0.0


def answers_needed(difference: float, spread: float, margin: float, *, z: float = 1.96) -> int | None:
    """How many answers a 95 % interval needs for its lower bound to reach ``-margin``, were more answers to differ
    as these do (the same mean ``difference`` and standard deviation ``spread`` of the per-answer differences; the
    normal approximation the bootstrap follows): the n where ``difference - z * spread / sqrt(n) >= -margin``. None
    where the difference is at or below ``-margin``: no number of such answers shows it.

    >>> answers_needed(0.0, 0.35, 0.02), answers_needed(0.03, 0.3, 0.02), answers_needed(-0.02, 0.14, 0.02)
    (1177, 139, None)
    """
    if difference + margin <= 0:
        return None
    return max(1, math.ceil((z * spread / (difference + margin)) ** 2 - 1e-9))  # - 1e-9: an exact square is enough


def sign_test(wins: int, losses: int) -> float:
    """The exact two-sided sign test: the chance, with each differing answer a fair coin, of a split at least as
    uneven as ``wins`` against ``losses`` (ties left out, as McNemar's test leaves out agreeing answers).

    >>> sign_test(0, 0), sign_test(3, 3), round(sign_test(9, 1), 4)
    (1.0, 1.0, 0.0215)
    """
    n = wins + losses
    tail = sum(math.comb(n, i) for i in range(min(wins, losses) + 1))
    return min(1.0, 2 * tail / (1 << n))  # exact: Python divides the integers before rounding


def bootstrap_interval(differences: np.ndarray, *, resamples: int, rng: np.random.Generator,
                       level: float = 0.95) -> tuple[float, float]:
    """The percentile interval of the mean of ``differences`` resampled with replacement (paired: one draw moves
    both arms' answers to a query together)."""
    n = len(differences)
    means = np.empty(resamples)
    chunk = max(1, 4_000_000 // n)  # bounds the index array's memory for large splits
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        means[start:stop] = differences[rng.integers(0, n, size=(stop - start, n))].mean(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def markdown(a: ArmAnswers, b: ArmAnswers, rows: Sequence[Difference], *, margin: float | None = None) -> str:
    """A table of ``rows``, rates in % and differences in points; with ``margin`` (a fraction), the answers an
    interval needs to show A no more than ``margin`` below B ("never" where the difference is that far below)."""
    needed = f" answers for A >= B - {100 * margin:g} |" if margin is not None else ""
    header = "| rate | k or kind | answers | A | B | A - B | 95 % interval | A better | B better | sign test p |"
    lines = [f"A: {a.label}", f"B: {b.label}", "", header + needed,
             "|---|---|---:|---:|---:|---:|---|---:|---:|---:|" + ("---:|" if needed else "")]
    for row in rows:
        group = row.kind or ("all" if row.k is None else row.k)
        line = (f"| {RATES[row.rate]} | {group} | {row.answers} | {row.a:.1%} | "
                f"{row.b:.1%} | {100 * row.difference:+.1f} | {100 * row.low:+.1f} to {100 * row.high:+.1f} | "
                f"{row.a_better} | {row.b_better} | {row.p:.3g} |")
        if margin is not None:
            count = row.answers_needed(margin)
            line += f" {'never' if count is None else count} |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def as_json(a: ArmAnswers, b: ArmAnswers, rows: Sequence[Difference], *,
            margin: float | None = None) -> dict[str, Any]:
    differences = [asdict(row) | ({"answers_needed": row.answers_needed(margin)} if margin is not None else {})
                   for row in rows]
    return {"a": a.label, "b": b.label, **({"margin": margin} if margin is not None else {}),
            "differences": differences}


def _split_spec(spec: str) -> tuple[Path, str | None]:
    """``RESULTS:ARM`` -> (results.json's path, ARM); a path that exists as given has no arm."""
    path, arm = Path(spec), None
    if not path.exists() and ":" in spec:
        head, _, arm = spec.rpartition(":")
        path = Path(head)
    if path.is_dir():
        path = path / RESULTS_FILE
    if not path.is_file():
        raise ResultsError(f"{spec}: no results file (give RESULTS:ARM, RESULTS a results.json or the directory "
                           f"`tooltrie eval -o` wrote)")
    return path, arm or None
