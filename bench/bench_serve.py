"""Serving throughput and latency with the real model: ``tooltrie serve`` under concurrent HTTP clients, batching on
against batching off, at several concurrencies, in one run.

Two servers run side by side as subprocesses (``python -m tooltrie.cli serve``), on the default model
(SmolLM2-135M-Instruct with the bundled adapter; ``--dtype`` as ``tooltrie serve`` takes it, default auto) and the
bundled 47-tool catalog: one batching (``--max-batch`` = the largest concurrency), one answering a request at a time
(``--max-batch 1``). For each concurrency c (1, 8, 32 by default), c clients in this process (asyncio + httpx, one
connection each) send the same fixed list of requests (``--requests``, the ``QUERIES`` in turn with k = 1, 2, 3 in
turn), each client sending its next request when its last one is answered. The two servers take turns at each
concurrency (the first one rotating from level to level), so drift on a shared machine hits both alike; the idle
server uses no CPU.

Measured per (batching, concurrency): throughput (answers per second of wall time from the first request to the
last answer), client-side latency p50/p99 (queueing included), and the rows per engine step (from the server's
``/metrics``: ``tooltrie_batch_rows``). The target is batching >= 4x the throughput of one-at-a-time at
concurrency 32 (reported, never asserted).

Checked (not timed): every answer is HTTP 200 with exactly k distinct catalog tools; the two servers give the same
tools for the same request (a mismatch would be a bug, or a near-tie flipped by float rounding: they are counted).

Torch runs with ``--torch-threads`` intra-op threads in each server (OMP_NUM_THREADS; default 1, as in
``bench_decode.py``: steadier on a shared 2-core machine).

    python bench/bench_serve.py [--concurrency 1,8,32] [--requests 320] [--ks 1,2,3] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from _common import REPO_DIR, RESULTS_DIR, machine_info, percentile, print_table, write_results
from bench_decode import QUERIES  # the same fixed queries as the decode benchmark

from tooltrie.registry import CATALOG_PATH, load_registry

TARGET_SPEEDUP_AT_32 = 4.0  # batching on / off throughput at concurrency 32; reported, never asserted
ON, OFF = "on", "off"


# -- the servers ------------------------------------------------------------------------------------------------------

@dataclass
class Server:
    name: str
    url: str
    max_batch: int
    process: subprocess.Popen[bytes]
    log: Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serving(name: str, *, max_batch: int, queue: int, model: str | None, torch_threads: int, dtype: str,
            start_timeout_s: float = 600.0, timeout_s: float = 3600.0, extra: Sequence[str] = ()) -> Iterator[Server]:
    """``tooltrie serve`` in a subprocess on a free loopback port, until its ``/healthz`` answers; stopped on exit.
    ``timeout_s``: its ``--timeout``; ``extra``: more of its arguments (registries, ranker)."""
    port = _free_port()
    log = Path(tempfile.mkstemp(prefix=f"bench-serve-{name}-", suffix=".log")[1])
    command = [sys.executable, "-m", "tooltrie.cli", "serve", "--port", str(port), "--max-batch", str(max_batch),
               "--queue", str(queue), "--timeout", str(timeout_s), "--dtype", dtype,
               *(["--model", model] if model else []), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(torch_threads), "MKL_NUM_THREADS": str(torch_threads)}
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=REPO_DIR, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(name, f"http://127.0.0.1:{port}", max_batch, process, log)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"server {name} exited with {process.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(server.url + "/healthz", timeout=60).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server {name} did not come up in {start_timeout_s:g} s:\n"
                                   f"{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.unlink(missing_ok=True)


def batch_rows(url: str) -> tuple[float, float]:
    """(sum, count) of the catalog engine's rows per step, from ``/metrics``."""
    values = {"sum": 0.0, "count": 0.0}
    for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
        for part in values:
            if line.startswith(f'tooltrie_batch_rows_{part}{{registry="catalog"}} '):
                values[part] = float(line.split()[-1])
    return values["sum"], values["count"]


# -- the clients ------------------------------------------------------------------------------------------------------

@dataclass
class Run:
    wall_s: float
    latencies_ms: list[float]
    replies: list[tuple[int, dict[str, Any]]]  # in the plan's order


async def _load(url: str, plan: Sequence[tuple[str, int]], concurrency: int) -> Run:
    """``concurrency`` clients working through ``plan``; each sends its next request when its last is answered."""
    replies: list[tuple[int, dict[str, Any]]] = [(0, {})] * len(plan)
    latencies: list[float] = [0.0] * len(plan)
    next_index = 0

    async def client() -> None:
        nonlocal next_index
        async with httpx.AsyncClient(base_url=url, timeout=3600) as session:
            while next_index < len(plan):
                index = next_index
                next_index += 1
                query, k = plan[index]
                began = time.perf_counter()
                reply = await session.post("/v1/discover", json={"query": query, "k": k})
                latencies[index] = (time.perf_counter() - began) * 1e3
                replies[index] = (reply.status_code, reply.json())

    began = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return Run(time.perf_counter() - began, latencies, replies)


def check(plan: Sequence[tuple[str, int]], run: Run, names: set[str]) -> int:
    """Requests whose answer is not 200 with exactly k distinct catalog tools."""
    bad = 0
    for (_, k), (status, body) in zip(plan, run.replies, strict=True):
        tools = [tool["name"] for tool in body.get("tools", [])] if status == 200 else []
        bad += not (status == 200 and body.get("finish_reason") == "stop" and len(tools) == k
                    and len(set(tools)) == k and set(tools) <= names)
    return bad


# -- main -------------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,8,32", help="client counts (default 1,8,32)")
    # 10 per client at 32 clients: with fewer, the ramp and the drain are much of the run (96 gave 3.3x, not 4.5x)
    parser.add_argument("--requests", type=int, default=320,
                        help="requests per concurrency and server (default 320)")
    parser.add_argument("--ks", default="1,2,3", help="tools per answer, in turn (default 1,2,3)")
    parser.add_argument("--max-batch", type=int, default=None, help="the batching server's --max-batch (default: "
                                                                     "the largest concurrency)")
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="the servers' --dtype (default auto)")
    parser.add_argument("--torch-threads", type=int, default=1, help="intra-op threads per server (default 1)")
    parser.add_argument("--out", default=str(RESULTS_DIR / "serve.json"), help="results file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    max_batch = args.max_batch or max(levels)
    plan = [(QUERIES[i % len(QUERIES)], ks[i % len(ks)]) for i in range(args.requests)]
    names = set(load_registry(CATALOG_PATH).names)
    settings = {"model": args.model or "smollm2-135m-instruct (default)", "registry": "catalog (47 tools)",
                "concurrency": levels, "requests": args.requests, "ks": ks, "max_batch_on": max_batch,
                "torch_threads": args.torch_threads, "dtype": args.dtype, "queries": list(QUERIES)}
    print(f"machine: {machine_info()['cpu']}, {machine_info()['usable_cores']} usable cores; settings: "
          f"{ {key: value for key, value in settings.items() if key != 'queries'} }", file=sys.stderr)

    rows: list[dict[str, Any]] = []
    answers: dict[str, list[list[str]]] = {ON: [], OFF: []}
    queue = max(levels) + 8
    common = {"queue": queue, "model": args.model, "torch_threads": args.torch_threads, "dtype": args.dtype}
    with serving(ON, max_batch=max_batch, **common) as on, serving(OFF, max_batch=1, **common) as off:
        for server in (on, off):  # warm-up: the prompt prefix is computed on first use
            asyncio.run(_load(server.url, plan[:2], 1))
        for turn, concurrency in enumerate(levels):
            for server in ((on, off) if turn % 2 == 0 else (off, on)):
                rows_before = batch_rows(server.url)
                run = asyncio.run(_load(server.url, plan, concurrency))
                rows_after = batch_rows(server.url)
                steps = rows_after[1] - rows_before[1]
                answers[server.name].append([",".join(t["name"] for t in body.get("tools", []))
                                             for _, body in run.replies])
                rows.append({
                    "batching": server.name, "max_batch": server.max_batch, "concurrency": concurrency,
                    "requests": len(plan), "wall_s": round(run.wall_s, 3),
                    "throughput_rps": round(len(plan) / run.wall_s, 3),
                    "p50_ms": round(percentile(run.latencies_ms, 50), 1),
                    "p99_ms": round(percentile(run.latencies_ms, 99), 1),
                    "rows_per_step": round((rows_after[0] - rows_before[0]) / steps, 2) if steps else None,
                    "invalid": check(plan, run, names)})
                print(f"  {server.name} c={concurrency}: {rows[-1]['throughput_rps']} answers/s", file=sys.stderr)

    rows.sort(key=lambda row: (row["concurrency"], row["batching"] != ON))
    print_table(rows, title="Serving: real model, catalog, answers per second and latency (client side)")
    throughput = {(row["batching"], row["concurrency"]): row["throughput_rps"] for row in rows}
    ratios = [{"concurrency": c, "on_over_off": round(throughput[ON, c] / throughput[OFF, c], 2),
               "target": f">= {TARGET_SPEEDUP_AT_32:g}x" if c == 32 else "-"} for c in levels]
    print_table(ratios, title="Batching on / off, throughput")
    mismatches = sum(a != b for on_level, off_level in zip(answers[ON], answers[OFF], strict=True)
                     for a, b in zip(on_level, off_level, strict=True))
    invalid = sum(row["invalid"] for row in rows)
    print(f"\ninvalid answers: {invalid}; on/off answers that differ: {mismatches} of {len(levels) * len(plan)}")
    path = write_results("serve", settings=settings, out=args.out,
                         results={"rows": rows, "ratios": ratios, "invalid": invalid, "on_off_mismatches": mismatches,
                                  "target_speedup_at_32": TARGET_SPEEDUP_AT_32})
    print(f"results: {path}", file=sys.stderr)
    return 0 if invalid == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
