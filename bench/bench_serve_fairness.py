"""Whether one kind of request slows the others down: ``tooltrie serve`` (the default model, a subprocess on loopback)
under a mixed load, the others' latency measured with and without the heavy kind, in one run, the arms taking turns.

Two scenarios (``--scenario``):

- ``long``: ``--ordinary-clients`` clients (32) with ordinary queries (``bench_decode.QUERIES``, k = 1, 2, 3 in turn),
  alone, then while ``--long-clients`` clients (4) send the longest query the server accepts (rain clouds, 3 tokens
  each: ``--long-chars`` 341 is 1,023 tokens, under ``ServeLimits.max_query_tokens``; 1,999 is the 5,997-token query
  that stalled the server before queries were bounded in tokens and read in chunks). Reported: the ordinary
  requests' p50/p99 and HTTP statuses, the long ones' statuses and latency.
- ``fused``: two registries (the catalog, and the same tools under another name), ``--plain-clients`` clients asking
  the second one with the model ranker, while ``--heavy`` requests (32) ask the first at once, ranked by ``model``
  (an arm) or ``fused`` (the other arm: each needs a query embedding, all-MiniLM-L6-v2). The prior is made at
  admission, in a thread; inside the engine's step it would hold every registry's batch. Reported: the plain
  requests' p50 per arm, and the ratio fused / model (the target: within 10 %).

Latency is the client's (queueing included). Nothing is asserted; every answer is checked to be 200 with k tools.

    python bench/bench_serve_fairness.py --scenario long [--long-chars 341] [--model DIR]
    python bench/bench_serve_fairness.py --scenario fused [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import yaml
from _common import RESULTS_DIR, machine_info, percentile, print_table, write_results
from bench_decode import QUERIES
from bench_serve import serving

from tooltrie.registry import CATALOG_PATH

LONG_QUERY_CHAR = "\U0001f327"  # a rain cloud: 3 tokens in SmolLM2's vocabulary


async def _clients(url: str, asks: list[dict[str, Any]], clients: int) -> list[tuple[int, float]]:
    """``clients`` connections working through ``asks``; (status, seconds) per ask, in order."""
    results: list[tuple[int, float]] = [(0, 0.0)] * len(asks)
    next_index = 0

    async def client(session: httpx.AsyncClient) -> None:
        nonlocal next_index
        while next_index < len(asks):
            index = next_index
            next_index += 1
            began = time.perf_counter()
            reply = await session.post("/v1/discover", json=asks[index])
            ok = reply.status_code == 200 and len(reply.json().get("tools", [])) == asks[index]["k"]
            results[index] = (reply.status_code if ok or reply.status_code != 200 else -1,
                              time.perf_counter() - began)

    limits = httpx.Limits(max_connections=clients + 1)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return results


async def _together(url: str, measured: tuple[list[dict[str, Any]], int],
                    load: tuple[list[dict[str, Any]], int] | None,
                    head_start_s: float) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """The measured asks while the load runs (started ``head_start_s`` before them)."""
    background = asyncio.ensure_future(_clients(url, *load)) if load is not None else None
    if background is not None:
        await asyncio.sleep(head_start_s)
    measured_results = await _clients(url, *measured)
    return measured_results, (await background if background is not None else [])


def _summary(name: str, results: list[tuple[int, float]]) -> dict[str, Any]:
    seconds = [s for status, s in results if status == 200]
    statuses = Counter(status for status, _ in results)
    return {"arm": name, "requests": len(results), "ok": statuses.get(200, 0),
            "statuses": ",".join(f"{status}:{n}" for status, n in sorted(statuses.items())),
            "p50_s": round(percentile(seconds, 50), 2) if seconds else None,
            "p99_s": round(percentile(seconds, 99), 2) if seconds else None}


def long_scenario(args: argparse.Namespace, common: dict[str, Any]) -> dict[str, Any]:
    ordinary = [{"query": QUERIES[i % len(QUERIES)], "k": 1 + i % 3}
                for i in range(args.ordinary_clients * args.requests_each)]
    long_asks = [{"query": LONG_QUERY_CHAR * args.long_chars, "k": 1}] * args.long_clients
    rows = []
    with serving("long", max_batch=args.max_batch, queue=256, timeout_s=args.timeout, extra=["--ranker", "model"],
                 **common) as server:
        asyncio.run(_clients(server.url, ordinary[:2], 1))  # warm-up
        for turn in range(args.rounds):
            arms = [("ordinary alone", None), ("ordinary with long", (long_asks, args.long_clients))]
            for name, load in arms if turn % 2 == 0 else arms[::-1]:
                measured, loaded = asyncio.run(_together(server.url, (ordinary, args.ordinary_clients), load, 1.0))
                rows.append({**_summary(name, measured), "round": turn})
                if loaded:
                    rows.append({**_summary("long", loaded), "round": turn})
                print(f"  round {turn}: {rows[-1]}", file=sys.stderr)
    print_table(rows, title=f"Ordinary requests alone and beside {args.long_clients} of "
                            f"{args.long_chars} rain clouds (client latency)")
    return {"rows": rows}


def fused_scenario(args: argparse.Namespace, common: dict[str, Any]) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="bench-fairness-"))
    twin = yaml.safe_load(CATALOG_PATH.read_text(encoding="utf-8"))
    twin["name"] = "twin"
    (folder / "twin.yaml").write_text(yaml.safe_dump(twin, sort_keys=False), encoding="utf-8")
    plain = [{"query": QUERIES[i % len(QUERIES)], "k": 1 + i % 3, "registry": "twin"}
             for i in range(args.plain_clients * args.requests_each)]
    rows = []
    extra = ["--registry", str(CATALOG_PATH), "--registry", str(folder / "twin.yaml"), "--ranker", "model"]
    with serving("fused", max_batch=args.max_batch, queue=256, timeout_s=args.timeout, extra=extra, **common) as server:
        for ranker in ("model", "fused"):  # warm-up: the prefixes, and the tools' embeddings
            asyncio.run(_clients(server.url, [{"query": QUERIES[0], "k": 1, "ranker": ranker}], 1))
        asyncio.run(_clients(server.url, plain[:2], 1))
        for turn in range(args.rounds):
            arms: list[tuple[str, str | None]] = [("alone", None), ("beside model", "model"),
                                                  ("beside fused", "fused")]
            for name, ranker in arms if turn % 2 == 0 else arms[::-1]:
                heavy = [{"query": QUERIES[i % len(QUERIES)], "k": 1 + i % 3, "ranker": ranker}
                         for i in range(args.heavy)] if ranker else []
                measured, loaded = asyncio.run(_together(server.url, (plain, args.plain_clients),
                                                         (heavy, args.heavy) if heavy else None, 0.0))
                rows.append({**_summary(name, measured), "round": turn})
                if loaded:
                    rows.append({**_summary(f"heavy {ranker}", loaded), "round": turn})
                print(f"  round {turn}: {rows[-1]}", file=sys.stderr)
    p50 = {name: [row["p50_s"] for row in rows if row["arm"] == name] for name in ("beside model", "beside fused")}
    ratios = [{"round": turn, "fused_over_model_p50": round(f / m, 3)}
              for turn, (m, f) in enumerate(zip(p50["beside model"], p50["beside fused"], strict=True)) if m and f]
    print_table(rows, title=f"Plain requests on one registry beside {args.heavy} on another (client latency)")
    print_table(ratios, title="Plain p50 beside fused / beside model (target <= 1.10)")
    return {"rows": rows, "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=("long", "fused"), required=True)
    parser.add_argument("--ordinary-clients", type=int, default=32)
    parser.add_argument("--long-clients", type=int, default=4)
    parser.add_argument("--long-chars", type=int, default=341, help="rain clouds per long query (341: 1,023 tokens)")
    parser.add_argument("--plain-clients", type=int, default=8)
    parser.add_argument("--heavy", type=int, default=32, help="concurrent requests on the other registry")
    parser.add_argument("--requests-each", type=int, default=1, help="measured requests per client")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=30.0, help="the server's --timeout (default 30, its own)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="results file (default bench/results/serve-<scenario>.json)")
    args = parser.parse_args(argv)
    settings = {key: value for key, value in vars(args).items() if key != "out"}
    print(f"machine: {machine_info()['cpu']}; settings: {settings}", file=sys.stderr)
    common = {"model": args.model, "torch_threads": args.torch_threads, "dtype": args.dtype}
    results = (long_scenario if args.scenario == "long" else fused_scenario)(args, common)
    path = write_results(f"serve-{args.scenario}", settings=settings, results=results,
                         out=args.out or RESULTS_DIR / f"serve-{args.scenario}.json")
    print(f"results: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
