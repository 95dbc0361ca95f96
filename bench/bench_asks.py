"""What one tool per ask costs (``tooltrie.ranker.PerAsk``), on one core.

- **per request**, at BFCL's 1,853 tools with all-MiniLM-L6-v2 (the tools' embeddings made beforehand, as a served
  registry keeps them): ``Ranker.row(query, "fused")`` of the hybrid prior with the asks (the request and its asks
  embedded in one batch, each ask's BM25, the blend, the first prior) against the same ranker without them
  (``asks=False``: today's prior), the two taking turns on each request. Requests: BFCL's hand-written compound
  requests (2-4 asks) and its plainly worded validation requests (one ask: nothing to add but the split).
- **per finished tool**, at 100,000 tools (``bench_lexical.synthetic_registry``): the prior of the next tool once the
  answer has committed to 1, 2, 3 tools of a request of 4 asks (the open asks found, the best over their rows) and,
  once every ask has its tool, the whole request's follow-up (``FollowUp``: today's cost, for scale). The asks'
  priors are random z-scores: the cost does not depend on their values.

Targets (reported, never asserted): at most 5 ms per request above today's prior at 1,853 tools, at most 1 ms per
finished tool at 100,000 tools.

    NUMBA_NUM_THREADS=1 OMP_NUM_THREADS=1 python bench/bench_asks.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from _common import REPO_DIR, print_table, summarize, write_results
from _study import SETS
from bench_lexical import synthetic_registry

from tooltrie.asks import split_asks
from tooltrie.eval.datasets import load_split
from tooltrie.ranker import UNTRAINED, PerAsk, Ranker, Weights
from tooltrie.registry import BFCL_PATH, load_registry
from tooltrie.retrieval import SentenceEncoder

TARGETS = {"per_request_ms_at_1853": 5.0, "per_finished_tool_ms_at_100k": 1.0}


def per_request(repeats: int) -> dict[str, Any]:
    registry = load_registry(BFCL_PATH)
    encoder = SentenceEncoder()
    kept = REPO_DIR / "build" / "bench_asks" / "bfcl.embeddings.safetensors"  # the tools embedded once, for both
    rankers = {asks: Ranker(registry, fused=UNTRAINED, asks=asks, encoder=encoder, embeddings_path=kept)
               for asks in (True, False)}
    sets = {"compound": [q.query for name in SETS["bfcl"]["compound"] for split in ("validation", "test")
                         for q in load_split(name, split)],
            "plain": [q.query for name in SETS["bfcl"]["plain"] for q in load_split(name, "validation")][:100]}
    for ranker in rankers.values():  # warm: the lexical index, the encoder's first passes
        ranker.row(sets["compound"][0], "fused")
    results: dict[str, Any] = {}
    for kind, queries in sets.items():
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(repeats):
            for i, query in enumerate(queries):
                for asks in ((True, False) if i % 2 else (False, True)):  # turn-taking, each first half the time
                    began = time.perf_counter()
                    rankers[asks].row(query, "fused")
                    times[asks].append(1000 * (time.perf_counter() - began))
        extra = [a - b for a, b in zip(times[True], times[False], strict=True)]
        results[kind] = {"requests": len(queries), "asks_per_request": float(np.mean([len(split_asks(q))
                                                                                    for q in queries])),
                         "with_asks_ms": summarize(times[True]), "today_ms": summarize(times[False]),
                         "extra_ms": summarize(extra)}
    return results


def per_finished_tool(repeats: int, asks: int = 4) -> dict[str, Any]:
    registry = synthetic_registry(100_000)
    ranker = Ranker(registry, prior="lexical", fused=Weights(model=1.0, retrieval=1.0), asks=False)
    queries = [q.query for name in SETS["bfcl"]["compound"] for q in load_split(name, "validation")][:20]
    rng = np.random.default_rng(0)
    samples: dict[str, list[float]] = {f"{n} committed": [] for n in range(1, asks + 1)}
    for query in queries:
        made = ranker.row(query, "fused")  # the whole request's prior and its follow-up (the lexical index warm)
        assert made.scores is not None and made.follow is not None
        follow = PerAsk(rng.standard_normal((asks, len(registry))).astype(np.float32), made.scores, made.follow)
        chosen = tuple(int(t) for t in rng.choice(len(registry), asks, replace=False))
        for _ in range(repeats):
            for n in range(1, asks + 1):
                began = time.perf_counter()
                follow(chosen[:n])
                samples[f"{n} committed"].append(1000 * (time.perf_counter() - began))
    return {"tools": len(registry), "asks": asks, "requests": len(queries),
            **{key: summarize(values) for key, values in samples.items()}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    request = per_request(args.repeats)
    print_table([{"requests": kind, "n": cell["requests"], "asks each": f"{cell['asks_per_request']:.2f}",
                  "with asks ms": cell["with_asks_ms"]["median"], "today ms": cell["today_ms"]["median"],
                  "extra ms (median)": cell["extra_ms"]["median"]}
                 for kind, cell in request.items()], title="Ranker.row at 1,853 tools (BFCL), one core")
    tool = per_finished_tool(args.repeats)
    print_table([{"answer so far": key, "next prior ms (median)": tool[key]["median"]}
                 for key in tool if key.endswith("committed")],
                title=f"the next tool's prior at {tool['tools']:,} tools, {tool['asks']} asks, one core")
    path = write_results("asks", settings={"repeats": args.repeats, "targets": TARGETS, "threads": 1},
                         results={"per_request": request, "per_finished_tool": tool}, out=args.output, compact=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
