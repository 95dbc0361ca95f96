"""Every module's doctests run: each file of code with a doctest lies under one of pytest's ``testpaths``, which
``--doctest-modules`` collects (a module outside them once kept doctests nobody ran)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT = re.compile(r"^\s*>>> ", re.MULTILINE)
NOT_CODE = {".venv", "build", "tests", "node_modules"}


def collected_paths(pyproject: Path = REPO / "pyproject.toml") -> list[Path]:
    options = tomllib.loads(pyproject.read_text(encoding="utf-8"))["tool"]["pytest"]["ini_options"]
    assert "--doctest-modules" in options["addopts"].split()
    return [REPO / path for path in options["testpaths"]]


def modules_with_doctests() -> list[Path]:
    return [path for path in sorted(REPO.rglob("*.py"))
            if not NOT_CODE.intersection(path.relative_to(REPO).parts[:-1])
            and not any(part.startswith(".") for part in path.relative_to(REPO).parts)
            and PROMPT.search(path.read_text(encoding="utf-8"))]


def test_every_module_with_doctests_is_collected() -> None:
    found = modules_with_doctests()
    assert len(found) >= 20  # the walk itself sees the code
    roots = collected_paths()
    missed = [str(path.relative_to(REPO)) for path in found if not any(path.is_relative_to(r) for r in roots)]
    assert not missed, f"doctests never collected (add their folder to testpaths): {missed}"
