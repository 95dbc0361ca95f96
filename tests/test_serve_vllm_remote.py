"""The discovery endpoint answering through a vLLM server (``serve --vllm-url``, ``serve/vllm_remote.py``), against a
stand-in for vLLM's completions route on loopback: a reference decoder (the tiny Llama's full logits for the prompt
and the answer so far, masked by ``TrieMatcher``, greedy) that answers as vLLM started with
``--logprobs-mode processed_logprobs`` does. What is checked:

- the same answers as the in-process engine, as the same JSON: tools, pointers, scores (summed from the returned
  logprobs) and token counts, at k = 1, 2, 3; the request carries the prompt's ids and the flat request arguments;
- vLLM down: 502, and the endpoint lives on (answers once vLLM is up); vLLM slow: 504 upstream_timeout, given
  before the service's own timeout, its pool thread free again; vLLM refusing the request, answering prose (no
  processor), fewer logprobs than tokens, or tokens the trie cannot replay: 502. Each names the kind of failure and
  a request id, nothing internal (vLLM's URL, its port, its answer, the artifacts' directory): those are logged with
  the request id, at WARNING;
- ``serve --vllm-url`` refuses ``--dtype`` (the model's dtype is the vLLM server's);
- the answer's token budget is one definition (``limits.answer_budget``), which the deepest answer fits, on both
  paths: what vLLM may generate, and what the in-process service keeps free of the model's context;
- allow/deny travel as the allowed tools' ids (``tooltrie_tools``), a retrieval or fused request's prior as its
  scores (``tooltrie_prior``, ``tooltrie_model_weight``) and how it follows the answer (``tooltrie_query``,
  ``tooltrie_follow``): the same answers and scores as in process; k above the
  allowed tools is a 422; the artifact is sent by its name in the processor's root (the stand-in reads it as the
  processor does, ``$TOOLTRIE_ARTIFACT_ROOT``).

The same against a real ``vllm serve``: ``test_vllm_serve_remote.py`` (``make test-vllm``).
"""

from __future__ import annotations

import base64
import json
import logging
import re
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from support.serve_http import check_answer, running_server, same_answer, smollm_tokenizer, tiny_service

from tooltrie.asks import split_asks
from tooltrie.cli import main
from tooltrie.compiler import Artifact
from tooltrie.compiler.trie import phase_of
from tooltrie.errors import DecodeError
from tooltrie.integrations.vllm_rows import (
    RequestArgs,
    artifact_root,
    load_artifact,
    parse_request_args,
    ranked,
)
from tooltrie.kernels import TrieMatcher
from tooltrie.kernels.batch import TrieBatch
from tooltrie.registry import CATALOG_PATH, load_registry
from tooltrie.serve import vllm_remote
from tooltrie.serve.limits import ServeLimits, answer_budget
from tooltrie.serve.prompt import Prompt
from tooltrie.serve.service import DiscoveryService
from tooltrie.serve.vllm_remote import VllmServer, replay
from tooltrie.testing import tiny_llama

pytestmark = pytest.mark.usefixtures("loopback_only")

QUERIES = ("What's the weather in Paris tomorrow?", "Convert 100 USD to EUR", "Find me a recipe for dinner")
TIMEOUT = 120.0
REQUEST_ID = re.compile(r"request id ([0-9a-f]{16})\b")


class StandIn:
    """vLLM's ``/v1/models`` and ``/v1/completions`` on a loopback port, answering as ``mode`` says: ``reference``
    (the tiny Llama under the trie), ``prose`` (a server without the processor), ``refuse`` (a 400), ``hang``
    (until ``release`` is set), ``short`` (as ``reference``, with the first token's logprob only)."""

    def __init__(self, port: int = 0) -> None:
        self.model = tiny_llama()
        self.mode = "reference"
        self.requests: list[dict[str, Any]] = []
        self.unfollowed: list[bool] = []  # per request whose prior follows the answer: whether, without, it differs
        self.release = threading.Event()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._reply(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stand_in.requests.append(body)
                if stand_in.mode == "hang":
                    stand_in.release.wait(60)
                if stand_in.mode == "refuse":
                    self._reply(400, {"error": {"message": "tooltrie_k must be an int", "type": "BadRequestError"}})
                    return
                try:
                    args = parse_request_args(SimpleNamespace(extra_args=body["vllm_xargs"]))
                except ValueError as exc:  # as vLLM refuses what its processor's validator refuses
                    self._reply(400, {"error": {"message": str(exc), "type": "BadRequestError"}})
                    return
                self._reply(200, stand_in.complete(body, args))

            def _reply(self, status: int, data: dict[str, Any]) -> None:
                payload = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def complete(self, body: dict[str, Any], args: RequestArgs | None) -> dict[str, Any]:
        """Greedy over the full logits, masked by the trie (under the request's subset; a request with a prior gets
        its fused values, as vLLM's processor writes them); the chosen tokens' logprobs after the processor."""
        assert args is not None
        if args.prior is not None and self.mode == "reference":
            return self.complete_fused(body, args)
        matcher = TrieMatcher(load_artifact(args.artifact), args.k, allowed=args.tools)
        tokens: list[int] = []
        logprobs: list[float] = []
        with torch.inference_mode():
            out = self.model(torch.tensor([body["prompt"]]), use_cache=True, logits_to_keep=1)
            while len(tokens) < body["max_tokens"]:
                if tokens:
                    out = self.model(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
                logits = out.logits[0, -1].float()
                if self.mode == "prose":
                    token = int(torch.argmax(logits))
                    logprob = float(torch.log_softmax(logits, -1)[token])
                else:
                    masked = torch.full_like(logits, float("-inf"))
                    legal = torch.tensor(matcher.legal_tokens() or [])
                    masked[legal] = logits[legal]
                    token = int(torch.argmax(masked))
                    logprob = float(torch.log_softmax(masked, -1)[token])
                    matcher.accept_token(token)
                tokens.append(token)
                logprobs.append(logprob)
                if token in body["stop_token_ids"]:
                    break
        finish = "stop" if tokens[-1] in body["stop_token_ids"] else "length"
        if self.mode == "short":
            logprobs = logprobs[:1]
        return {"choices": [{"index": 0, "text": "", "token_ids": tokens, "finish_reason": finish,
                             "logprobs": {"token_logprobs": logprobs}}]}

    def complete_fused(self, body: dict[str, Any], args: RequestArgs) -> dict[str, Any]:
        """As vLLM with the processor, for a request that carries a prior: its row's fused values
        (``TrieBatch.fuse_logits_``), greedy, its prior following the answer where the request says how
        (``vllm_rows.follow_up``, as the processor makes it); the answer it would have been without is noted."""
        reply = self.fused_answer(body, args)
        if args.follow is not None or args.asks is not None:
            without = self.fused_answer(body, replace(args, query=None, follow=None, asks=None))
            self.unfollowed.append(without["choices"][0]["token_ids"] != reply["choices"][0]["token_ids"])
        return reply

    def fused_answer(self, body: dict[str, Any], args: RequestArgs) -> dict[str, Any]:
        artifact = load_artifact(args.artifact)
        batch = TrieBatch(artifact, capacity=1)
        prior, follow = ranked(args, artifact)
        batch.add(0, args.k, subset=args.tools, prior=prior, model_weight=args.model_weight, follow=follow)
        tokens: list[int] = []
        logprobs: list[float] = []
        with torch.inference_mode():
            out = self.model(torch.tensor([body["prompt"]]), use_cache=True, logits_to_keep=1)
            while batch.is_running(0) and len(tokens) < body["max_tokens"]:
                if tokens:
                    out = self.model(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
                logits = out.logits[0, -1].float().numpy()[None].copy()
                batch.fuse_logits_(logits, [0])
                token = int(np.argmax(logits[0]))
                tokens.append(token)
                logprobs.append(float(torch.log_softmax(torch.from_numpy(logits[0]), -1)[token]))
                batch.accept([[token]], [0])
        return {"choices": [{"index": 0, "text": "", "token_ids": tokens, "finish_reason": "stop",
                             "logprobs": {"token_logprobs": logprobs}}]}

    def __enter__(self) -> StandIn:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def remote_service(url: str, tmp_path: Path, *, limits: ServeLimits | None = None,
                   concurrency: int = 64) -> DiscoveryService:
    limits = limits or ServeLimits(timeout_s=TIMEOUT)  # the first answer compiles the CPU kernels
    return DiscoveryService.from_paths([CATALOG_PATH], None, smollm_tokenizer(), limits=limits,
                                       cache_dir=tmp_path / "cache",
                                       remote=VllmServer(url, artifact_root(), timeout_s=limits.timeout_s,
                                                         concurrency=concurrency))


def warm_replay(artifact: Artifact) -> None:
    """Compile the CPU kernels a replay runs (once per process), outside any timeout: an answer of the lowest
    legal tokens, replayed."""
    batch = TrieBatch(artifact, capacity=1)
    batch.add(0, 1)
    tokens: list[int] = []
    width = smollm_tokenizer().vocab_size
    while batch.is_running(0):
        choice = batch.choose(np.zeros((1, width), dtype=np.float32), [0])
        tokens += [int(choice.chosen[0]), *choice.forced[0]]
    tools, _ = replay(artifact, 1, tokens, [0.0] * len(tokens), width=width)
    assert tools is not None and len(tools) == 1


@contextmanager
def client_of(service: DiscoveryService) -> Iterator[httpx.Client]:
    with running_server(service) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        yield client


def upstream_failure(reply: httpx.Response, caplog: pytest.LogCaptureFixture, url: str, *, says: str,
                     hidden: list[str], logged: list[str], status: int = 502, code: str = "bad_gateway") -> str:
    """``reply`` is a ``status`` naming the upstream's kind of failure (``says``) and a request id, and nothing
    internal: not vLLM's ``url``, host or port, the artifacts' directory, nor any of ``hidden`` (its answer, the
    error's text); the details (``logged``) are in one WARNING of ``vllm_remote``'s log, with the same request id.
    The request id."""
    assert reply.status_code == status and reply.json()["error"]["code"] == code, reply.text
    message = reply.json()["error"]["message"]
    assert says in message, message
    host, _, port = url.removeprefix("http://").partition(":")
    for text in [*hidden, url, host, f":{port}", "localhost", "http", "/v1", str(artifact_root())]:
        assert text not in reply.text, (text, reply.text)
    found = REQUEST_ID.search(message)
    assert found is not None, message
    records = [record for record in caplog.records if found.group(1) in record.getMessage()]
    assert len(records) == 1, [record.getMessage() for record in caplog.records]
    assert records[0].levelno == logging.WARNING and records[0].name == vllm_remote.__name__, records[0]
    for text in logged:
        assert text in records[0].getMessage(), (text, records[0].getMessage())
    return found.group(1)


def test_answers_as_the_engine_does(tmp_path: Path) -> None:
    catalog = load_registry(CATALOG_PATH)
    local_service = tiny_service([CATALOG_PATH], tmp_path / "local", limits=ServeLimits(timeout_s=TIMEOUT))
    with StandIn() as vllm, client_of(remote_service(vllm.url, tmp_path)) as remote, client_of(local_service) as local:
        for query in QUERIES[:2]:
            for k in (1, 2, 3):
                ask = {"query": query, "k": k}
                here, there = local.post("/v1/discover", json=ask), remote.post("/v1/discover", json=ask)
                assert here.status_code == there.status_code == 200, there.text
                check_answer(there.json(), catalog, k)
                assert same_answer(here.json(), there.json()), (here.json(), there.json())
                assert [t["score"] for t in there.json()["tools"]] != [0.0] * k  # scores come from the logprobs
                for field in ("prompt_tokens", "completion_tokens", "decision_points"):
                    assert here.json()["usage"][field] == there.json()["usage"][field], field
        assert remote.get("/healthz").status_code == 200  # the probe registry, through vLLM too
    sent = vllm.requests[0]
    name = sent["vllm_xargs"]["tooltrie_artifact"]
    assert "/" not in name and (artifact_root() / name).is_file()
    pinned = Artifact.load(artifact_root() / name).sha256  # the file it means, pinned by its content
    assert sent["vllm_xargs"] == {"tooltrie_artifact": name, "tooltrie_k": 1, "tooltrie_sha256": pinned}  # all tools
    assert sent["model"] == "tiny" and sent["temperature"] == 0.0 and all(isinstance(t, int) for t in sent["prompt"])


def test_vllm_down_is_502_and_the_endpoint_lives_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    port = free_port()
    with client_of(remote_service(f"http://127.0.0.1:{port}", tmp_path)) as client:
        reply = client.post("/v1/discover", json={"query": QUERIES[0], "k": 2})
        url = f"http://127.0.0.1:{port}"
        first = upstream_failure(reply, caplog, url, says="could not be reached", hidden=["ConnectError", "refused"],
                                 logged=[f"{url}/v1", "ConnectError"])
        again = client.post("/v1/discover", json={"query": QUERIES[0], "k": 2})
        assert upstream_failure(again, caplog, url, says="could not be reached", hidden=[], logged=[]) != first
        assert client.get("/v1/registries").status_code == 200
        with StandIn(port):  # vLLM comes up: the same endpoint answers
            reply = client.post("/v1/discover", json={"query": QUERIES[0], "k": 2})
            assert reply.status_code == 200, reply.text


def test_vllm_slow_is_504_upstream_timeout_and_its_thread_is_freed(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """vLLM does not answer: the call gives up before the service's own timeout, so the reply is the definite 504
    upstream_timeout (never the service's "timeout", which would leave the call holding its thread), and the pool's
    one thread is free again: the next request is answered while the first one's vLLM handler still hangs."""
    caplog.set_level(logging.WARNING)
    with StandIn() as vllm:
        service = remote_service(vllm.url, tmp_path, limits=ServeLimits(timeout_s=2), concurrency=1)
        warm_replay(service.served("catalog").artifact)
        with client_of(service) as client:
            vllm.mode = "hang"
            reply = client.post("/v1/discover", json={"query": QUERIES[1], "k": 1})
            upstream_failure(reply, caplog, vllm.url, says="did not answer in time", status=504,
                             code="upstream_timeout", hidden=[], logged=[vllm.url, "2 s"])
            vllm.mode = "reference"  # the hanging handler is not released: only the call's own timeout freed it
            reply = client.post("/v1/discover", json={"query": QUERIES[1], "k": 1})
            assert reply.status_code == 200, reply.text
            assert len(vllm.requests) == 2 and not vllm.release.is_set()


def test_fewer_logprobs_than_tokens_is_502(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    with StandIn() as vllm, client_of(remote_service(vllm.url, tmp_path)) as client:
        vllm.mode = "short"
        reply = client.post("/v1/discover", json={"query": QUERIES[0], "k": 2})
        upstream_failure(reply, caplog, vllm.url, says="not an answer", hidden=["logprob"],
                         logged=[vllm.url, "1 logprobs"])


class FailingReplay(TrieBatch):
    """A trie batch whose choices fail as the kernels' input checks do (``DecodeError``)."""

    def choose(self, *_: object, **__: object) -> None:  # type: ignore[override]
        raise DecodeError("rows [0] reach outside the batch")


def test_a_reply_the_trie_cannot_replay_is_vllms_fault(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A ``DecodeError`` while replaying vLLM's tokens is about vLLM's reply (the request was checked before the
    call): 502, not the client's 422."""
    caplog.set_level(logging.WARNING)
    monkeypatch.setattr(vllm_remote, "TrieBatch", FailingReplay)
    with StandIn() as vllm, client_of(remote_service(vllm.url, tmp_path)) as client:
        reply = client.post("/v1/discover", json={"query": QUERIES[0], "k": 1})
        upstream_failure(reply, caplog, vllm.url, says="not an answer", hidden=["rows [0]"],
                         logged=[vllm.url, "rows [0] reach outside the batch"])


def deepest_answer_tokens(artifact: Artifact, k: int) -> int:
    """An answer's tokens at most: at each of its k places the longest path any tool has in that place's trie (its
    phase: first or later, last or not), then the stop token. No real answer of k distinct tools is longer."""
    trie = artifact.trie
    longest = [max(len(trie.tool_path(int(trie.phase_trie[phase_of(place, k)]), tool))
                   for tool in range(trie.n_tools)) for place in range(k)]
    return sum(longest) + 1


@pytest.mark.parametrize("k", [1, 3])
def test_the_deepest_answer_fits_the_budget_on_both_paths(tmp_path: Path, k: int) -> None:
    query = "Please find the weather forecast for Paris and the news about the trains to Lyon tomorrow morning"
    local = tiny_service([CATALOG_PATH], tmp_path / "local", limits=ServeLimits(timeout_s=TIMEOUT))
    served = local.served("catalog")
    artifact = served.artifact
    deepest = deepest_answer_tokens(artifact, k)
    assert k * artifact.trie.max_depth + 1 >= deepest <= answer_budget(artifact, k)
    # Through vLLM: it may generate the whole budget, and the answer it gives fits it.
    with StandIn() as vllm, client_of(remote_service(vllm.url, tmp_path)) as client:
        reply = client.post("/v1/discover", json={"query": query, "k": k})
        assert reply.status_code == 200, reply.text
        assert vllm.requests[-1]["max_tokens"] == answer_budget(artifact, k)
        assert reply.json()["usage"]["completion_tokens"] <= deepest
    # In process: a context with room for the prompt, the query and the budget takes the request; one without room
    # for the deepest answer refuses it.
    query_tokens = len(local.tokenizer.encode_prompt("", query, ""))
    with client_of(local) as client:
        local.context_tokens = served.prompt_tokens + query_tokens + answer_budget(artifact, k)
        reply = client.post("/v1/discover", json={"query": query, "k": k})
        assert reply.status_code == 200, reply.text
        local.context_tokens = served.prompt_tokens + query_tokens + deepest - 1
        reply = client.post("/v1/discover", json={"query": query, "k": k})
        assert reply.status_code == 422 and "too long" in reply.json()["error"]["message"], reply.text


@pytest.mark.parametrize(("mode", "says", "details"), [
    ("refuse", "refused the request (HTTP 400)", ["tooltrie_k must be an int"]),  # vLLM refusing our arguments: 502
    ("prose", "not an answer", ["processor", "TOOLTRIE_ARTIFACT_ROOT", "ROOT"])])  # ROOT: the artifacts' directory
def test_vllm_refusing_or_unconstrained_is_502(tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: str,
                                               says: str, details: list[str]) -> None:
    caplog.set_level(logging.WARNING)
    details = [str(artifact_root()) if detail == "ROOT" else detail for detail in details]
    with StandIn() as vllm, client_of(remote_service(vllm.url, tmp_path)) as client:
        vllm.mode = mode
        reply = client.post("/v1/discover", json={"query": QUERIES[2], "k": 2})
        upstream_failure(reply, caplog, vllm.url, says=says, hidden=details, logged=[vllm.url, *details])


ALLOWED = [  # (what the request narrows, the tools it leaves)
    ({"allow": ["WeatherTool", "NewsTool", "MapTool"]}, {"WeatherTool", "NewsTool", "MapTool"}),
    ({"deny": ["WeatherTool"]}, None),
]


@pytest.mark.parametrize(("narrowed", "kept"), ALLOWED)
def test_a_subset_travels_to_vllm_and_answers_as_in_process(tmp_path: Path, narrowed: dict[str, Any],
                                                            kept: set[str] | None) -> None:
    catalog = load_registry(CATALOG_PATH)
    local_service = tiny_service([CATALOG_PATH], tmp_path / "local", limits=ServeLimits(timeout_s=TIMEOUT))
    with StandIn() as vllm, client_of(remote_service(vllm.url, tmp_path)) as remote, client_of(local_service) as local:
        for k in (1, 2):
            ask = {"query": QUERIES[0], "k": k, **narrowed}
            here, there = local.post("/v1/discover", json=ask), remote.post("/v1/discover", json=ask)
            assert here.status_code == there.status_code == 200, there.text
            assert same_answer(here.json(), there.json()), (here.json(), there.json())
            names = {tool["name"] for tool in there.json()["tools"]}
            assert names <= (kept or set(catalog.names) - set(narrowed.get("deny", [])))
        sent = vllm.requests[-1]["vllm_xargs"]
        allowed = {catalog.names[tool] for tool in sent["tooltrie_tools"]}
        assert allowed == (kept or set(catalog.names) - set(narrowed.get("deny", [])))
        assert sent["tooltrie_tools"] == sorted(sent["tooltrie_tools"])


# Requests of several needs, where the prior that follows the answer changes it (``StandIn.unfollowed``); the last two
# ask several things (their asks' priors travel too: ``tooltrie_asks``).
SEVERAL_NEEDS = ("what is the weather in Paris and the news about flights there",
                 "I want to buy a house and need a mortgage calculator and a moving company",
                 "Convert 100 dollars to euros, then find me a cheap flight to Lisbon",
                 "1) the weather in Oslo tomorrow 2) the latest news on the stock market 3) a nice podcast")


@pytest.mark.parametrize("ranker", ["fused", "retrieval"])
def test_a_ranked_request_sends_its_prior_and_answers_as_in_process(tmp_path: Path, ranker: str) -> None:
    """The prior is made at admission as in process and travels with the call, and so does how it follows the
    answer (the request's text and ``FollowUp``'s numbers: ``tooltrie_query``, ``tooltrie_follow``); vLLM's
    processor fuses it into the logits its greedy argmax reads, following the answer, so the tools and their scores
    are the in-process engine's, and some of them are not what the prior that does not follow would have given."""
    local_service = tiny_service([CATALOG_PATH], tmp_path / "local", limits=ServeLimits(timeout_s=TIMEOUT))
    asks = [*zip(QUERIES, (1, 2, 3), strict=True), *((query, k) for query in SEVERAL_NEEDS for k in (2, 3))]
    asked = 0
    with StandIn() as vllm, client_of(remote_service(vllm.url, tmp_path)) as remote, client_of(local_service) as local:
        for query, k in asks:
            ask = {"query": query, "k": k, "ranker": ranker, "prior": "hybrid"}
            here, there = local.post("/v1/discover", json=ask), remote.post("/v1/discover", json=ask)
            assert here.status_code == there.status_code == 200, there.text
            assert same_answer(here.json(), there.json()), (here.json(), there.json())
            assert there.json()["ranker"] == here.json()["ranker"] != {"model": 1.0, "retrieval": 0.0}
            sent = vllm.requests[-1]["vllm_xargs"]
            assert sent["tooltrie_prior"].startswith("f32:")  # the float32 scores in base64: 4 bytes a tool
            assert len(base64.b64decode(sent["tooltrie_prior"][4:])) == 4 * 47
            assert sent["tooltrie_model_weight"] == here.json()["ranker"]["model"]
            assert sent["tooltrie_query"] == query and len(sent["tooltrie_follow"]) == 4
            several = len(split_asks(query)) > 1
            assert len(sent.get("tooltrie_asks", ())) == (len(split_asks(query)) if several else 0), query
            asked += several
        assert asked == 2 * 2  # two requests of several asks, at two k each
        assert len(vllm.unfollowed) == len(asks) and any(vllm.unfollowed), vllm.unfollowed
        plain = remote.post("/v1/discover", json={"query": QUERIES[0], "k": 1, "ranker": "model"})
        sent = vllm.requests[-1]["vllm_xargs"]
        assert plain.status_code == 200 and not {"tooltrie_prior", "tooltrie_query", "tooltrie_follow"} & set(sent)


def test_what_the_processor_cannot_do_is_refused(tmp_path: Path) -> None:
    with StandIn() as vllm, client_of(remote_service(vllm.url, tmp_path)) as client:
        reply = client.post("/v1/discover", json={"query": QUERIES[0], "k": 3, "allow": ["WeatherTool", "NewsTool"]})
        assert reply.status_code == 422 and "k=3 but only 2 tools" in reply.json()["error"]["message"], reply.text
        assert client.post("/v1/discover", json={"query": QUERIES[0], "k": 1}).status_code == 200


def test_busy_lanes_wait_once_per_turn_for_all_their_calls(catalog_artifact: Artifact) -> None:
    """N registries through vLLM: a turn of the worker's loop steps N lanes whose calls are in flight, and waits for
    them once (not N times STEP_WAIT_S); a call finishing in any lane ends that wait."""
    server = VllmServer("http://127.0.0.1:9", artifact_root())
    waits: list[float | None] = []

    class Counted(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            waits.append(timeout)
            return super().wait(timeout)

    server._answered = Counted()
    lanes = [vllm_remote.RemoteEngine(server, smollm_tokenizer(), catalog_artifact, prompt=Prompt())
             for _ in range(8)]
    calls: list[Future[Any]] = []
    for lane in lanes:
        calls.append(Future())
        calls[-1].add_done_callback(server.answered)
        lane._calls[object()] = calls[-1]  # type: ignore[index]  # a call in flight
    for _ in range(5):
        assert [lane.step() for lane in lanes] == [[]] * len(lanes)
    assert len(waits) == 5
    calls[5].set_exception(RuntimeError("vLLM answered"))  # a call of another lane than the waiting one
    assert server._answered.is_set()
    server.close()


def test_dtype_is_the_vllm_servers(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``serve --vllm-url`` loads no model: ``--dtype`` is refused, naming both options and where the dtype is set,
    before anything starts; left at its default, it is no obstacle (the next check speaks)."""
    import uvicorn

    def run(*_: object, **__: object) -> None:
        raise AssertionError("the server started")

    monkeypatch.setattr(uvicorn, "run", run)
    url = "http://127.0.0.1:9"
    for dtype in ("float32", "bfloat16"):
        assert main(["serve", "--vllm-url", url, "--dtype", dtype]) == 2
        err = capsys.readouterr().err
        assert "--dtype" in err and "--vllm-url" in err and "vllm serve --dtype" in err, err
    assert main(["serve", "--vllm-url", url, "--host", "0.0.0.0", "--registry", str(CATALOG_PATH)]) == 2
    err = capsys.readouterr().err
    assert "without --policy" in err and "--dtype" not in err, err
