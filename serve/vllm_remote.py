"""Answers through a vLLM server (``tooltrie serve --vllm-url URL``): the discovery endpoint as it is (admission,
queue, timeouts, the JSON it returns), the decoding done by a ``vllm serve`` that loaded tooltrie's logits processor
and reads the same artifact files: written here into the directory that is the processor's artifact root there
(``$TOOLTRIE_ARTIFACT_ROOT``), and named, never given as paths. One endpoint in front of a bigger model, or of many
replicas behind vLLM's own load balancing (tensor and data parallelism are vLLM's).

Each request is one call of vLLM's OpenAI completions route: the prompt's token ids (``Prompt.ids``, what the
in-process engine feeds), greedy, at most the answer's budget of tokens, the request arguments in their flat form
(``request_args(..., flat=True)``: ``vllm_xargs`` carries no nested objects: the artifact's name, k and, for a
request whose tools admission narrowed (a tenant's policy, allow/deny, the prefilter), their ids; for one ranked by
``retrieval`` or ``fused``, its prior, made at admission as in process, and where that prior follows the answer the
request's text and how: ``tooltrie_query``, ``tooltrie_follow``) and the chosen tokens' logprobs. Started
with ``--logprobs-mode processed_logprobs``, vLLM reports them after the processor: log-probabilities under the
constraint, of the fused values where a prior came (``TrieBatch.fuse_logits_``), what the engine scores with. The
answer's tokens are then replayed through the trie here (:func:`replay`), which checks that they are k distinct
registry tools (a server without the processor answers in prose) and says which decisions belong to which tool: a
tool's score is the sum of its decisions' logprobs, as the engine reports it.

:class:`RemoteEngine` stands where an ``Engine`` stands in the worker (``worker.py``): ``submit`` starts the call on
a thread of the server's pool, ``step`` hands back what has finished. A vLLM that cannot be reached, refuses the
request or answers something that is not an answer is a 502 for that request, one that does not answer in time a
504; the endpoint goes on. The client is told the kind of failure and a request id (:func:`upstream_error`), nothing
internal: vLLM's address, its answer, the error's text and the artifacts' directory are logged (WARNING) under the
same id.
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tooltrie.compiler.artifact import Artifact
from tooltrie.compiler.tokenizer_info import TokenizerInfo
from tooltrie.errors import DecodeError
from tooltrie.integrations.vllm_rows import request_args
from tooltrie.kernels.batch import TrieBatch
from tooltrie.ranker import MODEL_ONLY, Prior, Ranker, RankerError
from tooltrie.serve.errors import BadGatewayError, UpstreamError, UpstreamTimeoutError
from tooltrie.serve.limits import answer_budget
from tooltrie.serve.prompt import Prompt
from tooltrie.serve.request import Answer, Request, RequestStatus, ToolChoice, check_request, request_prior

# How long ``step`` waits for a call to finish before it returns to the worker's loop (which then takes new jobs and
# cancellations): short, since the worker does nothing else meanwhile. One wait per turn of the worker's loop, for
# the calls of all its lanes (``VllmServer.wait_for_answers``): N registries do not wait N times.
STEP_WAIT_S = 0.01
# What a call leaves of the service's timeout (a quarter of a timeout under 2 s): time to replay the answer and hand it
# back through the worker's step before the service gives up on the request. So a vLLM that does not answer in time
# is reported as such (504, upstream_timeout), and the pool thread the call held is free again by then.
UPSTREAM_MARGIN_S = 0.5

logger = logging.getLogger(__name__)

# The kinds of failure a client is told of (``upstream_error``); the details go to the log.
UNREACHABLE = "the decoding server could not be reached"
NOT_AN_ANSWER = "the decoding server answered something that is not an answer"
LATE = "the decoding server did not answer in time"


def refused(status: int) -> str:
    """The kind of failure of a reply with HTTP ``status`` (not 200): vLLM refused the request (a 4xx, e.g. our
    arguments) or failed on it.

    >>> refused(400), refused(503)
    ('the decoding server refused the request (HTTP 400)', 'the decoding server failed on the request (HTTP 503)')
    """
    return f"the decoding server {'refused' if 400 <= status < 500 else 'failed on'} the request (HTTP {status})"


def upstream_error(kind: str, detail: str, error: type[UpstreamError] = BadGatewayError) -> UpstreamError:
    """The ``error`` (502, or ``UpstreamTimeoutError``'s 504) a client gets for a failure of the vLLM server: its
    ``kind`` and a request id made for it, nothing internal. ``detail`` (the server's address, its answer, the
    error's text) is logged at WARNING with the same id."""
    request_id = secrets.token_hex(8)
    logger.warning("request id %s: %s: %s", request_id, kind, detail)
    return error(f"{kind} (request id {request_id}; the details are in the endpoint's log)", request_id=request_id)


def upstream_timeout_s(timeout_s: float) -> float:
    """How long a call may wait for vLLM within the service's ``timeout_s``: its deadline, less the margin.

    >>> upstream_timeout_s(30.0), upstream_timeout_s(1.0)
    (29.5, 0.75)
    """
    return timeout_s - min(UPSTREAM_MARGIN_S, timeout_s / 4)


@dataclass
class VllmServer:
    """Where the vLLM server is and how it is called. ``url``: its base (``http://host:port``, with or without
    ``/v1``); ``artifact_dir``: where the artifacts are written for it to read (the directory its processor's
    ``$TOOLTRIE_ARTIFACT_ROOT`` names, shared by both machines); ``model``: the name it serves (None: the one its
    ``/v1/models`` lists); ``timeout_s``: the service's timeout, which a call ends before (``upstream_timeout_s``);
    ``concurrency``: calls in flight at once."""

    url: str
    artifact_dir: Path
    model: str | None = None
    timeout_s: float = 30.0
    concurrency: int = 64
    _client: httpx.Client | None = field(default=None, init=False, repr=False)
    _pool: ThreadPoolExecutor | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _answered: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _waiter: object | None = field(default=None, init=False, repr=False)
    _waited_at: float = field(default=float("-inf"), init=False, repr=False)

    @property
    def base(self) -> str:
        url = self.url.rstrip("/")
        return url if url.endswith("/v1") else url + "/v1"

    @property
    def client(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                self._client = httpx.Client(timeout=upstream_timeout_s(self.timeout_s), limits=httpx.Limits(
                    max_connections=self.concurrency, max_keepalive_connections=self.concurrency))
            return self._client

    @property
    def pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="tooltrie-vllm")
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, client, self._pool, self._client = self._pool, self._client, None, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if client is not None:
            client.close()

    def answered(self, _: object = None) -> None:
        """A call finished (its future's done-callback): the worker's wait ends."""
        self._answered.set()

    def wait_for_answers(self, lane: object, timeout: float) -> None:
        """Wait up to ``timeout`` for any call of any lane to finish, once per turn of the worker's loop: the lane
        that waited last waits again; the others step without waiting, unless it has not waited for two timeouts
        (it is idle now). Called from the worker's thread only."""
        if self._waiter is not lane and time.monotonic() - self._waited_at < 2 * timeout:
            return
        self._waiter = lane
        self._answered.wait(timeout)
        self._answered.clear()  # calls finishing from now on set it again; those finished already are collected
        self._waited_at = time.monotonic()

    def artifact_path(self, artifact: Artifact) -> Path:
        """The artifact as a file vLLM's processor loads (by its name, in its root): named by its content, written
        (atomically) once."""
        label = re.sub(r"[^A-Za-z0-9_-]", "_", artifact.registry.name)[:64]
        path = self.artifact_dir / f"{label}-{artifact.sha256[:16]}.trie.safetensors"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            artifact.save(path)
        return path

    def model_name(self, *, deadline: float | None = None) -> str:
        if self.model is None:
            data = self._call("GET", "/models", deadline=deadline).get("data")
            listed = [entry.get("id") if isinstance(entry, dict) else None
                      for entry in (data if isinstance(data, list) else [data])]
            if len(listed) != 1 or not isinstance(listed[0], str):
                raise upstream_error(NOT_AN_ANSWER, f"the vLLM server at {self.base} serves models {listed}; name "
                                     "the one to use (--vllm-model)")
            self.model = listed[0]
        return self.model

    def complete(self, body: dict[str, Any], *, deadline: float | None = None) -> dict[str, Any]:
        """One call of the completions route with the model's name filled in, over by ``deadline``
        (``time.monotonic()``; None: ``upstream_timeout_s`` from now)."""
        return self._call("POST", "/completions", {"model": self.model_name(deadline=deadline), **body},
                          deadline=deadline)

    def _call(self, method: str, route: str, body: dict[str, Any] | None = None, *,
              deadline: float | None = None) -> dict[str, Any]:
        url = self.base + route
        # httpx bounds each wait (connect, send, each read) by it: a vLLM that sends nothing is left at the deadline.
        left = upstream_timeout_s(self.timeout_s) if deadline is None else deadline - time.monotonic()

        def late() -> UpstreamError:
            return upstream_error(LATE, f"the vLLM server at {self.base} did not answer {method} {route} within the "
                                  f"server's timeout of {self.timeout_s:g} s", UpstreamTimeoutError)

        if left <= 0:
            raise late()
        try:
            reply = self.client.request(method, url, json=body, timeout=left)
        except httpx.TimeoutException:
            raise late() from None
        except httpx.HTTPError as exc:
            raise upstream_error(UNREACHABLE, f"the vLLM server at {self.base} cannot be reached "
                                 f"({type(exc).__name__}: {exc})") from None
        if reply.status_code != 200:
            raise upstream_error(refused(reply.status_code), f"the vLLM server at {self.base} answered {method} "
                                 f"{route} with {reply.status_code}: {_message(reply)}")
        try:
            data = reply.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise upstream_error(NOT_AN_ANSWER, f"the vLLM server at {self.base} answered {method} {route} with "
                                 f"something that is not a JSON object: {reply.text[:500]!r}")
        return data


def _message(reply: httpx.Response) -> str:
    """vLLM's error message (``{"error": {"message"}}``), else the start of the body."""
    try:
        error = reply.json().get("error")
        message = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = None
    return str(message if message else reply.text)[:500]


class RemoteEngine:
    """An ``Engine``'s place in the worker, answered by ``server``: every request submitted is a call in flight
    (vLLM batches them); ``max_batch`` bounds how many the worker hands it at once. ``ranker`` makes the retrieval
    prior of requests ranked by ``retrieval`` or ``fused`` that come without one, as the in-process engine's does;
    the prior travels with the call and vLLM's processor fuses it into the logits its argmax reads."""

    def __init__(self, server: VllmServer, tokenizer: TokenizerInfo, artifact: Artifact, *, prompt: Prompt,
                 max_batch: int = 16, ranker: Ranker | None = None) -> None:
        artifact.check_compatible(tokenizer=tokenizer, where="engine")
        self.server, self.tokenizer, self.artifact, self.prompt, self.max_batch = (server, tokenizer, artifact,
                                                                                  prompt, max_batch)
        self.ranker = ranker
        self.artifact_path = server.artifact_path(artifact)  # written now: an unwritable directory fails at start
        self._calls: dict[Request, Future[Answer]] = {}

    @property
    def busy(self) -> bool:
        return bool(self._calls)

    @property
    def load(self) -> tuple[int, int]:
        return len(self._calls), 0

    def fresh(self) -> RemoteEngine:
        return RemoteEngine(self.server, self.tokenizer, self.artifact, prompt=self.prompt, max_batch=self.max_batch,
                            ranker=self.ranker)

    def submit(self, request: Request) -> Request:
        tools = check_request(request, self.artifact)  # the allowed tools' ids in this artifact (None: all)
        if not request.constrained or request.reasoning:
            raise DecodeError("this server answers through vLLM: constrained answers only, without reasoning")
        if request.ranked_by != "model" and self.ranker is None:
            raise RankerError(f"the {request.ranked_by} ranker needs a retrieval ranker beside the vLLM server "
                              "(RemoteEngine(..., ranker=Ranker(registry)))")
        request.prior = request_prior(request, self.ranker, self.artifact)
        request.status = RequestStatus.DECODING
        call = self._calls[request] = self.server.pool.submit(self._answer, request, tools)
        call.add_done_callback(self.server.answered)
        return request

    def cancel(self, request: Request) -> bool:
        """Forget the call (vLLM finishes it; its answer is dropped)."""
        call = self._calls.pop(request, None)
        if call is not None:
            call.cancel()
            request.status = RequestStatus.CANCELLED
        return call is not None

    def step(self) -> list[Request]:
        """The requests whose calls have finished (waiting briefly for one, once per worker turn for all lanes:
        ``VllmServer.wait_for_answers``): each answered, or failed with its ``ServeError``."""
        if self._calls and not any(call.done() for call in self._calls.values()):
            self.server.wait_for_answers(self, STEP_WAIT_S)
        finished: list[Request] = []
        for request, call in list(self._calls.items()):
            if call.done():
                del self._calls[request]
                error = call.exception()
                if error is None:
                    request.finish(call.result())
                else:
                    request.fail(error)
                finished.append(request)
        return finished

    def _answer(self, request: Request, tools: frozenset[int] | None) -> Answer:
        started = time.perf_counter()
        # The call starts as the worker hands the request over (it hands over at most ``max_batch`` at once, below
        # the pool's ``concurrency``): it must be over before the service's timeout, counted from about now.
        deadline = time.monotonic() + upstream_timeout_s(self.server.timeout_s)
        artifact, k = self.artifact, request.k
        prompt_ids = self.prompt.ids(self.tokenizer, artifact.registry, artifact.contract, request.query, k)
        reply = self.server.complete({
            "prompt": prompt_ids, "max_tokens": answer_budget(artifact, k), "temperature": 0.0,
            "logprobs": 1, "stop_token_ids": [artifact.eos_id], "skip_special_tokens": False,
            "return_token_ids": True,
            "vllm_xargs": request_args(self.artifact_path.name, k, tools=tools, sha256=artifact.sha256, flat=True,
                                       **_prior_args(request.prior))},
            deadline=deadline)
        try:
            choice = reply["choices"][0]
            tokens = [int(token) for token in choice["token_ids"]]
            logprobs = [float(lp) if lp is not None else 0.0 for lp in choice["logprobs"]["token_logprobs"]]
            finish_reason = str(choice.get("finish_reason"))
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise upstream_error(NOT_AN_ANSWER, f"the vLLM server at {self.server.base} answered without the "
                                 f"answer's tokens and logprobs ({type(exc).__name__}: {exc}); tooltrie needs vLLM "
                                 "0.32 or later") from None
        if len(logprobs) != len(tokens):
            raise upstream_error(NOT_AN_ANSWER, f"the vLLM server at {self.server.base} answered {len(tokens)} "
                                 f"tokens with {len(logprobs)} logprobs; its reply must give one logprob per token")
        if finish_reason == "stop" and (not tokens or tokens[-1] != artifact.eos_id):
            tokens.append(artifact.eos_id)  # a stop token vLLM left out of the list
            logprobs.append(0.0)
        try:
            chosen, decisions = replay(artifact, k, tokens, logprobs, width=self.tokenizer.vocab_size, subset=tools)
        except DecodeError as exc:  # the request was checked at submit: what fails now is vLLM's reply
            raise upstream_error(NOT_AN_ANSWER, f"the vLLM server at {self.server.base} answered tokens that cannot "
                                 f"be replayed through the trie ({exc})") from None
        if chosen is None:
            text = self.tokenizer.decode([t for t in tokens if t != artifact.eos_id])
            raise upstream_error(NOT_AN_ANSWER, f"the vLLM server at {self.server.base} answered {text[:120]!r}, "
                                 f"which is not {k} distinct allowed tools of registry {artifact.registry.name!r}: "
                                 "is tooltrie's processor loaded there (--logits-processors "
                                 "tooltrie.integrations.vllm:TrieVllmProcessorV1), its TOOLTRIE_ARTIFACT_ROOT the "
                                 f"directory of {self.artifact_path}?")
        ids = [t for t in tokens if t != artifact.eos_id]
        return Answer(tools=chosen, finish_reason="stop", token_ids=tokens, text=self.tokenizer.decode(ids),
                      forward_passes=len(tokens), decision_points=decisions, prompt_tokens=len(prompt_ids),
                      latency_ms=(time.perf_counter() - started) * 1e3, artifact=artifact,
                      ranker=(request.prior.weights if request.prior is not None else MODEL_ONLY).as_dict())


def _prior_args(prior: Prior | None) -> dict[str, Any]:
    """``request_args``' prior for vLLM's processor: the scores, already weighted, the model's weight, and how the
    prior follows the answer where it does (``Prior.follow``: the request's text and its four numbers travel); none
    for the model alone."""
    if prior is None or prior.scores is None:
        return {}
    args = {"prior": prior.scores, "model_weight": prior.model_weight}
    return args if prior.follow is None else {**args, "follow": prior.follow}


def replay(artifact: Artifact, k: int, tokens: Sequence[int], logprobs: Sequence[float], *, width: int,
           subset: Collection[int] | None = None) -> tuple[list[ToolChoice] | None, int]:
    """Walk ``tokens`` (an answer and its stop token) through the trie as the engine's choices walk it: the tools,
    each scored by the summed ``logprobs`` of the decisions that were about it (a token the trie forced is no
    decision), and the number of decisions; None for the tools when the tokens are not a complete answer of k
    distinct tools (of ``subset``, tool ids, when given). ``width``: the vocabulary's size."""
    batch = TrieBatch(artifact, capacity=1)
    batch.add(0, k, subset=subset)
    scores: dict[int, float] = {}
    decisions, i = 0, 0
    while i < len(tokens) and batch.is_running(0):
        token = tokens[i]
        if not 0 <= token < width:
            return None, decisions
        # The choice the engine would make if the model preferred this token: its decision counts and forced run.
        logits = np.zeros((1, width), dtype=np.float32)
        logits[0, token] = 1.0
        choice = batch.choose(logits, [0])
        if int(choice.chosen[0]) != token:
            return None, decisions
        n_legal, _, tool_index = (int(v) for v in choice.decision[0])
        if n_legal > 1:
            decisions += 1
            scores[tool_index] = scores.get(tool_index, 0.0) + logprobs[i]
        forced = choice.forced[0]
        if list(tokens[i + 1 : i + 1 + len(forced)]) != forced:
            return None, decisions
        i += 1 + len(forced)
    if not batch.is_done(0) or i != len(tokens):
        return None, decisions
    registry = artifact.registry
    return [ToolChoice(rank=rank + 1, name=registry.names[tool], pointer=registry.tools[tool].pointer,
                       score=scores.get(rank, 0.0), margin=float("inf"))
            for rank, tool in enumerate(batch.tools(0))], decisions


__all__ = ["RemoteEngine", "VllmServer", "replay"]
