"""The discovery service: named registries, each decoded by its own engine on one shared model, behind one worker.

Both front ends, HTTP (``server.py``) and MCP (``mcp_tools.py``), call :meth:`DiscoveryService.discover`. A request
takes one path:

1. ``admit``: the registry is looked up and the request checked against it (query length, k against the tools)
   and turned into an engine ``Request``. Everything that can be refused is refused here, before the request
   reaches a batch, so a bad request never disturbs the others. (Per-request tool subsets and tenant policies,
   issue 9, belong here too: they narrow what a request may be answered with before it is decoded.)
2. ``_decode``: a ``Job`` for the worker thread; the caller awaits its future, cancelling the job when the
   server's timeout passes or the client disconnects (its slot is freed at the next step).
3. the endpoint's JSON object (``engine.response``), plus ``registry_sha256``: which version of a reloaded
   registry answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tooltrie.compiler import Artifact, TokenizerInfo, compile_cached, compile_registry
from tooltrie.errors import DecodeError, RegistryError, TooltrieError
from tooltrie.registry import Registry, load_registry, make_registry
from tooltrie.serve.engine import Engine, Request, response
from tooltrie.serve.errors import (
    ClientGoneError,
    InvalidRequestError,
    RegistryReloadError,
    RequestTimeoutError,
    ServeError,
    UnavailableError,
    UnknownRegistryError,
)
from tooltrie.serve.limits import ServeLimits
from tooltrie.serve.metrics import ServeMetrics
from tooltrie.serve.prompt import Prompt
from tooltrie.serve.worker import Answered, Job, Outcome, Worker

# The health probe's own tiny grammar: decoded by the same worker and model as the served registries, between their
# steps, so a probe that disturbed them (as a second grammar once overwrote the first in constant memory) would show.
PROBE_REGISTRY = "tooltrie-probe"
PROBE_TOOLS = (
    {"name": "HealthProbe", "description": "Report that the discovery service is healthy."},
    {"name": "ReadyProbe", "description": "Report that the discovery service is ready."},
    {"name": "StatusProbe", "description": "Report the discovery service's status."},
)
PROBE_QUERY = "Is the discovery service healthy?"


@dataclass(frozen=True)
class DiscoveryRequest:
    """What a caller asks, before it is checked: ``registry`` None means the server's default."""

    query: str
    k: int
    registry: str | None = None


@dataclass(frozen=True)
class ServedRegistry:
    """A registry as served: where it came from (for reloads), its artifact, and its prompt's size."""

    name: str
    path: Path | None  # None: built in memory, cannot be reloaded
    artifact: Artifact
    prompt_tokens: int  # the prompt without the query, at the largest k: what every request adds the query to
    loaded_at: float  # Unix time

    @classmethod
    def compile(cls, registry: Registry, tokenizer: TokenizerInfo, prompt: Prompt, *, path: Path | None = None,
                cache_dir: Path | None = None) -> ServedRegistry:
        artifact = (compile_cached(registry, tokenizer, cache_dir=cache_dir) if path is not None
                    else compile_registry(registry, tokenizer))
        prefix, suffix = prompt.parts(artifact.registry, artifact.contract, len(registry))
        return cls(name=registry.name, path=path, artifact=artifact,
                   prompt_tokens=len(tokenizer.encode(prefix + suffix)), loaded_at=time.time())

    @property
    def n_tools(self) -> int:
        return self.artifact.trie.n_tools

    def summary(self, *, default: bool = False) -> dict[str, Any]:
        artifact = self.artifact
        return {
            "name": self.name,
            "tools": self.n_tools,
            "default": default,
            "placement": artifact.placement(),
            "source": str(self.path) if self.path is not None else artifact.registry.source,
            "registry_sha256": artifact.registry.sha256,
            "artifact_sha256": artifact.sha256,
            "contract_sha256": artifact.contract.sha256,
            "tokenizer_fingerprint": artifact.tokenizer_fingerprint,
            "device_bytes": artifact.trie.device_bytes,
            "prompt_tokens": self.prompt_tokens,
            "loaded_at": round(self.loaded_at, 3),
        }


Disconnected = Callable[[], Awaitable[None]]  # returns when the client has gone


class DiscoveryService:
    """Serves ``registries`` (the first is the default) with ``model``; ``start`` before use, ``stop`` after."""

    def __init__(self, model: Any, tokenizer: TokenizerInfo, registries: Sequence[ServedRegistry], *,
                 prompt: Prompt | None = None, limits: ServeLimits | None = None,
                 cache_dir: Path | None = None) -> None:
        if not registries:
            raise ValueError("a discovery service needs at least one registry")
        self.model, self.tokenizer = model, tokenizer
        self.prompt = prompt or Prompt()
        self.limits = limits or ServeLimits()
        self.cache_dir = cache_dir
        self.metrics = ServeMetrics()
        self._served: dict[str, ServedRegistry] = {}
        for served in registries:
            if served.name in self._served or served.name == PROBE_REGISTRY:
                raise RegistryError(f"registry name {served.name!r} is given twice or is reserved "
                                    f"({served.path}); each served registry needs its own name")
            self._served[served.name] = served
        self.default_registry = registries[0].name
        # Positions the model can attend to; None when its config does not say.
        self.context_tokens: int | None = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        self._probe = ServedRegistry.compile(make_registry(list(PROBE_TOOLS), name=PROBE_REGISTRY), tokenizer,
                                             self.prompt)
        engines = {name: self._engine(served.artifact) for name, served in self._served.items()}
        engines[PROBE_REGISTRY] = self._engine(self._probe.artifact)
        self.worker = Worker(engines, queue_limit=self.limits.queue, metrics=self.metrics)
        self._reload_locks: dict[str, asyncio.Lock] = {}

    @classmethod
    def from_paths(cls, paths: Sequence[str | Path], model: Any, tokenizer: TokenizerInfo, *,
                   prompt: Prompt | None = None, limits: ServeLimits | None = None,
                   cache_dir: Path | None = None) -> DiscoveryService:
        """Load and compile (or take from the compile cache) each registry file."""
        prompt = prompt or Prompt()
        served = [ServedRegistry.compile(load_registry(path), tokenizer, prompt, path=Path(path), cache_dir=cache_dir)
                  for path in paths]
        return cls(model, tokenizer, served, prompt=prompt, limits=limits, cache_dir=cache_dir)

    def _engine(self, artifact: Artifact) -> Engine:
        return Engine(self.model, self.tokenizer, artifact, max_batch=self.limits.max_batch, prompt=self.prompt)

    def start(self) -> None:
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()

    # -- what is served -------------------------------------------------------------------------------------------

    def registries(self) -> list[dict[str, Any]]:
        return [served.summary(default=name == self.default_registry) for name, served in self._served.items()]

    def served(self, name: str) -> ServedRegistry:
        if name not in self._served:
            raise UnknownRegistryError(f"unknown registry {name!r}; this server serves "
                                       f"{', '.join(repr(n) for n in self._served)}")
        return self._served[name]

    # -- the request path -----------------------------------------------------------------------------------------

    async def discover(self, ask: DiscoveryRequest, *, disconnected: Disconnected | None = None) -> dict[str, Any]:
        """Answer ``ask`` with exactly k tools of its registry, or raise a ``ServeError`` saying why not."""
        started = time.perf_counter()
        label = ask.registry if ask.registry in self._served else (
            self.default_registry if ask.registry is None else "-")
        try:
            served, request = self.admit(ask)
            outcome = await self._decode(served.name, request, disconnected=disconnected)
        except ServeError as exc:
            self.metrics.requests.labels(label, exc.code).inc()
            raise
        except Exception:
            self.metrics.requests.labels(label, "internal").inc()
            raise
        self.metrics.requests.labels(label, "ok").inc()
        self.metrics.latency.labels(label).observe(time.perf_counter() - started)
        body = response(outcome.answer, outcome.artifact)
        body["registry_sha256"] = outcome.artifact.registry.sha256
        return body

    def admit(self, ask: DiscoveryRequest) -> tuple[ServedRegistry, Request]:
        """Check ``ask`` against its registry and the limits; the engine request to decode."""
        served = self.served(self.default_registry if ask.registry is None else ask.registry)
        query, k, limits = ask.query, ask.k, self.limits
        if not query.strip():
            raise InvalidRequestError("query is empty; ask a question in words")
        if len(query) > limits.max_query_chars:
            raise InvalidRequestError(f"query has {len(query):,} characters; the limit is {limits.max_query_chars:,}")
        try:
            query.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequestError(f"query is not valid Unicode ({exc.reason} at character {exc.start})") from None
        if not 1 <= k <= served.n_tools:
            raise InvalidRequestError(f"k must be between 1 and {served.n_tools} (the tools of registry "
                                      f"{served.name!r}), got {k}")
        if self.context_tokens is not None:
            answer_tokens = k * (served.artifact.trie.max_depth + 2) + 1
            needed = served.prompt_tokens + len(self.tokenizer.encode(query)) + answer_tokens
            if needed > self.context_tokens:
                raise InvalidRequestError(f"query is too long for the model: prompt and answer would take {needed:,} "
                                          f"tokens of its {self.context_tokens:,}")
        return served, Request(query, k)

    async def _decode(self, registry: str, request: Request, *, counted: bool = True,
                      disconnected: Disconnected | None = None) -> Answered:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Outcome] = loop.create_future()

        def deliver(outcome: Outcome) -> None:  # on the worker thread
            with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is waiting any more
                loop.call_soon_threadsafe(_settle, future, outcome)

        job = Job(registry, request, deliver, counted=counted)
        self.worker.submit(job)
        waiters: set[asyncio.Future[Any]] = {future}
        gone = asyncio.ensure_future(disconnected()) if disconnected is not None else None
        if gone is not None:
            waiters.add(gone)
        try:
            done, _ = await asyncio.wait(waiters, timeout=self.limits.timeout_s, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the caller's task was cancelled (e.g. an MCP client left): free the slot
            self.worker.cancel(job)
            raise
        finally:
            if gone is not None:
                gone.cancel()
                if gone.done() and not gone.cancelled():
                    gone.exception()  # a receive that failed also means the client is gone; retrieved, not logged
        if future in done:
            outcome = future.result()
            if isinstance(outcome, DecodeError):  # k no longer fits: the registry was reloaded meanwhile
                raise InvalidRequestError(str(outcome))
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome
        self.worker.cancel(job)
        if gone is not None and gone in done:
            raise ClientGoneError("the client disconnected; the request was cancelled")
        raise RequestTimeoutError(f"no answer within the server's timeout of {self.limits.timeout_s:g} s; the request "
                                  "was cancelled")

    # -- health ---------------------------------------------------------------------------------------------------

    async def probe(self) -> dict[str, Any]:
        """Decode the probe query on the probe grammar through the worker; ``UnavailableError`` unless the answer
        is one probe tool, finished."""
        started = time.perf_counter()
        outcome = await self._decode(PROBE_REGISTRY, Request(PROBE_QUERY, 1), counted=False)
        answer = outcome.answer
        names = [tool.name for tool in answer.tools]
        if answer.finish_reason != "stop" or len(names) != 1 or names[0] not in self._probe.artifact.registry.names:
            raise UnavailableError(f"the probe decode answered {names} (finish_reason {answer.finish_reason!r}); "
                                   "expected one probe tool")
        return {"tool": names[0], "latency_ms": round((time.perf_counter() - started) * 1e3, 2)}

    # -- reload ---------------------------------------------------------------------------------------------------

    async def reload(self, name: str) -> dict[str, Any]:
        """Re-read ``name``'s file, compile it (in a thread; the compile cache makes an unchanged one a lookup) and
        swap its engine: requests decoding now finish on the old artifact, later ones get the new one. A file that
        no longer loads or compiles raises ``RegistryReloadError`` and the old version keeps serving."""
        path = self.served(name).path
        if path is None:
            raise RegistryReloadError(f"registry {name!r} was not loaded from a file; there is nothing to reload")
        async with self._reload_locks.setdefault(name, asyncio.Lock()):  # one reload of a registry at a time
            old = self._served[name]
            started = time.perf_counter()
            try:
                new = await asyncio.to_thread(self._load, name, path)
            except ServeError as exc:
                self.metrics.reloads.labels(name, exc.code).inc()
                raise
            self.worker.install(name, self._engine(new.artifact))
            self._served[name] = new
            self.metrics.reloads.labels(name, "ok").inc()
        return {**new.summary(default=name == self.default_registry),
                "changed": new.artifact.sha256 != old.artifact.sha256,
                "reload_ms": round((time.perf_counter() - started) * 1e3, 2)}

    def _load(self, name: str, path: Path) -> ServedRegistry:
        try:
            registry = load_registry(path)
            if registry.name != name:
                raise RegistryReloadError(f"{path} now names its registry {registry.name!r}; a reload keeps the "
                                          f"name {name!r} (serve it under a new name instead)")
            return ServedRegistry.compile(registry, self.tokenizer, self.prompt, path=path, cache_dir=self.cache_dir)
        except RegistryReloadError:
            raise
        except (TooltrieError, OSError) as exc:
            raise RegistryReloadError(f"registry {name!r} was not reloaded, the previous version keeps serving: "
                                      f"{exc}") from exc


def _settle(future: asyncio.Future[Outcome], outcome: Outcome) -> None:
    if not future.done():  # a request that timed out or lost its client has no one waiting
        future.set_result(outcome)

