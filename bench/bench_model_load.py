"""Loading the default model as it is served (the shipped adapter merged, bfloat16 where the CPU has it) the way it
was and the way it is, and what the engine holds of it.

- Load, each arm a fresh process, the arms taking turns: "before", ``from_pretrained`` in float32, the adapter merged,
  then ``.to(dtype)`` (what ``load_model`` did); "after", ``load_model()`` (the weights read a tensor at a time into
  ``dtype``, ``serve/weights_file.py``). Seconds, the peak resident memory above the imports, and what stays
  resident; then an engine on the bundled catalog, and the model's copied weights let go as ``ask`` and ``serve``
  do (``release_copied_weights``). With ``--steps``, a warm ``ask`` over a large artifact, its memory step by step.
- Answers: ``.to(dtype)`` also rounded the rotary embedding's frequencies to bfloat16, which ``from_pretrained`` in
  bfloat16, and now ``load_model``, keep in float32. The five development registries' test requests of every kind,
  answered by the default ranker (``--ranker auto``) with the frequencies as they were and as they are, exact set
  paired request by request.

    .venv/bin/python bench/bench_model_load.py [--repeats 3] [--steps ARTIFACT]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import median, peak_rss_bytes, print_table, run_json_worker, take_turns, write_results
from _study import KINDS, REGISTRIES, paired_by_kind, registry_file, requests

MB = 2**20
ARMS = ("before", "after")


def resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def load_before(dtype: torch.dtype) -> Any:
    """The load as it was: float32, the adapter merged, then the whole model cast."""
    from transformers import AutoModelForCausalLM

    from tooltrie.serve.adapter import merge_adapter, read_adapter
    from tooltrie.serve.model import bundled_adapter, locate_default_model

    model = AutoModelForCausalLM.from_pretrained(locate_default_model(), dtype=torch.float32, local_files_only=True)
    adapter = bundled_adapter()
    if adapter is not None:
        merge_adapter(model, read_adapter(adapter))
    return model.to(dtype).eval()


def worker(arm: str) -> dict[str, float]:
    """One arm in this (fresh) process: the load, then an engine on the catalog, then the copies let go."""
    import transformers.models.llama.modeling_llama  # noqa: F401  # imported by both arms' loads: not theirs

    from tooltrie.compiler import TokenizerInfo
    from tooltrie.compiler.sources import artifact_from
    from tooltrie.registry import CATALOG_PATH
    from tooltrie.serve.decoder import release_copied_weights
    from tooltrie.serve.engine import Engine, Request
    from tooltrie.serve.model import load_model, serving_dtype

    dtype = serving_dtype("auto")
    tokenizer = TokenizerInfo.load("smollm2-135m")
    artifact = artifact_from(CATALOG_PATH, tokenizer)
    imports = resident_bytes()
    began = time.perf_counter()
    model = load_before(dtype) if arm == "before" else load_model(None, dtype=dtype)[0]
    out = {"load_s": time.perf_counter() - began, "load_peak_mb": (peak_rss_bytes() - imports) / MB,
           "loaded_mb": (resident_bytes() - imports) / MB}
    engine = Engine(model, tokenizer, artifact, max_batch=1)
    engine.run([Request("what is the weather in Paris", 1)])
    out["engine_mb"] = (resident_bytes() - imports) / MB
    if arm == "after":
        release_copied_weights(model)
        engine.run([Request("what is the weather in Paris", 1)])
    out["served_mb"] = (resident_bytes() - imports) / MB
    return out


def steps(artifact_path: str) -> dict[str, float]:
    """A warm ``tooltrie ask --ranker retrieval`` over a compiled artifact (its prior's parts beside it), step by
    step as ``ask`` takes them, in this (fresh) process: the resident memory after each (MB) and the peak."""
    out = {"start": resident_bytes() / MB}
    from tooltrie.compiler import Artifact, TokenizerInfo
    from tooltrie.compiler.sources import artifact_from
    from tooltrie.ranker import ranker_for
    from tooltrie.ranker_policy import fused_weights
    from tooltrie.registry.named import NameIndex
    from tooltrie.serve.decoder import release_copied_weights
    from tooltrie.serve.engine import Engine, Request
    from tooltrie.serve.first import first_tools
    from tooltrie.serve.model import load_model, serving_dtype
    from tooltrie.serve.prompt import Prompt

    out["imports"] = resident_bytes() / MB
    loaded = Artifact.load(artifact_path)
    out["artifact"] = resident_bytes() / MB
    model, info = load_model(None, dtype=serving_dtype("auto"))
    out["model"], out["model peak"] = resident_bytes() / MB, peak_rss_bytes() / MB
    tokenizer = TokenizerInfo.load(info.tokenizer)
    artifact = artifact_from(artifact_path, tokenizer, loaded=loaded)
    out["tokenizer"] = resident_bytes() / MB
    ranker = ranker_for(artifact, artifact_path, fused_weights(info.adapter, artifact))
    engine = Engine(model, tokenizer, artifact, prompt=Prompt.style(info.prompt_style), ranker=ranker, max_batch=1)
    out["engine"] = resident_bytes() / MB
    release_copied_weights(model)
    out["engine, projections let go"] = resident_bytes() / MB
    query = "find the invoices of a customer in Paris"
    first = first_tools(NameIndex(artifact.registry), query, 3, allowed=None, pins=(), pin_within_k=True)
    out["name index"] = resident_bytes() / MB
    engine.run([Request(query, first.decoded, ranker="retrieval")])
    out["answer"], out["peak"] = resident_bytes() / MB, peak_rss_bytes() / MB
    return out


def exact_rates(model: Any, info: Any) -> dict[str, dict[str, np.ndarray]]:
    """Per registry and kind, each test request's exact set (0/1) from the default ranker with ``model``."""
    from tooltrie.compiler import TokenizerInfo
    from tooltrie.compiler.sources import artifact_from
    from tooltrie.eval.scoring import answer_rates
    from tooltrie.ranker import ranker_for
    from tooltrie.ranker_policy import auto_ranker, fused_weights
    from tooltrie.serve.engine import Engine, Request
    from tooltrie.serve.prompt import Prompt

    tokenizer = TokenizerInfo.load(info.tokenizer)
    rates: dict[str, dict[str, np.ndarray]] = {}
    for registry in REGISTRIES:
        path = registry_file(registry)
        artifact = artifact_from(path, tokenizer)
        ranker = ranker_for(artifact, path, fused_weights(info.adapter, artifact))
        ranked = auto_ranker(info.adapter, artifact, retrieval=True)
        engine = Engine(model, tokenizer, artifact, prompt=Prompt.style(info.prompt_style), ranker=ranker)
        rates[registry] = {}
        for kind in KINDS:
            queries = requests(registry, kind)
            answers = engine.run([Request(q.query, q.k, ranker=ranked) for q in queries])
            rates[registry][kind] = np.array([answer_rates([t.name for t in a.tools], list(q.tools))["exact"]
                                              for a, q in zip(answers, queries, strict=True)], float)
    return rates


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="turns of loading, each arm a fresh process")
    parser.add_argument("--worker", choices=ARMS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--steps", default=None, metavar="ARTIFACT",
                        help="also a warm ask's memory step by step over this compiled artifact (its prior kept)")
    parser.add_argument("--steps-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return 0
    if args.steps_worker:
        print(json.dumps(steps(args.steps_worker)))
        return 0
    from tooltrie.serve.model import load_model, serving_dtype

    script = str(Path(__file__).resolve())
    times = take_turns({arm: (lambda arm=arm: run_json_worker([script, "--worker", arm], timeout_s=600))
                        for arm in ARMS}, args.repeats)
    loads = {arm: {key: median(values) for key, values in times[arm].samples.items() if key != "wall"}
             for arm in ARMS}
    print_table([{"arm": arm, **{key: round(value, 2) for key, value in loads[arm].items()}} for arm in ARMS],
                title=f"the default model loaded and served (MB above the imports; medians of {args.repeats})")
    by_step = None
    if args.steps:
        by_step = run_json_worker([script, "--steps-worker", args.steps], timeout_s=600)
        print_table([{"step": step, "resident MB": round(value)} for step, value in by_step.items()],
                    title=f"a warm ask over {Path(args.steps).name}, step by step")

    dtype = serving_dtype("auto")
    now, info = load_model(None, dtype=dtype)
    was = copy.deepcopy(now)
    was.model.rotary_emb.to(dtype)  # the frequencies as ``.to(dtype)`` left them
    reference = load_before(dtype)
    for name, tensor in reference.state_dict().items():  # "was" is the old load, weights and buffers
        assert torch.equal(was.state_dict()[name], tensor), name
    for name, buffer in reference.named_buffers():
        assert torch.equal(dict(was.named_buffers())[name], buffer), name
    del reference
    rates = {"before": exact_rates(was, info), "after": exact_rates(now, info)}
    pooled, by_registry, rows = paired_by_kind(rates["after"], rates["before"], ("after", "before"), seed=11)
    print_table(rows, title="the default ranker, exact set, rotary frequencies in float32 (after) against bfloat16")
    path = write_results("model_load", settings={"repeats": args.repeats, "dtype": str(dtype).removeprefix("torch."),
                                                 "threads": torch.get_num_threads()},
                         results={"load": loads, "load_samples": {arm: times[arm].samples for arm in ARMS},
                                  "ask_steps_mb": by_step,
                                  "answers_pooled": pooled, "answers_by_registry": by_registry},
                         out=args.output, compact=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
