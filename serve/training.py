"""A served registry's own adapter, trained in the background: ``tooltrie serve --train``.

For each registry without one, the ``AdapterTrainer`` runs a ``TrainingJob``'s command in a child process, one
registry at a time (``tooltrie.train.recipe.Recipe``: ``python -m tooltrie.train.job`` at the lowest CPU priority,
which regenerates training data from the registry's own text and trains a LoRA adapter on the model as served).
Meanwhile the server answers with what it has (the fused ranker); when the adapter is written, the service swaps it
in as a reload swaps a registry: requests decoding finish on the old engine, later ones get the new. Serving never
imports the training code, nor names it: the job is given (``tooltrie serve --train`` gives the recipe).

Adapters are cached under ``<cache>/adapters/<key>``, the key the job's (``TrainingJob.key``): a sha256 of everything
an adapter depends on. A restart finds them there; a registry that changed gets a new key, so an adapter is never
applied to tools it was not trained on. The child writes the adapter atomically (``write_adapter``), with the sha256
of its weights in the record: a cached adapter whose weights are truncated or corrupt, or that lacks the sha256
(written by an older trainer), is trained again, never served (``cached``).

The child process, and what it may start, is bounded:

- it runs in a session of its own, so stopping it (``SIGTERM``, then ``SIGKILL`` after ``STOP_GRACE_S``) reaches
  everything it started, and stopping never blocks the server's event loop; what it started and left running when it
  exited (on its own too) is killed with it, lest it keep the key's lock (below);
- it exits with the server however the server ends, ``SIGKILL`` included: its stdin is a pipe from the server that
  it watches (``serve.lifeline.exit_with_server``), which reads end-of-file once the server's process is gone;
- one process at a time trains a key: the trainer holds a lock (``flock`` on ``<cache>/adapters/.<key>.lock``) that
  the child inherits, so a restarted server, or a second server on the same cache, waits for a child still running
  instead of starting another in the same ``.<key>.work`` directory, then takes its adapter from the cache;
- it is killed after ``time_limit_s`` (``TIME_LIMIT_S``, one hour, by default; waiting for the lock included) and
  its registry reported ``failed`` in ``/v1/registries`` (``training.error`` says why) and ``/metrics``
  (``tooltrie_adapter_training_failed``).

Progress is read from the training log (one JSON line per step) and shown in ``/v1/registries`` and ``/metrics``.

An adapter's weights are hashed (``verify_adapter``: a second or more for a large one) in a worker thread whenever the
event loop is waiting on them; ``request`` and ``adapter`` may be called from such a thread
(``asyncio.to_thread``) while ``run`` is being awaited.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tooltrie.compiler.artifact import Artifact
from tooltrie.serve.adapter import AdapterError, AdapterRecord, is_adapter_dir, read_adapter, verify_adapter
from tooltrie.serve.lifeline import LIFELINE_ENV

__all__ = ["TIME_LIMIT_S", "AdapterTrainer", "TrainingJob", "TrainingStatus", "adapter_cache_dir"]

logger = logging.getLogger(__name__)

# A training's time limit, waiting for another process's lock included: about four times what a 1,853-tool
# registry (BFCL) takes with the default recipe on a 2-core CPU (13.3 minutes, docs/training.md).
TIME_LIMIT_S = 3_600.0
STOP_GRACE_S = 5.0  # after SIGTERM, how long the child has to clean up before SIGKILL
_POLL_S = 1.0  # how often the child's progress is read
_ERROR_TAIL = 2_000  # characters of a failed child's output kept in its status


class TrainingJob(Protocol):
    """How an adapter is trained (``tooltrie.train.recipe.Recipe``): what the trainer needs of it, no more."""

    @property
    def steps(self) -> int: ...

    def key(self, artifact: Artifact, base_fingerprint: str) -> str:
        """The cache key of the adapter trained for ``artifact`` on the base with ``base_fingerprint``."""
        ...

    def command(self, artifact_file: Path, output: Path, *, work: Path, base_model: str | None,
                base_adapter: bool) -> list[str]:
        """The command that trains it into ``output``: ``artifact_file`` holds the artifact, ``work`` is its own,
        ``work/train.log.jsonl`` its log (one JSON line per step). It must call
        ``serve.lifeline.exit_with_server()`` first."""
        ...


def adapter_cache_dir() -> Path:
    """``$TOOLTRIE_CACHE_DIR/adapters``, else ``$XDG_CACHE_HOME/tooltrie/adapters``, else ``~/.cache/...``."""
    from tooltrie.serve.model import default_model_cache_dir

    return default_model_cache_dir().parent / "adapters"


@dataclass
class TrainingStatus:
    """Where a registry's adapter stands: ``queued``, ``training`` (``phase``: ``waiting`` for another process
    training the same adapter, ``data`` or ``steps``), ``ready`` or ``failed`` (``error`` says why)."""

    state: str
    steps: int
    key: str = ""  # the cache key of the adapter it is about (``TrainingJob.key``)
    step: int = 0
    phase: str | None = None
    adapter: str | None = None  # its directory, once ready
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        seconds = None if self.started_at is None else (self.finished_at or time.time()) - self.started_at
        return {"state": self.state, "phase": self.phase, "step": self.step, "steps": self.steps,
                "adapter": self.adapter, "seconds": None if seconds is None else round(seconds, 1),
                "error": self.error}


Ready = Callable[[str, AdapterRecord], Awaitable[None]]


class AdapterTrainer:
    """Trains the adapters of registries ``request``\\ ed, one at a time, while ``run`` is being awaited."""

    def __init__(self, *, job: TrainingJob, base_model: str | None, base_fingerprint: str,
                 base_adapter: bool = True, cache_dir: Path | None = None,
                 time_limit_s: float = TIME_LIMIT_S) -> None:
        """Adapters are trained by ``job`` on ``serve.model.load_model(base_model, adapter=base_adapter)``, the
        model as served (None: the default model, with its shipped adapter merged), whose float32 weights have
        ``base_fingerprint``."""
        if not time_limit_s > 0:
            raise ValueError(f"AdapterTrainer: time_limit_s must be positive, got {time_limit_s}")
        self.job = job
        self.base_model, self.base_adapter, self.base_fingerprint = base_model, base_adapter, base_fingerprint
        self.cache_dir = cache_dir or adapter_cache_dir()
        self.time_limit_s = time_limit_s
        self.status: dict[str, TrainingStatus] = {}
        self._queue: deque[tuple[str, Artifact, TrainingStatus]] = deque()
        self._wake = asyncio.Event()
        # ``status`` and ``_queue`` are changed under this lock, from the loop's thread or a worker's, and never while
        # weights are hashed; ``_loop`` is the loop ``run`` is awaited on, which a worker wakes thread-safely.
        self._books = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    def directory(self, artifact: Artifact) -> Path:
        return self.cache_dir / self.job.key(artifact, self.base_fingerprint)

    def cached(self, artifact: Artifact) -> AdapterRecord | None:
        """The adapter trained for ``artifact`` by this job on this base, if a sound one is in the cache. A damaged
        one (unreadable, its weights not those its record hashed, or no hash: an older trainer's) is set aside,
        with a warning, to be trained again."""
        directory = self.directory(artifact)
        if not is_adapter_dir(directory):
            return None
        try:
            record = read_adapter(directory)
            verify_adapter(record)
        except AdapterError as exc:
            logger.warning("the cached adapter %s is not used, and is trained again: %s", directory, exc)
            return None
        return record

    def request(self, name: str, artifact: Artifact) -> TrainingStatus:
        """Queue ``name``'s adapter for ``artifact``: nothing new when that one is queued or training already, or
        in the cache. A registry reloaded meanwhile is queued for its new version, whose status ``name`` then
        shows; an older version still waiting leaves the queue, one training finishes (and is not swapped in:
        it no longer fits)."""
        return self._request(name, artifact)[0]

    def adapter(self, name: str, artifact: Artifact) -> AdapterRecord | None:
        """``name``'s adapter for ``artifact`` when the cache has a sound one, else None, and it is queued to be
        trained (``request``): the weights are read and hashed once."""
        return self._request(name, artifact)[1]

    def _request(self, name: str, artifact: Artifact) -> tuple[TrainingStatus, AdapterRecord | None]:
        key = self.directory(artifact).name
        with self._books:
            pending = self._pending(name, key)
        if pending is not None:
            return pending, None
        cached = self.cached(artifact)  # outside the lock: hashing the weights takes a while
        with self._books:
            pending = self._pending(name, key)  # queued by another caller meanwhile
            if pending is not None:
                return pending, None
            self._queue = deque(entry for entry in self._queue if entry[0] != name)
            if cached is not None:  # trained already (the service swaps it in when it loads the registry)
                self.status[name] = TrainingStatus("ready", steps=self.job.steps, key=key, step=self.job.steps,
                                                   adapter=str(cached.path))
                return self.status[name], cached
            status = self.status[name] = TrainingStatus("queued", steps=self.job.steps, key=key)
            self._queue.append((name, artifact, status))
        self._wake_runner()
        return status, None

    def _pending(self, name: str, key: str) -> TrainingStatus | None:
        current = self.status.get(name)
        if current is not None and current.state in ("queued", "training") and current.key == key:
            return current
        return None

    def _wake_runner(self) -> None:
        """Wake ``run``: an ``asyncio.Event`` is set on its loop's thread, never from another."""
        loop = self._loop
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:  # a worker thread
            on_loop = False
        if loop is None or on_loop or loop.is_closed():
            self._wake.set()
        else:
            loop.call_soon_threadsafe(self._wake.set)

    async def run(self, ready: Ready) -> None:
        """Train what is queued, one registry at a time, calling ``ready(name, adapter)`` after each; until
        cancelled (a child training is then stopped)."""
        self._loop = asyncio.get_running_loop()
        while True:
            while not self._queue:
                self._wake.clear()
                await self._wake.wait()
            with self._books:
                name, artifact, status = self._queue.popleft()
            try:
                record = await self._train(status, artifact)
                await ready(name, record)
            except Exception as exc:  # the server goes on with what it had
                logger.exception("training an adapter for registry %r failed", name)
                status.state, status.error = "failed", status.error or f"{type(exc).__name__}: {exc}"
            else:
                status.state, status.adapter = "ready", str(record.path)
            finally:
                status.finished_at = time.time()

    async def _train(self, status: TrainingStatus, artifact: Artifact) -> AdapterRecord:
        output = self.directory(artifact)
        status.state, status.started_at = "training", time.time()
        deadline = time.monotonic() + self.time_limit_s
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        lock = os.open(self.cache_dir / f".{output.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            await self._lock(lock, status, deadline)
            # another process may have trained it while this one waited
            cached = await asyncio.to_thread(self.cached, artifact)
            if cached is not None:
                status.step = self.job.steps
                return cached
            return await self._run_child(lock, status, artifact, output, deadline)
        finally:
            os.close(lock)  # the lock is free once the child, which inherited it, is gone too

    async def _lock(self, lock: int, status: TrainingStatus, deadline: float) -> None:
        """Take the key's lock, waiting while another process (a child a killed server left, another server on
        this cache) holds it."""
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if status.phase != "waiting":
                    logger.info("another process is training the adapter %s; waiting for it", status.key)
                status.phase = "waiting"
            if time.monotonic() > deadline:
                status.error = (f"another process held the lock on this adapter for longer than the training's "
                                f"time limit ({self.time_limit_s:g} s)")
                raise TimeoutError(status.error)
            await asyncio.sleep(_POLL_S)

    async def _run_child(self, lock: int, status: TrainingStatus, artifact: Artifact, output: Path,
                         deadline: float) -> AdapterRecord:
        work = self.cache_dir / f".{output.name}.work"
        work.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(artifact.save, work / "registry.trie")  # a large one takes a moment
        log = work / "train.log.jsonl"
        log.unlink(missing_ok=True)
        command = self.job.command(work / "registry.trie", output, work=work, base_model=self.base_model,
                                   base_adapter=self.base_adapter)
        status.phase = "data"
        logger.info("training an adapter for registry %r (%d tools) in the background, into %s",
                    artifact.registry.name, artifact.trie.n_tools, output)
        with (work / "child.log").open("wb") as out:
            child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                                     start_new_session=True, pass_fds=(lock,),
                                     env={**os.environ, LIFELINE_ENV: "stdin"})
        try:
            while not _exited(child):
                if time.monotonic() > deadline:
                    status.error = (f"the training process was still running after its time limit "
                                    f"({self.time_limit_s:g} s) and was killed")
                    raise TimeoutError(status.error)
                await asyncio.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))
                step = _last_step(log)
                if step is not None:
                    status.phase, status.step = "steps", step
        finally:
            await _stop(child)
        if child.returncode != 0:
            tail = (work / "child.log").read_text(encoding="utf-8", errors="replace")[-_ERROR_TAIL:]
            status.error = f"the training process exited with status {child.returncode}: {tail.strip()}"
            raise RuntimeError(status.error)
        status.step = self.job.steps
        shutil.rmtree(work / "data", ignore_errors=True)  # the log stays, beside the adapter
        return await asyncio.to_thread(_verified, output)


def _verified(output: Path) -> AdapterRecord:
    record = read_adapter(output)
    verify_adapter(record)
    return record


async def _stop(child: subprocess.Popen[bytes]) -> None:
    """End ``child`` and everything in its session, without blocking the event loop: a running child gets
    ``SIGTERM``, then after ``STOP_GRACE_S`` its whole group gets ``SIGKILL``, also when it exited on its own (what it
    started and left running would keep the key's lock inherited from it). Shielded: a cancelled caller still waits
    for the child to be gone.

    The group is signalled only while the child is not reaped (``_exited`` looks without reaping it): until then the
    child's pid, which is its group's id (``start_new_session``), is held by it, a zombie at worst, so it cannot have
    been given to another process, and the signal reaches only what the child started. It is reaped last."""

    async def stop() -> None:
        if child.returncode is None:  # not reaped yet (it is below, once)
            if not _exited(child):
                _signal_group(child.pid, signal.SIGTERM)
                grace = time.monotonic() + STOP_GRACE_S
                while not _exited(child) and time.monotonic() < grace:
                    await asyncio.sleep(0.05)
            _signal_group(child.pid, signal.SIGKILL)
            while not _exited(child):
                await asyncio.sleep(0.05)
            child.wait()  # exited already: returns at once, and reaps it
        if child.stdin is not None:
            child.stdin.close()

    task = asyncio.ensure_future(stop())
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise


def _exited(child: subprocess.Popen[bytes]) -> bool:
    """Whether ``child`` has exited, without reaping it (``WNOWAIT``): its pid stays its own, a zombie's."""
    if child.returncode is not None:
        return True
    if not hasattr(os, "waitid"):  # macOS before Python 3.13: reaped, so what it left running is not signalled
        return child.poll() is not None
    return os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _signal_group(pid: int, signal_number: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal_number)


def _last_step(log: Path) -> int | None:
    """The step of the training log's last complete line, or None before the first."""
    try:
        with log.open("rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - 4096))
            lines = file.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        with contextlib.suppress(ValueError):
            return int(json.loads(line)["step"])
    return None
