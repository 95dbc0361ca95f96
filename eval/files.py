"""Writing results: atomically (a reader sees the old file or directory or the whole new one, never half of it), and
naming files relative to the folder the command ran in, so that a result reads the same on every machine."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tooltrie.files import make_readable, write_atomically


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (``tooltrie.files``), its folder made if need be."""
    return write_atomically(path, text.encode("utf-8"))


JSON_WIDTH = 120  # a container whose one-line form fits in this many characters stays on one line


def json_text(value: Any) -> str:
    """``value`` as JSON for a file people read and diff: a container on one line when it holds no other container
    or fits in ``JSON_WIDTH`` characters, otherwise one item a line (indented by one space). A bench result stays a
    few hundred lines where ``indent=2`` made thousands (one per number).

    >>> print(json_text({"cores": 2, "load": [1.5, 2.0], "rows": [{"n": 1, "x": [1]}] * 2}), end="")
    {"cores": 2, "load": [1.5, 2.0], "rows": [{"n": 1, "x": [1]}, {"n": 1, "x": [1]}]}
    >>> print(json_text({"rows": [{"name": "a" * 50, "x": [1]}] * 2, "k": [1, 2]}), end="")
    {
     "rows": [
      {"name": "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "x": [1]},
      {"name": "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "x": [1]}
     ],
     "k": [1, 2]
    }
    """
    return _json_lines(value, level=0, lead=0) + "\n"


def _json_lines(value: Any, *, level: int, lead: int) -> str:
    one_line = json.dumps(value, ensure_ascii=False, allow_nan=False)
    if not isinstance(value, dict | list) or not value:
        return one_line
    items = list(value.values() if isinstance(value, dict) else value)
    if lead + len(one_line) <= JSON_WIDTH or not any(isinstance(item, dict | list) for item in items):
        return one_line
    pad = " " * (level + 1)
    names = [json.dumps(key, ensure_ascii=False) + ": " for key in value] if isinstance(value, dict) else None
    keys = names or [""] * len(items)
    lines = [pad + key + _json_lines(item, level=level + 1, lead=len(pad) + len(key))
             for key, item in zip(keys, items, strict=True)]
    opening, closing = "{}" if isinstance(value, dict) else "[]"
    return opening + "\n" + ",\n".join(lines) + "\n" + " " * level + closing


def relative_paths(value: Any, *, root: str | Path | None = None) -> Any:
    """``value`` (JSON-like) with every string that names a path inside ``root`` (default: the working directory)
    made relative to it, a ``file:line`` suffix kept: ``<root>/eval/data/q.jsonl:7`` ->
    ``eval/data/q.jsonl:7``. Other strings are left as they are."""
    prefix = str(Path(root or Path.cwd()).resolve()).rstrip(os.sep) + os.sep
    if isinstance(value, dict):
        return {key: relative_paths(item, root=prefix) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [relative_paths(item, root=prefix) for item in value]
    if isinstance(value, str) and value.startswith(prefix):
        return value[len(prefix) :]
    return value


def fresh_directory_beside(target: str | Path) -> Path:
    """An empty temporary directory next to ``target``, to fill and then ``replace_directory`` into place."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    make_readable(tmp, mode=0o777)
    return tmp


def replace_directory(tmp: Path, target: str | Path) -> Path:
    """Move a filled temporary directory into place, replacing what was there (set aside first, then removed)."""
    target = Path(target)
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
        os.rename(target, old / target.name)
    os.rename(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return target
