"""The sentence encoder in bfloat16 against float32, on a CPU that multiplies bfloat16 natively: how much faster the
tools embed, and whether the answers move. Each of the five development registries' test requests, of every kind, is
answered by the default prior alone (what ``--ranker retrieval`` answers: ``Ranker.row``, following the answer) with
the tools and the request embedded in each precision; the exact-set rates are paired request by request. Embedding
times: the registry's tools from cold, the two precisions taking turns.

    .venv/bin/python bench/bench_encoder_precision.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from _common import median, print_table, write_results
from _study import KINDS, REGISTRIES, paired_by_kind, registry_of, requests

from tooltrie.eval.scoring import answer_rates
from tooltrie.precision import native_bf16
from tooltrie.ranker import Ranker
from tooltrie.retrieval import SentenceEncoder, tool_text

PRECISIONS = ("float32", "bfloat16")


def exact_rates(ranker: Ranker, registry: Any, names: Sequence[str]) -> dict[str, np.ndarray]:
    """Per kind, each test request's exact-set outcome (0/1) for the prior alone."""
    rates = {}
    for kind in KINDS:
        outcomes = []
        for query in requests(names[0], kind):
            made = ranker.row(query.query, "retrieval", k=query.k)
            assert made.follow is not None
            chosen = [registry.names[i] for i in made.follow.top(query.k)]
            outcomes.append(answer_rates(chosen, list(query.tools))["exact"])
        rates[kind] = np.array(outcomes, float)
    return rates


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="turns of embedding each registry's tools")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    encoders = {precision: SentenceEncoder(precision=precision) for precision in PRECISIONS}
    for encoder in encoders.values():
        encoder.encode(["warm"])
    rates: dict[str, dict[str, dict[str, np.ndarray]]] = {}
    seconds: dict[str, dict[str, list[float]]] = {}
    cosines: dict[str, float] = {}
    tools: dict[str, int] = {}
    for registry_name in REGISTRIES:
        registry = registry_of(registry_name)
        texts = [tool_text(tool) for tool in registry.tools]
        tools[registry_name] = len(texts)
        seconds[registry_name] = {precision: [] for precision in PRECISIONS}
        rankers = {precision: Ranker(registry, encoder=encoders[precision]) for precision in PRECISIONS}
        for turn in range(args.repeats):  # the precisions take turns, each turn in the other order
            for precision in PRECISIONS if turn % 2 == 0 else PRECISIONS[::-1]:
                began = time.perf_counter()  # the first turn: the ranker's own embeddings, which it answers with
                _ = rankers[precision].tool_embeddings if turn == 0 else encoders[precision].encode(texts)
                seconds[registry_name][precision].append(time.perf_counter() - began)
        vectors = {precision: rankers[precision].tool_embeddings for precision in PRECISIONS}
        cosines[registry_name] = float((vectors["float32"] * vectors["bfloat16"]).sum(-1).min())
        rates[registry_name] = {precision: exact_rates(rankers[precision], registry, [registry_name])
                                for precision in PRECISIONS}
    pooled, by_registry, rows = paired_by_kind({r: rates[r]["bfloat16"] for r in REGISTRIES},
                                               {r: rates[r]["float32"] for r in REGISTRIES},
                                               ("bfloat16", "float32"), seed=7)
    results = {"pooled": pooled, "by_registry": by_registry, "tools": tools, "embedding_s": seconds,
               "smallest_cosine": cosines}
    print_table(rows, title="the prior alone, exact set on the five registries' test requests (pooled)")
    print_table([{"registry": r, "tools": tools[r], **{f"{p} s": median(seconds[r][p]) for p in PRECISIONS},
                  "speedup": f"{median(seconds[r]['float32']) / median(seconds[r]['bfloat16']):.2f}x",
                  "smallest cosine": f"{cosines[r]:.4f}"} for r in REGISTRIES], title="embedding the tools from cold")
    path = write_results("encoder_precision", settings={"repeats": args.repeats, "threads": torch.get_num_threads(),
                                                         "native_bf16": native_bf16()},
                         results=results, out=args.output, compact=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
