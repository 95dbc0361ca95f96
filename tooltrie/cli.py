"""The ``tooltrie`` command line: compile, inspect, decode."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tooltrie.errors import TooltrieError
from tooltrie.options import add_quiet_option, add_ranker_options, add_separator_option


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tooltrie", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    compile_cmd = commands.add_parser("compile", help="compile a registry into a trie artifact")
    compile_cmd.add_argument("registry", type=Path,
                             help="registry file (.yaml, .json, .jsonl; an OpenAPI 3 document as .json or .yaml)")
    compile_cmd.add_argument("--tokenizer", default=None,
                             help="tokenizer directory, tokenizer.json, or bundled name (default: smollm2-135m)")
    add_separator_option(compile_cmd, default=", ")
    compile_cmd.add_argument("-o", "--output", type=Path, required=True, help="artifact file to write")
    compile_cmd.add_argument("--format", choices=("text", "json"), default="text",
                             help="how errors are reported: text on stderr, or one JSON object on stdout listing "
                                  "every problem (for CI)")
    compile_cmd.add_argument("--require-descriptions", action="store_true",
                             help="an empty tool description is a problem too")
    compile_cmd.add_argument("--embed", action="store_true",
                             help="also embed every tool with all-MiniLM-L6-v2 and keep the embeddings beside the "
                                  "artifact (the dense and hybrid priors' first request would otherwise make them); "
                                  "the lexical index is kept there always (with bm25s, the model extra)")
    add_quiet_option(compile_cmd)
    compile_cmd.set_defaults(run=_compile)

    inspect_cmd = commands.add_parser("inspect", help="print an artifact's header, placement, the prior's parts kept "
                                                      "beside it and chains (which tool finds the identifier another "
                                                      "requires) as JSON")
    inspect_cmd.add_argument("artifact", type=Path)
    inspect_cmd.set_defaults(run=_inspect)

    decode_cmd = commands.add_parser("decode", help="decode with random or tied logits (a check of the rules)")
    decode_cmd.add_argument("artifact", type=Path)
    decode_cmd.add_argument("--k", type=int, required=True, help="tools per answer")
    decode_cmd.add_argument("--batch", type=int, default=4)
    decode_cmd.add_argument("--seed", type=int, default=0)
    decode_cmd.add_argument("--logits", choices=("random", "ties"), default="random")
    decode_cmd.add_argument("--tokenizer", default=None, help="tokenizer the artifact was compiled for")
    decode_cmd.set_defaults(run=_decode)

    ask_cmd = commands.add_parser("ask", help="which tools answer this query? (default: bundled catalog, SmolLM2)")
    ask_cmd.add_argument("query")
    ask_cmd.add_argument("--k", type=int, default=3, help="how many tools (default 3)")
    ask_cmd.add_argument("--registry", type=Path, default=None,
                         help="registry file or compiled artifact (default: the bundled catalog)")
    add_separator_option(ask_cmd)
    ask_cmd.add_argument("--model", default=None,
                         help="local Hugging Face causal-LM directory or adapter directory (default: SmolLM2 with "
                              "the bundled adapter)")
    ask_cmd.add_argument("--base", "--no-adapter", dest="base", action="store_true",
                         help="leave the adapter out: the default model (or --model adapter's base) alone")
    ask_cmd.add_argument("--tokenizer", default=None, help="tokenizer (default: the model's, else smollm2-135m)")
    ask_cmd.add_argument("--json", action="store_true", help="print the discovery endpoint's JSON object")
    add_ranker_options(ask_cmd)
    _add_dtype_option(ask_cmd)
    add_quiet_option(ask_cmd)
    ask_cmd.set_defaults(run=_ask)

    serve_cmd = commands.add_parser("serve", help="serve discovery over HTTP and MCP (default: catalog, SmolLM2)")
    serve_cmd.add_argument("--registry", type=Path, action="append", default=None,
                           help="registry file or compiled artifact to serve; repeat for several, the first is "
                                "the default (default: the bundled catalog)")
    add_separator_option(serve_cmd)
    _add_server_options(serve_cmd, dtype_where="; not with --vllm-url (the vLLM server's: vllm serve --dtype)")
    serve_cmd.add_argument("--policy", type=Path, default=None,
                           help="tenants' API keys and allowed tools (YAML, see README); without it the server is "
                                "open and binds loopback only")
    serve_cmd.add_argument("--prefilter", action="append", default=None, metavar="[REGISTRY=]N",
                           help="keep the N tools the query's retrieval prior ranks first (--prior, or the "
                                "request's), then decode within them (default and most a request may ask); repeat "
                                "per registry")
    add_ranker_options(serve_cmd, what="the server's")
    serve_cmd.add_argument("--train", action="store_true",
                           help="give each registry its own adapter, trained from its own text in the background "
                                "(about 15 minutes for 2,000 tools on 2 cores) and cached; the fused ranker "
                                "answers meanwhile")
    serve_cmd.add_argument("--vllm-url", default=None, metavar="URL",
                           help="answer through the vLLM server at URL (vllm serve with tooltrie's processor) "
                                "instead of loading the model here; --model names the model it runs")
    serve_cmd.add_argument("--vllm-model", default=None,
                           help="the model's name on the vLLM server (default: the only one it serves)")
    serve_cmd.add_argument("--vllm-artifacts", type=Path, default=None, metavar="DIR",
                           help="where the artifacts are written for the vLLM server to read (a path it sees the "
                                "same; default: the compile cache's vllm/)")
    serve_cmd.set_defaults(run=_serve)

    proxy_cmd = commands.add_parser("proxy", help="in front of an OpenAI-compatible server: each chat completion goes "
                                                  "on with only the tools that fit its last user turn")
    proxy_cmd.add_argument("--upstream", required=True, metavar="URL",
                           help="the OpenAI-compatible server's base URL (e.g. http://127.0.0.1:8001 for vllm serve)")
    proxy_cmd.add_argument("--k", type=int, default=None,
                           help="tools forwarded per request (default 8), besides the pinned ones, the ones not "
                                "deferred and the ones the conversation called")
    proxy_cmd.add_argument("--pin", action="append", default=[], metavar="TOOL",
                           help="a tool always forwarded when a request lists it; repeat for several")
    _add_server_options(proxy_cmd, dtype_where="")
    add_ranker_options(proxy_cmd, what="the proxy's")
    proxy_cmd.set_defaults(run=_proxy)

    from tooltrie.train.command import add_gen_data_command, add_train_command

    add_gen_data_command(commands)

    from tooltrie.eval.cli import add_commands as add_eval_commands

    add_eval_commands(commands)  # eval, compare, grammar
    add_train_command(commands)

    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except TooltrieError as exc:
        if getattr(args, "format", "text") == "json":
            report = exc.to_json() if hasattr(exc, "to_json") else {"error": type(exc).__name__, "message": str(exc)}
            print(json.dumps(report, ensure_ascii=False, indent=2))
        else:
            print(f"tooltrie {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # a part of an extra that is not installed: say which, and how
        from tooltrie.extras import missing_extra_message

        advice = missing_extra_message(exc.name)
        if advice is None:
            raise
        print(f"tooltrie {args.command}: error: {advice}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `tooltrie inspect ... | head`: the reader left, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _compile(args: argparse.Namespace) -> int:
    from tooltrie.compiler import Contract, TokenizerInfo, compile_registry
    from tooltrie.registry import load_registry
    from tooltrie.registry.problems import Problem

    problems: list[Problem] = []  # every entry's problems, reported with the compiler's in one pass
    registry = load_registry(args.registry, problems=problems, require_descriptions=args.require_descriptions)
    tokenizer = TokenizerInfo.load(args.tokenizer)
    artifact = compile_registry(registry, tokenizer, Contract(separator=args.separator), problems=problems,
                                progress=False if args.quiet else None)
    artifact.save(args.output)
    trie = artifact.trie
    print(f"{args.output}: {trie.n_tools} tools, {trie.n_nodes} nodes, {trie.n_edges} edges, "
          f"{trie.device_bytes} device bytes, placement {artifact.placement()}", file=sys.stderr)
    _keep_prior(artifact, args.output, embed=args.embed, quiet=args.quiet)
    return 0


def _keep_prior(artifact: Any, path: Path, *, embed: bool, quiet: bool) -> None:
    """The prior's parts made now and kept beside the artifact at ``path`` (``ranker.lexical_path``,
    ``embeddings_path``), where ``ask`` and ``serve`` read them: the lexical index (when bm25s is installed) and,
    with ``embed``, the tools' embeddings (their progress shown unless ``quiet``)."""
    import importlib.util
    import time

    from tooltrie.progress import Progress
    from tooltrie.ranker import UNTRAINED, embeddings_path, lexical_path, ranker_for

    ranker = ranker_for(artifact, path, UNTRAINED,
                        progress=Progress(f"{path.name}: embedding", unit="tool", quiet=quiet))
    if importlib.util.find_spec("bm25s") is None:
        print(f"{path}: no lexical index kept (bm25s is not installed: the model extra)", file=sys.stderr)
    else:
        began = time.perf_counter()
        ranker.lexical  # noqa: B018 (built and written beside the artifact)
        print(f"{lexical_path(path)}: the lexical index ({time.perf_counter() - began:.1f} s)", file=sys.stderr)
    if embed:
        began = time.perf_counter()
        ranker.tool_embeddings  # noqa: B018 (made and written beside the artifact)
        print(f"{embeddings_path(path)}: {len(artifact.registry)} tools embedded ({time.perf_counter() - began:.1f} s)",
              file=sys.stderr)


def _inspect(args: argparse.Namespace) -> int:
    from tooltrie.chains import Chains
    from tooltrie.compiler import Artifact

    artifact = Artifact.load(args.artifact)
    summary = artifact.summary()
    tools = summary.pop("tools")  # the tools stay last; before them, the chains the prior follows
    summary["prior_kept"] = _prior_kept(artifact, args.artifact)
    summary["chains"] = Chains.of(artifact.registry).describe(artifact.registry.names)
    print(json.dumps({**summary, "tools": tools}, indent=2, ensure_ascii=False))
    return 0


def _prior_kept(artifact: Any, path: Path) -> dict[str, str]:
    """Which of the prior's parts are kept beside the artifact for its registry version: "ready", "missing", or
    "stale" (a file of another registry version, or unreadable: made again on first use)."""
    from tooltrie.ranker import UNTRAINED, ranker_for

    return {part: ("ready" if ready else "stale" if file.is_file() else "missing")
            for part, (file, ready) in ranker_for(artifact, path, UNTRAINED).kept().items()}


def _decode(args: argparse.Namespace) -> int:
    from tooltrie.compiler import Artifact, TokenizerInfo
    from tooltrie.kernels.demo import decode_demo

    artifact = Artifact.load(args.artifact)
    tokenizer = TokenizerInfo.load(args.tokenizer or artifact.tokenizer_meta["source"])
    artifact.check_compatible(tokenizer=tokenizer, where=str(args.artifact))
    for line in decode_demo(artifact, tokenizer, k=args.k, batch=args.batch, seed=args.seed, logits=args.logits):
        print(json.dumps(line, ensure_ascii=False))
    return 0


def _add_dtype_option(command: argparse.ArgumentParser, *, where: str = "") -> None:
    # The names of serve.model.DTYPE_NAMES, spelled out so --help needs no torch import.
    command.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                         help="weights and passes: auto is bfloat16 where the CPU has native bfloat16 (AMX, "
                              f"AVX512-BF16), else float32{where}")


def _ask(args: argparse.Namespace) -> int:
    from transformers.utils import logging as transformers_logging

    from tooltrie.compiler import Artifact, TokenizerInfo
    from tooltrie.compiler.sources import artifact_from, is_artifact, registry_of
    from tooltrie.kernels.state import check_k
    from tooltrie.progress import Progress
    from tooltrie.ranker import needs_encoder, ranker_for
    from tooltrie.ranker_policy import auto_ranker, fused_weights
    from tooltrie.registry import CATALOG_PATH
    from tooltrie.registry.named import NameIndex
    from tooltrie.retrieval import locate_minilm
    from tooltrie.serve.decoder import release_copied_weights
    from tooltrie.serve.engine import Engine, Request
    from tooltrie.serve.first import first_tools, nothing_decoded, with_first
    from tooltrie.serve.model import load_model, serving_dtype, training_mismatch
    from tooltrie.serve.prompt import Prompt

    # The answer is the output: no weight-loading progress bars around it.
    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    source = args.registry or CATALOG_PATH
    # A bad registry or artifact is refused before the model loads; an artifact is read once.
    loaded = Artifact.load(source) if is_artifact(source) else None
    if loaded is None:
        registry_of(source)
    model, info = load_model(args.model, adapter=not args.base, dtype=serving_dtype(args.dtype))
    tokenizer = TokenizerInfo.load(args.tokenizer or info.tokenizer)
    artifact = artifact_from(source, tokenizer, separator=args.separator, loaded=loaded)
    mismatch = training_mismatch(info.adapter, artifact)
    if mismatch:
        print(f"tooltrie ask: warning: {mismatch}", file=sys.stderr)
    retrieval = not needs_encoder(args.prior) or locate_minilm() is not None  # lexical needs only bm25s
    ranked = auto_ranker(info.adapter, artifact, retrieval=retrieval) if args.ranker == "auto" else args.ranker
    weights = args.fused_weights or fused_weights(info.adapter, artifact)
    ranker = None if ranked == "model" else ranker_for(  # embedding a registry's tools the first time takes a while
        artifact, source, weights, prior=args.prior,
        progress=Progress(f"{Path(source).name}: embedding", unit="tool", quiet=args.quiet))
    # One request: one row of cache and trie state, not a batch's.
    engine = Engine(model, tokenizer, artifact, prompt=Prompt.style(info.prompt_style), ranker=ranker, max_batch=1)
    release_copied_weights(model)  # the engine holds the layers' weights in its own layout: not twice
    check_k(args.k, len(artifact.registry), where="--k")
    # A query naming tools gets them first, as the endpoint answers it (serve/first.py); the decode adds the rest.
    first = first_tools(NameIndex(artifact.registry), args.query, args.k, allowed=None, pins=(), pin_within_k=True)
    named = tuple(artifact.registry.names[i] for i in first.tools)
    decoded = engine.run([Request(args.query, first.decoded, ranker=ranked, deny=named)])[0] if first.decoded else (
        nothing_decoded(artifact))
    answer = with_first(decoded, first, artifact.registry)
    body = answer.response()
    if args.json:
        print(json.dumps(body, ensure_ascii=False))
    else:
        for tool in body["tools"]:
            print(f"{tool['rank']}. {tool['name']:<32} {tool['pointer']:<40} score {tool['score']:.3f}")
        if answer.finish_reason != "stop":
            print(f"(finish_reason: {answer.finish_reason})", file=sys.stderr)
    return 0 if answer.finish_reason == "stop" else 1


def _add_server_options(command: argparse.ArgumentParser, *, dtype_where: str) -> None:
    """What ``serve`` and ``proxy`` both take: where to listen, the model, and the limits."""
    command.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    command.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    command.add_argument("--model", default=None,
                         help="local Hugging Face causal-LM directory or adapter directory (default: SmolLM2)")
    command.add_argument("--base", action="store_true", help="the base model alone, without the bundled adapter")
    command.add_argument("--tokenizer", default=None, help="tokenizer (default: the model's, else smollm2-135m)")
    _add_dtype_option(command, where=dtype_where)
    command.add_argument("--max-batch", type=int, default=16, help="rows decoded together; 1: no batching")
    command.add_argument("--queue", type=int, default=128, help="requests waiting for a slot before 429")
    command.add_argument("--timeout", type=float, default=30.0, help="seconds per request, queueing included")


def _proxy(args: argparse.Namespace) -> int:
    from tooltrie.registry import CATALOG_PATH
    from tooltrie.serve.limits import ServeLimits

    try:
        from tooltrie.serve.proxy import DEFAULT_K
        from tooltrie.serve.server import serve
    except ImportError as exc:  # fastapi, uvicorn, mcp: the `serve` extra
        raise SystemExit(f"tooltrie proxy: error: {exc.name} is not installed; "
                         "`pip install -e '.[serve]'` (or `make install`)") from None
    k = DEFAULT_K if args.k is None else args.k
    if k < 1:
        raise SystemExit(f"tooltrie proxy: error: --k must be at least 1, got {k}")
    try:
        limits = ServeLimits(max_batch=args.max_batch, queue=args.queue, timeout_s=args.timeout)
    except ValueError as exc:
        raise SystemExit(f"tooltrie proxy: error: {exc}") from None
    serve(registries=[CATALOG_PATH], model=args.model, adapter=not args.base, tokenizer=args.tokenizer,
          host=args.host, port=args.port, limits=limits, dtype=args.dtype, ranker=args.ranker, prior=args.prior,
          fused_weights=args.fused_weights, upstream=args.upstream, upstream_k=k, upstream_pin=args.pin)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from tooltrie.registry import CATALOG_PATH
    from tooltrie.serve.limits import ServeLimits

    try:
        from tooltrie.serve.server import serve
    except ImportError as exc:  # fastapi, uvicorn, mcp: the `serve` extra
        raise SystemExit(f"tooltrie serve: error: {exc.name} is not installed; "
                         "`pip install -e '.[serve]'` (or `make install`)") from None
    try:
        limits = ServeLimits(max_batch=args.max_batch, queue=args.queue, timeout_s=args.timeout)
    except ValueError as exc:
        raise SystemExit(f"tooltrie serve: error: {exc}") from None
    prefilter: dict[str | None, int] = {}
    for setting in args.prefilter or ():
        name, _, n = setting.rpartition("=")
        if not n.isdigit():
            raise SystemExit(f"tooltrie serve: error: --prefilter takes [REGISTRY=]N, got {setting!r}")
        prefilter[name or None] = int(n)
    recipe = None
    if args.train:  # the server starts the training job; it never imports the training code itself
        from tooltrie.train.recipe import Recipe

        recipe = Recipe()
    serve(registries=args.registry or [CATALOG_PATH], model=args.model, adapter=not args.base, tokenizer=args.tokenizer,
          host=args.host, port=args.port, limits=limits, policy=args.policy, prefilter=prefilter, dtype=args.dtype,
          separator=args.separator, ranker=args.ranker, prior=args.prior, fused_weights=args.fused_weights,
          train=recipe, vllm_url=args.vllm_url, vllm_model=args.vllm_model, vllm_artifacts=args.vllm_artifacts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
