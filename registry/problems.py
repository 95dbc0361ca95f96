"""Every problem of a registry in one report: grouped by cause, each with its place and its tool.

Loading and compiling collect :class:`Problem` records instead of stopping at the first bad entry, so a registry
with a dozen bad names is fixed in one run; :class:`RegistryProblems` carries them all (its message lists up to
``cap`` per cause and counts the rest; ``to_json`` lists every one, for CI pipelines).

>>> error = RegistryProblems([Problem("whitespace", "r.json (tools[0])", " a", "leading or trailing whitespace"),
...                           Problem("duplicate_name", "r.json (tools[2])", "b", "duplicate tool name")],
...                          source="r.json", cap=1)
>>> print(error)
r.json: 2 problems (fix them all, then compile again):
names with leading or trailing whitespace (1):
  r.json (tools[0]) ' a': leading or trailing whitespace
duplicate names (1):
  r.json (tools[2]) 'b': duplicate tool name
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tooltrie.errors import RegistryError
from tooltrie.registry.model import Tool

# Causes in the order a report lists them, with the heading of each group.
CAUSES = {
    "entry": "entries that are not a valid tool",
    "empty_name": "empty names",
    "whitespace": "names with leading or trailing whitespace",
    "line_break": "names containing a line break",
    "duplicate_name": "duplicate names",
    "separator": "names containing the separator",
    "special_token": "names containing a special token",
    "no_tokens": "names that render to no tokens",
    "round_trip": "names that do not survive decoding",
    "duplicate_path": "names that tokenize exactly like another",
    "empty_description": "empty descriptions",
}
DEFAULT_CAP = 10  # problems listed per cause; the rest are counted


@dataclass(frozen=True)
class Problem:
    """One problem: its cause (a key of ``CAUSES``), where it is (file:line or file (tools[i])), the tool's name
    (None when the entry has no usable name) and what is wrong."""

    cause: str
    where: str
    tool: str | None
    detail: str

    def line(self) -> str:
        name = "" if self.tool is None else f" {self.tool!r}"
        return f"{self.where}{name}: {self.detail}"

    @classmethod
    def of(cls, tool: Tool, cause: str, detail: str) -> Problem:
        """A problem of a loaded tool (whose ``where`` ends with its name)."""
        return cls(cause, tool.where.removesuffix(f" {tool.name!r}"), tool.name, detail)

    def to_dict(self) -> dict[str, Any]:
        return {"cause": self.cause, "where": self.where, "tool": self.tool, "detail": self.detail}


class RegistryProblems(RegistryError):
    """A registry with problems: all of them, grouped by cause; ``hint`` is advice for the whole set (e.g. a
    separator no name contains)."""

    def __init__(self, problems: Sequence[Problem], *, source: str, hint: str | None = None,
                 suggested_separator: str | None = None, cap: int = DEFAULT_CAP) -> None:
        self.problems = sorted(problems, key=lambda problem: list(CAUSES).index(problem.cause))
        self.source, self.hint, self.suggested_separator, self.cap = source, hint, suggested_separator, cap
        super().__init__(self.report())

    def by_cause(self) -> dict[str, list[Problem]]:
        groups: dict[str, list[Problem]] = {}
        for problem in self.problems:
            groups.setdefault(problem.cause, []).append(problem)
        return groups

    def report(self) -> str:
        count = len(self.problems)
        if count == 1 and self.hint is None:  # one problem reads as one line, as it always has
            return self.problems[0].line()
        lines = [f"{self.source}: {count} problem{'s' if count != 1 else ''} (fix them all, then compile again):"]
        for cause, group in self.by_cause().items():
            lines.append(f"{CAUSES[cause]} ({len(group)}):")
            lines += [f"  {problem.line()}" for problem in group[: self.cap]]
            if len(group) > self.cap:
                lines.append(f"  ... and {len(group) - self.cap} more")
        if self.hint:
            lines.append(self.hint)
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """Every problem (no cap), with counts per cause: ``tooltrie compile --format json``."""
        return {
            "error": "registry",
            "source": self.source,
            "count": len(self.problems),
            "counts": {cause: len(group) for cause, group in self.by_cause().items()},
            "problems": [problem.to_dict() for problem in self.problems],
            "suggested_separator": self.suggested_separator,
            "hint": self.hint,
        }


def raise_if_any(problems: Sequence[Problem], *, source: str) -> None:
    if problems:
        raise RegistryProblems(problems, source=source)


def kind(value: Any) -> str:
    """What a value is, for a message that says what was expected instead: ``"int 3"``, ``"nothing"``."""
    return "nothing" if value is None else f"{type(value).__name__} {value!r:.60}"
