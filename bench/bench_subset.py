"""What a per-request tool subset costs: tooltrie's count initialisation against compiling a grammar for it.

For each registry size (the 47-tool catalog, the 1,853-name BFCL registry, 100,000 synthetic names, as in
``bench_compile.py``) and each subset size (32 tools, and a tenth of the registry), the same random subsets,
arms taking turns:

- ``subset (tooltrie)``: what a request with ``allow`` costs here: names resolved to tool indices
  (``select_tools``) and the slot's edge counts computed from them (``BatchState.start(..., subsets=...)``);
  the compiled artifact of the whole registry is reused as it is;
- ``compile sub-registry (tooltrie)``: compiling a registry of the subset alone (what a system without per-slot
  counts would do per subset, cache misses assumed);
- ``compile subset grammar (XGrammar)``: the exactly-k EBNF of the subset's names compiled by XGrammar (its
  tokenizer info built once, outside the timers: only the per-grammar work is timed).

    python bench/bench_subset.py [--sizes 47,1853,100000] [--repeats 5] [--k 3]
"""

from __future__ import annotations

import argparse
import random
import time
from functools import partial
from typing import Any

from _common import Arm, machine_info, print_table, summarize, take_turns, write_results
from bench_compile import build_registry, hf_tokenizer

from tooltrie.compiler import Artifact, Contract, TokenizerInfo, compile_registry
from tooltrie.compiler.ebnf import exactly_k_ebnf
from tooltrie.kernels import BatchState
from tooltrie.registry import Registry, make_registry, select_tools

ARM_SUBSET, ARM_COMPILE, ARM_XGR = ("subset (tooltrie)", "compile sub-registry (tooltrie)",
                                    "compile subset grammar (XGrammar)")


def limit_slot(registry: Registry, artifact: Artifact, names: list[str], k: int) -> None:
    BatchState.start(artifact, [k], subsets=[select_tools(registry, allow=names)])


def compile_subset(tokenizer: TokenizerInfo, names: list[str]) -> None:
    compile_registry(make_registry([{"name": n} for n in names], name="subset"), tokenizer, Contract(), progress=False)


def xgrammar_subset(compiler: Any, names: list[str], k: int) -> None:
    compiler.compile_grammar(exactly_k_ebnf(names, k))


def bench_size(args: argparse.Namespace, size: int, tokenizer: TokenizerInfo, xgr_info: Any) -> list[dict[str, Any]]:
    import xgrammar as xgr

    label, registry = build_registry(size, args.seed)
    began = time.perf_counter()
    artifact = compile_registry(registry, tokenizer, Contract(), progress=False)
    print(f"\n[{label}: {len(registry):,} tools; whole registry compiled once in {time.perf_counter() - began:.2f} s]",
          flush=True)
    compiler = xgr.GrammarCompiler(xgr_info, cache_enabled=False)
    rng = random.Random(args.seed)
    rows = []
    for subset_size in sorted({min(32, len(registry)), max(args.k, len(registry) // 10)}):
        subsets = [rng.sample(registry.names, subset_size) for _ in range(args.repeats)]
        samples: dict[str, list[float]] = {ARM_SUBSET: [], ARM_COMPILE: [], ARM_XGR: []}
        for names in subsets:  # one subset per turn, every arm on it
            arms: dict[str, Arm] = {ARM_SUBSET: partial(limit_slot, registry, artifact, names, args.k),
                                    ARM_COMPILE: partial(compile_subset, tokenizer, names),
                                    ARM_XGR: partial(xgrammar_subset, compiler, names, args.k)}
            for name, times in take_turns(arms, repeats=1).items():
                samples[name] += times.samples["wall"]
        medians = {name: summarize([s * 1e3 for s in values]) for name, values in samples.items()}
        row: dict[str, Any] = {"registry": label, "tools": len(registry), "subset": subset_size, "k": args.k}
        for name in samples:
            row[f"{name} ms"] = medians[name]["median"]
        row["compile / subset"] = medians[ARM_COMPILE]["median"] / medians[ARM_SUBSET]["median"]
        row["XGrammar / subset"] = medians[ARM_XGR]["median"] / medians[ARM_SUBSET]["median"]
        row["samples"] = medians
        rows.append(row)
        print_table([{key: value for key, value in row.items() if key != "samples"}])
    return rows


def main(argv: list[str] | None = None) -> int:
    import xgrammar as xgr

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="47,1853,100000")
    parser.add_argument("--repeats", type=int, default=5, help="subsets per size (one timed turn each)")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default="smollm2-135m")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    began = time.perf_counter()
    tokenizer = TokenizerInfo.load(args.tokenizer)
    hf = hf_tokenizer(args.tokenizer, tokenizer.decode([tokenizer.eos_id]))
    xgr_info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tokenizer.vocab_size,
                                                  stop_token_ids=[tokenizer.eos_id])
    rows = [row for size in (int(s) for s in args.sizes.split(",")) for row in bench_size(args, size, tokenizer,
                                                                                           xgr_info)]
    print_table([{key: value for key, value in row.items() if key != "samples"} for row in rows],
                title="Per-request subset cost (median ms) and ratios")
    settings = {"sizes": args.sizes, "repeats": args.repeats, "k": args.k, "seed": args.seed,
                "tokenizer": args.tokenizer, "arms": {ARM_SUBSET: "select_tools + BatchState.start(subsets=...)",
                                                      ARM_COMPILE: "compile_registry of the subset's names",
                                                      ARM_XGR: "GrammarCompiler.compile_grammar(exactly_k_ebnf)"},
                "load_average_at_start": machine_info()["load_average"]}
    path = write_results("subset", settings=settings, results={"rows": rows, "wall_s": time.perf_counter() - began},
                         out=args.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
