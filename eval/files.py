"""Writing results: atomically (a reader sees the old file or directory or the whole new one, never half of it), and
naming files relative to the folder the command ran in, so that a result reads the same on every machine."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically, its folder made if need be: a reader sees the old file or the
    whole new one, also after a crash (the bytes reach the disk before the rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        make_readable(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


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


def make_readable(path: str | Path) -> None:
    """Give a file made by ``mkstemp`` (private) the permissions of an ordinary file."""
    os.chmod(path, 0o666 & ~_umask())


def fresh_directory_beside(target: str | Path) -> Path:
    """An empty temporary directory next to ``target``, to fill and then ``replace_directory`` into place."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    os.chmod(tmp, 0o777 & ~_umask())
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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
