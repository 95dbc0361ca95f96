"""How a long step shows its progress, the same for every command and the server: a bar with the rate and the time
left on a terminal (tqdm), a line each tenth of the way elsewhere (a log, a container, CI), nothing when quiet.

A step reports by calling its ``OnProgress`` with what is done and the total, as often as it likes: a line is printed
only when the next tenth is crossed, so a step that reports every item costs no more output than one that reports
every chunk.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

OnProgress = Callable[[int, int], None]  # (done so far, total)
LINES = 10  # lines a step prints off a terminal: one each tenth of the way


class Progress:
    """Shows one step's progress (``what``: its name, ``unit``: what it counts) on ``stream`` (default stderr);
    nothing when ``quiet``."""

    def __init__(self, what: str, *, unit: str = "item", quiet: bool = False, stream: TextIO | None = None) -> None:
        self.what, self.unit, self.quiet = what, unit, quiet
        self.stream = sys.stderr if stream is None else stream
        self._bar: Any = None
        self._shown = 0  # the tenths already printed
        self._began = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        if self.quiet or total <= 0:
            return
        if self.stream.isatty():
            self._on_terminal(done, total)
            return
        tenths = LINES if done >= total else LINES * done // total
        if tenths <= self._shown:
            return
        self._shown = tenths
        elapsed = time.perf_counter() - self._began
        rate = done / elapsed if elapsed > 0 else 0.0
        left = f", {(total - done) / rate:.0f} s left" if rate and done < total else f" in {elapsed:.1f} s"
        print(f"{self.what}: {done:,}/{total:,} {self.unit}s ({rate:,.0f}/s{left})", file=self.stream, flush=True)

    def _on_terminal(self, done: int, total: int) -> None:
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=self.what, unit=self.unit, file=self.stream)
        self._bar.update(done - self._bar.n)
        if done >= total:
            self._bar.close()


__all__ = ["LINES", "OnProgress", "Progress"]
