"""The discovery endpoint through a real ``vllm serve`` on loopback (``serve --vllm-url``): vLLM's CPU build with
tooltrie's processor, the default model as served (its adapter merged, float32). Runs where vLLM is installed
(``make test-vllm``), skipped elsewhere; the stand-in tests in ``test_serve_vllm_remote.py`` run everywhere.

- the same greedy answers as the in-process engine on the same model, as the same JSON (tools, pointers, scores
  from vLLM's processed logprobs, token counts), on held-out catalog queries at k = 1, 2, 3, over the whole registry,
  over subsets (allow, deny: the allowed tools' ids in ``tooltrie_tools``), and ranked by the default (hybrid)
  prior, alone or fused, with and without the pre-filter (the prior made here and sent in ``tooltrie_prior``, and how
  it follows the answer in ``tooltrie_query`` and ``tooltrie_follow``), for a tenant whose policy narrows the
  catalog, and with the pre-filter on BFCL;
- vLLM's own completions route: k tools asked for in ``vllm_xargs`` come back as k distinct registry tools (of the
  subset, when one is given); a bad argument is a 400 naming it: a path or an unknown name for the artifact (which
  vLLM reads only from its ``$TOOLTRIE_ARTIFACT_ROOT``), a tool outside the registry, k above the subset;
- vLLM stopped: 502, and the endpoint lives on.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm builds an environment with it)")

from support.serve_http import check_answer, running_server, smollm_tokenizer

from tooltrie.compiler import Artifact
from tooltrie.compiler.contract import Contract
from tooltrie.eval.datasets import load_split
from tooltrie.integrations.vllm_rows import request_args
from tooltrie.ranker import DEFAULT_PRIOR
from tooltrie.registry import BFCL_PATH, CATALOG_PATH, Registry, load_registry
from tooltrie.serve.limits import ServeLimits, answer_budget
from tooltrie.serve.model import load_model, save_model_as_served
from tooltrie.serve.policy import Policy
from tooltrie.serve.prefilter import Prefilter
from tooltrie.serve.prompt import Prompt
from tooltrie.serve.proxy import ChatProxy
from tooltrie.serve.server import create_app
from tooltrie.serve.service import DiscoveryService
from tooltrie.serve.tool_search import json_schema
from tooltrie.serve.vllm_remote import VllmServer
from tooltrie.vllm_server import OUTCOMES, free_port, hostile, outcome, root_files, start_vllm, stop, wait_up

QUERIES = 6  # held-out catalog queries, each at k = 1, 2, 3
NARROWED = ({}, {"allow": ["WeatherTool", "NewsTool", "MapTool", "FinanceTool"]}, {"deny": ["WeatherTool", "MapTool"]})
# Ranked by the prior (the default, hybrid), alone or fused, and narrowed by the pre-filter: the prior travels.
RANKED = ({"ranker": "fused"}, {"ranker": "retrieval"}, {"ranker": "fused", "prefilter": 8}, {"prefilter": 8},
          {"ranker": "fused", "allow": ["WeatherTool", "NewsTool", "MapTool", "FinanceTool"]})
SUBSET = [3, 5, 8, 13]  # tool ids, for vLLM's own route
OPEN_KEY, ACME_KEY = "open-tenant-key-0123456789", "acme-tenant-key-0123456789"
ACME_TOOLS = ["WeatherTool", "NewsTool", "MapTool", "FinanceTool", "TripTool", "ExchangeTool"]
POLICY = Policy.parse({"tenants": {  # a tenant of every tool, and one whose policy narrows the catalog
    "everyone": {"keys": [OPEN_KEY], "registries": {"catalog": {}, "bfcl": {}}},
    "acme": {"keys": [ACME_KEY], "registries": {"catalog": {"allow": ACME_TOOLS}}}}})
# Hostile requests the fuzzer sends in the suite, each beside a valid one through both endpoints (three requests an
# example); bench/fuzz_vllm.py sends more.
FUZZ_EXAMPLES = int(os.environ.get("TOOLTRIE_FUZZ_EXAMPLES", "100"))
# A chat template that lists the request's tools before the conversation, as tool-calling models' templates do
# (SmolLM2's own ignores them): what the proxy saves is then in vLLM's prompt tokens.
TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\nYou may call these tools:\n{% for tool in tools %}"
                  "{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}{% for message in messages %}"
                  "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
FUZZ_QUERIES = ("Convert 100 US dollars to euros", "What will the weather be in Paris tomorrow?",
                "Find me a flight to Rome and the news there", "Is there a good recipe for lasagne?")


def check_completions_route(client: httpx.Client, url: str, artifact: Path, catalog: Registry) -> None:
    name = artifact.name
    """vLLM's own completions route, as any OpenAI client calls it: k tools asked for in ``vllm_xargs`` (the flat
    form) come back as exactly k distinct registry tools; a bad argument is a 4xx naming it, and the server goes on."""
    model = client.get(url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": "Query: What will the weather be in Paris tomorrow?\nTools:", "max_tokens": 40,
            "temperature": 0}
    for k in (1, 3):
        reply = client.post(url + "/v1/completions",
                            json={**body, "vllm_xargs": request_args(name, k, tools=SUBSET, flat=True)})
        assert reply.status_code == 200, reply.text
        names = Contract().parse(reply.json()["choices"][0]["text"])
        assert len(names) == k == len(set(names)) and set(names) <= {catalog.names[t] for t in SUBSET}, names
    for bad, named in (({"tooltrie_artifact": name, "tooltrie_k": 0}, "k=0"),
                       ({"tooltrie_artifact": name, "tooltrie_k": 2, "tooltrie_x": 1}, "tooltrie_x"),
                       ({"tooltrie_artifact": str(artifact), "tooltrie_k": 1}, "unknown artifact name"),
                       ({"tooltrie_artifact": "../" + name, "tooltrie_k": 1}, "unknown artifact name"),
                       ({"tooltrie_artifact": "other.trie.safetensors", "tooltrie_k": 1}, "unknown artifact name"),
                       ({"tooltrie_artifact": name, "tooltrie_k": 1, "tooltrie_tools": [3, 47]}, "tools"),
                       ({"tooltrie_artifact": name, "tooltrie_k": 3, "tooltrie_tools": [3, 5]}, "tools")):
        reply = client.post(url + "/v1/completions", json={**body, "vllm_xargs": bad})
        assert 400 <= reply.status_code < 500 and named in reply.text, (bad, reply.status_code, reply.text)
        assert str(artifact.parent) not in reply.text  # no file system in vLLM's refusal
    assert client.get(url + "/health").status_code == 200


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[object, str, object]]:
    """The default model as served, its prompt style and its adapter's record."""
    model, info = load_model()
    yield model, info.prompt_style, info.adapter


@dataclass
class Stack:
    """One ``vllm serve`` with the processor, and two discovery endpoints on the catalog and BFCL: one decoding
    through it (``there``), one in process (``here``), with the same policy, limits and pre-filter."""

    process: subprocess.Popen[bytes]
    url: str
    work: Path
    there: Any
    here: Any
    client: httpx.Client


@pytest.fixture(scope="module")
def stack(served: tuple[object, str, Any]) -> Iterator[Stack]:
    model, style, adapter = served
    limits = ServeLimits(timeout_s=300)
    with tempfile.TemporaryDirectory(prefix="tooltrie-vllm-") as scratch:
        work = Path(scratch)
        save_model_as_served(model, None, work / "model")  # type: ignore[arg-type]
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = (work / "vllm.log").open("wb")
        process = start_vllm(work / "model", port, log, work / "artifacts")
        try:
            wait_up(process, url, work / "vllm.log")
            both = dict(prompt=Prompt.style(style), limits=limits, cache_dir=work / "cache", policy=POLICY,
                        prefilter=Prefilter.over(DEFAULT_PRIOR), base_adapter=adapter)
            remote = DiscoveryService.from_paths(
                [CATALOG_PATH, BFCL_PATH], None, smollm_tokenizer(), **both,
                remote=VllmServer(url, work / "artifacts", timeout_s=limits.timeout_s))
            local = DiscoveryService.from_paths([CATALOG_PATH, BFCL_PATH], model, smollm_tokenizer(), **both)
            with running_server(remote) as there, running_server(local) as here, \
                    httpx.Client(timeout=600) as client:
                yield Stack(process, url, work, there, here, client)
        finally:
            stop(process)
            log.close()


def same_answer(stack: Stack, headers: dict[str, str], ask: dict[str, Any], registry: Registry) -> None:
    """The endpoint through vLLM answers ``ask`` as the one in process does."""
    theirs = stack.client.post(stack.there.url + "/v1/discover", json=ask, headers=headers)
    ours = stack.client.post(stack.here.url + "/v1/discover", json=ask, headers=headers)
    assert theirs.status_code == 200, theirs.text
    check_answer(theirs.json(), registry, ask["k"])
    a, b = ours.json(), theirs.json()
    assert a["ranker"] == b["ranker"], (ask, a, b)
    assert [t["name"] for t in a["tools"]] == [t["name"] for t in b["tools"]], (ask, a, b)
    assert [t["pointer"] for t in a["tools"]] == [t["pointer"] for t in b["tools"]]
    for x, y in zip(a["tools"], b["tools"], strict=True):  # two engines' float32 arithmetic
        assert abs(x["score"] - y["score"]) < 0.02, (ask, a, b)
    for field in ("prompt_tokens", "completion_tokens", "decision_points"):
        assert a["usage"][field] == b["usage"][field], (field, a, b)


# -- the fuzzer: hostile vllm_xargs from any client of vLLM's server, beside valid requests -------------------------

FUZZ = dict.fromkeys(("sent", *OUTCOMES), 0)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_hostile_vllm_xargs_are_refused_and_never_disturb_the_engine(stack: Stack, data: st.DataObject) -> None:
    """Each example sends one hostile request to vLLM's own completions route while a valid request decodes through
    the endpoint: the hostile one is a 400 (or, where the draw is valid after all, k distinct tools), the valid one
    the in-process answer, and vLLM's server never restarts."""
    catalog = load_registry(CATALOG_PATH)
    root = stack.work / "artifacts"
    if not any(root.glob("catalog-*.trie.safetensors")):  # published by the endpoint's first answer
        same_answer(stack, {"Authorization": f"Bearer {OPEN_KEY}"}, {"query": "weather", "k": 1, "ranker": "fused"},
                    catalog)
    names = root_files(root, next(root.glob("catalog-*.trie.safetensors")).name)
    base = request_args(names["catalog"], data.draw(st.integers(1, 3)), flat=True)
    if data.draw(st.booleans()):
        base.update(request_args(names["catalog"], base["tooltrie_k"], prior=[0.5] * 47, flat=True))
    xargs = hostile(data.draw, base, names)
    due = outcome(xargs, root)  # decided before the reply, from the arguments alone
    # an answer's whole budget where one is due (a valid k may be large), a few tokens of prose where none is
    budget = answer_budget(Artifact.load(root / xargs["tooltrie_artifact"]), xargs["tooltrie_k"]) if (
        due == "answered") else 40
    model = stack.client.get(stack.url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": "Query: What will the weather be in Paris tomorrow?\nTools:",
            "max_tokens": budget, "temperature": 0, "vllm_xargs": xargs}
    query = data.draw(st.sampled_from(FUZZ_QUERIES))
    with ThreadPoolExecutor(1) as pool:  # the valid request decodes while the hostile one arrives
        valid = pool.submit(same_answer, stack, {"Authorization": f"Bearer {OPEN_KEY}"},
                            {"query": query, "k": 2, "ranker": "fused"}, catalog)
        try:
            reply = stack.client.post(stack.url + "/v1/completions", json=body)
        finally:
            valid.result()
    FUZZ["sent"] += 1
    assert stack.process.poll() is None, "vllm serve exited"
    FUZZ[due] += 1
    if due == "refused":
        assert reply.status_code == 400, (xargs, reply.status_code, reply.text[:500])
        assert str(root) not in reply.text
    elif due == "plain":
        assert reply.status_code == 200, (xargs, reply.text[:500])
    else:
        assert reply.status_code == 200, (xargs, reply.text[:500])
        names_out = Contract().parse(reply.json()["choices"][0]["text"])
        k = xargs["tooltrie_k"]
        assert len(names_out) == k == len(set(names_out)), (xargs, names_out)


def test_the_fuzzers_figures(stack: Stack) -> None:
    """The figures of the run above (sent, refused, answered), and vLLM's server still the one started."""
    assert stack.process.poll() is None and stack.client.get(stack.url + "/health").status_code == 200
    print(f"\nfuzzer: {FUZZ['sent']} hostile requests sent, {FUZZ['refused']} refused (400), {FUZZ['answered']} "
          f"answered (valid after all), {FUZZ['plain']} without tooltrie's arguments left, 0 engine restarts")
    assert FUZZ["sent"] == FUZZ["refused"] + FUZZ["answered"] + FUZZ["plain"] > 0


def test_the_proxy_forwards_a_thousand_tool_request_with_k_of_them(stack: Stack, served: tuple[object, str, Any]
                                                                    ) -> None:
    """``tooltrie proxy`` in front of this ``vllm serve``: a chat completion listing 1,000 tools (the catalog's and
    BFCL's first), rendered by a template that lists them as a tool-calling model's does, is far over the model's
    context and refused by vLLM; through the proxy it arrives with the k tools the decoder picks and the pinned one,
    in as many prompt tokens as the template makes of them, and is answered."""
    import jinja2

    model, style, adapter = served
    tools = [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                               "parameters": json_schema(tool.parameters)}}
             for tool in [*load_registry(CATALOG_PATH).tools, *load_registry(BFCL_PATH).tools][:1000]]
    name = stack.client.get(stack.url + "/v1/models").json()["data"][0]["id"]
    messages = [{"role": "user", "content": "What will the weather be in Paris tomorrow?"}]
    body = {"model": name, "max_tokens": 8, "temperature": 0, "tool_choice": "none", "chat_template": TOOLS_TEMPLATE,
            "tools": tools, "messages": messages}
    service = DiscoveryService.from_paths([CATALOG_PATH], model, smollm_tokenizer(), prompt=Prompt.style(style),
                                          limits=ServeLimits(timeout_s=300), cache_dir=stack.work / "proxy-cache",
                                          base_adapter=adapter)
    sent: list[dict[str, Any]] = []
    proxy = ChatProxy(service, stack.url, k=5, pin=("MapTool",))
    picked = proxy.tools_for

    async def recorded(request: Any) -> Any:
        sent.append(chosen := await picked(request))
        return chosen

    proxy.tools_for = recorded  # type: ignore[method-assign]
    with running_server(service, app=create_app(service, proxy=proxy)) as front:
        through = stack.client.post(front.url + "/v1/chat/completions", json=body)
    direct = stack.client.post(stack.url + "/v1/chat/completions", json=body)

    def prompt_tokens(listed: list[dict[str, Any]]) -> int:
        text = jinja2.Template(TOOLS_TEMPLATE).render(tools=listed, messages=messages, add_generation_prompt=True)
        return len(smollm_tokenizer().encode(text))

    assert through.status_code == 200, through.text
    assert through.headers["x-tooltrie-tools"] == "6/1000" and len(sent[0]) == 6
    assert through.json()["object"] == "chat.completion" and through.json()["choices"][0]["message"]["content"]
    counted = prompt_tokens(sent[0])  # vLLM's jinja renders JSON a little differently: within 2 %
    assert abs(through.json()["usage"]["prompt_tokens"] - counted) <= 0.02 * counted
    listed = prompt_tokens(tools)  # over the 2,048 vLLM is started with: refused whole
    assert direct.status_code == 400 and listed > 2048 and listed > 50 * prompt_tokens(sent[0]), direct.text


def test_same_answers_as_the_engine_then_vllm_down_is_502(stack: Stack) -> None:
    catalog, bfcl = load_registry(CATALOG_PATH), load_registry(BFCL_PATH)
    queries, bfcl_queries = load_split("metatool-single", "test"), load_split("bfcl", "test")
    everyone, acme = {"Authorization": f"Bearer {OPEN_KEY}"}, {"Authorization": f"Bearer {ACME_KEY}"}
    asks = [(everyone, {"query": queries[i * len(queries) // QUERIES].query, "k": k, **narrowed}, catalog)
            for i in range(QUERIES) for k in (1, 2, 3) for narrowed in NARROWED + RANKED]
    asks += [(acme, {"query": queries[i * len(queries) // QUERIES].query, "k": 2, **ranked}, catalog)
             for i in range(QUERIES) for ranked in ({}, {"ranker": "fused"})]  # the tenant's subset
    asks += [(everyone, {"query": bfcl_queries[i * len(bfcl_queries) // QUERIES].query, "k": 1, "registry": "bfcl",
                         "prefilter": 32, **ranked}, bfcl)
             for i in range(QUERIES) for ranked in ({}, {"ranker": "fused"})]
    compound = load_split("catalog-compound", "test")  # requests of several asks: their asks' priors travel too
    asks += [(everyone, {"query": compound[i].query, "k": compound[i].k, **ranked}, catalog)
             for i in (0, 10, 20) for ranked in ({"ranker": "fused"}, {"ranker": "retrieval"})]
    client, work = stack.client, stack.work
    for headers, ask, registry in asks:
        same_answer(stack, headers, ask, registry)
        if headers is acme:
            theirs = client.post(stack.there.url + "/v1/discover", json=ask, headers=headers)
            assert {t["name"] for t in theirs.json()["tools"]} <= set(ACME_TOOLS)
    assert client.get(stack.there.url + "/healthz").status_code == 200
    # the ranked requests' priors followed their answers there: the processor made the lexical index of
    # each registry beside its artifact, in its root (vllm_rows.ArtifactNames.lexical)
    for label in ("catalog", "bfcl"):
        assert next((work / "artifacts").glob(f"{label}-*.trie.lexical.safetensors"), None), label
    check_completions_route(client, stack.url, next((work / "artifacts").glob("catalog-*.trie.safetensors")),
                            catalog)
    stop(stack.process)
    reply = client.post(stack.there.url + "/v1/discover", json=asks[0][1], headers=everyone)
    assert reply.status_code == 502 and reply.json()["error"]["code"] == "bad_gateway", reply.text
    assert client.get(stack.there.url + "/v1/registries", headers=everyone).status_code == 200
