"""One registry's adapter, trained as ``tooltrie serve --train`` asks (``serve/training.py``), in a process of its own:
``python -m tooltrie.train.job ARTIFACT OUTPUT --work DIR --recipe JSON [--base-model M] [--no-base-adapter]``.

It regenerates training data from the registry's own text (``gen-data --no-queries --compose``, and
``--self-instruct`` when the recipe asks for it) and from the labelled requests of the bundled registry the recipe
replays (the catalog's, by default), trains the recipe's LoRA adapter on the model as served, drawing from both, and
writes it atomically to OUTPUT; the training log (one JSON line per step) goes to ``DIR/train.log.jsonl``, where the
server reads the progress. The command is ``train.recipe.Recipe.command``'s; started by a server, the job ends with
it (``serve.lifeline.exit_with_server``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from tooltrie.compiler.artifact import Artifact
from tooltrie.serve.adapter import AdapterRecord, read_adapter
from tooltrie.serve.lifeline import exit_with_server
from tooltrie.train.recipe import Recipe, replayed_sets

if TYPE_CHECKING:
    from tooltrie.compiler import TokenizerInfo
    from tooltrie.train.data import TrainingData

__all__ = ["main", "train_adapter"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tooltrie.train.job", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("output", type=Path)
    parser.add_argument("--work", type=Path, required=True, help="directory for the data and the log")
    parser.add_argument("--recipe", type=Recipe.from_json, default=Recipe())
    parser.add_argument("--base-model", default=None)
    parser.add_argument("--no-base-adapter", dest="base_adapter", action="store_false",
                        help="train on the base model alone, without the adapter load_model would merge")
    args = parser.parse_args(argv)
    exit_with_server()
    # SIGTERM (the server stopping it) ends the job as an exception would: temporary directories are removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with contextlib.suppress(OSError):
        os.nice(19)  # the server's requests come first
    train_adapter(Artifact.load(args.artifact), args.output, work=args.work, recipe=args.recipe,
                  base_model=args.base_model, base_adapter=args.base_adapter)
    return 0


def train_adapter(artifact: Artifact, output: Path, *, work: Path, recipe: Recipe, base_model: str | None = None,
                  base_adapter: bool = True) -> AdapterRecord:
    """Regenerate training data from ``artifact``'s registry (and the replayed registry's labelled requests) and
    train the recipe's adapter into ``output``, on ``load_model(base_model, adapter=base_adapter)``."""
    from transformers.utils import logging as transformers_logging

    from tooltrie.compiler import TokenizerInfo
    from tooltrie.serve.model import DEFAULT_MODEL_NAME, load_model
    from tooltrie.train.data import load_training_data
    from tooltrie.train.hard_negatives import confused_tools
    from tooltrie.train.self_instruct import default_model_requests
    from tooltrie.train.settings import LoraSettings, TrainSettings
    from tooltrie.train.trainer import train
    from tooltrie.train.training_data import generate_training_data

    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    replayed = None if recipe.replay is None else replayed_sets(recipe.replay)  # a bad name fails before any work
    tokenizer = TokenizerInfo.load(artifact.tokenizer_meta["source"])
    written = default_model_requests(artifact.registry, per_tool=recipe.self_instruct, seed=recipe.seed)[0] if (
        recipe.self_instruct) else []
    generate_training_data(work / "data", artifact=artifact, tokenizer=tokenizer, queries=[], compose=recipe.compose,
                           prompt_style=recipe.prompt_style, seed=recipe.seed, written=written)
    data = load_training_data(work / "data", artifact)
    replays = [] if replayed is None else [_replay_data(work / "replay", artifact, tokenizer, *replayed,
                                                        recipe=recipe)]
    also = [one for one, _ in replays]
    prior_weight = recipe.fused.retrieval / recipe.fused.model if recipe.through_prior else 0.0
    if prior_weight:  # each set's prior is over its own registry's tools, with the weight it is served with
        from tooltrie.train.priors import retrieval_priors

        data = retrieval_priors(data, artifact, None, prior_weight, prior=recipe.prior)
        also = [retrieval_priors(one, one_artifact, None, prior_weight, prior=recipe.prior)
                for one, one_artifact in replays]
    partners = confused_tools(artifact.registry) if recipe.hard_negatives else None
    model, info = load_model(base_model, adapter=base_adapter)
    lora = replace(LoraSettings(), rank=recipe.rank, alpha=recipe.alpha, top_layers=recipe.top_layers)
    settings = replace(TrainSettings(), steps=recipe.steps, batch_size=recipe.batch_size,
                       learning_rate=recipe.learning_rate, warmup_steps=recipe.warmup_steps, loss=recipe.loss,
                       lora=lora, seed=recipe.seed, threads=recipe.threads, eval_every=0, eval_examples=0,
                       prior_weight=prior_weight, prior=recipe.prior)
    base_name = DEFAULT_MODEL_NAME if info.name == DEFAULT_MODEL_NAME else str(info.path.resolve())
    # Nothing is measured for this adapter (its registry has no labelled requests): the record gives the recipe's
    # weights for what they are, and no ``auto`` (``tooltrie.ranker_policy`` ranks it fused at them).
    ranker = {"fused": recipe.fused.as_dict(),
              "fused_from": "the recipe, chosen once on BFCL's validation split with an adapter it trained on BFCL's "
                            "registry; not measured for this adapter"}
    train(data, artifact, model, base_name=base_name, output=output, settings=settings,
          log_path=work / "train.log.jsonl", progress=False, ranker=ranker, also=also, partners=partners)
    return read_adapter(output)


def _replay_data(directory: Path, artifact: Artifact, tokenizer: TokenizerInfo, sets: list[str], path: Path, *,
                 recipe: Recipe) -> tuple[TrainingData, Artifact]:
    """The training requests of the bundled labelled ``sets`` over the registry at ``path``, made alike
    ``artifact``'s data: drawn beside a registry's own text, they keep the adapter answering requests as people write
    them rather than as tool descriptions read (docs/training.md#training-while-serving). Test splits are never
    among them. With the artifact they were made for."""
    from tooltrie.compiler.sources import artifact_from
    from tooltrie.train.data import load_training_data
    from tooltrie.train.training_data import generate_training_data

    replayed = artifact_from(path, tokenizer, separator=artifact.contract.separator)
    generate_training_data(directory, artifact=replayed, tokenizer=tokenizer, queries=sets,
                           prompt_style=recipe.prompt_style, seed=recipe.seed)
    return load_training_data(directory, replayed), replayed


if __name__ == "__main__":
    sys.exit(main())
