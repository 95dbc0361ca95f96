"""Scoring an answer through the contract's ``parse``, and the metrics over many answers.

Every backend hands back the answer as text; it is split with ``Contract.parse`` (the one rule every arm is scored
by, so a constrained arm gets no credit the text does not carry) and compared with the gold tools:

- **valid**: exactly k names, each a registry tool, none repeated (what the trie guarantees);
- **exact**: k names whose set is the gold set (order free; a repeat or an extra name is not exact);
- **recall@k**: gold tools among the first k names / gold tools; **precision**: right names / names given;
- **top-1**: the first name is a gold tool;
- **hallucinated**: some name is not in the registry; **repeated**: some name occurs twice; **wrong count**: not k
  names (an empty answer counts here).

>>> from tooltrie.compiler import Contract
>>> outcome = score("NewsTool, NewsTool", ("NewsTool", "FinanceTool"), names={"NewsTool", "FinanceTool"},
...                 contract=Contract())
>>> outcome.valid, outcome.repeated, outcome.recall, outcome.precision
(False, True, 0.5, 1.0)
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tooltrie.compiler.contract import Contract

RATE_METRICS = ("exact", "recall", "precision", "top1", "valid", "hallucinated", "repeated", "wrong_count")


@dataclass(frozen=True)
class Outcome:
    """One answer, scored."""

    gold: tuple[str, ...]
    predicted: tuple[str, ...]
    exact: bool
    recall: float
    precision: float
    top1: bool
    valid: bool
    hallucinated: bool
    repeated: bool
    wrong_count: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def score(text: str, gold: Sequence[str], *, names: Collection[str], contract: Contract,
          stop_text: str | None = None) -> Outcome:
    """Score one answer's text against its gold tools; ``k`` is the number of gold tools."""
    predicted = tuple(contract.parse(text, stop_text=stop_text))
    k, gold_set = len(gold), set(gold)
    hits = [name in gold_set for name in predicted]
    hallucinated = any(name not in names for name in predicted)
    repeated = len(set(predicted)) != len(predicted)
    wrong_count = len(predicted) != k
    rates = answer_rates(predicted, gold)
    return Outcome(
        gold=tuple(gold),
        predicted=predicted,
        exact=bool(rates["exact"]),
        recall=rates["recall"],
        precision=sum(hits) / len(predicted) if predicted else 0.0,
        top1=bool(rates["top1"]),
        valid=not (hallucinated or repeated or wrong_count),
        hallucinated=hallucinated,
        repeated=repeated,
        wrong_count=wrong_count,
    )


def answer_rates(predicted: Sequence[str], gold: Sequence[str]) -> dict[str, float]:
    """The rates that rank one answer against its gold tools: ``exact``, ``recall`` (@k) and ``top1``, as 0-1.

    >>> answer_rates(["b", "a", "c"], ["a", "c"])
    {'exact': 0.0, 'recall': 0.5, 'top1': 0.0}
    """
    k, gold_set = len(gold), set(gold)
    return {"exact": float(len(predicted) == k and set(predicted) == gold_set),  # k names, the gold set: distinct
            "recall": len(set(predicted[:k]) & gold_set) / k,
            "top1": float(bool(predicted) and predicted[0] in gold_set)}


def summarize(outcomes: Sequence[Outcome], latencies_ms: Sequence[float]) -> dict[str, float | int | None]:
    """Mean of each rate over the answers, and the latency's median and 90th percentile (ms per answer).

    >>> from tooltrie.compiler import Contract
    >>> good = score("a", ("a",), names={"a", "b"}, contract=Contract())
    >>> bad = score("c", ("a",), names={"a", "b"}, contract=Contract())
    >>> summary = summarize([good, bad], [10.0, 30.0])
    >>> summary["exact"], summary["valid"], summary["hallucinated"], summary["latency_median_ms"]
    (0.5, 0.5, 0.5, 20.0)
    """
    summary: dict[str, float | int | None] = {"answers": len(outcomes)}
    for metric in RATE_METRICS:
        values = [float(getattr(outcome, metric)) for outcome in outcomes]
        summary[metric] = sum(values) / len(values) if values else None
    summary["latency_median_ms"] = statistics.median(latencies_ms) if latencies_ms else None
    summary["latency_p90_ms"] = _percentile(latencies_ms, 0.9) if latencies_ms else None
    return summary


def _percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (NumPy's default)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
