"""``tooltrie proxy`` in front of ``vllm serve`` (vLLM's CPU build, the default model as served): a chat completion
listing 1,000 tools (the catalog's and BFCL's first), rendered by a template that lists them as a tool-calling
model's does. What reaches vLLM with and without the proxy (prompt tokens: the template rendered and tokenized here,
and vLLM's own count where it answers), and how long an answer takes: the first through the proxy (the list compiled
then), the next ones, and the same forwarded requests sent to vLLM directly (what the proxy adds), taking turns.
Runs where vLLM is installed (``make test-vllm``'s environment):

    build/vllm-env/bin/python bench/bench_proxy.py [--queries 8] [--k 5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import jinja2
from _common import median, print_table, take_turns, wait_healthy, write_results

from tooltrie.compiler import TokenizerInfo
from tooltrie.eval.datasets import load_split
from tooltrie.registry import BFCL_PATH, CATALOG_PATH, load_registry
from tooltrie.serve.model import load_model, save_model_as_served
from tooltrie.serve.tool_search import json_schema
from tooltrie.vllm_server import free_port, start_vllm, stop, wait_up

TOOLS = 1000
# As tests/test_vllm_serve_remote.py's: the request's tools listed before the conversation.
TEMPLATE = ("{% if tools %}<|im_start|>system\nYou may call these tools:\n{% for tool in tools %}"
            "{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}{% for message in messages %}"
            "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def rendered_tokens(tokenizer: TokenizerInfo, tools: list[dict[str, Any]], messages: list[dict[str, Any]]) -> int:
    text = jinja2.Template(TEMPLATE).render(tools=tools, messages=messages, add_generation_prompt=True)
    return len(tokenizer.encode(text))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=int, default=8)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    tools = [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                               "parameters": json_schema(tool.parameters)}}
             for tool in [*load_registry(CATALOG_PATH).tools, *load_registry(BFCL_PATH).tools][:TOOLS]]
    test = load_split("metatool-single", "test")
    queries = [test[i * len(test) // args.queries].query for i in range(args.queries)]
    tokenizer = TokenizerInfo.load("smollm2-135m")
    with tempfile.TemporaryDirectory(prefix="tooltrie-proxy-") as scratch:
        work = Path(scratch)
        save_model_as_served(load_model()[0], None, work / "model")
        vllm_port, proxy_port = free_port(), free_port()
        vllm_url, proxy_url = f"http://127.0.0.1:{vllm_port}", f"http://127.0.0.1:{proxy_port}"
        with (work / "vllm.log").open("wb") as log:
            vllm = start_vllm(work / "model", vllm_port, log, work / "artifacts")
            proxy = subprocess.Popen([sys.executable, "-P", "-m", "tooltrie.cli", "proxy", "--upstream", vllm_url,
                                      "--port", str(proxy_port), "--k", str(args.k)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            try:
                wait_up(vllm, vllm_url, work / "vllm.log")
                wait_healthy(proxy_url, proxy, 600, what="tooltrie proxy", poll_s=1)
                results = measure(vllm_url, proxy_url, tools, queries, tokenizer)
            finally:
                proxy.terminate()
                proxy.wait(timeout=60)
                stop(vllm)
    print_table([{"request": "1,000 tools, sent directly", "prompt tokens": results["direct_tokens"],
                  "vLLM": f"{results['direct_status']} (context 2,048)"},
                 {"request": "through the proxy", "prompt tokens": f"{median(results['proxy_tokens']):.0f} "
                                                                   "(median)", "vLLM": "200"}],
                title="what reaches vLLM")
    print_table([{"arm": arm, "ms (median)": f"{median(ms):.0f}", "samples": len(ms)}
                 for arm, ms in results["ms"].items()] + [{"arm": "first through the proxy (compiles the list)",
                                                           "ms (median)": f"{results['first_ms']:.0f}", "samples": 1}],
                title="answer latency")
    path = write_results("proxy", settings={"tools": TOOLS, "k": args.k, "queries": args.queries},
                         results=results, out=args.output, compact=True)
    print(f"wrote {path}")
    return 0


def measure(vllm_url: str, proxy_url: str, tools: list[dict[str, Any]], queries: list[str],
            tokenizer: TokenizerInfo) -> dict[str, Any]:
    client = httpx.Client(timeout=600)
    name = client.get(vllm_url + "/v1/models").json()["data"][0]["id"]

    def body(query: str, listed: list[dict[str, Any]]) -> dict[str, Any]:
        return {"model": name, "max_tokens": 16, "temperature": 0, "tool_choice": "none", "chat_template": TEMPLATE,
                "tools": listed, "messages": [{"role": "user", "content": query}]}

    messages = [{"role": "user", "content": queries[0]}]
    direct = client.post(vllm_url + "/v1/chat/completions", json=body(queries[0], tools))
    began = time.perf_counter()
    first = client.post(proxy_url + "/v1/chat/completions", json=body(queries[0], tools))
    first_ms = (time.perf_counter() - began) * 1e3
    first.raise_for_status()
    forwarded: dict[str, list[dict[str, Any]]] = {}
    tokens: list[int] = []

    def through(query: str) -> None:
        reply = client.post(proxy_url + "/v1/chat/completions", json=body(query, tools))
        reply.raise_for_status()
        tokens.append(reply.json()["usage"]["prompt_tokens"])

    def straight(query: str) -> None:  # what the proxy forwarded, sent directly
        reply = client.post(vllm_url + "/v1/chat/completions", json=body(query, forwarded[query]))
        reply.raise_for_status()

    for query in queries:  # the tools the proxy forwards for each query, found once through its search
        found = client.post(proxy_url + "/v1/tool-search", json={"query": query, "limit": 5, "tools": tools}).json()
        picked = {tool["name"] for tool in found["tools"]}
        forwarded[query] = [tool for tool in tools if tool["function"]["name"] in picked]
    times: dict[str, list[float]] = {"through the proxy": [], "the same tools, directly": []}
    for query in queries:
        turns = take_turns({"through the proxy": lambda q=query: through(q),
                            "the same tools, directly": lambda q=query: straight(q)}, repeats=2)
        for arm, measured in turns.items():
            times[arm] += [1e3 * value for value in measured.samples["wall"]]
    return {"direct_status": direct.status_code, "direct_tokens": rendered_tokens(tokenizer, tools, messages),
            "direct_error": json.dumps(direct.json())[:300] if direct.status_code != 200 else None,
            "proxy_tokens": tokens, "first_ms": first_ms, "ms": times}


if __name__ == "__main__":
    raise SystemExit(main())
