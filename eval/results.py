"""An evaluation's results on disk: ``results.json`` (settings, machine, each arm's scores) and, beside it,
``answers.jsonl`` (one line per query: the query, its gold tools, and each arm's answer).

Per-query data is one line per query so that a committed run stays small (a few hundred lines, not ten thousand)
and a diff between two runs shows the answers that changed. ``read_results`` gives back the object the harness
built, answers included; it also reads the first format (version 1: the answers inside ``results.json``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tooltrie.errors import TooltrieError
from tooltrie.eval.files import json_text, relative_paths, write_text

FORMAT = "tooltrie-eval"
VERSION = 2
RESULTS_FILE = "results.json"
ANSWERS_FILE = "answers.jsonl"


class ResultsError(TooltrieError, ValueError):
    """An evaluation's results cannot be read, or cannot be paired with another's."""


def write_results_files(results: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write ``results`` (the harness's object) as ``results.json`` and ``answers.jsonl`` in ``out_dir``, each
    atomically, paths inside the working directory made relative; returns the two paths."""
    out = Path(out_dir)
    results = relative_paths(results)
    answers = results.pop("answers", [])
    paths = {"results": out / RESULTS_FILE, "answers": out / ANSWERS_FILE}
    write_text(paths["answers"], "".join(json.dumps(a, ensure_ascii=False, allow_nan=False) + "\n" for a in answers))
    write_text(paths["results"], json_text({**results, "version": VERSION}))
    return paths


def read_results(path: str | Path) -> dict[str, Any]:
    """The results object in ``path`` (a ``results.json``), with its ``answers`` read from ``answers.jsonl`` beside it
    (none where that file is absent)."""
    path = Path(path)
    results = _read_json(path)
    if not isinstance(results, dict) or results.get("format") != FORMAT:
        raise ResultsError(f"{path}: not the results of `tooltrie eval` (no \"format\": \"{FORMAT}\")")
    if results.get("version", 1) >= 2:
        results["answers"] = _read_answers(path.parent / ANSWERS_FILE)
    return results


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultsError(f"{path}: not readable as JSON ({exc})") from None


def _read_answers(path: Path) -> list[Any]:
    if not path.exists():
        return []  # a run recorded without its answers: its scores still read
    try:
        lines = path.read_text(encoding="utf-8").split("\n")  # not splitlines: an answer may hold U+0085 or U+2028
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultsError(f"{path}: the answers cannot be read ({exc})") from None
    answers = []
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            answers.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ResultsError(f"{path}:{number}: not a JSON answer ({exc})") from None
    return answers
