"""Files written whole or not at all: a reader sees the old file or the whole new one, never half of it, also after a
crash (the bytes reach the disk before the rename). The artifact, the priors' caches and every result file are
written here."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["make_readable", "umask", "write_atomically"]


def write_atomically(path: str | Path, blob: bytes) -> Path:
    """Write ``blob`` to ``path``, its folder made if need be; an ``OSError`` leaves no temporary file behind.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> write_atomically(folder / "a" / "b.txt", b"whole").read_bytes()
    b'whole'
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(blob)
            out.flush()
            os.fsync(out.fileno())
        make_readable(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def make_readable(path: str | Path, *, mode: int = 0o666) -> None:
    """Give a file (or, with ``mode=0o777``, a folder) made by ``mkstemp``/``mkdtemp``, which are private, the
    permissions of an ordinary one."""
    os.chmod(path, mode & ~umask())


def umask() -> int:
    """The process's umask, as read once at import (``_UMASK``): never set again, not even for a moment."""
    return _UMASK


def _read_umask() -> int:
    """The umask without changing it where Linux shows it (``/proc/self/status``), else by setting it and putting it
    back: once, at import, before any thread of ours can make a file or folder in that moment with no mask."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


# Read at import: setting the umask to 0 and back on each call made, for that moment, every mkdir/open of another
# thread world-writable. A program that changes its umask later should do so before importing this module.
_UMASK = _read_umask()
