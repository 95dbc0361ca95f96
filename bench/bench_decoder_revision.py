"""The engine with this tree's decoder against the decoder of another revision, in one process, taking turns.

A change to ``serve/decoder.py`` (how a pass attends, what it computes in which precision) is measured here: the
default model (the shipped adapter merged, as ``tooltrie ask`` loads it) and the bundled catalog, held-out MetaTool
queries, k = 1 and 3, one answer at a time (batch 1, what a lone ``ask`` waits for) and in batches of 16; for each
decoder the median milliseconds per answer (each arm answers each group twice, timed the second time, the arms
taking turns), how many answers the two decoders' tools differ on, and how many answers' scores (the tools'
log-probabilities) differ between a query answered alone and in its batch of 16: 0 where a row's result does not
depend on what shares its passes.

    .venv/bin/python bench/bench_decoder_revision.py --before HEAD~1 [--queries 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from statistics import median
from types import ModuleType

import torch
from _common import REPO_DIR, print_table, take_turns, write_results

from tooltrie.compiler import TokenizerInfo
from tooltrie.compiler.sources import artifact_from
from tooltrie.eval.datasets import load_split
from tooltrie.registry import CATALOG_PATH
from tooltrie.serve.engine import Answer, Engine, Request
from tooltrie.serve.model import load_model, serving_dtype
from tooltrie.serve.prompt import Prompt

BATCHES = (1, 16)
KS = (1, 3)


def decoder_at(revision: str, folder: Path) -> ModuleType:
    """``serve/decoder.py`` as it was at ``revision``, imported as a module of its own."""
    source = subprocess.run(["git", "show", f"{revision}:serve/decoder.py"], cwd=REPO_DIR, check=True,
                            capture_output=True, text=True).stdout
    path = folder / "decoder_before.py"
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("decoder_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def timed(engine: Engine, group: list[str], k: int, out: list[tuple[float, list[Answer]]]) -> None:
    """The group answered twice (the first puts the engine's weights back in the caches); the second's ms per
    answer and answers appended to ``out``."""
    engine.run([Request(q, k) for q in group])
    began = time.perf_counter()
    answers = engine.run([Request(q, k) for q in group])
    out.append(((time.perf_counter() - began) * 1e3 / len(group), answers))


def signature(answer: Answer) -> list[tuple[str, float, float]]:
    return [(tool.name, tool.score, tool.margin) for tool in answer.tools]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the revision whose decoder to compare with (e.g. HEAD~1)")
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    model, info = load_model(None, dtype=serving_dtype("auto"))
    tokenizer = TokenizerInfo.load(info.tokenizer)
    artifact = artifact_from(CATALOG_PATH, tokenizer)
    test = load_split("metatool-single", "test")
    queries = [test[i * len(test) // args.queries].query for i in range(args.queries)]
    with tempfile.TemporaryDirectory() as folder:
        before = decoder_at(args.before, Path(folder))
        engines = {}
        for name in ("before", "now"):
            engine = Engine(model, tokenizer, artifact, prompt=Prompt.style(info.prompt_style), max_batch=max(BATCHES))
            if name == "before":
                engine.decoder = before.SharedPrefixDecoder(model, max(BATCHES))
            engines[name] = engine
        rows, answers = [], {}
        for k in KS:
            for batch in BATCHES:
                runs: dict[str, list[tuple[float, list[Answer]]]] = {name: [] for name in engines}
                for i in range(0, len(queries), batch):
                    take_turns({name: partial(timed, engine, queries[i : i + batch], k, runs[name])
                                for name, engine in engines.items()}, repeats=1)
                for name, timings in runs.items():
                    answers[name, k, batch] = [a for _, out in timings for a in out]
                rows.append({"k": k, "batch": batch,
                             **{f"{name} ms": median(ms for ms, _ in runs[name]) for name in engines},
                             "now / before": median(ms for ms, _ in runs["now"]) / median(ms for ms, _ in
                                                                                         runs["before"])})
        differ = {}
        for name in engines:
            for k in KS:
                differ[f"{name}, k = {k}: scores alone and in a batch of 16"] = sum(
                    signature(a) != signature(b) for a, b in zip(answers[name, k, 1], answers[name, k, 16],
                                                                 strict=True))
        for k in KS:
            differ[f"k = {k}: tools before and now, batch 1"] = sum(
                [t.name for t in a.tools] != [t.name for t in b.tools]
                for a, b in zip(answers["before", k, 1], answers["now", k, 1], strict=True))
    print_table(rows, title=f"ms per answer (median), the decoder at {args.before} and now")
    print_table([{"answers that differ": key, "of": len(queries), "count": value} for key, value in differ.items()])
    settings = {"before": args.before, "queries": len(queries), "ks": KS, "batches": BATCHES, "model": info.name,
                "dtype": str(info.dtype).removeprefix("torch."), "torch_threads": torch.get_num_threads()}
    path = write_results("decoder-revision", settings=settings, results={"rows": rows, "differ": differ},
                         out=args.out, compact=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
