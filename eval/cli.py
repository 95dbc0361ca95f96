"""The ``tooltrie`` subcommands of evaluation: ``eval``, ``compare`` and ``grammar``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tooltrie.eval.datasets import is_bundled

DEFAULT_EVAL_ARMS = "engine,hf,unconstrained,xgrammar"


def add_commands(commands: Any) -> None:
    """Register the subcommands on ``tooltrie``'s subparsers."""
    from tooltrie.options import add_quiet_option, add_ranker_options, add_separator_option

    ev = commands.add_parser("eval", help="score a model and an artifact on labelled queries, per arm")
    ev.add_argument("--dataset", default="metatool-single",
                    help="NAME[:SPLIT] of a bundled set (default split: test) or a JSONL file of {query, tools}; "
                         "several joined by commas (one registry)")
    ev.add_argument("--arms", default=DEFAULT_EVAL_ARMS,
                    help=f"comma-separated: engine, fused, hf, unconstrained, xgrammar, retrieval (dense), lexical, "
                         f"hybrid, clauses (one tool per ask of the request), prior (what --ranker retrieval "
                         f"answers, without the model), vllm, vllm-xgrammar, vllm-unconstrained "
                         f"(default: {DEFAULT_EVAL_ARMS})")
    ev.add_argument("--registry", type=Path, default=None,
                    help="registry file or compiled artifact (default: the dataset's)")
    ev.add_argument("--artifact", type=Path, default=None, help="compiled artifact (default: compiled, cached)")
    add_separator_option(ev)
    ev.add_argument("--model", default=None,
                      help="local Hugging Face causal-LM directory or adapter directory (default: SmolLM2)")
    ev.add_argument("--base", action="store_true", help="the base model alone, without the bundled adapter")
    ev.add_argument("--tokenizer", default=None, help="tokenizer (default: the model's, else smollm2-135m)")
    ev.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="as served (tooltrie serve --dtype): auto is bfloat16 where the CPU has native bfloat16")
    ev.add_argument("--prompt-style", default=None, help="catalog or short (default: what the model expects)")
    ev.add_argument("--batch", type=int, default=8, help="answers per batch (default 8)")
    ev.add_argument("--limit", type=int, default=None, help="evaluate the first N queries only")
    ev.add_argument("--sample", type=int, default=None,
                    help="evaluate N evenly spaced queries (a test split is grouped by gold tool: this keeps them all)")
    ev.add_argument("--max-new-tokens", type=int, default=48, help="for unconstrained arms (default 48)")
    ev.add_argument("--vllm", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting of the vLLM arms' LLM (VALUE read as JSON, else text), over the machine's "
                         "defaults (on a CPU: enforce_eager=true, kv_cache_memory_bytes=2 GiB); repeatable")
    add_ranker_options(ev, what="the engine arm's")  # auto: what `ask` and `serve` answer with, measured
    ev.add_argument("--no-follow", dest="follow", action="store_false",
                    help="the prior of every tool is the first tool's: it does not follow the answer (to measure "
                         "what following it adds; ranker.FollowUp)")
    ev.add_argument("--no-asks", dest="asks", action="store_false",
                    help="a request that asks several things is ranked as one ask: no tool per ask first (to measure "
                         "what the asks add; ranker.PerAsk)")
    ev.add_argument("--no-plots", dest="plots", action="store_false")
    add_quiet_option(ev)
    ev.add_argument("-o", "--output", type=Path, required=True,
                    help="directory for results.json, answers.jsonl, report.md, PNGs")
    ev.set_defaults(run=_eval)

    cmp = commands.add_parser("compare", help="two evaluated arms answer by answer: is their difference noise?")
    cmp.add_argument("a", metavar="A", help="RESULTS:ARM, RESULTS a results.json or the directory eval wrote")
    cmp.add_argument("b", metavar="B", help="the same for the arm to compare with (e.g. results:retrieval)")
    cmp.add_argument("--rates", default="exact,top1,recall", help="comma-separated: exact, top1, recall")
    cmp.add_argument("--seed", type=int, default=0, help="the bootstrap's seed (default 0)")
    cmp.add_argument("--margin", type=float, default=None, metavar="POINTS",
                     help="also say how many answers like these an interval needs to show A at most POINTS below B "
                     "(e.g. 2: a lower bound of -2 points)")
    cmp.add_argument("--format", choices=("text", "json"), default="text")
    cmp.set_defaults(run=_compare)

    grammar = commands.add_parser("grammar", help="write the artifact's exactly-k EBNF (what vLLM/XGrammar get)")
    grammar.add_argument("artifact", type=Path)
    grammar.add_argument("--k", type=int, required=True)
    grammar.add_argument("-o", "--output", type=Path, default=None, help="file to write (default: stdout)")
    grammar.set_defaults(run=_grammar)


def registry_and_artifact(registry_path: Path | None, artifact_path: Path | None, tokenizer_source: str | None,
                           default_registry: Path, *, separator: str | None = None) -> tuple[Any, Any]:
    """The tokenizer and the artifact a command works on: ``artifact_path``, or ``registry_path`` when it is a
    compiled artifact (checked against the other, the tokenizer and ``separator`` when given), else the registry
    file compiled with ``separator`` (default: the contract's) through the cache."""
    from tooltrie.compiler import Artifact, Contract, TokenizerInfo
    from tooltrie.compiler.sources import artifact_from, is_artifact, registry_of

    if artifact_path is None and registry_path is not None and is_artifact(registry_path):
        artifact_path, registry_path = registry_path, None
    if artifact_path is not None:
        artifact = Artifact.load(artifact_path)
        tokenizer = TokenizerInfo.load(tokenizer_source or artifact.tokenizer_meta["source"])
        registry = registry_of(registry_path) if registry_path else None
        contract = Contract(separator=separator) if separator is not None else None
        artifact.check_compatible(tokenizer=tokenizer, registry=registry, contract=contract, where=str(artifact_path))
        return tokenizer, artifact
    tokenizer = TokenizerInfo.load(tokenizer_source)
    return tokenizer, artifact_from(registry_path or default_registry, tokenizer, separator=separator)


def dataset_parts(spec: str) -> list[tuple[str, str]]:
    """``--dataset``'s sets as (name, split): ``NAME[:SPLIT]`` (a bundled set, test by default; a JSONL file, read
    whole), several joined by commas, e.g. plain and need-describing requests in one run (its report groups them).

    >>> dataset_parts("catalog-needs:validation,metatool-single")
    [('catalog-needs', 'validation'), ('metatool-single', 'test')]
    """
    parts = []
    for entry in (part.strip() for part in spec.split(",")):
        name, _, split = entry.partition(":")
        parts.append((name, split or ("test" if is_bundled(name) else "all")))
    return parts


def dataset_registry(parts: list[tuple[str, str]]) -> Path | None:
    """The one registry the bundled sets among ``parts`` are labelled over (None: none is bundled); sets over two
    registries cannot be scored in one run."""
    from tooltrie.eval.datasets import DatasetError, registry_path

    registries = {registry_path(name) for name, _ in parts if is_bundled(name)}
    if len(registries) > 1:
        raise DatasetError(f"--dataset: the sets are labelled over different registries "
                           f"({', '.join(sorted(path.name for path in registries))}); evaluate them one at a time")
    return registries.pop() if registries else None


def _eval(args: argparse.Namespace) -> int:
    from transformers.utils import logging as transformers_logging

    from tooltrie.eval.backends import PRIOR_ARMS, EvalSetup
    from tooltrie.eval.datasets import DatasetError, check_labels, load_split
    from tooltrie.eval.harness import evaluate
    from tooltrie.eval.report import write_results
    from tooltrie.progress import Progress
    from tooltrie.ranker import needs_encoder, ranker_for
    from tooltrie.ranker_policy import auto_ranker, fused_weights
    from tooltrie.registry import CATALOG_PATH
    from tooltrie.retrieval import locate_minilm
    from tooltrie.serve.model import load_model, serving_dtype, training_mismatch
    from tooltrie.serve.prompt import Prompt

    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    parts = dataset_parts(args.dataset)
    labelled_over = dataset_registry(parts) or CATALOG_PATH  # before the model loads: a bad mix fails at once
    loaded = [(f"{name}:{split}", load_split(name, split)) for name, split in parts]
    empty = [part for part, queries in loaded if not queries]  # a file with none is refused when read
    if empty:  # a set to train on has no test or validation split
        raise DatasetError(f"--dataset: {', '.join(empty)} holds no queries (a set to train on has only a train "
                           "split); name another split or set")
    queries = [query for _, part in loaded for query in part]
    if args.limit is not None:
        queries = queries[: args.limit]
    if args.sample is not None and args.sample < len(queries):
        queries = [queries[i * len(queries) // args.sample] for i in range(args.sample)]
    model, info = load_model(args.model, adapter=not args.base, dtype=serving_dtype(args.dtype))
    tokenizer, artifact = registry_and_artifact(
        args.registry, args.artifact, args.tokenizer or info.tokenizer,
        labelled_over, separator=args.separator)
    mismatch = training_mismatch(info.adapter, artifact)
    if mismatch:
        print(f"tooltrie eval: warning: {mismatch}", file=sys.stderr)
    check_labels(queries, artifact.registry)
    style = args.prompt_style or info.prompt_style
    arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    ranker = args.ranker
    if ranker == "auto":  # what `tooltrie ask` and `serve` answer with by default, measured as they give it
        ranker = auto_ranker(info.adapter, artifact,
                             retrieval=not needs_encoder(args.prior) or locate_minilm() is not None)
    ranked = "fused" in arms or ("engine" in arms and ranker != "model") or any(a in PRIOR_ARMS for a in arms)
    weights = args.fused_weights or fused_weights(info.adapter, artifact)
    retrieval = ranker_for(artifact, args.artifact or args.registry, weights, prior=args.prior, follow=args.follow,
                           asks=args.asks, progress=Progress(f"{artifact.registry.name}: embedding", unit="tool",
                                                             quiet=args.quiet)) if ranked else None
    setup = EvalSetup(model=model, tokenizer=tokenizer, artifact=artifact, prompt=Prompt.style(style),
                      batch_size=args.batch, max_new_tokens=args.max_new_tokens, model_path=info.path,
                      artifact_path=args.artifact,
                      options={"ranker": ranker, "vllm": vllm_options(args.vllm), "retrieval": retrieval})
    meta = {"dataset": ",".join(name for name, _ in parts), "split": ",".join(split for _, split in parts),
            "model": info.name, "model_fingerprint": info.fingerprint, "dtype": str(info.dtype).removeprefix("torch."),
            "prompt_style": style, "limit": args.limit,
            "adapter": None if info.adapter is None else str(info.adapter.path),
            "sample": args.sample, "ranker": ranker, "ranker_asked": args.ranker, "prior": args.prior,
            "fused_weights": weights.as_dict(), "follow": args.follow, "asks": args.asks}
    results = evaluate(queries, arms, setup, meta=meta, progress=not args.quiet)
    paths = write_results(results, args.output, plots=args.plots)
    for arm, data in results["arms"].items():
        summary = data["summary"]
        print(json.dumps({"arm": arm, **{k: summary[k] for k in ("exact", "valid", "hallucinated", "repeated",
                                                                  "latency_median_ms")}}))
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0


def vllm_options(settings: list[str]) -> dict[str, Any]:
    """``--vllm KEY=VALUE`` settings as ``LLM`` keyword arguments, each value JSON if it reads as JSON.

    >>> vllm_options(["enforce_eager=false", "kv_cache_memory_bytes=1073741824", "dtype=float32"])
    {'enforce_eager': False, 'kv_cache_memory_bytes': 1073741824, 'dtype': 'float32'}
    """
    options: dict[str, Any] = {}
    for setting in settings:
        key, equals, value = setting.partition("=")
        if not equals or not key.isidentifier():
            raise SystemExit(f"tooltrie eval: error: --vllm takes KEY=VALUE, got {setting!r}")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def _compare(args: argparse.Namespace) -> int:
    from tooltrie.eval.compare import ArmAnswers, as_json, compare, markdown
    from tooltrie.eval.results import ResultsError

    a, b = ArmAnswers.load(args.a), ArmAnswers.load(args.b)
    rows = compare(a, b, rates=[rate.strip() for rate in args.rates.split(",") if rate.strip()], seed=args.seed)
    margin = None if args.margin is None else args.margin / 100
    if margin is not None and not 0 <= margin < 1:
        raise ResultsError(f"--margin {args.margin:g}: give points between 0 and 100")
    if args.format == "json":
        print(json.dumps(as_json(a, b, rows, margin=margin), indent=2))
    else:
        sys.stdout.write(markdown(a, b, rows, margin=margin))
    return 0


def _grammar(args: argparse.Namespace) -> int:
    from tooltrie.compiler import Artifact
    from tooltrie.compiler.ebnf import exactly_k_ebnf
    from tooltrie.eval.files import write_text
    from tooltrie.kernels.state import check_k

    artifact = Artifact.load(args.artifact)
    check_k(args.k, len(artifact.registry), where="--k")
    text = exactly_k_ebnf(artifact.registry.names, args.k, artifact.contract) + "\n"
    if args.output is None:
        sys.stdout.write(text)
    else:
        write_text(args.output, text)
    return 0
