"""The discovery endpoint over HTTP: the real server (uvicorn on a loopback port, in a thread) called with httpx.

The model is the tiny random Llama with SmolLM2's vocabulary and the bundled SmolLM2 tokenizer (fast; its answers
are arbitrary but must always be valid); one test asks the real default model. What is checked:

- every answer is exactly k distinct tools of the registry asked, with their pointers;
- 32 clients x 10 requests at once (with clients sending bad input among them): no errors, and every answer the same
  as that request sent alone; the engine did batch them;
- the bad-input table: each refusal is a 4xx with a message that names the problem, never a 500;
- ``/healthz`` between catalog requests never changes a catalog answer;
- reload under load: no request lost, each answer from the version it reports; a request decoding during a reload
  finishes on its old version; a broken file leaves the old version serving;
- a full queue is 429 with Retry-After; a timeout is 504; a client that disconnects frees its slot;
- a failure inside decoding is a 500 for that step's rows only, and the server goes on;
- ``tooltrie serve`` as a command, in its own process, on a saved model directory.

A gate on the model's forward passes (``support.serve_http.Gate``) holds the worker mid-step, so queues and
disconnects are staged exactly, without sleeps. No network beyond loopback.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.serve_http import (
    PROBE_NAMES,
    Gate,
    Running,
    catalog,
    catalog_tools,
    check_answer,
    running_server,
    same_answer,
    serve_command,
    smollm_tokenizer,
    tiny_service,
    wait_until,
    write_registry,
)

from tooltrie.errors import ModelError
from tooltrie.registry import CATALOG_PATH
from tooltrie.serve.limits import ServeLimits
from tooltrie.serve.prompt import Prompt
from tooltrie.testing import tiny_llama

pytestmark = pytest.mark.usefixtures("loopback_only")

QUERIES = (
    "What will the weather be in Paris tomorrow?",
    "Convert 100 US dollars to euros",
    "Show me today's top headlines about the economy",
    "Book a table for two at an Italian restaurant tonight",
    "Find remote software engineering jobs in Berlin",
    "Play some relaxing jazz music",
    "What is Apple's current stock price?",
    "Were there any earthquakes in Japan this week?",
    "Help me write a resume for a data analyst position",
    "Plan a three-day trip to Rome",
    "Find recent research papers on graph neural networks",
    "hi",
)
KS = (1, 2, 3)
CLIENTS, REQUESTS_PER_CLIENT = 32, 10
TIMEOUT = httpx.Timeout(60.0)


def post(client: httpx.Client, body: Any, **kwargs: Any) -> httpx.Response:
    return client.post("/v1/discover", json=body, **kwargs)


# -- the main server: the catalog, plus a small registry from a file that the reload tests rewrite ----------------

@pytest.fixture(scope="module")
def rotating(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("registries") / "rotating.yaml"
    write_registry(path, "rotating", catalog_tools(0, 12))
    return path


@pytest.fixture(scope="module")
def server(rotating: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    service = tiny_service([CATALOG_PATH, rotating], tmp_path_factory.mktemp("cache"),
                           limits=ServeLimits(max_batch=16, queue=128, timeout_s=60))
    with running_server(service) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Running) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        yield client


@pytest.fixture(scope="module")
def alone(client: httpx.Client) -> dict[tuple[str, int], dict[str, Any]]:
    """Each (query, k) of the catalog asked alone, one request at a time."""
    answers = {}
    for query in QUERIES:
        for k in KS:
            reply = post(client, {"query": query, "k": k})
            assert reply.status_code == 200, reply.text
            answers[query, k] = reply.json()
    return answers


def test_every_answer_is_k_distinct_registry_tools(client: httpx.Client, alone: dict[tuple[str, int], Any]) -> None:
    for (_, k), body in alone.items():
        check_answer(body, catalog(), k)
    for k in (4, 47):  # up to every tool of the registry
        reply = post(client, {"query": QUERIES[0], "k": k, "registry": "catalog"})
        assert reply.status_code == 200, reply.text
        check_answer(reply.json(), catalog(), k)


async def _client_run(url: str, plan: list[tuple[str, int]]) -> list[tuple[int, Any]]:
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        results = []
        for query, k in plan:
            reply = await client.post("/v1/discover", json={"query": query, "k": k})
            results.append((reply.status_code, reply.json()))
        return results


async def _noise_run(url: str, bodies: list[bytes]) -> list[int]:
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        return [(await client.post("/v1/discover", content=body,
                                   headers={"content-type": "application/json"})).status_code for body in bodies]


def test_concurrent_clients_get_the_answers_they_would_get_alone(server: Running, client: httpx.Client,
                                                                   alone: dict[tuple[str, int], Any]) -> None:
    combos = list(alone)
    plans = [[combos[(c * 7 + i) % len(combos)] for i in range(REQUESTS_PER_CLIENT)] for c in range(CLIENTS)]
    noise = [[b'{"query": "x", "k": 0}', b'{"query": ', b'{"query": "", "k": 1}', b'{"query": "x", "k": "2"}',
              json.dumps({"query": "x" * 3000, "k": 1}).encode()] * 2 for _ in range(4)]
    before = client.get("/metrics").text

    async def everyone() -> tuple[list[list[tuple[int, Any]]], list[list[int]]]:
        good = asyncio.gather(*(_client_run(server.url, plan) for plan in plans))
        bad = asyncio.gather(*(_noise_run(server.url, bodies) for bodies in noise))
        return await asyncio.wait_for(asyncio.gather(good, bad), timeout=180)

    results, refused = asyncio.run(everyone())
    answered = 0
    for plan, replies in zip(plans, results, strict=True):
        for (query, k), (status, body) in zip(plan, replies, strict=True):
            assert status == 200, body
            check_answer(body, catalog(), k)
            assert same_answer(body, alone[query, k]), (query, k, body["tools"], alone[query, k]["tools"])
            answered += 1
    assert answered == CLIENTS * REQUESTS_PER_CLIENT
    assert all(400 <= status < 500 for statuses in refused for status in statuses), refused
    after = client.get("/metrics").text
    steps = (server.metric(after, "tooltrie_batch_rows_count", registry="catalog")
             - server.metric(before, "tooltrie_batch_rows_count", registry="catalog"))
    single = (server.metric(after, "tooltrie_batch_rows_bucket", le="1.0", registry="catalog")
              - server.metric(before, "tooltrie_batch_rows_bucket", le="1.0", registry="catalog"))
    assert steps > single, "every step decoded one row: the requests were never batched"


# -- bad input ------------------------------------------------------------------------------------------------------

LONG_QUERY = "x" * 2001
# (case, body as bytes or a JSON value, content type, status, error code, a phrase the message must contain)
BAD_INPUT = [
    ("malformed JSON", b'{"query": "hi", "k": 3', "application/json", 400, "malformed_json", "not valid JSON"),
    ("not JSON at all", b"hello", "application/json", 400, "malformed_json", "not valid JSON"),
    ("empty body", b"", "application/json", 422, "invalid_request", "JSON body is required"),
    ("an array", [1, 2], "application/json", 422, "invalid_request", "must be a JSON object"),
    ("text content type", b'{"query": "hi", "k": 3}', "text/plain", 422, "invalid_request", "JSON object"),
    ("missing k", {"query": "hi"}, "application/json", 422, "invalid_request", "k: required"),
    ("missing query", {"k": 3}, "application/json", 422, "invalid_request", "query: required"),
    ("k a string", {"query": "hi", "k": "3"}, "application/json", 422, "invalid_request", "k: Input should be"),
    ("k a float", {"query": "hi", "k": 3.0}, "application/json", 422, "invalid_request", "k: Input should be"),
    ("k a bool", {"query": "hi", "k": True}, "application/json", 422, "invalid_request", "k: Input should be"),
    ("k null", {"query": "hi", "k": None}, "application/json", 422, "invalid_request", "k: Input should be"),
    ("k zero", {"query": "hi", "k": 0}, "application/json", 422, "invalid_request", "k must be between 1 and 47"),
    ("k negative", {"query": "hi", "k": -2}, "application/json", 422, "invalid_request", "got -2"),
    ("k over the tools", {"query": "hi", "k": 48}, "application/json", 422, "invalid_request",
     "between 1 and 47 (the tools of registry 'catalog'), got 48"),
    ("k over a small registry", {"query": "hi", "k": 13, "registry": "rotating"}, "application/json", 422,
     "invalid_request", "between 1 and 12"),
    ("k huge", {"query": "hi", "k": 10**30}, "application/json", 422, "invalid_request", "k"),
    ("query a number", {"query": 5, "k": 1}, "application/json", 422, "invalid_request", "query: Input should be"),
    ("query empty", {"query": "", "k": 1}, "application/json", 422, "invalid_request", "query is empty"),
    ("query blank", {"query": " \n\t", "k": 1}, "application/json", 422, "invalid_request", "query is empty"),
    ("query too long", {"query": LONG_QUERY, "k": 1}, "application/json", 422, "invalid_request",
     "2,001 characters; the limit is 2,000"),
    ("query over the token limit", json.dumps({"query": "\U0001f327" * 1999, "k": 1}, ensure_ascii=False).encode(),
     "application/json", 422,
     "invalid_request", "query has 5,997 tokens; the limit is 1,024 (ServeLimits.max_query_tokens)"),
    ("query a lone surrogate", b'{"query": "\\ud800", "k": 1}', "application/json", 422, "invalid_request",
     "not valid Unicode"),
    ("unknown registry", {"query": "hi", "k": 1, "registry": "nope"}, "application/json", 404, "unknown_registry",
     "unknown registry 'nope'"),
    ("registry a number", {"query": "hi", "k": 1, "registry": 3}, "application/json", 422, "invalid_request",
     "registry: Input should be"),
    ("unknown field", {"query": "hi", "k": 1, "tools": ["x"]}, "application/json", 422, "invalid_request",
     "unknown field 'tools'"),
    ("body too large", {"query": "hi", "k": 1, "pad": "x" * 20_000}, "application/json", 413, "body_too_large",
     "limit of 16,384 bytes"),
]


@pytest.mark.parametrize(("case", "body", "content_type", "status", "code", "phrase"), BAD_INPUT,
                         ids=[row[0] for row in BAD_INPUT])
def test_bad_input_is_a_4xx_that_says_what_is_wrong(client: httpx.Client, case: str, body: Any, content_type: str,
                                                    status: int, code: str, phrase: str) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = client.post("/v1/discover", content=content, headers={"content-type": content_type})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["code"] == code
    assert phrase in error["message"], error["message"]


def test_chunked_body_over_the_limit_is_refused_unread(client: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit must hold while the body streams in
        yield b'{"query": "'
        for _ in range(40):
            yield b"x" * 1000
        yield b'", "k": 1}'

    reply = client.post("/v1/discover", content=chunks(), headers={"content-type": "application/json"})
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "body_too_large"


def test_unknown_routes_and_methods_are_4xx_with_a_message(client: httpx.Client) -> None:
    assert client.get("/v1/nothing").json()["error"]["code"] == "not_found"
    reply = client.get("/v1/discover")
    assert reply.status_code == 405 and reply.json()["error"]["code"] == "method_not_allowed"
    reply = client.post("/v1/registries/nope/reload")
    assert reply.status_code == 404 and "unknown registry 'nope'" in reply.json()["error"]["message"]


def test_no_refusal_was_a_500(client: httpx.Client, server: Running) -> None:
    """Runs after the tables above (tests run in file order): nothing the server answered was a 5xx."""
    text = client.get("/metrics").text
    statuses = [line for line in text.splitlines() if line.startswith("tooltrie_http_responses_total")]
    assert any('status="422"' in line for line in statuses)
    assert not [line for line in statuses if 'status="5' in line], statuses


# -- health, registries, metrics, docs ------------------------------------------------------------------------------

def test_healthz_between_catalog_requests_never_changes_their_answers(
        server: Running, client: httpx.Client, alone: dict[tuple[str, int], Any]) -> None:
    for (query, k), expected in list(alone.items())[:12]:  # one after the other
        health = client.get("/healthz")
        assert health.status_code == 200 and health.json()["probe"]["tool"] in PROBE_NAMES
        assert same_answer(post(client, {"query": query, "k": k}).json(), expected)

    async def together() -> tuple[list[httpx.Response], list[httpx.Response]]:  # and at the same time
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as session:
            probes = asyncio.gather(*(session.get("/healthz") for _ in range(12)))
            asks = asyncio.gather(*(session.post("/v1/discover", json={"query": q, "k": k}) for q, k in alone))
            return await asyncio.wait_for(asyncio.gather(probes, asks), timeout=120)

    probes, asks = asyncio.run(together())
    assert all(reply.status_code == 200 and reply.json()["probe"]["tool"] in PROBE_NAMES for reply in probes)
    for (query, k), reply in zip(alone, asks, strict=True):
        assert reply.status_code == 200 and same_answer(reply.json(), alone[query, k])


def test_registries_metrics_and_docs(client: httpx.Client) -> None:
    registries = client.get("/v1/registries").json()["registries"]
    assert [r["name"] for r in registries] == ["catalog", "rotating"]
    first = registries[0]
    assert first["default"] and first["tools"] == 47 and first["placement"] in ("constant", "global")
    assert first["registry_sha256"] == catalog().sha256 and len(first["artifact_sha256"]) == 64
    metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    for name in ("tooltrie_discover_requests_total", "tooltrie_discover_latency_seconds_bucket",
                 "tooltrie_batch_rows_bucket", "tooltrie_queued_requests", "tooltrie_http_responses_total"):
        assert name in metrics.text
    spec = client.get("/openapi.json").json()
    assert {"/v1/discover", "/v1/registries", "/v1/registries/{name}/reload", "/healthz"} <= set(spec["paths"])
    assert client.get("/docs").status_code == 200


# -- reload ---------------------------------------------------------------------------------------------------------

def test_reload_under_load_loses_nothing(server: Running, client: httpx.Client, rotating: Path) -> None:
    versions: dict[str, set[str]] = {}  # registry sha256 -> its tool names

    def publish(start: int, stop: int) -> None:
        registry = write_registry(rotating, "rotating", catalog_tools(start, stop))
        versions[registry.sha256] = set(registry.names)

    publish(0, 12)
    assert client.post("/v1/registries/rotating/reload").status_code == 200
    reloads: list[dict[str, Any]] = []
    answered: list[tuple[bool, dict[str, Any]]] = []  # (sent after the last reload, answer)
    reloaded = asyncio.Event()  # binds to no event loop until awaited: safe to make outside one

    async def asker(session: httpx.AsyncClient, c: int) -> None:
        i = after = 0
        while after < 2:  # until the reloads are done, then two more
            final = reloaded.is_set()
            body = {"query": QUERIES[(c + i) % len(QUERIES)], "k": 1 + (c + i) % 3, "registry": "rotating"}
            reply = await session.post("/v1/discover", json=body)
            assert reply.status_code == 200, reply.text
            answered.append((final, reply.json()))
            i, after = i + 1, after + final

    async def reloader(session: httpx.AsyncClient) -> None:
        while len(answered) < 8:
            await asyncio.sleep(0.01)
        for start, stop in ((1, 14), (3, 16), (5, 11)):  # tools dropped, added; the last one smaller
            publish(start, stop)
            reply = await session.post("/v1/registries/rotating/reload")
            assert reply.status_code == 200, reply.text
            reloads.append(reply.json())
            await asyncio.sleep(0.05)
        reloaded.set()

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as session:
            await asyncio.wait_for(asyncio.gather(reloader(session), *(asker(session, c) for c in range(8))), 180)

    asyncio.run(run())
    assert [reload["changed"] for reload in reloads] == [True, True, True]
    seen = set()
    for final, body in answered:  # every answer is valid under the version that says it answered
        names = [tool["name"] for tool in body["tools"]]
        assert body["finish_reason"] == "stop" and len(set(names)) == len(names)
        assert set(names) <= versions[body["registry_sha256"]], (names, body["registry_sha256"])
        assert not final or body["registry_sha256"] == reloads[-1]["registry_sha256"]
        seen.add(body["registry_sha256"])
    assert len(seen) >= 2


def test_broken_registry_file_keeps_the_old_version_serving(client: httpx.Client, rotating: Path) -> None:
    current = write_registry(rotating, "rotating", catalog_tools(0, 12))
    assert client.post("/v1/registries/rotating/reload").status_code == 200
    rotating.write_text("name: rotating\ntools:\n- name: A\n  description: one\n- name: A\n  description: twice\n",
                        encoding="utf-8")
    reply = client.post("/v1/registries/rotating/reload")
    assert reply.status_code == 422 and reply.json()["error"]["code"] == "invalid_registry"
    assert "previous version keeps serving" in reply.json()["error"]["message"]
    rotating.write_text("name: renamed\ntools:\n- name: A\n  description: one\n", encoding="utf-8")
    reply = client.post("/v1/registries/rotating/reload")
    assert reply.status_code == 422 and "keeps the name 'rotating'" in reply.json()["error"]["message"]
    answer = post(client, {"query": "hi", "k": 2, "registry": "rotating"})
    assert answer.status_code == 200
    check_answer(answer.json(), current, 2)
    write_registry(rotating, "rotating", catalog_tools(0, 12))


# -- staged: a gate holds the worker mid-step -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Running, Gate, Path]]:
    """One decoding slot, a queue of 2; a gate on the model; the catalog and a small registry from a file."""
    path = tmp_path_factory.mktemp("gated") / "small.yaml"
    write_registry(path, "small", catalog_tools(20, 30))
    model = tiny_llama()
    gate = Gate(model)
    service = tiny_service([CATALOG_PATH, path], tmp_path_factory.mktemp("cache"), model=model,
                           limits=ServeLimits(max_batch=1, queue=2, timeout_s=60))
    with running_server(service) as running:
        with httpx.Client(base_url=running.url, timeout=TIMEOUT) as warm:  # prefixes cached before any staging
            for registry in ("catalog", "small"):
                assert post(warm, {"query": "warm up", "k": 1, "registry": registry}).status_code == 200
        yield running, gate, path
        gate.open()


def test_full_queue_is_429_with_retry_after(gated: tuple[Running, Gate, Path]) -> None:
    server, gate, _ = gated

    async def run() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as session:
            gate.close()
            try:
                first = asyncio.ensure_future(session.post("/v1/discover", json={"query": "one", "k": 3}))
                await asyncio.to_thread(gate.wait_entered)  # decoding, holding the only slot
                queued = [asyncio.ensure_future(session.post("/v1/discover", json={"query": q, "k": 2}))
                          for q in ("two", "three")]
                await asyncio.to_thread(wait_until, lambda: server.service.worker.queued == 2, what="2 queued")
                refused = await session.post("/v1/discover", json={"query": "four", "k": 1})
            finally:
                gate.open()
            return list(await asyncio.gather(first, *queued)), refused

    answered, refused = asyncio.run(run())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "queue_full" and "queue is full" in refused.json()["error"]["message"]
    assert [reply.status_code for reply in answered] == [200, 200, 200]


def test_client_that_disconnects_frees_its_slot(gated: tuple[Running, Gate, Path]) -> None:
    server, gate, _ = gated
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        before = client.get("/metrics").text
        gate.close()
        try:
            body = json.dumps({"query": "I will not wait", "k": 3}).encode()
            with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as leaver:
                leaver.sendall(b"POST /v1/discover HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                gate.wait_entered()  # its prefill is in the forward pass: it holds the only slot
            wait_until(lambda: server.metric(client.get("/metrics").text, "tooltrie_discover_requests_total",
                                             registry="catalog", outcome="client_closed_request") > server.metric(
                before, "tooltrie_discover_requests_total", registry="catalog", outcome="client_closed_request"),
                what="the server to notice the disconnect")
        finally:
            gate.open()
        reply = post(client, {"query": "next in line", "k": 1})  # gets the freed slot
        assert reply.status_code == 200
        after = client.get("/metrics").text
    cancelled = (server.metric(after, "tooltrie_cancelled_requests_total", stage="decoding")
                 - server.metric(before, "tooltrie_cancelled_requests_total", stage="decoding"))
    assert cancelled == 1, "the disconnected request was not cancelled while decoding"
    assert server.metric(after, "tooltrie_discover_requests_total", registry="catalog", outcome="ok") == (
        server.metric(before, "tooltrie_discover_requests_total", registry="catalog", outcome="ok") + 1)


def test_request_decoding_during_a_reload_finishes_on_its_version(gated: tuple[Running, Gate, Path]) -> None:
    server, gate, path = gated
    old = write_registry(path, "small", catalog_tools(20, 30))
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        assert client.post("/v1/registries/small/reload").status_code == 200

    async def run() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as session:
            gate.close()
            try:
                during = asyncio.ensure_future(session.post("/v1/discover", json={"query": "q", "k": 3,
                                                                                   "registry": "small"}))
                await asyncio.to_thread(gate.wait_entered)
                write_registry(path, "small", catalog_tools(25, 40))
                reload = await session.post("/v1/registries/small/reload")  # compiles while the worker is held
                after = asyncio.ensure_future(session.post("/v1/discover", json={"query": "q", "k": 3,
                                                                                  "registry": "small"}))
                await asyncio.to_thread(wait_until, lambda: server.service.worker.queued == 1, what="1 queued")
            finally:
                gate.open()
            return reload, await during, await after

    reload, during, after = asyncio.run(run())
    assert reload.status_code == 200 and reload.json()["changed"] and reload.json()["tools"] == 15
    check_answer(during.json(), old, 3)
    check_answer(after.json(), write_registry(path, "small", catalog_tools(25, 40)), 3)


def test_a_burst_of_health_checks_decodes_one_probe(tmp_path: Path) -> None:
    """Health checks need no key: twenty at once, held behind a probe that is decoding, share it."""
    model = tiny_llama()
    gate = Gate(model)
    service = tiny_service([CATALOG_PATH], tmp_path, model=model)
    decoded: list[str] = []
    decode = service._decode

    async def counting(registry: str, *args: Any, **kwargs: Any) -> Any:
        decoded.append(registry)
        return await decode(registry, *args, **kwargs)

    asked: list[int] = []
    probe = service.probe

    async def arriving() -> Any:
        asked.append(1)
        return await probe()

    service._decode = counting  # type: ignore[method-assign]
    service.probe = arriving  # type: ignore[method-assign]
    with running_server(service) as server:
        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as session:
                replies = [asyncio.ensure_future(session.get("/healthz")) for _ in range(20)]
                await asyncio.to_thread(gate.wait_entered)
                await asyncio.to_thread(wait_until, lambda: len(asked) == 20, what="twenty health checks")
                gate.open()
                return list(await asyncio.wait_for(asyncio.gather(*replies), timeout=120))

        gate.close()
        try:
            replies = asyncio.run(burst())
        finally:
            gate.open()
    assert [reply.status_code for reply in replies] == [200] * 20
    assert len({json.dumps(reply.json()["probe"]) for reply in replies}) == 1 and len(decoded) == 1


def test_timeout_is_504_and_frees_the_slot(tmp_path: Path) -> None:
    model = tiny_llama()
    gate = Gate(model)
    service = tiny_service([CATALOG_PATH], tmp_path, model=model, limits=ServeLimits(max_batch=1, timeout_s=0.5))
    with running_server(service) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        gate.close()
        try:
            reply = post(client, {"query": "slow", "k": 2})
        finally:
            gate.open()
        assert reply.status_code == 504 and reply.json()["error"]["code"] == "timeout"
        assert "0.5 s" in reply.json()["error"]["message"]

        def cancelled() -> float:
            text = client.get("/metrics").text
            return sum(server.metric(text, "tooltrie_cancelled_requests_total", stage=stage)
                       for stage in ("waiting", "decoding"))

        wait_until(lambda: cancelled() == 1, what="the worker to cancel the request")
        reply = post(client, {"query": "fast enough now", "k": 1})
        assert reply.status_code == 200, reply.text


def test_failed_decoding_is_500_for_its_rows_and_the_server_goes_on(tmp_path: Path) -> None:
    model = tiny_llama()
    gate = Gate(model)
    service = tiny_service([CATALOG_PATH], tmp_path, model=model)
    with running_server(service) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        gate.fail_next = True
        reply = post(client, {"query": "this step breaks", "k": 2})
        assert reply.status_code == 500 and reply.json()["error"]["code"] == "decoding_failed"
        assert "injected failure" in reply.json()["error"]["message"]
        reply = post(client, {"query": "the next one is fine", "k": 2})
        assert reply.status_code == 200, reply.text
        check_answer(reply.json(), catalog(), 2)


def test_a_registry_whose_prompt_fills_the_context_is_refused_as_the_servers_limit(tmp_path: Path) -> None:
    """The catalog prompt lists every tool: BFCL's 1,853 take ~50,000 tokens, past the tiny model's 2,048. Its
    requests are a 503 that blames the prompt, not the query; the catalog next to it answers; the short prompt an
    adapter would bring is counted anew."""
    from tooltrie.serve.service import ServedRegistry

    bfcl = Path(__file__).resolve().parent.parent / "registry" / "bfcl.jsonl"
    service = tiny_service([CATALOG_PATH, bfcl], tmp_path)
    with running_server(service) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        reply = post(client, {"query": "hi", "k": 1, "registry": "bfcl"})
        assert reply.status_code == 503, reply.text
        message = reply.json()["error"]["message"]
        assert "registry 'bfcl' cannot be answered by this model: its prompt alone takes" in message
        assert post(client, {"query": "hi", "k": 1}).status_code == 200
    served = service.served("bfcl")
    short = served.with_adapter(None, service.tokenizer, Prompt.style("short"))
    assert short.prompt_tokens < 100 < 2_048 < served.prompt_tokens
    fresh = ServedRegistry.of(served.artifact, service.tokenizer, Prompt.style("short"))
    assert short.prompt_tokens == fresh.prompt_tokens


def test_tooltrie_serve_command(tmp_path: Path) -> None:
    """``tooltrie serve`` as a user runs it, in its own process, on a model directory (the tiny Llama, saved)."""
    tiny_llama().save_pretrained(tmp_path / "model")
    options = ["--model", str(tmp_path / "model"), "--tokenizer", "smollm2-135m", "--registry", str(CATALOG_PATH),
               "--max-batch", "4"]
    with serve_command(options, tmp_path) as served:
        reply = httpx.post(served.url + "/v1/discover", json={"query": QUERIES[0], "k": 2}, timeout=TIMEOUT)
        assert reply.status_code == 200, reply.text
        check_answer(reply.json(), catalog(), 2)
    output = served.output
    assert served.process.returncode in (0, -signal.SIGTERM), output  # uvicorn shuts down, then re-raises the signal
    assert "tooltrie serve: catalog (47 tools)" in output and "Application shutdown complete" in output


# -- the real model -------------------------------------------------------------------------------------------------

def test_real_default_model_answers_alone_and_together(tmp_path: Path) -> None:
    """SmolLM2-135M-Instruct (skipped when not installed): the same valid answers alone and batched."""
    from tooltrie.serve.model import load_model, locate_default_model

    try:
        locate_default_model()
    except ModelError as exc:
        pytest.skip(f"the default model is not installed: {exc}")
    model, info = load_model()
    service = tiny_service([CATALOG_PATH], tmp_path, model=model, limits=ServeLimits(max_batch=4),
                           prompt=Prompt.style(info.prompt_style))
    assert info.tokenizer == "smollm2-135m" and service.tokenizer is smollm_tokenizer()
    asks = [(QUERIES[0], 3), (QUERIES[1], 1), (QUERIES[2], 2), (QUERIES[6], 3)]
    with running_server(service) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        alone = [post(client, {"query": q, "k": k}).json() for q, k in asks]

        async def together() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as session:
                return list(await asyncio.gather(*(session.post("/v1/discover", json={"query": q, "k": k})
                                                   for q, k in asks)))

        batched = asyncio.run(together())
    for (_, k), first, reply in zip(asks, alone, batched, strict=True):
        check_answer(first, catalog(), k)
        assert reply.status_code == 200 and same_answer(reply.json(), first)


def test_the_request_schema_offers_the_rankers_and_priors_the_ranker_knows() -> None:
    """The body's ``ranker`` and ``prior`` are the ranker module's types: the schema's choices are its names."""
    from tooltrie.ranker import PRIORS, RANKERS
    from tooltrie.serve.schema import DiscoverBody

    properties = DiscoverBody.model_json_schema()["properties"]
    for key, names in (("ranker", RANKERS), ("prior", PRIORS)):
        choices = [option["enum"] for option in properties[key]["anyOf"] if "enum" in option]
        assert choices == [list(names)], (key, properties[key])
