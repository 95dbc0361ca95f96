"""Files written whole (``tooltrie/files.py``): the umask is read once, at import, and never set again (setting it
to 0 for a moment, as a read, made any folder another thread made meanwhile world-writable), while files written
still get the permissions of an ordinary file, ``0o666 & ~umask``."""

from __future__ import annotations

import importlib
import os
import stat
import threading
from pathlib import Path

import pytest

import tooltrie.files as files
from tooltrie.files import make_readable, umask, write_atomically


def _no_umask(mask: int) -> int:
    raise AssertionError(f"os.umask({mask:#o}) called after import")


def test_writes_never_set_the_umask_and_give_ordinary_permissions(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    process_umask = os.umask(0o022)
    os.umask(process_umask)
    monkeypatch.setattr(os, "umask", _no_umask)
    assert umask() == process_umask
    path = write_atomically(tmp_path / "a" / "b.json", b"{}")
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~process_umask
    folder = tmp_path / "private"
    folder.mkdir(mode=0o700)
    make_readable(folder, mode=0o777)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~process_umask


def test_the_umask_is_read_once_at_import_from_the_process_status(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where ``/proc/self/status`` shows it, not even the import sets it."""
    if not Path("/proc/self/status").exists():
        pytest.skip("no /proc/self/status here: the umask is read by setting it and putting it back, at import")
    monkeypatch.setattr(os, "umask", _no_umask)
    try:
        reloaded = importlib.reload(files)
        with open("/proc/self/status", encoding="ascii") as status:
            shown = next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
        assert reloaded.umask() == shown
    finally:
        monkeypatch.undo()
        importlib.reload(files)


def test_folders_made_while_threads_write_are_never_world_writable(tmp_path: Path) -> None:
    """The race itself: folders made while four threads write. (It caught a world-writable folder in a few hundred
    on a 2-core VM when each write set the umask to 0 and back; the tests above fail every time.)"""
    errors: list[BaseException] = []

    def write(worker: int) -> None:
        try:
            for i in range(200):
                write_atomically(tmp_path / "out" / f"{worker}-{i}.txt", b"x")
        except BaseException as exc:  # reported below
            errors.append(exc)

    writers = [threading.Thread(target=write, args=(worker,)) for worker in range(4)]
    for writer in writers:
        writer.start()
    made = []
    while any(writer.is_alive() for writer in writers):
        folder = tmp_path / "made" / str(len(made))
        folder.mkdir(parents=True, mode=0o777)
        made.append(folder)
    for writer in writers:
        writer.join()
    assert not errors
    assert made
    assert [folder for folder in made if folder.stat().st_mode & stat.S_IWOTH] == []
