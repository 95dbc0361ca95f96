"""Writing results: atomically (a reader sees the old file or directory or the whole new one, never half of it), and
naming files relative to the folder the command ran in, so that a result reads the same on every machine."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any


def write_text(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        make_readable(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


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
