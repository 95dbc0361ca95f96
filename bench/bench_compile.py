"""Compile benchmark: tooltrie's registry compiler against XGrammar's exactly-k grammar, taking turns.

For each registry size (the 47-tool catalog, the 1,853-name BFCL registry, synthetic 4,000- and 100,000-name
registries), in this process:

- ours: ``compile_registry`` (tokenization and verification included) with the tokenizer already loaded, its
  median time, device bytes, nodes, edges and placement; peak RSS of a compile in a fresh process;
- XGrammar: ``TokenizerInfo.from_huggingface`` + ``GrammarCompiler.compile_grammar`` of the equivalent
  exactly-k EBNF (no cache), and the compiled grammar's ``memory_size_bytes``. Above ``XGR_INPROCESS_MAX`` tools
  it runs in a subprocess under ``--xgr-timeout``; a timeout ends its turns at that size.

Loading the tokenizers (ours, and the Hugging Face fast tokenizer XGrammar starts from) is timed separately.

Whole processes, as a user runs them (start-up, imports and the tokenizer load included, nothing cached): ours is
``tooltrie compile REGISTRY -o OUT``; XGrammar's is a fresh Python that imports xgrammar and transformers, loads
the fast tokenizer, builds its ``TokenizerInfo`` and compiles the exactly-k EBNF read from a file, cache
disabled. The marginal cost of a size is its median wall time minus that of a 3-tool registry, per arm.

The targets are reported, never asserted.

    python bench/bench_compile.py [--repeats 7] [--k 3] [--sizes 47,1853,4000,100000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    RESULTS_DIR,
    Arm,
    StopArm,
    median,
    peak_rss_bytes,
    print_table,
    ru_maxrss_bytes,
    run_json_worker,
    summarize,
    take_turns,
    write_results,
)

from tooltrie.compiler import Artifact, Contract, TokenizerInfo, compile_registry
from tooltrie.compiler.ebnf import exactly_k_ebnf
from tooltrie.compiler.tokenizer_info import BUNDLED_TOKENIZERS_DIR
from tooltrie.registry import BFCL_PATH, CATALOG_PATH, Registry, load_registry, make_registry

LARGE = 10_000  # from this many tools on: --large-repeats
XGR_INPROCESS_MAX = 2_000  # up to this many tools: one untimed warm-up; above: XGrammar in a time-limited subprocess
GB = 10**9
BASELINE_TOOLS = 3  # the whole-process baseline: what a process costs before the registry's size counts
TARGETS = {
    "time_ratio_at_2k": 0.5,  # our compile / XGrammar (TokenizerInfo + compile), at ~2,000 tools
    "marginal_ratio_at_4k": 0.5,  # whole processes: our marginal cost / XGrammar's, at ~4,000 tools
    "size_ratio_at_2k": 0.25,  # our device bytes / XGrammar memory_size_bytes, at ~2,000 tools
    "compile_s_at_100k": 5.0,
    "peak_rss_at_100k": 1 * GB,
}

def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# Synthetic names: "<domain>.<verb>_<object>[_<qualifier>[_<qualifier>]]", e.g. "weather.get_forecast_v2".
_DOMAINS = _words(
    "weather calendar email billing payments invoices crm tickets search maps travel flights hotels music video "
    "photos storage files docs sheets slack github jira analytics ads inventory orders shipping returns catalog "
    "pricing users auth accounts contacts notes tasks projects hr payroll recruiting finance stocks crypto news "
    "sports recipes fitness health pharmacy insurance banking loans tax legal compliance security logs metrics "
    "alerts deploy kubernetes database cache queue translate speech vision")
_VERBS = _words(
    "get list create update delete search find fetch send cancel schedule approve reject sync export import "
    "validate compute estimate convert summarize archive restore share upload download subscribe refresh lookup "
    "count rank")
_OBJECTS = _words(
    "forecast alerts event events message thread invoice payment refund customer lead ticket comment route place "
    "booking flight hotel room playlist track album photo file folder document sheet channel issue pull_request "
    "commit report dashboard campaign item order shipment return product price discount user session token "
    "account contact note task project employee salary candidate budget quote portfolio headline score recipe "
    "workout appointment prescription claim policy transaction balance loan filing contract audit log metric "
    "alert deployment pod record key job translation transcript label")
_QUALIFIERS = _words("by_id by_name by_date details summary history status batch async bulk v2 v3 stream paginated "
                     "latest")


def synthetic_names(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct, realistic tool names, the same for the same ``(n, seed)``.

    >>> synthetic_names(3)
    ['pharmacy.upload_quote_async_batch', 'banking.count_product', 'sports.estimate_channel_summary']
    """
    rng = random.Random(seed)
    seen: set[str] = set()
    names: list[str] = []
    while len(names) < n:
        name = f"{rng.choice(_DOMAINS)}.{rng.choice(_VERBS)}_{rng.choice(_OBJECTS)}"
        draw = rng.random()
        if draw < 0.15:
            name += "_" + "_".join(rng.sample(_QUALIFIERS, 2))
        elif draw < 0.6:
            name += "_" + rng.choice(_QUALIFIERS)
        if name not in seen:
            seen.add(name)
            names.append(name)
    return names


def build_registry(size: int, seed: int) -> tuple[str, Registry]:
    """The registry benchmarked at ``size``: the bundled catalog (47), BFCL (1,853), else synthetic names."""
    if size == 47:
        return "catalog", load_registry(CATALOG_PATH)
    if size == 1853:
        return "bfcl", load_registry(BFCL_PATH)
    if size == BASELINE_TOOLS:
        return "catalog-3", make_registry([tool.content() for tool in load_registry(CATALOG_PATH).tools[:size]],
                                          name="catalog-3")
    names = synthetic_names(size, seed)
    return "synthetic", make_registry([{"name": name} for name in names], name=f"synthetic-{size}")


def tokenizer_json(source: str) -> Path:
    """The ``tokenizer.json`` behind a ``TokenizerInfo.load`` source (bundled name, directory or file)."""
    path = Path(source)
    if not path.exists():
        path = BUNDLED_TOKENIZERS_DIR / source
    return path / "tokenizer.json" if path.is_dir() else path


def hf_tokenizer(source: str, eos_token: str) -> Any:
    import transformers

    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json(source)), eos_token=eos_token)


def xgrammar_compile(hf: Any, ebnf: str, vocab_size: int, eos_id: int) -> tuple[dict[str, float], int]:
    """XGrammar's per-tokenizer and per-grammar work, timed apart; returns the timings and the compiled size."""
    import xgrammar as xgr

    began = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=[eos_id])
    built = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_grammar(ebnf)
    done = time.perf_counter()
    times = {"tokenizer_info": built - began, "compile": done - built, "total": done - began}
    return times, int(compiled.memory_size_bytes)


# -- workers (fresh processes) -----------------------------------------------------------------------------------

def worker_rss(args: argparse.Namespace) -> dict[str, Any]:
    """Peak RSS of one compile in this fresh process, and the baseline before it (imports, tokenizer, registry)."""
    tokenizer = TokenizerInfo.load(args.tokenizer)
    _, registry = build_registry(args.size, args.seed)
    baseline, baseline_ru = peak_rss_bytes(), ru_maxrss_bytes()
    began = time.perf_counter()
    compile_registry(registry, tokenizer, Contract(), progress=False)
    elapsed = time.perf_counter() - began
    return {"baseline_rss_bytes": baseline, "peak_rss_bytes": peak_rss_bytes(), "cold_compile_s": elapsed,
            "baseline_ru_maxrss_bytes": baseline_ru, "peak_ru_maxrss_bytes": ru_maxrss_bytes()}


def worker_xgrammar(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = TokenizerInfo.load(args.tokenizer)
    _, registry = build_registry(args.size, args.seed)
    ebnf = exactly_k_ebnf(registry.names, args.k)
    hf = hf_tokenizer(args.tokenizer, tokenizer.eos_token)
    times, size = xgrammar_compile(hf, ebnf, tokenizer.vocab_size, tokenizer.eos_id)
    return {**times, "memory_size_bytes": size, "peak_rss_bytes": peak_rss_bytes()}


def worker_argv(args: argparse.Namespace, kind: str, size: int) -> list[str]:
    return [__file__, "--worker", kind, "--size", str(size), "--k", str(args.k), "--tokenizer", args.tokenizer,
            "--seed", str(args.seed)]


# -- whole processes ----------------------------------------------------------------------------------------------

# XGrammar as a user's script would run it: argv = tokenizer.json, stop token, vocabulary size, stop id, EBNF file.
XGR_PROCESS = """
import sys
import transformers, xgrammar as xgr
path, eos, vocab_size, eos_id, ebnf = sys.argv[1:]
hf = transformers.PreTrainedTokenizerFast(tokenizer_file=path, eos_token=eos)
info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=int(vocab_size), stop_token_ids=[int(eos_id)])
compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_grammar(open(ebnf, encoding="utf-8").read())
assert compiled.memory_size_bytes > 0
"""


def bench_processes(args: argparse.Namespace, tokenizer: TokenizerInfo, folder: Path) -> list[dict[str, Any]]:
    """Median wall time of whole processes per size (and the 3-tool baseline), ours and XGrammar's taking turns."""
    tooltrie_exe = str(Path(sys.executable).with_name("tooltrie"))
    rows = []
    for size in [BASELINE_TOOLS, *args.size_list]:
        label, registry = build_registry(size, args.seed)
        source = Path(registry.source)
        if not source.is_file():  # a synthetic registry: written as a file, as a user would have it
            source = folder / f"{label}-{size}.jsonl"
            source.write_text("".join(json.dumps({"name": name}) + "\n" for name in registry.names), encoding="utf-8")
        ebnf = folder / f"{label}-{size}.ebnf"
        ebnf.write_text(exactly_k_ebnf(registry.names, args.k), encoding="utf-8")
        ours_argv = [tooltrie_exe, "compile", str(source), "--tokenizer", args.tokenizer, "-o",
                     str(folder / "out.safetensors")]
        xgr_argv = [sys.executable, "-c", XGR_PROCESS, str(tokenizer_json(args.tokenizer)), tokenizer.eos_token,
                    str(tokenizer.vocab_size), str(tokenizer.eos_id), str(ebnf)]

        def run(argv: list[str], timeout_s: float) -> None:
            try:
                subprocess.run(argv, check=True, capture_output=True, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise StopArm(f"timeout after {timeout_s:g} s") from None
            except subprocess.CalledProcessError as exc:
                raise StopArm(f"failed: {exc.stderr.decode(errors='replace')[-300:]}") from None

        arms: dict[str, Arm] = {"ours": lambda argv=ours_argv: run(argv, 600)}
        if args.xgr_max_tools is None or size <= args.xgr_max_tools:
            arms["xgrammar"] = lambda argv=xgr_argv: run(argv, args.xgr_timeout)
        repeats = args.process_repeats if size < LARGE else args.large_repeats
        print(f"[whole processes: {label}, {size:,} tools, {repeats} repeats]", flush=True)
        times = take_turns(arms, repeats=repeats)
        row: dict[str, Any] = {"registry": label, "n_tools": size, "repeats": repeats}
        for arm, measured in times.items():
            row[arm] = {"wall_s": summarize(measured.samples["wall"])} if measured.samples.get("wall") else {}
            if measured.stopped:
                row[arm]["status"] = measured.stopped
        if "xgrammar" not in times:
            row["xgrammar"] = {"status": f"skipped: above --xgr-max-tools {args.xgr_max_tools:,}"}
        rows.append(row)
    base = rows[0]
    for row in rows[1:]:
        for arm in ("ours", "xgrammar"):
            if "wall_s" in row[arm] and "wall_s" in base[arm]:
                row[arm]["marginal_s"] = row[arm]["wall_s"]["median"] - base[arm]["wall_s"]["median"]
        if "marginal_s" in row["ours"] and "marginal_s" in row["xgrammar"]:
            row["ratios"] = {"wall": row["ours"]["wall_s"]["median"] / row["xgrammar"]["wall_s"]["median"],
                             "marginal": row["ours"]["marginal_s"] / row["xgrammar"]["marginal_s"]}
    return rows


# -- the benchmark -----------------------------------------------------------------------------------------------

def bench_tokenizer_load(args: argparse.Namespace, eos_token: str) -> dict[str, Any]:
    times = take_turns({
        "tooltrie": lambda: TokenizerInfo.load(args.tokenizer),
        "hf_fast": lambda: hf_tokenizer(args.tokenizer, eos_token),
    }, repeats=args.repeats, warmup=1)
    return {"tooltrie_TokenizerInfo_load_s": summarize(times["tooltrie"].samples["wall"]),
            "hf_PreTrainedTokenizerFast_s": summarize(times["hf_fast"].samples["wall"])}


def bench_size(args: argparse.Namespace, size: int, tokenizer: TokenizerInfo, hf: Any,
               rss: dict[str, Any]) -> dict[str, Any]:
    began = time.perf_counter()
    label, registry = build_registry(size, args.seed)
    registry_s = time.perf_counter() - began
    names = registry.names
    name_tokens = [len(ids) for ids in tokenizer.encode_batch(names)]
    ebnf = exactly_k_ebnf(names, args.k)
    large = len(names) >= LARGE
    repeats = args.large_repeats if large else args.repeats
    print(f"\n[{label}: {len(names):,} tools, {repeats} repeats]", flush=True)

    artifacts: list[Artifact] = []
    xgr_sizes: list[int] = []
    xgr_rss: list[int] = []

    def ours() -> None:
        artifacts[:] = [compile_registry(registry, tokenizer, Contract(), progress=False)]

    def xgr_in_process() -> dict[str, float]:
        times, nbytes = xgrammar_compile(hf, ebnf, tokenizer.vocab_size, tokenizer.eos_id)
        xgr_sizes.append(nbytes)
        return times

    def xgr_subprocess() -> dict[str, float]:
        try:
            out = run_json_worker(worker_argv(args, "xgrammar", size), timeout_s=args.xgr_timeout)
        except subprocess.TimeoutExpired:
            raise StopArm(f"timeout: no compiled grammar after {args.xgr_timeout:g} s") from None
        except RuntimeError as exc:  # e.g. killed for memory
            raise StopArm(f"failed: {exc}") from None
        xgr_sizes.append(int(out["memory_size_bytes"]))
        xgr_rss.append(int(out["peak_rss_bytes"]))
        return {key: float(out[key]) for key in ("tokenizer_info", "compile", "total")}

    arms: dict[str, Arm] = {"ours": ours}
    if args.xgr_max_tools is not None and len(names) > args.xgr_max_tools:
        xgr_status = f"skipped: above --xgr-max-tools {args.xgr_max_tools:,}"
    else:
        arms["xgrammar"] = xgr_in_process if len(names) <= XGR_INPROCESS_MAX else xgr_subprocess
        xgr_status = "ok"
    times = take_turns(arms, repeats=repeats, warmup=1 if len(names) <= XGR_INPROCESS_MAX else 0)

    trie = artifacts[0].trie
    ours_s = times["ours"].samples["wall"]
    result: dict[str, Any] = {
        "registry": label,
        "source": registry.source,
        "n_tools": len(names),
        "name_tokens": {"mean": sum(name_tokens) / len(name_tokens), "max": max(name_tokens)},
        "registry_build_s": registry_s,
        "repeats": repeats,
        "ours": {
            "compile_s": summarize(ours_s),
            "device_bytes": trie.device_bytes,
            "bytes_per_tool": trie.device_bytes / trie.n_tools,
            "nodes": trie.n_nodes,
            "edges": trie.n_edges,
            "tries": trie.n_tries,
            "max_depth": trie.max_depth,
            "placement": artifacts[0].placement(),
            "split": [artifacts[0].split_left, artifacts[0].split_right],
            "verified_answers": artifacts[0].stats.verified_answers,
            **rss,
        },
    }
    xgr: dict[str, Any] = {"status": xgr_status, "ebnf_bytes": len(ebnf.encode("utf-8"))}
    if "xgrammar" in times:
        xt = times["xgrammar"]
        xgr["mode"] = "in-process" if len(names) <= XGR_INPROCESS_MAX else f"subprocess, {args.xgr_timeout:g} s limit"
        if xt.stopped:
            xgr["status"] = xt.stopped
        for key in ("tokenizer_info", "compile", "total"):
            if key in xt.samples:
                xgr[f"{key}_s"] = summarize(xt.samples[key])
        if xgr_sizes:
            xgr["memory_size_bytes"] = xgr_sizes[-1]
        if xgr_rss:
            xgr["peak_rss_bytes"] = max(xgr_rss)
    result["xgrammar"] = xgr
    if "total_s" in xgr:
        result["ratios"] = {
            "time": median(ours_s) / xgr["total_s"]["median"],
            "time_vs_compile_only": median(ours_s) / xgr["compile_s"]["median"],
            "size": trie.device_bytes / xgr["memory_size_bytes"],
        }
    return result


def evaluate_targets(sizes: list[dict[str, Any]], processes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target with the measured value and whether it is met (``None`` when its size was not run)."""
    with_xgr = [s for s in sizes if "ratios" in s]
    near_4k = min((p for p in processes if "ratios" in p), key=lambda p: abs(p["n_tools"] - 4_000), default=None)
    near_2k = min(with_xgr, key=lambda s: abs(s["n_tools"] - 2_000), default=None)
    at_100k = next((s for s in sizes if s["n_tools"] >= 100_000), None)
    targets = []

    def add(name: str, where: dict[str, Any] | None, value: float | None, limit: float, strict: bool) -> None:
        met = None if value is None else (value < limit if strict else value <= limit)
        targets.append({"target": name, "n_tools": where["n_tools"] if where else None, "value": value,
                        "limit": limit, "met": met})

    time_ratio = near_2k["ratios"]["time"] if near_2k else None
    size_ratio = near_2k["ratios"]["size"] if near_2k else None
    add("compile time / XGrammar (TokenizerInfo + compile) at ~2k tools <= 0.5", near_2k, time_ratio,
        TARGETS["time_ratio_at_2k"], strict=False)
    add("device bytes / XGrammar memory_size_bytes at ~2k tools <= 0.25", near_2k, size_ratio,
        TARGETS["size_ratio_at_2k"], strict=False)
    add("whole processes: marginal compile / XGrammar's at ~4k tools <= 0.5", near_4k,
        near_4k["ratios"]["marginal"] if near_4k else None, TARGETS["marginal_ratio_at_4k"], strict=False)
    add("compile time at 100k tools < 5 s", at_100k, at_100k["ours"]["compile_s"]["median"] if at_100k else None,
        TARGETS["compile_s_at_100k"], strict=True)
    add("peak RSS of a 100k compile < 1 GB", at_100k, at_100k["ours"]["peak_rss_bytes"] if at_100k else None,
        TARGETS["peak_rss_at_100k"], strict=True)
    return targets


def print_report(loads: dict[str, Any], sizes: list[dict[str, Any]], processes: list[dict[str, Any]],
                 targets: list[dict[str, Any]]) -> None:
    mb = 1e6
    print_table([{
        "tokenizer load": name, "median s": stats["median"], "min s": stats["min"], "max s": stats["max"],
    } for name, stats in loads.items()], title="Tokenizer load (not in the compile times below)")
    print_table([{
        "registry": s["registry"],
        "tools": s["n_tools"],
        "tok/name": f"{s['name_tokens']['mean']:.1f}",
        "reps": s["repeats"],
        "ours s": s["ours"]["compile_s"]["median"],
        "xgr info s": s["xgrammar"].get("tokenizer_info_s", {}).get("median"),
        "xgr compile s": s["xgrammar"].get("compile_s", {}).get("median"),
        "xgr total s": s["xgrammar"].get("total_s", {}).get("median"),
        "ours/xgr": f"{s['ratios']['time']:.3f}x" if "ratios" in s else None,
        "ours/xgr compile": f"{s['ratios']['time_vs_compile_only']:.3f}x" if "ratios" in s else None,
        "xgrammar": s["xgrammar"]["status"],
    } for s in sizes], title="Compile time (median over repeats; ours includes tokenization and verification)")
    print_table([{
        "registry": s["registry"],
        "tools": s["n_tools"],
        "device bytes": s["ours"]["device_bytes"],
        "B/tool": f"{s['ours']['bytes_per_tool']:.1f}",
        "nodes": s["ours"]["nodes"],
        "edges": s["ours"]["edges"],
        "placement": s["ours"]["placement"],
        "xgr bytes": s["xgrammar"].get("memory_size_bytes"),
        "ours/xgr": f"{s['ratios']['size']:.4f}x" if "ratios" in s else None,
        "RSS base MB": f"{s['ours']['baseline_rss_bytes'] / mb:.0f}",
        "RSS peak MB": f"{s['ours']['peak_rss_bytes'] / mb:.0f}",
        "cold compile s": s["ours"]["cold_compile_s"],
    } for s in sizes], title="Size and memory (RSS: VmHWM of one compile in a fresh process)")
    print_table([{
        "registry": p["registry"],
        "tools": p["n_tools"],
        "reps": p["repeats"],
        "ours s": p["ours"].get("wall_s", {}).get("median"),
        "xgr s": p["xgrammar"].get("wall_s", {}).get("median"),
        "ours/xgr": f"{p['ratios']['wall']:.3f}x" if "ratios" in p else None,
        "ours marginal s": p["ours"].get("marginal_s"),
        "xgr marginal s": p["xgrammar"].get("marginal_s"),
        "marginal ours/xgr": f"{p['ratios']['marginal']:.3f}x" if "ratios" in p else None,
        "xgrammar": p["xgrammar"].get("status", "ok"),
    } for p in processes], title=f"Whole processes (median wall; marginal: minus the {BASELINE_TOOLS}-tool registry's)")
    print_table([{
        "target": t["target"],
        "tools": t["n_tools"],
        "value": None if t["value"] is None else (f"{t['value'] / mb:.0f} MB" if "RSS" in t["target"]
                                                  else f"{t['value']:.3f}"),
        "met": {True: "yes", False: "NO", None: "not run"}[t["met"]],
    } for t in targets], title="Targets (reported, not asserted)")


def profile_compile(size: int, seed: int, tokenizer: TokenizerInfo, top: int = 15) -> list[dict[str, Any]]:
    """cProfile one compile; print and return the functions with the most time spent in themselves."""
    import cProfile
    import pstats

    _, registry = build_registry(size, seed)
    profiler = cProfile.Profile()
    profiler.runcall(compile_registry, registry, tokenizer, Contract(), progress=False)
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = sorted(({"function": f"{Path(file).name}:{line}({name})", "calls": calls, "tottime_s": tottime,
                    "cumtime_s": cumtime} for (file, line, name), (_, calls, tottime, cumtime, _) in stats.items()),
                  key=lambda row: -row["tottime_s"])[:top]
    print_table(rows, title=f"Hot spots of one {size:,}-tool compile (cProfile, by own time)")
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats below 10,000 tools (default 7)")
    parser.add_argument("--large-repeats", type=int, default=3, help="timed repeats from 10,000 tools (default 3)")
    parser.add_argument("--k", type=int, default=3, help="tools per answer in the exactly-k EBNF (default 3)")
    parser.add_argument("--tokenizer", default="smollm2-135m", help="bundled tokenizer name or tokenizer.json path")
    parser.add_argument("--sizes", default="47,1853,4000,100000",
                        help="registry sizes: 47 = catalog, 1853 = BFCL, others synthetic "
                             "(default 47,1853,4000,100000)")
    parser.add_argument("--process-repeats", type=int, default=5,
                        help="whole-process repeats below 10,000 tools (default 5; from 10,000: --large-repeats)")
    parser.add_argument("--no-processes", dest="processes", action="store_false", help="skip the whole processes")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic names (default 0)")
    parser.add_argument("--xgr-timeout", type=float, default=120.0,
                        help=f"seconds allowed to one XGrammar run above {XGR_INPROCESS_MAX:,} tools (default 120)")
    parser.add_argument("--xgr-max-tools", type=int, default=None, help="skip XGrammar above this many tools")
    parser.add_argument("--profile", action="store_true",
                        help="also cProfile one compile of the largest size and print its hot spots")
    parser.add_argument("--out", default=str(RESULTS_DIR / "compile.json"), help="results file")
    parser.add_argument("--worker", choices=("rss", "xgrammar"), help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.size_list = [int(part) for part in args.sizes.split(",") if part.strip()]
    if args.repeats < 1 or args.large_repeats < 1 or args.k < 1 or not args.size_list:
        parser.error("--repeats, --large-repeats and --k must be at least 1, and --sizes non-empty")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker = worker_rss if args.worker == "rss" else worker_xgrammar
        print(json.dumps(worker(args)))
        return 0
    began, load_at_start = time.perf_counter(), list(os.getloadavg())
    # Memory first, while this process is small (ru_maxrss, reported beside VmHWM, is inherited by children).
    print("[peak RSS: one compile per size in a fresh process]", flush=True)
    rss = {size: run_json_worker(worker_argv(args, "rss", size), timeout_s=600) for size in args.size_list}
    tokenizer = TokenizerInfo.load(args.tokenizer)
    hf = hf_tokenizer(args.tokenizer, tokenizer.eos_token)
    loads = bench_tokenizer_load(args, tokenizer.eos_token)
    sizes = [bench_size(args, size, tokenizer, hf, rss[size]) for size in args.size_list]
    processes: list[dict[str, Any]] = []
    if args.processes:
        with tempfile.TemporaryDirectory() as folder:
            processes = bench_processes(args, tokenizer, Path(folder))
    targets = evaluate_targets(sizes, processes)
    print_report(loads, sizes, processes, targets)
    profile = profile_compile(max(args.size_list), args.seed, tokenizer) if args.profile else None
    settings = {
        "repeats": args.repeats, "large_repeats": args.large_repeats, "large_from_tools": LARGE, "k": args.k,
        "tokenizer": args.tokenizer, "sizes": args.size_list, "seed": args.seed, "xgr_timeout_s": args.xgr_timeout,
        "xgr_max_tools": args.xgr_max_tools, "xgr_inprocess_max_tools": XGR_INPROCESS_MAX,
        "xgr_compiler": "GrammarCompiler(cache_enabled=False), default max_threads",
        "order": f"arms take turns within each repeat, the first arm rotating; one untimed warm-up up to "
                 f"{XGR_INPROCESS_MAX:,} tools",
        "targets": TARGETS,
        "process_repeats": args.process_repeats, "process_baseline_tools": BASELINE_TOOLS,
        "processes": "ours: tooltrie compile REGISTRY -o OUT; xgrammar: python -c (import xgrammar, transformers; "
                     "PreTrainedTokenizerFast, TokenizerInfo.from_huggingface, GrammarCompiler(cache_enabled=False)"
                     ".compile_grammar(EBNF file)); arms take turns",
    }
    results = {"tokenizer_load": loads, "sizes": sizes, "whole_processes": processes, "targets": targets,
               "wall_s": time.perf_counter() - began, "load_average_at_start": load_at_start}
    if profile is not None:
        results["profile"] = profile
    path = write_results("compile", settings=settings, results=results, out=args.out)
    print(f"\nwrote {path} ({time.perf_counter() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
