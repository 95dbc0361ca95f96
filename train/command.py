"""``tooltrie gen-data`` (training data regenerated from a registry) and ``tooltrie train`` (fine-tune a base model on
that directory and write a LoRA adapter).

Imported by ``tooltrie.cli`` at start-up, so only the argument parsing lives at module level; torch, transformers
and peft are imported when the command runs.
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tooltrie.eval.datasets import BUNDLED, DatasetError
from tooltrie.ranker import PRIORS
from tooltrie.train.settings import LOSS_NAMES, PRECISION_NAMES, SAMPLING_NAMES, LoraSettings, TrainSettings

if TYPE_CHECKING:
    from tooltrie.eval.datasets import LabelledQuery
    from tooltrie.registry.model import Registry

__all__ = ["add_gen_data_command", "add_train_command", "run_train", "settings_from_args"]

_DEFAULTS = TrainSettings()
_LORA = LoraSettings()


def add_gen_data_command(commands: Any) -> None:
    """Add ``gen-data`` to the ``tooltrie`` subcommands (an ``argparse`` subparsers object)."""
    from tooltrie.options import add_quiet_option, add_separator_option

    gen = commands.add_parser("gen-data", help="regenerate training data from a registry and labelled queries")
    gen.add_argument("--registry", type=Path, default=None,
                     help="registry file or compiled artifact (default: the bundled catalog)")
    gen.add_argument("--artifact", type=Path, default=None,
                     help="compiled artifact of that registry (default: compiled, through the cache)")
    add_separator_option(gen)
    gen.add_argument("--tokenizer", default=None, help="tokenizer (default: the artifact's, else smollm2-135m)")
    gen.add_argument("--queries", action="append", default=None,
                     help=f"a bundled set ({', '.join(BUNDLED)}) or a JSONL file of {{query, tools}}; repeatable "
                          "(default: the catalog's two MetaTool sets, or bfcl for the BFCL registry)")
    gen.add_argument("--exclude", action="append", type=Path, default=[],
                     help="a JSONL file whose queries must never be trained on (bundled test splits always are)")
    gen.add_argument("--prompt-style", default="short", help="prompt style: short (default) or catalog")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--validation-fraction", type=float, default=0.05, help="of a user file (default 0.05)")
    gen.add_argument("--no-descriptions", dest="descriptions", action="store_false",
                     help="leave out the tool descriptions as training queries")
    gen.add_argument("--no-queries", action="store_true",
                     help="the registry's own text only: no labelled queries, not even a bundled registry's sets")
    gen.add_argument("--compose", type=int, default=0, metavar="N",
                     help="add N multi-tool requests composed from the tools' descriptions, and a templated "
                          "request per tool (for a registry without labelled queries; default 0)")
    gen.add_argument("--self-instruct", type=int, default=0, metavar="N",
                     help="add N requests per tool written by the default model (without its adapter) from the "
                          "tool's text, kept when retrieval ranks the tool among its top 10 (needs the model extra and "
                          "all-MiniLM-L6-v2; slow on a CPU: about 2 s per tool on one core; default 0)")
    gen.add_argument("-o", "--output", type=Path, required=True, help="directory to write (replaced atomically)")
    add_quiet_option(gen)
    gen.set_defaults(run=_gen_data)


def add_train_command(commands: Any) -> None:
    """Add ``train`` to the ``tooltrie`` subcommands (an ``argparse`` subparsers object)."""
    from tooltrie.options import add_quiet_option, add_separator_option

    cmd = commands.add_parser("train", help="fine-tune the default model on training data: a small LoRA adapter",
                              description="Fine-tune a base model on the directory `tooltrie gen-data` wrote, and "
                                          "write a LoRA adapter (weights, peft config, tooltrie.json record).")
    cmd.add_argument("data", type=Path,
                     help="training data directory (train.jsonl, validation.jsonl, meta.json: tooltrie gen-data)")
    cmd.add_argument("-o", "--output", type=Path, required=True, help="adapter directory to write")
    cmd.add_argument("--registry", type=Path, default=None,
                     help="the registry file or compiled artifact the data was made from (default: the bundled "
                          "catalog)")
    add_separator_option(cmd)
    cmd.add_argument("--also", nargs=2, action="append", default=[], metavar=("DATA", "REGISTRY"),
                     help="training data made for another registry (file or artifact), drawn from with DATA's: e.g. "
                          "a registry's own text beside labelled queries of another; repeatable")
    cmd.add_argument("--hard-negatives", action="store_true",
                     help="draw each tool's requests beside those of the tool retrieval finds nearest it, in one "
                          "batch (needs all-MiniLM-L6-v2; balanced sampling)")
    cmd.add_argument("--prior-weight", type=float, default=_DEFAULTS.prior_weight, metavar="W",
                     help="train through the fused ranker: each legal token's score is the model's plus the "
                          "retrieval prior (--prior) at weight W, as `--ranker fused` serves it (default 0: the model "
                          "alone)")
    cmd.add_argument("--prior", choices=PRIORS, default=_DEFAULTS.prior,
                     help="with --prior-weight: the retrieval prior trained through, the one the adapter will be "
                          f"served with (`--prior`; dense and hybrid need all-MiniLM-L6-v2; default {_DEFAULTS.prior})")
    cmd.add_argument("--base-model", default=None,
                     help="base model directory (default: SmolLM2-135M-Instruct, without any adapter)")
    cmd.add_argument("--tokenizer", default=None, help="tokenizer (default: the base model's)")
    cmd.add_argument("--loss", choices=LOSS_NAMES, default=_DEFAULTS.loss,
                     help=f"plain: whole vocabulary; trie: the trie's legal tokens only; both: their sum "
                          f"(default {_DEFAULTS.loss})")
    cmd.add_argument("--sampling", choices=SAMPLING_NAMES, default=_DEFAULTS.sampling,
                     help="balanced: every gold set alike, the rare k boosted (as the test split counts); shuffled: "
                          f"epochs of the data as it is (default {_DEFAULTS.sampling})")
    cmd.add_argument("--steps", type=_positive, default=_DEFAULTS.steps, help=f"default {_DEFAULTS.steps}")
    cmd.add_argument("--batch-size", type=_positive, default=_DEFAULTS.batch_size,
                     help=f"default {_DEFAULTS.batch_size}")
    cmd.add_argument("--lr", type=float, default=_DEFAULTS.learning_rate, help=f"default {_DEFAULTS.learning_rate}")
    cmd.add_argument("--warmup-steps", type=int, default=_DEFAULTS.warmup_steps,
                     help=f"default {_DEFAULTS.warmup_steps}")
    cmd.add_argument("--rank", type=_positive, default=_LORA.rank, help=f"LoRA rank (default {_LORA.rank})")
    cmd.add_argument("--alpha", type=int, default=_LORA.alpha, help=f"LoRA alpha (default {_LORA.alpha})")
    cmd.add_argument("--dropout", type=float, default=_LORA.dropout, help=f"LoRA dropout (default {_LORA.dropout})")
    cmd.add_argument("--top-layers", type=_positive, default=_LORA.top_layers,
                     help="adapt only the last N blocks: faster steps, smaller adapter (default: every block)")
    cmd.add_argument("--seed", type=int, default=_DEFAULTS.seed, help=f"default {_DEFAULTS.seed}")
    cmd.add_argument("--threads", type=_positive, default=_DEFAULTS.threads,
                     help=f"torch threads (default {_DEFAULTS.threads})")
    cmd.add_argument("--precision", choices=PRECISION_NAMES, default=_DEFAULTS.precision,
                     help=f"autocast of the training passes (default {_DEFAULTS.precision}); validation is float32")
    cmd.add_argument("--eval-every", type=int, default=_DEFAULTS.eval_every,
                     help=f"steps between validations, 0: at the end only (default {_DEFAULTS.eval_every})")
    cmd.add_argument("--eval-examples", type=int, default=_DEFAULTS.eval_examples,
                     help=f"validation sample, 0: none (default {_DEFAULTS.eval_examples})")
    cmd.add_argument("--log", type=Path, default=None, help="JSON-lines log (default: OUTPUT.log.jsonl beside it)")
    add_quiet_option(cmd)
    cmd.set_defaults(run=run_train)


def settings_from_args(args: argparse.Namespace) -> TrainSettings:
    lora = replace(_LORA, rank=args.rank, alpha=args.alpha, dropout=args.dropout, top_layers=args.top_layers)
    return replace(_DEFAULTS, steps=args.steps, batch_size=args.batch_size, learning_rate=args.lr,
                   warmup_steps=args.warmup_steps, loss=args.loss, sampling=args.sampling, lora=lora, seed=args.seed,
                   threads=args.threads, precision=args.precision, eval_every=args.eval_every,
                   eval_examples=args.eval_examples, prior_weight=args.prior_weight, prior=args.prior)


def run_train(args: argparse.Namespace) -> int:
    from transformers.utils import logging as transformers_logging

    from tooltrie.compiler import TokenizerInfo
    from tooltrie.compiler.sources import artifact_from, registry_of
    from tooltrie.registry import CATALOG_PATH
    from tooltrie.serve.model import DEFAULT_MODEL_NAME, load_model
    from tooltrie.train.data import load_training_data
    from tooltrie.train.hard_negatives import confused_tools
    from tooltrie.train.trainer import train

    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    settings = settings_from_args(args)
    if args.hard_negatives and settings.sampling != "balanced":
        raise SystemExit(f"tooltrie train: error: --hard-negatives needs --sampling balanced, not {settings.sampling}")
    registry = registry_of(args.registry or CATALOG_PATH)  # a bad file is refused before the model loads
    for _, source in args.also:
        registry_of(source)
    model, info = load_model(args.base_model, adapter=False)
    tokenizer = TokenizerInfo.load(args.tokenizer or info.tokenizer)
    artifact = artifact_from(args.registry or CATALOG_PATH, tokenizer, separator=args.separator)
    data = load_training_data(args.data, artifact)
    sources = [(source, artifact_from(source, tokenizer, separator=args.separator)) for _, source in args.also]
    also = [load_training_data(directory, other) for (directory, _), (_, other) in zip(args.also, sources, strict=True)]
    if settings.prior_weight > 0:  # each set's prior is over its own registry's tools
        from tooltrie.train.priors import retrieval_priors

        data = retrieval_priors(data, artifact, args.registry, settings.prior_weight, prior=settings.prior)
        also = [retrieval_priors(one, other, source, settings.prior_weight, prior=settings.prior)
                for one, (source, other) in zip(also, sources, strict=True)]
    partners = confused_tools(artifact.registry) if args.hard_negatives else None
    base_name = DEFAULT_MODEL_NAME if info.name == DEFAULT_MODEL_NAME else str(info.path.resolve())
    others = "".join(f" and {len(other.train)} of registry {other.meta.registry_name!r}" for other in also)
    print(f"tooltrie train: {len(data.train)} training examples ({len(data.validation)} for validation) of "
          f"registry {registry.name!r}{others}; base {base_name}; {settings.steps} steps of {settings.batch_size}, "
          f"{settings.loss} loss, LoRA rank {settings.lora.rank}", file=sys.stderr)
    result = train(data, artifact, model, base_name=base_name, output=args.output, settings=settings,
                   log_path=args.log, progress=not args.quiet, also=also, partners=partners)
    size = sum(f.stat().st_size for f in result.output.iterdir() if f.is_file())
    summary = result.validation or {}
    print(f"tooltrie train: adapter {result.output} ({size / 1e6:.1f} MB) after {result.seconds / 60:.1f} min; "
          f"validation: loss {summary.get('loss')}, constrained exact {summary.get('constrained_exact')}, "
          f"unconstrained exact {summary.get('unconstrained_exact')}", file=sys.stderr)
    return 0


def _gen_data(args: argparse.Namespace) -> int:
    from tooltrie.eval.cli import registry_and_artifact
    from tooltrie.eval.datasets import registry_path
    from tooltrie.progress import Progress
    from tooltrie.registry import CATALOG_PATH
    from tooltrie.train.training_data import generate_training_data

    tokenizer, artifact = registry_and_artifact(args.registry, args.artifact, args.tokenizer, CATALOG_PATH,
                                                separator=args.separator)
    if args.no_queries and args.queries:
        raise DatasetError("--no-queries and --queries contradict each other: give one of them")
    queries = [] if args.no_queries else args.queries
    if queries is None:  # the bundled sets labelled over this registry, if it is a bundled one
        queries = [name for name in BUNDLED if _sha(registry_path(name)) == artifact.registry.sha256]
    written = _written_requests(artifact.registry, args.self_instruct, args.seed, quiet=args.quiet) if (
        args.self_instruct) else []
    meta = generate_training_data(args.output, artifact=artifact, tokenizer=tokenizer, queries=queries,
                                  prompt_style=args.prompt_style, seed=args.seed,
                                  validation_fraction=args.validation_fraction, descriptions=args.descriptions,
                                  exclude=args.exclude, compose=args.compose, written=written,
                                  progress=Progress("gen-data", unit="record", quiet=args.quiet))
    counts = meta["counts"]
    print(f"{args.output}: {counts['train']} train, {counts['validation']} validation records "
          f"({counts['dropped_held_out']} held-out texts dropped, {counts['dropped_in_validation']} train texts "
          f"that validation holds); registry {meta['registry']['name']}, "
          f"prompt {meta['prompt']['style']}", file=sys.stderr)
    return 0


def _written_requests(registry: Registry, per_tool: int, seed: int, *, quiet: bool) -> list[LabelledQuery]:
    from tooltrie.progress import Progress
    from tooltrie.train.self_instruct import default_model_requests

    kept, total = default_model_requests(registry, per_tool=per_tool, seed=seed,
                                         progress=Progress("self-instruct", unit="request", quiet=quiet))
    print(f"self-instruct: kept {len(kept)} of {total} written requests", file=sys.stderr)
    return kept


@functools.cache
def _sha(path: Path) -> str:
    from tooltrie.registry import load_registry

    return load_registry(path).sha256


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
