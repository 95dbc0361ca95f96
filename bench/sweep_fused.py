"""Choose the fused ranker's weights on a validation split: the engine with the fused ranker at each retrieval
weight (the model's weight fixed at 1) over a retrieval prior (``--prior``), against the three priors alone (dense,
lexical, hybrid) and the model alone, in one harness run (the arms take turns batch by batch). Prints a table and
writes JSON (settings, machine, per-arm summaries).

    .venv/bin/python bench/sweep_fused.py --dataset bfcl:validation --prior hybrid --weights 1,2,5,10 \
        -o build/sweep/bfcl.json
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from tooltrie.eval import backends
from tooltrie.eval.backends import PRIOR_ARMS, EvalSetup, FusedArm
from tooltrie.ranker import DEFAULT_PRIOR, PRIORS, UNTRAINED, Weights, ranker_for


def weighted_arm(weight: float, prior: str) -> type[FusedArm]:
    """A fused arm whose ranker gives the ``prior`` ``weight`` (each arm builds its own engine and ranker)."""

    class Arm(FusedArm):
        name = f"fused-{weight:g}"

        def __init__(self, setup: EvalSetup) -> None:
            ranker = ranker_for(setup.artifact, setup.artifact_path, Weights(model=1.0, retrieval=weight),
                                prior=prior)
            super().__init__(dataclasses.replace(setup, options={**setup.options, "retrieval": ranker}))

    return Arm


def main(argv: list[str] | None = None) -> int:
    from tooltrie.compiler import TokenizerInfo
    from tooltrie.compiler.sources import artifact_from
    from tooltrie.eval.datasets import load_split, registry_path
    from tooltrie.eval.files import json_text, relative_paths, write_text
    from tooltrie.eval.harness import evaluate
    from tooltrie.serve.model import load_model
    from tooltrie.serve.prompt import Prompt

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="bfcl:validation", help="NAME:SPLIT of a bundled set")
    parser.add_argument("--prior", choices=PRIORS, default=DEFAULT_PRIOR, help="the fused arms' retrieval prior")
    parser.add_argument("--weights", default="1,2,5,10", help="the prior's weights to try (the model's at 1)")
    parser.add_argument("--sample", type=int, default=None, help="N evenly spaced queries")
    parser.add_argument("--base", action="store_true", help="the base model without the bundled adapter")
    parser.add_argument("--model", default=None, help="a model directory or adapter (default: the bundled one)")
    parser.add_argument("--prompt-style", default=None, help="catalog or short (default: what the model expects)")
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args(argv)

    name, _, split = args.dataset.partition(":")
    queries = load_split(name, split or "validation")
    if args.sample is not None and args.sample < len(queries):
        queries = [queries[i * len(queries) // args.sample] for i in range(args.sample)]
    model, info = load_model(args.model, adapter=not args.base)
    tokenizer = TokenizerInfo.load(info.tokenizer)
    artifact = artifact_from(registry_path(name), tokenizer)
    weights = [float(w) for w in args.weights.split(",")]
    arms = {f"fused-{w:g}": weighted_arm(w, args.prior) for w in weights}
    backends.ARMS.update(arms)
    setup = EvalSetup(model=model, tokenizer=tokenizer, artifact=artifact,
                      prompt=Prompt.style(args.prompt_style or info.prompt_style),
                      options={"ranker": "model", "retrieval": ranker_for(artifact, None, UNTRAINED)})
    results: dict[str, Any] = evaluate(queries, [*PRIOR_ARMS, "engine", *arms], setup,
                                       meta={"dataset": name, "split": split, "model": info.name,
                                             "adapter": None if info.adapter is None else str(info.adapter.path),
                                             "prior": args.prior, "sweep": "the prior's weight, model weight 1"})
    results.pop("answers")
    print(f"{'arm':<16}{'exact':>8}{'top-1':>8}{'recall':>8}")
    for arm, data in results["arms"].items():
        s = data["summary"]
        print(f"{arm:<16}{s['exact']:>8.3f}{s['top1']:>8.3f}{s['recall']:>8.3f}")
    write_text(args.output, json_text(relative_paths(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
