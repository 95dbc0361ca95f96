"""A server's warm-up: the priors its registries' answers rank by, made before the first request needs them.

A registry's prior needs its tools embedded and indexed (``tooltrie/ranker.py``): read back in seconds when
``tooltrie compile --embed`` kept them beside the artifact, minutes from cold at 100,000 tools. ``tooltrie serve``
listens at once and warms on a thread of its own, printing its progress (``tooltrie/progress.py``); until it is done
``/healthz`` answers 503 "warming" (not ready: a load balancer sends nothing yet) and a request that needs a warming
registry's prior is refused the same way, with ``Retry-After``. Requests that rank by the model alone are answered
meanwhile. Stopping the server stops the warm-up after the chunk in hand: the chunks made are kept, and the next
start continues from them (``tooltrie/embeddings.py``).
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Mapping
from typing import TextIO

from tooltrie.progress import Progress
from tooltrie.ranker import Ranker
from tooltrie.serve.errors import WarmingError


class _Stopped(Exception):
    """Raised inside a warm-up's progress report to end it when the server stops."""


class WarmUp:
    """The registries (name -> ranker) whose priors are still to be made, in order; ``run`` makes them."""

    def __init__(self, rankers: Mapping[str, Ranker], *, stream: TextIO | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self._pending = dict(rankers)
        self._now = ("", 0, 0)  # the registry warming now, its tools embedded so far and all its tools
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def warming(self, name: str) -> bool:
        with self._lock:
            return name in self._pending

    def run(self, *, show: bool = True) -> None:
        """Make each pending prior in turn (``show``: print the progress and how long each took)."""
        while not self._stopping.is_set():
            with self._lock:
                if not self._pending:
                    return
                name, ranker = next(iter(self._pending.items()))
            began = time.perf_counter()
            progress = Progress(f"tooltrie serve: {name}: embedding", unit="tool", quiet=not show, stream=self.stream)
            ranker.progress = functools.partial(self._report, progress)
            try:
                ranker.prior_scores([""])  # the tools embedded and indexed, or read back from beside the artifact
            except _Stopped:
                return
            except Exception as exc:  # the others are still served; this one's requests try again (and say why)
                print(f"tooltrie serve: {name}: the prior failed ({type(exc).__name__}: {exc}); requests that rank "
                      "by it will try to make it again", file=self.stream, flush=True)
            else:
                if show:
                    print(f"tooltrie serve: {name}: prior ready ({ranker.prior}, {time.perf_counter() - began:.1f} s)",
                          file=self.stream, flush=True)
            finally:
                ranker.progress = None
            with self._lock:
                self._pending.pop(name, None)
                self._now = ("", 0, 0)

    def start(self) -> None:
        """``run`` on a thread of its own (a daemon: a stopping server does not wait for an embedding)."""
        if self._pending and self._thread is None:
            self._thread = threading.Thread(target=self.run, name="tooltrie-warm-up", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stopping.set()

    def join(self, timeout_s: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def forget(self, name: str) -> None:
        """``name`` is served by a new engine, whose prior was made as it was installed (a reload)."""
        with self._lock:
            self._pending.pop(name, None)

    def check(self, *, names: bool = True) -> None:
        """Raise ``WarmingError`` while a prior is being made; ``names``: whether the message may name the
        registries (not under a policy, where health is open to all)."""
        with self._lock:
            pending, (now, done, total) = list(self._pending), self._now
        if pending:
            embedded = f" ({now}: {done:,}/{total:,} tools embedded)" if names and total else ""
            which = f": {', '.join(pending)}" if names else ""
            raise WarmingError(f"warming up: making the prior of {len(pending)} registr"
                               f"{'y' if len(pending) == 1 else 'ies'}{which}{embedded}")

    def check_registry(self, name: str) -> None:
        """Raise ``WarmingError`` while ``name``'s prior is being made (a request that needs it waits outside)."""
        with self._lock:
            if name not in self._pending:
                return
            now, done, total = self._now
        share = f", {done:,} of {total:,} tools embedded" if now == name and total else ""
        raise WarmingError(f"registry {name!r} is warming up (its prior is being made{share}); retry shortly, or "
                           "ask with ranker=model meanwhile")

    def _report(self, progress: Progress, done: int, total: int) -> None:
        if self._stopping.is_set():
            raise _Stopped
        with self._lock:
            self._now = (next(iter(self._pending)), done, total)
        progress(done, total)
