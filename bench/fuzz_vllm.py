"""Hostile ``vllm_xargs`` against vLLM's real engine, and its memory after many wide requests against many plain ones.

One ``vllm serve`` with tooltrie's processor (vLLM's CPU build on a CPU; ``tooltrie.vllm_server``), the default model
as served, the catalog's and BFCL's artifacts in its root. Three phases, in this order:

1. ``--requests`` plain requests (the catalog, k = 1), then the resident memory of vLLM's processes;
2. ``--requests`` of the widest a request may be (BFCL, k = ``RowLimits.max_k``, a subset of 1,000 tools, a prior
   that follows the answer), then the memory again: the batch state's widths go with the requests that needed them
   (``BatchState.release``), so the two should be within noise;
3. ``--hostile`` hostile requests (``tooltrie.vllm_server.hostile``: drawn by hypothesis), each sent while a valid
   ranked request decodes beside it: a hostile request must be refused (400) or, where the draw is valid after all,
   answered with k distinct tools; the valid one must be the answer it gets alone; the server must never restart.

Each request generates at most ``--tokens`` tokens in phases 1 and 2 (the state a request widens is made when it
joins, whatever it generates). Run it in vLLM's environment (``make test-vllm`` builds one):

    build/vllm-env/bin/python bench/fuzz_vllm.py [--requests 1000] [--hostile 1000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from _common import print_table, write_results

from tooltrie.compiler import Artifact, TokenizerInfo, compile_cached
from tooltrie.compiler.contract import Contract
from tooltrie.integrations.vllm_rows import LIMITS, publish_artifact, request_args
from tooltrie.ranker import Ranker
from tooltrie.registry import BFCL_PATH, CATALOG_PATH, load_registry
from tooltrie.serve.limits import answer_budget
from tooltrie.serve.model import load_model, save_model_as_served
from tooltrie.vllm_server import free_port, hostile, outcome, resident_bytes, root_files, start_vllm, stop, wait_up

PROMPT = "Query: What will the weather be in Paris tomorrow, and is there news about flights?\nTools:"
CONCURRENCY = 16  # the server's --max-num-seqs


class Server:
    def __init__(self, url: str, client: httpx.Client) -> None:
        self.url, self.client = url, client
        self.model = client.get(url + "/v1/models").json()["data"][0]["id"]

    def complete(self, xargs: dict[str, Any], max_tokens: int) -> httpx.Response:
        return self.client.post(self.url + "/v1/completions", json={
            "model": self.model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "vllm_xargs": xargs})


def many(server: Server, requests: Sequence[dict[str, Any]], max_tokens: int) -> Counter[int]:
    """Send ``requests`` ``CONCURRENCY`` at a time; the count of each status code."""
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        return Counter(reply.status_code for reply in pool.map(lambda x: server.complete(x, max_tokens), requests))


def wide_requests(bfcl: Artifact, name: str, count: int, seed: int) -> list[dict[str, Any]]:
    """The widest requests admission takes: k at its limit, a subset of 1,000 tools, a prior that follows."""
    rng = np.random.default_rng(seed)
    ranker = Ranker(bfcl.registry, prior="lexical")
    made = ranker.row("Find the nearest hospital and compute my BMI", "fused")
    result = []
    for _ in range(count):
        tools = rng.choice(len(bfcl.registry), size=1000, replace=False)
        result.append(request_args(name, LIMITS.max_k, tools=tools.tolist(), prior=made.scores, model_weight=1.0,
                                   follow=made.follow, flat=True))
    return result


def fuzz(server: Server, root: Path, catalog_name: str, examples: int, seed: int) -> dict[str, Any]:
    """``examples`` hostile requests, each beside a valid ranked one; what became of them."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    catalog = load_registry(CATALOG_PATH)
    valid = request_args(catalog_name, 2, prior=np.linspace(0, 1, len(catalog)), model_weight=1.0, flat=True)
    alone = server.complete(valid, 32).json()["choices"][0]["text"]
    counts: Counter[str] = Counter()
    problems: list[str] = []

    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def one(data: st.DataObject) -> None:
        names = root_files(root, catalog_name)
        base = request_args(catalog_name, data.draw(st.integers(1, 3)), flat=True)
        xargs = hostile(data.draw, base, names)
        due = outcome(xargs, root)
        budget = answer_budget(Artifact.load(root / xargs["tooltrie_artifact"]), xargs["tooltrie_k"]) if (
            due == "answered") else 40
        with ThreadPoolExecutor(1) as pool:
            beside = pool.submit(server.complete, valid, 32)
            reply = server.complete(xargs, budget)
            text = beside.result().json()["choices"][0]["text"]
        counts["sent"] += 1
        counts[due] += 1
        expected = {"refused": 400, "answered": 200, "plain": 200}[due]
        if reply.status_code != expected:
            problems.append(f"{due}: {reply.status_code} {reply.text[:200]}")
        elif due == "answered":
            tools = Contract().parse(reply.json()["choices"][0]["text"])
            if not len(tools) == xargs["tooltrie_k"] == len(set(tools)):
                problems.append(f"answered {tools} for k={xargs['tooltrie_k']}")
        if text != alone:
            counts["valid_differing"] += 1

    one()
    return {**counts, "problems": problems[:20], "problem_count": len(problems)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    model, _ = load_model()
    tokenizer = TokenizerInfo.load()
    catalog = compile_cached(load_registry(CATALOG_PATH), tokenizer)
    bfcl = compile_cached(load_registry(BFCL_PATH), tokenizer)
    with tempfile.TemporaryDirectory(prefix="tooltrie-fuzz-") as scratch:
        work = Path(scratch)
        root = work / "artifacts"
        root.mkdir()
        catalog_name = publish_artifact(catalog.save(work / "catalog.trie.safetensors"), root=root)
        bfcl_name = publish_artifact(bfcl.save(work / "bfcl.trie.safetensors"), root=root)
        save_model_as_served(model, None, work / "model")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with (work / "vllm.log").open("wb") as log:
            process = start_vllm(work / "model", port, log, root)
            try:
                wait_up(process, url, work / "vllm.log")
                with httpx.Client(timeout=600) as client:
                    server = Server(url, client)
                    plain = [request_args(catalog_name, 1, flat=True)] * args.requests
                    many(server, plain[:CONCURRENCY], args.tokens)  # warm-up
                    started = time.perf_counter()
                    plain_codes = many(server, plain, args.tokens)
                    plain_s, after_plain = time.perf_counter() - started, resident_bytes(process)
                    wide = wide_requests(bfcl, bfcl_name, args.requests, args.seed)
                    started = time.perf_counter()
                    wide_codes = many(server, wide, args.tokens)
                    wide_s, after_wide = time.perf_counter() - started, resident_bytes(process)
                    started = time.perf_counter()
                    fuzzed = fuzz(server, root, catalog_name, args.hostile, args.seed)
                    fuzz_s = time.perf_counter() - started
                    alive = process.poll() is None and client.get(url + "/health").status_code == 200
            finally:
                stop(process)
    return {"plain": {"requests": args.requests, "status": dict(plain_codes), "seconds": round(plain_s, 1),
                      "resident_bytes_after": after_plain},
            "wide": {"requests": args.requests, "k": LIMITS.max_k, "subset": 1000, "prior": True, "follow": True,
                     "status": dict(wide_codes), "seconds": round(wide_s, 1), "resident_bytes_after": after_wide},
            "memory_wide_over_plain": round(after_wide / after_plain, 4),
            "hostile": {**fuzzed, "seconds": round(fuzz_s, 1)},
            "server_alive_and_never_restarted": alive}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="plain requests, then as many wide ones")
    parser.add_argument("--hostile", type=int, default=1000, help="hostile requests (each beside a valid one)")
    parser.add_argument("--tokens", type=int, default=8, help="tokens each plain or wide request generates at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="the results file (default bench/results/fuzz_vllm.json)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    hostile_results, alive = results["hostile"], results["server_alive_and_never_restarted"]
    print_table([{"phase": phase, "requests": args.requests, "status": results[key]["status"],
                  "resident MB after": round(results[key]["resident_bytes_after"] / 2**20)}
                 for key, phase in (("plain", "plain"), ("wide", f"wide (k={LIMITS.max_k}, 1,000 tools, prior)"))],
                title=f"vLLM's memory: wide over plain {results['memory_wide_over_plain']}")
    print_table([{key: hostile_results.get(key, 0) for key in ("sent", "refused", "answered", "plain",
                                                               "valid_differing", "problem_count")}],
                title=f"hostile requests (server alive and never restarted: {alive})")
    path = write_results("fuzz_vllm", settings=vars(args), results=results, out=args.out, compact=True)
    print(f"wrote {path}")
    return 0 if alive and not hostile_results["problem_count"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
