"""Scoring through the contract's ``parse``, on hand-made answers: valid, repeated, hallucinated, wrong count, empty."""

from __future__ import annotations

import pytest

from tooltrie.compiler import Contract
from tooltrie.eval.scoring import score, summarize

NAMES = {"NewsTool", "FinanceTool", "WeatherTool", "MapTool"}
GOLD = ("NewsTool", "FinanceTool")

# (answer text, gold, exact, recall, precision, top1, valid, hallucinated, repeated, wrong_count)
ANSWERS = [
    ("NewsTool, FinanceTool", GOLD, True, 1.0, 1.0, True, True, False, False, False),
    ("FinanceTool, NewsTool", GOLD, True, 1.0, 1.0, True, True, False, False, False),  # order free
    ("NewsTool, WeatherTool", GOLD, False, 0.5, 0.5, True, True, False, False, False),
    ("WeatherTool, NewsTool", GOLD, False, 0.5, 0.5, False, True, False, False, False),
    ("NewsTool, NewsTool", GOLD, False, 0.5, 1.0, True, False, False, True, False),  # repeated
    ("NewsTool, StockTool", GOLD, False, 0.5, 0.5, True, False, True, False, False),  # hallucinated
    ("NewsTool", GOLD, False, 0.5, 1.0, True, False, False, False, True),  # too few
    ("NewsTool, FinanceTool, MapTool", GOLD, False, 1.0, 2 / 3, True, False, False, False, True),  # too many
    ("", GOLD, False, 0.0, 0.0, False, False, False, False, True),  # empty
    ("NewsTool,FinanceTool", GOLD, False, 0.0, 0.0, False, False, True, False, True),  # not the separator
    ("I would use NewsTool.", ("NewsTool",), False, 0.0, 0.0, False, False, True, False, False),  # prose
    ("MapTool", ("MapTool",), True, 1.0, 1.0, True, True, False, False, False),
]


@pytest.mark.parametrize(("text", "gold", "exact", "recall", "precision", "top1", "valid", "hallucinated",
                          "repeated", "wrong_count"), ANSWERS)
def test_score_hand_made_answer(text: str, gold: tuple[str, ...], exact: bool, recall: float, precision: float,
                                top1: bool, valid: bool, hallucinated: bool, repeated: bool,
                                wrong_count: bool) -> None:
    outcome = score(text, gold, names=NAMES, contract=Contract())
    assert (outcome.exact, outcome.top1, outcome.valid, outcome.hallucinated, outcome.repeated,
            outcome.wrong_count) == (exact, top1, valid, hallucinated, repeated, wrong_count)
    assert outcome.recall == pytest.approx(recall)
    assert outcome.precision == pytest.approx(precision)


def test_stop_text_is_dropped_and_the_separator_is_the_contracts() -> None:
    outcome = score("NewsTool | FinanceTool<|im_end|>", GOLD, names=NAMES, contract=Contract(separator=" | "),
                    stop_text="<|im_end|>")
    assert outcome.predicted == GOLD and outcome.valid


def test_summarize_rates_and_latency() -> None:
    outcomes = [score(text, gold, names=NAMES, contract=Contract()) for text, gold, *_ in ANSWERS]
    summary = summarize(outcomes, [float(i) for i in range(1, 11)] + [100.0, 200.0])
    n = len(ANSWERS)
    assert summary["answers"] == n
    assert summary["valid"] == pytest.approx(sum(row[6] for row in ANSWERS) / n)
    assert summary["exact"] == pytest.approx(3 / n)
    assert summary["repeated"] == pytest.approx(1 / n)
    assert summary["hallucinated"] == pytest.approx(3 / n)
    assert summary["latency_median_ms"] == pytest.approx(6.5)
    assert summary["latency_p90_ms"] == pytest.approx(10 + 0.9 * 90)  # numpy's linear interpolation
    assert summarize([], [])["exact"] is None


@pytest.mark.parametrize(("text", "gold"), [("NewsTool, NewsTool", ("NewsTool",)),  # the gold set, twice
                                            ("NewsTool, FinanceTool, NewsTool", GOLD)])  # the gold set and a repeat
def test_an_answer_that_repeats_a_gold_tool_is_not_exact(text: str, gold: tuple[str, ...]) -> None:
    outcome = score(text, gold, names=NAMES, contract=Contract())
    assert (outcome.exact, outcome.recall, outcome.top1, outcome.valid, outcome.repeated) == (False, 1.0, True, False,
                                                                                              True)
