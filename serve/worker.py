"""The worker: the one thread that owns and drives every engine (an ``Engine`` is not thread-safe).

Requests reach it through a thread-safe inbox, each an admitted ``Request`` naming its registry and carrying its
``deliver`` callback. Each turn of its loop it

1. takes the new messages (requests, cancellations, engine swaps), blocking only when no engine has work;
2. moves waiting requests into free decoding slots, first come first served, per registry (continuous batching:
   a request joins the running batch between forward passes);
3. steps every busy engine once (one forward pass each) and hands each finished request to its ``deliver``, which
   must be thread-safe (the service passes ``loop.call_soon_threadsafe``).

The queue limit counts requests accepted but not yet in a slot; ``submit`` refuses one more with ``QueueFullError``.

A registry reload ``install``\\s a new engine under the same name: requests not yet decoding go to the new engine, rows
already decoding finish on the old one (on the artifact they started with), which is stepped until it is empty and
then dropped.

An engine may also be a ``RemoteEngine`` (``vllm_remote.py``), whose steps hand back the answers a vLLM server
returned, or the error of a request it could not answer.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from tooltrie.serve.engine import Engine
from tooltrie.serve.errors import DecodingFailedError, QueueFullError, UnavailableError, UnknownRegistryError
from tooltrie.serve.metrics import ServeMetrics
from tooltrie.serve.request import Request, RequestStatus
from tooltrie.serve.vllm_remote import RemoteEngine

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Lane:
    """An engine and the requests it is decoding."""

    name: str
    engine: Engine | RemoteEngine
    requests: set[Request] = field(default_factory=set)


@dataclass(frozen=True)
class _Cancel:
    request: Request


@dataclass(frozen=True)
class _Install:
    name: str
    engine: Engine | RemoteEngine | None  # None: removed


class _Stop:
    pass


_Message = Request | _Cancel | _Install | _Stop


class Worker:
    """Drives ``engines`` (registry name -> engine) from one thread; every method may be called from any thread."""

    def __init__(self, engines: Mapping[str, Engine | RemoteEngine], *, queue_limit: int,
                 metrics: ServeMetrics | None = None) -> None:
        self.queue_limit = queue_limit
        self._metrics = metrics
        self._inbox: queue.SimpleQueue[_Message] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued = 0  # requests accepted and not yet in a slot; under _lock
        self._closed = False  # under _lock
        # The rest belongs to the worker thread once it runs.
        self._lanes = {name: _Lane(name, engine) for name, engine in engines.items()}
        self._waiting: dict[str, deque[Request]] = {name: deque() for name in engines}
        self._draining: list[_Lane] = []  # replaced engines finishing their rows
        self._thread = threading.Thread(target=self._run, name="tooltrie-worker", daemon=True)

    # -- any thread ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop after the current step; requests not answered by then get ``UnavailableError``."""
        with self._lock:
            self._closed = True
        self._inbox.put(_Stop())
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def submit(self, request: Request) -> None:
        """Accept a request for its ``registry``, or raise ``QueueFullError`` (queue full) or ``UnavailableError``
        (stopping). Its ``deliver`` is called exactly once, on the worker thread, unless it is cancelled first."""
        with self._lock:
            if self._closed:
                raise UnavailableError("the server is stopping")
            if request.counted:
                if self._queued >= self.queue_limit:
                    raise QueueFullError(f"the queue is full ({self.queue_limit} requests waiting for a decoding "
                                         "slot); retry later")
                self._queued += 1
            request.status = RequestStatus.WAITING
            self._inbox.put(request)  # under the lock: once stopping, nothing more reaches the inbox

    def cancel(self, request: Request) -> None:
        """Drop a request: out of the queue, or out of its slot at the next step. Nothing is delivered for it then
        (one already answered is left as it is)."""
        self._inbox.put(_Cancel(request))

    def install(self, name: str, engine: Engine | RemoteEngine) -> None:
        """Serve ``name`` with ``engine`` from now on; the old engine finishes the rows it is decoding."""
        self._inbox.put(_Install(name, engine))

    def remove(self, name: str) -> None:
        """Serve ``name`` no more (an agent's tool list let go); rows being decoded finish, waiting ones are
        refused."""
        self._inbox.put(_Install(name, None))

    @property
    def queued(self) -> int:
        with self._lock:
            return self._queued

    # -- the worker thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            running = True
            while running:
                for message in self._messages(block=not self._busy()):
                    running = self._handle(message) and running
                if not running:
                    break
                self._feed()
                for lane in [*self._lanes.values(), *self._draining]:
                    if lane.engine.busy:
                        self._step(lane)
                self._draining = [lane for lane in self._draining if lane.engine.busy]
                self._publish()
        except BaseException:  # a bug in the loop itself: refuse new work rather than hang every caller
            logger.exception("the worker stopped")
            raise
        finally:
            with self._lock:
                self._closed = True
            self._fail_all("the server is stopping")

    def _busy(self) -> bool:
        lanes = [*self._lanes.values(), *self._draining]
        return any(lane.engine.busy for lane in lanes) or any(self._waiting.values())

    def _messages(self, *, block: bool) -> list[_Message]:
        messages = [self._inbox.get()] if block else []
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                return messages

    def _handle(self, message: _Message) -> bool:
        """Apply one message; False for stop."""
        if isinstance(message, Request):
            if message.registry in self._waiting:
                self._waiting[message.registry].append(message)
            else:  # the service checks names before it submits; another caller may not
                self._uncount(message)
                self._deliver(message, UnknownRegistryError(f"unknown registry {message.registry!r}"))
        elif isinstance(message, _Cancel):
            self._cancel(message.request)
        elif isinstance(message, _Install):
            old = self._lanes.get(message.name)
            if old is not None and old.engine.busy:
                self._draining.append(old)
            if message.engine is not None:
                self._lanes[message.name] = _Lane(message.name, message.engine)
                self._waiting.setdefault(message.name, deque())
            else:  # removed: what still waits for it is refused (its rows being decoded finish)
                self._lanes.pop(message.name, None)
                for request in self._waiting.pop(message.name, deque()):
                    self._uncount(request)
                    self._deliver(request, UnknownRegistryError(f"registry {message.name!r} is no longer served"))
        else:
            return False
        return True

    def _cancel(self, request: Request) -> None:
        waiting = self._waiting.get(request.registry or "")
        if waiting is not None and request in waiting:
            waiting.remove(request)
            request.status = RequestStatus.CANCELLED
            self._uncount(request)
            self._count_cancel("waiting")
        else:
            lane = next((lane for lane in [*self._lanes.values(), *self._draining] if request in lane.requests), None)
            if lane is not None:
                lane.requests.discard(request)
                lane.engine.cancel(request)
                self._count_cancel("decoding")

    def _feed(self) -> None:
        """Move waiting requests into free slots; the engine admits them at its next step."""
        for name, waiting in self._waiting.items():
            lane = self._lanes[name]
            active, pending = lane.engine.load
            free = lane.engine.max_batch - active - pending
            while waiting and free > 0:
                request = waiting.popleft()
                self._uncount(request)
                try:
                    lane.engine.submit(request)
                except Exception as exc:  # DecodeError: k no longer fits a reloaded registry
                    self._deliver(request, exc)
                    continue
                lane.requests.add(request)
                free -= 1

    def _step(self, lane: _Lane) -> None:
        engine = lane.engine
        rows = min(engine.max_batch, sum(engine.load))
        try:
            finished = engine.step()
        except Exception as exc:  # a bug in decoding: fail this engine's rows, keep serving with a fresh engine
            logger.exception("decoding failed on registry %r", lane.name)
            failure = f"decoding failed ({type(exc).__name__}: {exc}); the request was dropped"
            for failed in lane.requests:  # an exception each: each is raised in its own caller's task
                self._deliver(failed, DecodingFailedError(failure))
            lane.requests.clear()
            lane.engine = engine.fresh()
            return
        if self._metrics is not None:
            self._metrics.batch_rows.labels(lane.name).observe(rows)
            if isinstance(engine, Engine) and engine.last_prefill:  # a remote engine reads prompts elsewhere
                self._metrics.prefill_tokens.labels(lane.name).observe(engine.last_prefill)
        for request in finished:  # answered, or (a remote engine's) failed with an error of its own
            if request in lane.requests:
                lane.requests.discard(request)
                self._deliver(request)

    def _deliver(self, request: Request, error: BaseException | None = None) -> None:
        """Hand ``request`` back, failed with ``error`` when given."""
        if error is not None:
            request.fail(error)
        if request.deliver is None:
            return
        try:
            request.deliver(request)
        except Exception:  # the caller's callback must not take the worker down with it
            logger.exception("delivering an answer failed")

    def _uncount(self, request: Request) -> None:
        if request.counted:
            with self._lock:
                self._queued -= 1

    def _count_cancel(self, stage: str) -> None:
        if self._metrics is not None:
            self._metrics.cancelled.labels(stage).inc()

    def _publish(self) -> None:
        if self._metrics is not None:
            self._metrics.queued.set(self.queued)
            self._metrics.active_rows.set(sum(lane.engine.load[0] for lane in [*self._lanes.values(),
                                                                               *self._draining]))

    def _fail_all(self, reason: str) -> None:
        """Answer every request still held (stopping), including those still in the inbox."""
        for waiting in self._waiting.values():
            while waiting:
                request = waiting.popleft()
                self._uncount(request)
                self._deliver(request, UnavailableError(reason))
        for lane in [*self._lanes.values(), *self._draining]:
            for request in lane.requests:
                self._deliver(request, UnavailableError(reason))
            lane.requests.clear()
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, Request):
                self._uncount(message)
                self._deliver(message, UnavailableError(reason))
