"""Latency of one discovery answer with the default model (what ``tooltrie ask`` waits for, model load excluded).

The default model (SmolLM2-135M-Instruct + the bundled adapter, short prompt) and the bundled catalog; queries from
the held-out MetaTool test split, answered one at a time (batch 1), k = 1 and 3, arms taking turns:

- ``engine``: ``Engine.run([Request(query, k)])`` (prefix cache, sparse head, forced chains);
- ``hf generate``: transformers ``model.generate`` with ``TrieLogitsProcessor`` from a cached prompt prefix (the
  evaluation harness's ``hf`` arm), greedy, full head every step.

Both answer the same tokens (checked). The model runs as ``tooltrie ask`` runs it: ``--dtype auto`` (bfloat16 on a
CPU with native bfloat16, as this one) and torch's default threads (every core; ``--threads`` to change), so the
machine must be otherwise idle.

Each turn an arm answers the query twice, and both are timed: the first answer comes right after the other arm's
(``after the other``: its weights pushed out of the CPU's caches by the other arm's), the second right after its own
(``warm``: what a server answering one request after another sees). The engine's weights (~200 MB in bfloat16) fit
this machine's last-level cache; the two arms' weights together do not.

    python bench/bench_ask.py [--queries 20] [--ks 1,3] [--dtype auto] [--threads N]
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from typing import Any

import torch
from _common import machine_info, print_table, summarize, take_turns, write_results

from tooltrie.compiler import TokenizerInfo, compile_registry
from tooltrie.eval.backends import EngineArm, EvalSetup, HfArm
from tooltrie.eval.datasets import LabelledQuery, load_split
from tooltrie.registry import CATALOG_PATH, load_registry
from tooltrie.serve.model import DTYPE_NAMES, load_model, serving_dtype
from tooltrie.serve.prompt import Prompt

TARGET_K1_MS = 50.0  # the target for the engine's answer at k = 1: reported, never asserted


def answer_twice(arm: Any, query: LabelledQuery, tokens: dict[str, list[int]], name: str) -> dict[str, float]:
    """The query answered twice: the seconds of each answer, after the other arm's and after its own."""
    seconds = {}
    for turn in ("after the other", "warm"):
        began = time.perf_counter()
        tokens[name] = arm.predict([query])[0].token_ids
        seconds[turn] = time.perf_counter() - began
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queries", type=int, default=20)
    parser.add_argument("--ks", default="1,3")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, every core)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, info = load_model(dtype=serving_dtype(args.dtype))
    tokenizer = TokenizerInfo.load(info.tokenizer)
    artifact = compile_registry(load_registry(CATALOG_PATH), tokenizer, progress=False)
    setup = EvalSetup(model=model, tokenizer=tokenizer, artifact=artifact, prompt=Prompt.style(info.prompt_style),
                      batch_size=1)
    arms = {"engine": EngineArm(setup), "hf generate": HfArm(setup)}
    test = load_split("metatool-single", "test")
    picked = [test[i * len(test) // args.queries] for i in range(args.queries)]
    rows, mismatches = [], 0
    for k in (int(part) for part in args.ks.split(",")):
        samples: dict[str, dict[str, list[float]]] = {name: {"after the other": [], "warm": []} for name in arms}
        for labelled in picked:
            # k comes from the gold list's length: pad it with other tools (accuracy is not measured here)
            gold = tuple(dict.fromkeys([*labelled.tools, *artifact.registry.names]))[:k]
            query = LabelledQuery(query=labelled.query, tools=gold)
            tokens: dict[str, list[int]] = {}
            times = take_turns({name: partial(answer_twice, arm, query, tokens, name) for name, arm in arms.items()},
                               repeats=1, warmup=1 if labelled is picked[0] else 0)
            mismatches += tokens["engine"] != tokens["hf generate"]
            for name in arms:
                for turn, values in samples[name].items():
                    values += [s * 1e3 for s in times[name].samples[turn]]
        summary = {name: {turn: summarize(values) for turn, values in turns.items()}
                   for name, turns in samples.items()}
        engine, hf = summary["engine"], summary["hf generate"]
        rows.append({"k": k, "engine ms (warm)": engine["warm"]["median"],
                     "hf generate ms (warm)": hf["warm"]["median"],
                     "hf / engine (warm)": hf["warm"]["median"] / engine["warm"]["median"],
                     "engine ms (after hf)": engine["after the other"]["median"],
                     "hf generate ms (after engine)": hf["after the other"]["median"],
                     "answers": len(picked), "samples": summary})
    print_table([{key: value for key, value in row.items() if key != "samples"} for row in rows],
                title=f"One answer, batch 1 (median ms; target for the engine at k = 1: <= {TARGET_K1_MS:g} ms)")
    print(f"engine and hf generate differ on {mismatches} answers")
    settings = {"model": info.name, "adapter": None if info.adapter is None else str(info.adapter.path.name),
                "prompt_style": info.prompt_style, "queries": args.queries, "torch_threads": torch.get_num_threads(),
                "dtype": str(info.dtype).removeprefix("torch."),
                "target_engine_k1_ms": TARGET_K1_MS, "load_average_at_start": machine_info()["load_average"]}
    path = write_results("ask", settings=settings, results={"rows": rows, "mismatches": mismatches,
                                                            "measured_at": time.time()}, out=args.out,
                         compact=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
