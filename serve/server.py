"""The discovery endpoint: a FastAPI app over a ``DiscoveryService``, with MCP mounted at ``/mcp``.

Routes: ``POST /v1/discover``, ``GET /v1/registries``, ``POST /v1/registries/{name}/reload``, ``GET /healthz``,
``GET /metrics`` (Prometheus), ``/docs`` and ``/openapi.json`` (FastAPI), and MCP's streamable HTTP transport at
``/mcp`` (the ``discover_tools`` tool). ``tooltrie serve`` runs it with uvicorn (:func:`serve`).

Every refusal is a 4xx whose body says what is wrong, ``{"error": {"code", "message"}}``: malformed JSON 400, no
or an unknown API key 401 (with ``WWW-Authenticate: Bearer``), a registry outside the tenant's policy 403, an unknown
registry 404, a body over the limit 413, wrong types or impossible values (k out of range, an empty or too long
query, an allow/deny entry that is not a tool or tag the caller may use, k over the allowed tools) 422, a full queue
429 with ``Retry-After``; no answer in time is 504. The limits are ``ServeLimits``. A server that answers through
vLLM (``--vllm-url``) says 502 when vLLM cannot be reached or refuses, 504 when it does not answer in time.

With a policy (``policy.py``) every route but ``OPEN_PATHS`` (health, metrics, API docs: no tool data) needs
``Authorization: Bearer <key>``, MCP included; :class:`_Authenticate` resolves the key to its tenant before any
route runs, and the routes pass that tenant on to the service. Without one, the server is open and binds loopback
only (``check_open_binding``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tooltrie.compiler.artifact import Artifact
from tooltrie.errors import TooltrieError
from tooltrie.ranker import DEFAULT_PRIOR, Weights
from tooltrie.serve.adapter import AdapterRecord
from tooltrie.serve.errors import QueueFullError, ServeError, UnauthorizedError, UnavailableError, WarmingError
from tooltrie.serve.limits import ServeLimits
from tooltrie.serve.mcp_tools import MCP_PATH, TENANT_SCOPE_KEY, mcp_server
from tooltrie.serve.metrics import ServeMetrics
from tooltrie.serve.policy import Policy, Tenant, check_open_binding
from tooltrie.serve.prefilter import Prefilter, PrefilterError
from tooltrie.serve.proxy import CHAT_PATH, DEFAULT_K, ChatProxy
from tooltrie.serve.request import Request
from tooltrie.serve.schema import DiscoverBody, DiscoverResponse, ErrorBody, ToolSearchBody
from tooltrie.serve.service import Disconnected, DiscoveryService
from tooltrie.serve.training import TrainingJob

logger = logging.getLogger(__name__)

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": description} for status, description in {
        400: "malformed JSON", 401: "no API key, or an unknown one (with a policy)",
        403: "a registry outside the tenant's policy", 404: "unknown registry", 413: "body over the size limit",
        422: "wrong types or impossible values (k out of range, empty or too long query, an allow/deny entry that "
             "is not a tool or tag the caller may use, k over the allowed tools)",
        429: "queue full (see Retry-After)",
        502: "the vLLM server behind the endpoint cannot be reached or refused (serve --vllm-url)",
        504: "no answer within the server's timeout"}.items()}


def create_app(service: DiscoveryService, *, host: str = "127.0.0.1", proxy: ChatProxy | None = None) -> FastAPI:
    """The app; its lifespan starts and stops ``service`` (the worker thread) and MCP's session manager.

    ``host`` is what the server binds: on a loopback address MCP refuses requests whose Host or Origin header is
    not local (protection against DNS rebinding). ``proxy``: chat completions forwarded with their tools narrowed
    (``tooltrie proxy``, ``proxy.py``).
    """
    mcp = mcp_server(service)
    mcp_app = mcp.streamable_http_app(streamable_http_path=MCP_PATH, stateless_http=True, json_response=True,
                                      host=host, max_request_body_size=service.limits.max_tools_body_bytes)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        service.start()
        service.warm_up()  # the priors not made yet, while the server listens (/healthz: warming)
        training = asyncio.create_task(service.run_training())  # returns at once without a trainer
        try:
            async with mcp.session_manager.run():
                yield
        finally:
            training.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await training
            if proxy is not None:
                await proxy.close()
            await asyncio.to_thread(service.stop)

    app = FastAPI(title="tooltrie discovery", version="0.1.0", lifespan=lifespan,
                  description="Which registry tools answer this request? Exactly k distinct tools that exist, "
                              "decoded by a language model under a trie over its token ids. MCP: `discover_tools` "
                              f"at `{MCP_PATH}` (streamable HTTP).")
    if service.policy is not None:  # added first, so it runs inside _BodyLimit, which counts its 401s
        app.add_middleware(_Authenticate, policy=service.policy)
    app.add_middleware(_BodyLimit, max_body_bytes=service.limits.max_body_bytes, metrics=service.metrics,
                       larger={path: service.limits.max_tools_body_bytes for path in TOOL_LIST_PATHS})
    app.add_exception_handler(ServeError, _serve_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)

    @app.post("/v1/discover", response_model=DiscoverResponse, responses=_ERRORS, tags=["discovery"])
    async def discover(body: DiscoverBody, request: HttpRequest) -> dict[str, Any]:
        """Exactly k distinct tools of the registry that best answer the query, most relevant first."""
        ask = Request(query=body.query, k=body.k, registry=body.registry,
                      allow=None if body.allow is None else tuple(body.allow), deny=tuple(body.deny),
                      prefilter=body.prefilter, tenant=_tenant(request), ranker=body.ranker, prior_kind=body.prior,
                      pin=tuple(body.pin), pin_within_k=body.pin_within_k)
        return await service.discover(ask, disconnected=_until_disconnected(request))

    @app.post("/v1/tool-search", responses=_ERRORS, tags=["discovery"])
    async def tool_search(body: ToolSearchBody, request: HttpRequest) -> dict[str, Any]:
        """A tool search call the way agent platforms make it (deferred tools, a search tool called with the user's
        words): up to ``limit`` tools, answered as Anthropic's ``tool_result`` of ``tool_reference`` blocks,
        OpenAI's client-executed ``tool_search_output``, or a plain list (``format``)."""
        return await service.search(body.query, limit=body.limit, form=body.format, call_id=body.call_id,
                                    namespaces=None if body.namespaces is None else tuple(body.namespaces),
                                    registry=body.registry, tenant=_tenant(request), pin=tuple(body.pin),
                                    tools=body.tools)

    if proxy is not None:
        @app.post(CHAT_PATH, tags=["proxy"], responses={502: {"model": ErrorBody, "description": "no upstream"}})
        async def chat_completions(request: HttpRequest) -> Response:
            """An OpenAI chat completion, forwarded to the upstream server with only the tools that fit its last
            user turn (``tooltrie proxy``); the upstream's answer as it sent it (``x-tooltrie-tools``: sent/listed)."""
            try:
                body = json.loads(await request.body())
            except ValueError:
                return _error(400, "malformed_json", "the request body is not JSON")
            if not isinstance(body, dict):
                return _error(422, "invalid_request", "a chat completion request is a JSON object")
            status, headers, chunks = await proxy.forward(body, request.headers)
            return StreamingResponse(chunks, status_code=status, headers=headers)

    @app.get("/v1/registries", tags=["registries"], responses={401: _ERRORS[401]})
    async def registries(request: HttpRequest) -> dict[str, Any]:
        """The registries served (with a policy: those the tenant may use, and how many of their tools): name, tool
        count, placement (constant or global memory) and hashes."""
        return {"registries": service.registries(_tenant(request))}

    @app.post("/v1/registries/{name}/reload", tags=["registries"],
              responses={401: _ERRORS[401], 403: {"model": ErrorBody, "description": "the tenant is not an admin"},
                         404: _ERRORS[404], 422: {"model": ErrorBody, "description": "the file no longer loads"}})
    async def reload(name: str, request: HttpRequest) -> dict[str, Any]:
        """Re-read the registry's file, compile it and swap it in: requests already decoding finish on the old
        version, later ones get the new one. A file that no longer loads (or no longer fits the policy) leaves the
        old version serving (422). With a policy, only an admin tenant may reload."""
        return await service.reload(name, tenant=_tenant(request))

    @app.post("/v1/registries/{name}/train", tags=["registries"],
              responses={401: _ERRORS[401], 403: {"model": ErrorBody, "description": "the tenant is not an admin"},
                         404: _ERRORS[404], 503: {"model": ErrorBody, "description": "the server trains no adapters"}})
    async def train(name: str, request: HttpRequest) -> dict[str, Any]:
        """Train the registry's own adapter in the background (a server started with --train): the answers use
        the fused ranker meanwhile, and the adapter is swapped in when ready. Returns the training's status, also
        shown in /v1/registries and /metrics. With a policy, only an admin tenant may."""
        return await service.train(name, tenant=_tenant(request))

    @app.get("/healthz", tags=["health"], responses={503: {"model": ErrorBody, "description": "the probe failed"}})
    async def healthz() -> dict[str, Any]:
        """A probe decode on a tiny probe grammar, through the same worker and model as every request; 503 when
        it fails or takes longer than the request timeout, and 503 "warming" (with Retry-After) while the server
        is still making its registries' priors (``tooltrie serve`` starts listening before that)."""
        service.warmup.check(names=service.policy is None)
        try:
            probe = await service.probe()
        except UnavailableError:
            raise
        except ServeError as exc:
            raise UnavailableError(f"the probe decode failed: {exc}") from exc
        # Under a policy the probe is open to all, so it does not say which registries exist (as /v1 does not).
        registries = {"registries": [summary["name"] for summary in service.registries()]} if (
            service.policy is None) else {}
        return {"status": "ok", "probe": probe, **registries, "queued": service.worker.queued,
                "queue_limit": service.limits.queue}

    @app.get("/metrics", tags=["health"], response_class=Response)
    async def metrics() -> Response:
        """Prometheus text format: requests by outcome, latency and batch-size histograms, queue, reloads."""
        return Response(service.exposition(), media_type=service.metrics.content_type)

    app.router.routes.extend(mcp_app.routes)  # the MCP endpoint, after (and so never shadowing) the routes above
    return app


def _tenant(request: HttpRequest) -> Tenant | None:
    """Whom ``_Authenticate`` found the request's key belongs to (None: the server has no policy)."""
    tenant = request.scope.get(TENANT_SCOPE_KEY)
    return tenant if isinstance(tenant, Tenant) else None


def _until_disconnected(request: HttpRequest) -> Disconnected:
    """A coroutine function that returns once the client has gone. The body has been read by then, so the next
    ASGI message is ``http.disconnect`` (uvicorn sends nothing else until the response is complete)."""

    async def until_disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return until_disconnected


# -- errors ---------------------------------------------------------------------------------------------------------

def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


async def _serve_error(_: HttpRequest, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServeError)
    headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, QueueFullError | WarmingError) else None
    if isinstance(exc, UnauthorizedError):
        headers = {"WWW-Authenticate": exc.challenge}
    return _error(exc.status, exc.code, str(exc), headers)


async def _validation_error(request: HttpRequest, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    for error in errors:
        if error.get("type") == "json_invalid":
            reason = (error.get("ctx") or {}).get("error", "not JSON")
            position = [part for part in error.get("loc", ()) if isinstance(part, int)]
            where = f" at character {position[0]}" if position else ""
            return _error(400, "malformed_json", f"the body is not valid JSON{where}: {reason}")
    body = _BODIES.get(request.url.path, DiscoverBody)
    return _error(422, "invalid_request", "; ".join(_describe(error, body) for error in errors) or "invalid request")


# The routes whose bodies may carry an agent's tool list (``ServeLimits.max_tools_body_bytes``).
TOOL_LIST_PATHS = ("/v1/tool-search", MCP_PATH, CHAT_PATH)
_BODIES: dict[str, type[BaseModel]] = {"/v1/discover": DiscoverBody, "/v1/tool-search": ToolSearchBody}


def _describe(error: dict[str, Any], body: type[BaseModel]) -> str:
    """One validation error in words, naming the field: ``k: Input should be a valid integer (got "3")``."""
    path = [str(part) for part in error.get("loc", ()) if part != "body"]
    kind = error.get("type", "")
    fields = ", ".join(body.model_fields)
    if not path and kind == "value_error":  # a rule across fields (a model validator's message)
        return str(error.get("msg", "invalid")).removeprefix("Value error, ")
    if not path:
        return (f"the body must be a JSON object with the fields {fields}" if kind != "missing"
                else f"a JSON body is required, with the fields {fields}")
    field = ".".join(path)
    if kind == "extra_forbidden":
        return f"unknown field {field!r} (the fields are {fields})"
    if kind == "missing":
        return f"{field}: required"
    got = json.dumps(error.get("input"), ensure_ascii=False, default=str)
    return f"{field}: {error.get('msg', 'invalid')} (got {got[:80]})"


async def _http_error(_: HttpRequest, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return _error(exc.status_code, code, str(exc.detail), dict(exc.headers or {}))


async def _unexpected_error(_: HttpRequest, exc: Exception) -> JSONResponse:
    logger.error("unexpected error", exc_info=exc)
    return _error(500, "internal", f"internal error ({type(exc).__name__}); see the server's log")


# Routes that hold no tool data stay open with a policy: probes and scrapers carry no key. Any other path, including
# ones that do not exist (default deny: a 404 would tell a stranger which routes there are), needs a key.
OPEN_PATHS = frozenset({"/healthz", "/metrics", "/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc"})


class _Authenticate:
    """ASGI middleware: resolves ``Authorization: Bearer <key>`` to its tenant (``scope[TENANT_SCOPE_KEY]``) for
    every HTTP route but ``OPEN_PATHS``, MCP included, or answers 401 with ``WWW-Authenticate: Bearer``. The key
    appears in no message and no log line (uvicorn's access log shows the request line, never headers)."""

    def __init__(self, app: ASGIApp, *, policy: Policy) -> None:
        self.app, self.policy = app, policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            scope[TENANT_SCOPE_KEY] = self._tenant([value for name, value in scope["headers"]
                                                    if name == b"authorization"])
        except UnauthorizedError as exc:
            await _error(exc.status, exc.code, str(exc), {"WWW-Authenticate": exc.challenge})(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _tenant(self, values: list[bytes]) -> Tenant:
        if not values:
            raise UnauthorizedError("an API key is required: send Authorization: Bearer <key>")
        if len(values) > 1:
            raise UnauthorizedError("send one Authorization header, not several", invalid_token=True)
        scheme, _, key = values[0].decode("latin-1").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise UnauthorizedError("the Authorization header must be 'Bearer <key>'", invalid_token=True)
        tenant = self.policy.authenticate(key)
        if tenant is None:
            raise UnauthorizedError("the API key is not valid", invalid_token=True)
        return tenant


class _BodyLimit:
    """ASGI middleware: reads the body (up to ``max_body_bytes``) before the app sees it, refusing a larger one
    with 413 whatever its route (MCP included); and counts responses by status for ``/metrics``."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, metrics: ServeMetrics,
                 larger: Mapping[str, int] | None = None) -> None:
        """``larger``: the limits of the paths that take more (a tool search carrying the agent's tool list)."""
        self.app, self.max_body_bytes, self.metrics, self.larger = app, max_body_bytes, metrics, dict(larger or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http_responses.labels(str(message["status"])).inc()
            await send(message)

        limit = self.larger.get(scope["path"].rstrip("/"), self.max_body_bytes)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await self._too_large(scope, receive, counting_send, limit)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: no one to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._too_large(scope, receive, counting_send, limit)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, counting_send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        response = _error(413, "body_too_large", f"the request body is over the limit of {limit:,} bytes")
        await response(scope, receive, send)


# -- the command ----------------------------------------------------------------------------------------------------

def prefilter_limits(given: dict[str | None, int], names: list[str]) -> dict[str, int]:
    """Each served registry's pre-filter size from ``--prefilter`` (``{None: N}`` for a bare N): its own, else the
    bare one's, whatever their order.

    >>> prefilter_limits({"catalog": 5, None: 20}, ["catalog", "bfcl"])
    {'catalog': 5, 'bfcl': 20}
    """
    unknown = sorted(str(key) for key in given if key is not None and key not in names)
    if unknown:
        raise PrefilterError(f"--prefilter names registries {unknown}, which are not served ({', '.join(names)})")
    return {name: given[name] if name in given else given[None] for name in names if name in given or None in given}


def serve(*, registries: Sequence[Path], model: str | None = None, adapter: bool = True, tokenizer: str | None = None,
          host: str = "127.0.0.1", port: int = 8000, limits: ServeLimits | None = None,
          log_level: str = "info", policy: Path | None = None, prefilter: dict[str | None, int] | None = None,
          dtype: str = "auto", separator: str | None = None, ranker: str = "auto", prior: str = DEFAULT_PRIOR,
          fused_weights: Weights | None = None, train: TrainingJob | None = None, vllm_url: str | None = None,
          vllm_model: str | None = None, vllm_artifacts: Path | None = None, upstream: str | None = None,
          upstream_k: int = DEFAULT_K, upstream_pin: Sequence[str] = ()) -> None:
    """``tooltrie serve``: load the model, compile (or take from the cache) each registry, and serve until
    interrupted. ``registries``: registry files or compiled artifacts (``separator``: the contract's for the files,
    None for the default). ``policy``: the tenants' file (None: open, on loopback only); ``prefilter``: the top N by
    retrieval per registry name (None as the name: every registry), each also the most a request may ask for;
    ``dtype``: a ``serve.model.DTYPE_NAMES`` entry; ``ranker``, ``prior`` and ``fused_weights``: what answers rank by
    unless a request says (``tooltrie/ranker.py``; weights None: ``ranker_policy.fused_weights`` per registry).
    ``train``: each registry gets its own adapter, from the adapter cache or trained in the background by this job
    (``serve/training.py``; ``tooltrie.train.recipe.Recipe``), over the base model (the model's own adapter, if
    any, answers the others meanwhile).

    ``vllm_url``: answer through the vLLM server there (``vllm_remote.py``) instead of loading the model: ``model``
    then says which model that server runs (for its tokenizer and prompt style), ``vllm_model`` its name there (None:
    the only one it lists), ``vllm_artifacts`` the directory the artifacts are written to for it to read; a
    ``dtype`` other than auto is refused then (the model's dtype is that server's).

    ``upstream``: also forward chat completions to the OpenAI-compatible server there, each with the ``upstream_k``
    tools that fit its last user turn and ``upstream_pin`` (``tooltrie proxy``, ``proxy.py``); the client's
    Authorization goes on to it, so no ``policy`` then."""
    if upstream is not None and (policy is not None or vllm_url is not None):
        raise TooltrieError("tooltrie proxy takes no --policy (the client's Authorization header is the upstream's) "
                            "and no --vllm-url")
    if vllm_url is not None and dtype != "auto":  # nothing here would use it: say so rather than ignore it
        raise TooltrieError(f"--dtype {dtype} cannot be used with --vllm-url: no model is loaded here, and the "
                            "model's dtype is the vLLM server's (vllm serve --dtype)")
    import uvicorn
    from transformers.utils import logging as transformers_logging

    from tooltrie.compiler import TokenizerInfo
    from tooltrie.serve.decoder import release_copied_weights
    from tooltrie.serve.model import cast_parameters, load_model, serving_dtype, training_mismatch
    from tooltrie.serve.prompt import Prompt
    from tooltrie.serve.training import AdapterTrainer

    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    if vllm_url is not None:
        _serve_through_vllm(registries=registries, model=model, adapter=adapter, tokenizer=tokenizer, host=host,
                            port=port, limits=limits, log_level=log_level, separator=separator, url=vllm_url,
                            name=vllm_model, artifact_dir=vllm_artifacts, policy=policy, prefilter=prefilter,
                            ranker=ranker, prior=prior, fused=fused_weights, refused=["--train"] if train else [])
        return
    tenants = Policy.load(policy) if policy is not None else None
    check_open_binding(host, tenants)  # before anything slow: an open server may listen on loopback only
    names, artifacts = read_registries(registries)  # a bad one is refused before the model loads
    top_n = Prefilter.over(prior, limits=prefilter_limits(prefilter or {}, names))
    trainer = None
    if train is not None:  # adapters are trained on the model as served: its float32 weights' fingerprint keys them
        loaded, info = load_model(model, adapter=adapter)
        trainer = AdapterTrainer(job=train, base_model=model, base_adapter=adapter, base_fingerprint=info.fingerprint)
        loaded = cast_parameters(loaded, serving_dtype(dtype))
    else:
        loaded, info = load_model(model, adapter=adapter, dtype=serving_dtype(dtype))
    release_copied_weights(loaded)  # its engines hold the layers' weights in their own layout: not twice
    service = DiscoveryService.from_paths(registries, loaded, TokenizerInfo.load(tokenizer or info.tokenizer),
                                          prompt=Prompt.style(info.prompt_style), limits=limits, policy=tenants,
                                          prefilter=top_n, separator=separator, ranker=ranker, prior=prior,
                                          fused=fused_weights, base_adapter=info.adapter, trainer=trainer,
                                          warm=False, loaded=artifacts)  # warmed while listening (/healthz: warming)
    for name in names:  # the model answers validly anyway, but may not know these tools
        registry = service.served(name)
        mismatch = training_mismatch(registry.adapter or info.adapter, registry.artifact)
        if trainer is not None and trainer.status.get(name) is not None:
            print(f"tooltrie serve: {name}: training its own adapter in the background (fused ranker meanwhile)",
                  file=sys.stderr)
        elif mismatch:
            print(f"tooltrie serve: warning: {name}: {mismatch}", file=sys.stderr)
    served = ", ".join(f"{summary['name']} ({summary['tools']} tools)" for summary in service.registries())
    print(f"tooltrie serve: {served} with {info.name}, on http://{host}:{port} (docs /docs, MCP {MCP_PATH})",
          file=sys.stderr)
    access = (f"policy {policy}: {len(tenants.tenants)} tenants, API keys required (Authorization: Bearer)"
              if tenants is not None else "no --policy: OPEN to every client that can reach it, on loopback only")
    print(f"tooltrie serve: {access}; prefilter: {top_n.unavailable or 'available'}", file=sys.stderr)
    proxy = None if upstream is None else ChatProxy(service, upstream, k=upstream_k, pin=tuple(upstream_pin))
    if proxy is not None:
        print(f"tooltrie proxy: chat completions forwarded to {upstream} with {upstream_k} tools each (and "
              f"{len(proxy.pin)} pinned)", file=sys.stderr)
    uvicorn.run(create_app(service, host=host, proxy=proxy), host=host, port=port, log_level=log_level)


def _serve_through_vllm(*, registries: Sequence[Path], model: str | None, adapter: bool, tokenizer: str | None,
                        host: str, port: int, limits: ServeLimits | None, log_level: str, separator: str | None,
                        url: str, name: str | None, artifact_dir: Path | None, policy: Path | None,
                        prefilter: dict[str | None, int] | None, ranker: str, prior: str, fused: Weights | None,
                        refused: list[str]) -> None:
    """``serve`` with the decoding done by the vLLM server at ``url``: no model is loaded here. The tools a request
    may use (``policy``'s tenants, allow/deny, ``prefilter``) and its prior (``ranker``, ``prior``, ``fused``) are
    made here and sent to vLLM's processor."""
    import uvicorn

    from tooltrie.compiler import TokenizerInfo
    from tooltrie.compiler.cache import default_cache_dir
    from tooltrie.serve.prompt import Prompt
    from tooltrie.serve.vllm_remote import VllmServer

    if refused:  # training needs the model here
        raise TooltrieError(f"{', '.join(refused)} cannot be used with --vllm-url: the vLLM processor answers with "
                            "the model vLLM runs")
    tenants = Policy.load(policy) if policy is not None else None
    check_open_binding(host, tenants)
    names, artifacts = read_registries(registries)  # a bad one is refused before anything else
    top_n = Prefilter.over(prior, limits=prefilter_limits(prefilter or {}, names))
    tokenizer_source, style, served_adapter = _served_text(model, adapter=adapter)
    limits = limits or ServeLimits()
    remote = VllmServer(url, artifact_dir or default_cache_dir() / "vllm", model=name, timeout_s=limits.timeout_s,
                        concurrency=limits.max_batch * (len(registries) + 1))
    service = DiscoveryService.from_paths(registries, None, TokenizerInfo.load(tokenizer or tokenizer_source),
                                          prompt=Prompt.style(style), limits=limits, separator=separator,
                                          policy=tenants, prefilter=top_n,
                                          ranker=ranker, prior=prior, fused=fused, base_adapter=served_adapter,
                                          remote=remote, warm=False, loaded=artifacts)
    served = ", ".join(f"{summary['name']} ({summary['tools']} tools)" for summary in service.registries())
    access = (f"policy {policy}: {len(tenants.tenants)} tenants, API keys required" if tenants is not None
              else "no --policy: open, on loopback only")
    print(f"tooltrie serve: {served} through the vLLM server at {remote.base} (artifacts in {remote.artifact_dir}, "
          f"{style} prompt), on http://{host}:{port} ({access})", file=sys.stderr)
    uvicorn.run(create_app(service, host=host), host=host, port=port, log_level=log_level)


def read_registries(paths: Sequence[Path]) -> tuple[list[str], dict[Path, Artifact]]:
    """The registries' names, each file read and checked; the artifacts among them kept, so that each is read once
    (a 100,000-tool artifact takes 4.5 s a read)."""
    from tooltrie.compiler.sources import is_artifact, registry_of

    artifacts = {Path(path): Artifact.load(path) for path in paths if is_artifact(path)}
    names = [artifacts[Path(path)].registry.name if Path(path) in artifacts else registry_of(path).name
             for path in paths]
    return names, artifacts


def _served_text(model: str | None, *, adapter: bool) -> tuple[str | None, str, AdapterRecord | None]:
    """The tokenizer (None: the bundled one), prompt style and adapter record of ``model`` as ``load_model`` would
    load it, read without loading its weights: what a vLLM server running that model is fed, and what its answers'
    rankers are chosen by (``ranker_policy``)."""
    from tooltrie.serve.adapter import is_adapter_dir, read_adapter
    from tooltrie.serve.model import DEFAULT_MODEL_NAME, bundled_adapter

    if model is None or (model == DEFAULT_MODEL_NAME and not Path(model).exists()):
        bundled = bundled_adapter() if adapter else None
        record = read_adapter(bundled) if bundled is not None else None
        return None, record.prompt_style if record is not None else "catalog", record
    path = Path(model)
    if is_adapter_dir(path):
        record = read_adapter(path)
        base = Path(record.base_model)
        return ((str(base) if (base / "tokenizer.json").is_file() else None),
                record.prompt_style if adapter else "catalog", record if adapter else None)
    return (str(path) if (path / "tokenizer.json").is_file() else None), "catalog", None
