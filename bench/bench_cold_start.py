"""A large registry from cold, as a user meets it: each step a ``tooltrie`` process of its own, timed, with its peak
memory, at 1,853 tools (BFCL), 10,000 and 100,000 (synthetic OpenAI tools: camelCase names, a one-line description
and one parameter each).

Steps, for this revision ("after") and, with ``--before PYTHON`` (the interpreter of an environment where an earlier
revision of tooltrie is installed), for that one in the same run:

- compile: ``tooltrie compile`` (after: with the lexical index kept beside the artifact);
- embeddings from cold: after, ``tooltrie compile --embed`` (the seconds it prints for the embeddings); before,
  the first ``tooltrie ask --ranker retrieval``, which embedded every tool before answering (its time less a warm
  ``ask``'s);
- warm ``ask``: ``tooltrie ask --ranker retrieval`` with the prior's parts kept;
- warm ``serve``: ``tooltrie serve --ranker retrieval`` until ``/healthz`` answers 200, then its first answer.

Every process runs in a folder of its own with a fresh compile cache; the default model's converted copy (a one-time
conversion, about 10 s, whatever the registry) is shared, made before anything is timed. The steps of one size run
one after another (no two processes at once: on 2 cores they would slow each other).

    .venv/bin/python bench/bench_cold_start.py [--sizes 1853,10000,100000] [--before build/before-env/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from _common import print_table, wait_healthy, write_results
from bench_compile import GB, synthetic_names

from tooltrie.registry import BFCL_PATH

QUERY = "get the invoice of a customer by city"
EMBEDDED = re.compile(r"(\d[\d,]*) tools embedded \((\d+(?:\.\d+)?) s\)")


@dataclass
class Run:
    seconds: float
    peak_bytes: int
    output: str


def synthetic_registry(path: Path, size: int) -> Path:
    """``size`` OpenAI function tools: ``pharmacy.upload_quote_async`` becomes ``pharmacyUploadQuoteAsync``."""
    tools = []
    for name in synthetic_names(size):
        domain, action = name.split(".")
        words = action.split("_")
        tools.append({"type": "function", "function": {
            "name": domain + "".join(word.capitalize() for word in words),
            "description": f"{words[0].capitalize()} the {' '.join(words[1:])} of {domain}.",
            "parameters": {"type": "object", "properties": {"id": {"type": "string", "description": "which one"}},
                           "required": ["id"]}}})
    path.write_text(json.dumps(tools))
    return path


def run(command: Sequence[str], folder: Path, *, timeout_s: float) -> Run:
    """``command`` in ``folder`` with its own compile cache: wall seconds, the process's peak resident memory (its
    rusage, read as it is reaped) and what it printed."""
    log_path = folder / f"step-{len(list(folder.glob('step-*.log')))}.log"
    with log_path.open("w+") as log:
        began = time.perf_counter()
        process = subprocess.Popen(command, cwd=folder, env=_env(folder), stdout=log, stderr=subprocess.STDOUT)
        timer = threading.Timer(timeout_s, process.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(process.pid, 0)
        finally:
            timer.cancel()
        seconds = time.perf_counter() - began
        process.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        output = log.read()
    if process.returncode:
        raise RuntimeError(f"{' '.join(command)} exited with {process.returncode}:\n{output[-3000:]}")
    return Run(seconds, usage.ru_maxrss * 1024, output)


def _env(folder: Path) -> dict[str, str]:
    return {**os.environ, "TOOLTRIE_CACHE_DIR": str(folder / "cache"), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": ""}


def serve_until_ready(python: str, artifact: Path, folder: Path, *, timeout_s: float) -> dict[str, Any]:
    """``tooltrie serve`` on a free port: seconds until ``/healthz`` is 200, the first answer's seconds, and the
    server's peak resident memory once it has answered (VmHWM)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [python, "-m", "tooltrie.cli", "serve", "--registry", str(artifact), "--ranker", "retrieval",
               "--port", str(port)]
    began = time.perf_counter()
    process = subprocess.Popen(command, cwd=folder, env=_env(folder), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, timeout_s, what=" ".join(command))
        ready = time.perf_counter() - began
        asked = time.perf_counter()
        answer = httpx.post(url + "/v1/discover", json={"query": QUERY, "k": 3}, timeout=120)
        answer.raise_for_status()
        first = time.perf_counter() - asked
        peak = _status_bytes(process.pid, "VmHWM")
    finally:
        process.terminate()
        process.wait(timeout=60)
    return {"ready_s": ready, "first_answer_s": first, "peak_bytes": peak}


def _status_bytes(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def measure(revision: str, python: str, registry: Path, folder: Path, *, timeout_s: float) -> dict[str, Any]:
    """The steps of one revision on one registry (``revision``: after or before)."""
    (folder / "cache").mkdir(parents=True)
    (folder / "cache" / "models").symlink_to(folder.parent / "models", target_is_directory=True)
    artifact = folder / "registry.trie.safetensors"
    tooltrie = [python, "-m", "tooltrie.cli"]
    ask = [*tooltrie, "ask", QUERY, "--registry", str(artifact), "--ranker", "retrieval", "--json"]
    quiet = ["--quiet"] if revision == "after" else []
    compiled = run([*tooltrie, "compile", str(registry), "-o", str(artifact), *quiet], folder, timeout_s=timeout_s)
    row: dict[str, Any] = {"compile_s": compiled.seconds, "compile_peak_bytes": compiled.peak_bytes}
    if revision == "after":
        embedded = run([*tooltrie, "compile", str(registry), "-o", str(artifact), "--embed", "--quiet"], folder,
                       timeout_s=timeout_s)
        found = EMBEDDED.search(embedded.output)
        if found is None:
            raise RuntimeError(f"compile --embed did not say how long the embeddings took:\n{embedded.output}")
        row.update(embeddings_s=float(found.group(2)), embeddings_peak_bytes=embedded.peak_bytes)
    else:
        cold = run(ask, folder, timeout_s=timeout_s)
        row.update(cold_ask_s=cold.seconds, embeddings_peak_bytes=cold.peak_bytes)
    warm = run(ask, folder, timeout_s=timeout_s)
    row.update(warm_ask_s=warm.seconds, warm_ask_peak_bytes=warm.peak_bytes)
    if revision == "before":
        row["embeddings_s"] = row["cold_ask_s"] - warm.seconds
    served = serve_until_ready(python, artifact, folder, timeout_s=timeout_s)
    row.update(serve_ready_s=served["ready_s"], first_answer_s=served["first_answer_s"],
               serve_peak_bytes=served["peak_bytes"])
    return row


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1853,10000,100000", help="tools per registry (1853: BFCL)")
    parser.add_argument("--before", default=None, metavar="PYTHON",
                        help="the interpreter of an environment with an earlier revision installed")
    parser.add_argument("--before-revision", default=None, help="that revision's name, for the results")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a step may take")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.sizes.split(",")]
    revisions = {"after": sys.executable, **({"before": os.path.abspath(args.before)} if args.before else {})}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tooltrie-cold-") as scratch:
        models = Path(scratch) / "models"
        for revision, python in revisions.items():  # the default model converted once, before anything is timed
            folder = Path(scratch) / f"model-{revision}"
            (folder / "cache").mkdir(parents=True)
            models.mkdir(exist_ok=True)
            (folder / "cache" / "models").symlink_to(models, target_is_directory=True)
            run([python, "-m", "tooltrie.cli", "ask", "weather", "--k", "1"], folder, timeout_s=args.timeout)
        for size in sizes:
            registry = BFCL_PATH if size == 1853 else synthetic_registry(Path(scratch) / f"tools-{size}.json", size)
            for revision, python in revisions.items():
                began = time.perf_counter()
                row = measure(revision, python, registry, Path(scratch) / f"{revision}-{size}",
                              timeout_s=args.timeout)
                rows.append({"tools": size, "revision": revision, **row})
                print(f"{size:,} tools, {revision}: {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    print_table([{"tools": row["tools"], "revision": row["revision"], "compile s": row["compile_s"],
                  "embeddings s": row["embeddings_s"], "warm ask s": row["warm_ask_s"],
                  "ask peak GB": row["warm_ask_peak_bytes"] / GB, "serve ready s": row["serve_ready_s"],
                  "first answer s": row["first_answer_s"], "serve peak GB": row["serve_peak_bytes"] / GB,
                  "compile peak GB": row["compile_peak_bytes"] / GB, "embed peak GB": row["embeddings_peak_bytes"] / GB}
                 for row in rows], title="a large registry from cold")
    path = write_results("cold_start", settings={"sizes": sizes, "query": QUERY, "ranker": "retrieval",
                                                 "before_revision": args.before_revision,
                                                 "threads": os.cpu_count()},
                         results=rows, out=args.output, compact=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
