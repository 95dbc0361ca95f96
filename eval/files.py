"""Atomic writes: a reader sees the old file (or directory) or the whole new one, never half of it."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


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
