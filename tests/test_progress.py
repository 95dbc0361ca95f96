"""What a long step shows: a line each tenth of the way off a terminal, a bar on one, nothing when quiet."""

from __future__ import annotations

import io

from tooltrie.progress import LINES, Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_a_line_each_tenth_of_the_way_and_one_at_the_end() -> None:
    out = io.StringIO()
    show = Progress("embedding", unit="tool", stream=out)
    for done in range(1, 1001):  # a step that reports every item prints no more than one reporting every chunk
        show(done, 1000)
    show(1000, 1000)  # reported again at the end: printed once
    lines = out.getvalue().splitlines()
    assert len(lines) == LINES
    assert lines[0].startswith("embedding: 100/1,000 tools (") and "s left)" in lines[0]
    assert lines[-1].startswith("embedding: 1,000/1,000 tools (") and " in " in lines[-1] and "left" not in lines[-1]


def test_a_step_of_few_reports_prints_the_tenths_it_crosses() -> None:
    out = io.StringIO()
    show = Progress("eval", unit="answer", stream=out)
    for done in (4, 8, 10):  # 40 %, 80 %, done
        show(done, 10)
    assert [line.split(" (")[0] for line in out.getvalue().splitlines()] == [
        "eval: 4/10 answers", "eval: 8/10 answers", "eval: 10/10 answers"]


def test_quiet_prints_nothing_and_an_empty_step_nothing_either() -> None:
    out = io.StringIO()
    Progress("eval", quiet=True, stream=out)(4, 10)
    Progress("eval", stream=out)(0, 0)
    assert out.getvalue() == ""


def test_on_a_terminal_a_bar() -> None:
    out = Terminal()
    show = Progress("embedding", unit="tool", stream=out)
    show(5, 10)
    show(10, 10)
    assert "embedding" in out.getvalue() and "10/10" in out.getvalue() and "\r" in out.getvalue()
