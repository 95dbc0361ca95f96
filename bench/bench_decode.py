"""End-to-end decode cost with the real model (on the CPU, or a GPU): tooltrie's engine against full-head decoding,
taking turns.

Model: SmolLM2-135M-Instruct, the base (``load_model(adapter=False)``: the catalog prompt is the base model's; the
fine-tuned default's short prompt is measured by ``bench_serve.py``), float32 (``--dtype``); registry: the 47-tool
catalog compiled for the bundled tokenizer. Every arm answers the same fixed queries (``QUERIES``) under the
engine's prompt for that k (chat template + system prompt listing the catalog, ~1,300 tokens), for k = 1 and 3,
at batch 1 (one request at a time) and batch 16 (the 16 queries together). Arms:

- ``(a) unconstrained``: a plain Hugging Face-style greedy loop with a key/value cache, the full ``[B, V]``
  logits each step (``model(..., logits_to_keep=1)``) and ``torch.argmax``; it generates exactly N tokens per
  query, N being the length of tooltrie's answer to that query (the untimed discovery run below);
- ``(b) full head + mask``: the same loop, the full logits each step, then the trie mask + argmax through
  ``tooltrie.kernels.step(artifact, state, logits, backend="cpu")``; one forward pass per token, until the
  slot is done;
- ``(a') unconstrained, engine's decoder``: the engine itself with ``constrained=False`` rows (full head, plain
  greedy, N tokens): the same shared-prefix decoder as (c), so (c)/(a') is what the grammar alone saves;
- ``(c) tooltrie engine``: ``Engine(...).run(requests)``: prefix cache, sparse head (only the legal tokens' rows
  of the output layer), forced chains (a run of single-choice tokens is fed in one forward pass), continuous
  batching.

Prefix cache: the prompt's shared prefix (everything before the query; the same for every k) is run through the
model once, outside every timer. (a) and (b) keep it in a Hugging Face cache built from the same ids
(``Engine.prompt_parts(k)``) and copy it per request inside the timers, as ``generate`` with a prefix cache
would; the engine's decoder keeps one copy for all rows (``serve/decoder.py``). Every arm tokenizes each prompt
whole, as the engine does. One engine serves both batch sizes (its ``max_batch`` is lowered per run).

Batches in (a)/(b): the query parts are left-padded (pads masked out, positions continuous) and prefilled in one
forward pass; a row that is done (N tokens for (a), a finished slot for (b)) leaves the batch, as in the engine
(a plain ``generate`` would keep it): a conservative baseline. The engine prefills new requests together
(packed, no padding) and a done row frees its cache slot.

Checks (not timed): (b) and (c) must choose identical token ids for every query at every batch size and repeat;
mismatches are reported (they would be a bug, or a near-tie flipped by float rounding, shown with the texts).
Decision points of (b) are counted by replaying its tokens through ``kernels/rules.py`` (positions with more than
one legal token); for (c) the engine's ``forward_passes`` plus ``speculated`` (decisions taken on a speculated run,
without a pass) must equal its ``decision_points``.

Timing: arms take turns (``take_turns``), the first arm rotating from turn to turn; at batch 1 a turn is one
query, at batch 16 a turn is the whole batch. An untimed engine run over all queries (batch 16) per k is the
warm-up and gives N. ``--budget-s`` bounds the whole run: every configuration gets one repeat, and a further
repeat runs only if it should end within the budget (the sample counts are in the results). Torch runs with one
intra-op thread by default (``--torch-threads``): on a shared 2-core machine, two threads made the same loop
take 40x longer now and then (OpenMP waiting for a core another process holds), one thread is steady. Other
processes may share the machine: the load average is recorded.

On a GPU (``--device cuda``) every arm runs there; (b) copies each step's logits to the host for the ``cpu``
backend, as a mask computed on the host would. A machine without the real weights (a GPU machine has no network)
times the default's architecture with random weights (``--weights random``): the same cost per token, answers that
mean nothing (N still comes from the engine's answers, so every arm generates as many tokens).

    python bench/bench_decode.py [--repeats 3] [--batch1-queries 8] [--batch1-repeats 2] [--ks 1,3]
    python bench/bench_decode.py --device cuda --weights random --dtype bfloat16    # on a GPU machine
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from _common import RESULTS_DIR, Arm, machine_info, median, print_table, summarize, take_turns, write_results

from tooltrie.compiler import Artifact, TokenizerInfo, compile_registry
from tooltrie.kernels import step as tooltrie_step
from tooltrie.kernels.rules import Slot, advance, legal_moves
from tooltrie.kernels.state import DONE, RUNNING, BatchState
from tooltrie.registry import CATALOG_PATH, load_registry
from tooltrie.serve.engine import Engine, Request
from tooltrie.serve.model import DEFAULT_TOKENIZER, load_model
from tooltrie.testing import random_default_model

QUERIES = (
    "What's the weather in Paris tomorrow?",
    "Convert 100 USD to EUR",
    "Show me today's top headlines about the economy",
    "Book a table for two at an Italian restaurant tonight",
    "Find remote software engineering jobs in Berlin",
    "I want to rent a two-bedroom apartment near downtown Seattle",
    "Play some relaxing jazz music",
    "What is Apple's current stock price?",
    "Were there any earthquakes in Japan this week?",
    "Show me NASA's astronomy picture of the day",
    "Help me write a resume for a data analyst position",
    "Suggest a birthday gift for my dad who likes fishing",
    "Plan a three-day trip to Rome with sightseeing tips",
    "Find recent research papers on graph neural networks",
    "Compare the iPhone 15 and the Pixel 8 before I buy one",
    "Summarize this YouTube video about climate change",
)
TARGET_C_OVER_A = 0.5  # (c) / (a) per answer, reported, never asserted
ARM_A, ARM_A2, ARM_B, ARM_C = ("(a) unconstrained", "(a') unconstrained, engine's decoder", "(b) full head + mask",
                               "(c) tooltrie engine")
ARMS = (ARM_A, ARM_A2, ARM_B, ARM_C)


def clock() -> float:
    """Seconds, once the GPU's queued work is done (every arm's result is read on the host anyway)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


# -- key/value caches ----------------------------------------------------------------------------------------------

def _cache(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    from transformers import DynamicCache

    return DynamicCache(pairs)


def copy_cache(cache: Any, batch: int) -> Any:
    """A fresh copy of a one-row cache, repeated to ``batch`` rows."""
    return _cache([(layer.keys.repeat(batch, 1, 1, 1), layer.values.repeat(batch, 1, 1, 1)) for layer in cache.layers])


def select_rows(cache: Any, index: torch.Tensor) -> Any:
    return _cache([(layer.keys[index], layer.values[index]) for layer in cache.layers])


# -- (a) and (b): the Hugging Face-style loop ------------------------------------------------------------------------

@dataclass
class Loop:
    """What one run of the loop produced, per query in input order."""

    tokens: list[list[int]]
    forwards: list[int]  # forward passes each row took part in
    calls: int  # model calls for the whole batch
    errors: int = 0  # (b) slots that ended in ERROR


def hf_loop(model: Any, prefix: Any, prefix_len: int, suffixes: Sequence[Sequence[int]], *,
            lengths: Sequence[int] | None = None, artifact: Artifact | None = None, k: int = 1,
            pad_id: int = 0) -> Loop:
    """Greedy decoding from a copy of ``prefix``: exactly ``lengths[i]`` tokens per row by full-head argmax (a), or,
    with ``artifact``, the trie's choice from the full logits through the ``cpu`` backend until the slot is done (b).
    """
    batch = len(suffixes)
    width = max(len(s) for s in suffixes)
    device = model.device
    ids = torch.full((batch, width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((batch, prefix_len + width), dtype=torch.long, device=device)
    mask[:, :prefix_len] = 1
    for i, suffix in enumerate(suffixes):  # left-pad the query part: the last position is real in every row
        ids[i, width - len(suffix):] = torch.tensor(suffix, device=device)
        mask[i, prefix_len + width - len(suffix):] = 1
    cache = copy_cache(prefix, batch)
    state = BatchState.start(artifact, [k] * batch) if artifact is not None else None
    rows = list(range(batch))  # the query index of each active row
    tokens: list[list[int]] = [[] for _ in range(batch)]
    forwards = [0] * batch
    calls = 0
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)[:, prefix_len:]
    with torch.inference_mode():
        while True:
            if batch == 1:  # one row: no mask, positions from the cache, as a plain generate() would
                out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            else:
                out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                            use_cache=True, logits_to_keep=1)
            cache, calls = out.past_key_values, calls + 1
            logits = out.logits[:, -1]
            for row in rows:
                forwards[row] += 1
            if state is None:
                chosen = torch.argmax(logits, dim=-1).tolist()
            else:
                chosen = tooltrie_step(artifact, state, logits.cpu(), backend="cpu").tolist()
            for position, row in enumerate(rows):
                tokens[row].append(int(chosen[position]))
            if state is None:
                assert lengths is not None
                keep = [p for p, row in enumerate(rows) if len(tokens[row]) < lengths[row]]
            else:
                keep = [p for p in range(len(rows)) if state.status[p] == RUNNING]
            if not keep:
                break
            if len(keep) < len(rows):  # done rows leave the batch
                index = torch.tensor(keep, device=device)
                cache, mask = select_rows(cache, index), mask[index]
                if state is not None:
                    mapping = np.full(len(rows), -1)
                    mapping[keep] = np.arange(len(keep))
                    state.compact(mapping)
                rows = [rows[p] for p in keep]
                chosen = [chosen[p] for p in keep]
            ids = torch.tensor(chosen, dtype=torch.long, device=device).reshape(-1, 1)
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.long, device=device)], dim=1)
            positions = mask.sum(dim=1, keepdim=True) - 1
    errors = 0 if state is None else int((state.status != DONE).sum())
    return Loop(tokens=tokens, forwards=forwards, calls=calls, errors=errors)


def trie_decision_points(artifact: Artifact, k: int, tokens: Sequence[int]) -> int | None:
    """Positions along ``tokens`` where the trie offered more than one token (None if the path is illegal)."""
    slot = Slot.start(artifact.trie, k)
    points = 0
    for token in tokens:
        moves = legal_moves(artifact.trie, slot, artifact.eos_id)
        if token not in moves:
            return None
        points += len(moves) > 1
        slot = advance(artifact.trie, slot, moves[token])
    return points


# -- one configuration: k, batch ---------------------------------------------------------------------------------

@dataclass
class Config:
    k: int
    batch: int
    queries: list[int]  # indices into QUERIES
    groups: list[list[int]]  # the queries answered together, one group per turn
    answer_s: dict[str, list[float]] = field(default_factory=lambda: {arm: [] for arm in ARMS})  # per answer
    batch_s: dict[str, list[float]] = field(default_factory=lambda: {arm: [] for arm in ARMS})  # per group run
    forwards: dict[str, list[int]] = field(default_factory=lambda: {arm: [] for arm in ARMS})  # per answer
    calls: dict[str, list[int]] = field(default_factory=lambda: {arm: [] for arm in ARMS})  # model calls per group
    tokens: dict[str, dict[int, list[list[int]]]] = field(
        default_factory=lambda: {arm: {} for arm in ARMS})  # query -> token ids of every run
    decision_points: dict[str, list[int]] = field(default_factory=lambda: {ARM_B: [], ARM_C: []})
    speculated: list[int] = field(default_factory=list)  # (c)'s decisions taken without a pass, per answer
    b_errors: int = 0
    repeats_done: int = 0
    last_repeat_s: float = 0.0


class Counter:
    """Counts calls of a module (the decoder's final norm: every arm's forward passes end there)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls = 0
        module.register_forward_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        self.calls += 1


def make_arms(config: Config, group: list[int], *, model: Any, engine: Engine, artifact: Artifact, prefix: Any,
              prefix_len: int, suffix_ids: dict[int, list[int]], lengths: dict[int, int], counter: Counter
              ) -> dict[str, Arm]:
    k = config.k
    suffixes = [suffix_ids[q] for q in group]

    def record(arm: str, tokens: list[list[int]], forwards: list[int], calls: int) -> None:
        for q, ids, passes in zip(group, tokens, forwards, strict=True):
            config.tokens[arm].setdefault(q, []).append(ids)
            config.forwards[arm].append(passes)
        config.calls[arm].append(calls)

    def arm_a() -> None:
        loop = hf_loop(model, prefix, prefix_len, suffixes, lengths=[lengths[q] for q in group],
                       pad_id=artifact.eos_id)
        record(ARM_A, loop.tokens, loop.forwards, loop.calls)

    def arm_b() -> None:
        loop = hf_loop(model, prefix, prefix_len, suffixes, artifact=artifact, k=k, pad_id=artifact.eos_id)
        record(ARM_B, loop.tokens, loop.forwards, loop.calls)
        config.b_errors += loop.errors

    def arm_a2() -> None:
        engine.max_batch = len(group)
        before = counter.calls
        answers = engine.run([Request(QUERIES[q], k, constrained=False, max_new_tokens=lengths[q]) for q in group])
        record(ARM_A2, [a.token_ids for a in answers], [a.forward_passes for a in answers], counter.calls - before)

    def arm_c() -> None:
        engine.max_batch = len(group)
        before = counter.calls
        answers = engine.run([Request(QUERIES[q], k) for q in group])
        record(ARM_C, [a.token_ids for a in answers], [a.forward_passes for a in answers], counter.calls - before)
        config.decision_points[ARM_C] += [a.decision_points for a in answers]
        config.speculated += [a.speculated for a in answers]

    return {ARM_A: arm_a, ARM_A2: arm_a2, ARM_B: arm_b, ARM_C: arm_c}


def run_turn(config: Config, arms: dict[str, Arm], turn: int) -> None:
    """One turn: every arm once, the first arm rotating from turn to turn; the wall times go to the config."""
    names = list(arms)
    start = turn % len(names)
    rotated = {name: arms[name] for name in names[start:] + names[:start]}
    times = take_turns(rotated, repeats=1)
    for name, arm_times in times.items():
        wall = arm_times.samples["wall"][0]
        config.batch_s[name].append(wall)
        config.answer_s[name].append(wall / config.batch)


# -- report -------------------------------------------------------------------------------------------------------

def _ms(values: Sequence[float]) -> float | None:
    return median(values) * 1e3 if values else None


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize_config(config: Config, artifact: Artifact, tokenizer: TokenizerInfo) -> dict[str, Any]:
    out: dict[str, Any] = {"k": config.k, "batch": config.batch, "queries": [QUERIES[q] for q in config.queries],
                           "repeats_done": config.repeats_done, "arms": {}}
    for runs in config.tokens[ARM_B].values():
        for ids in runs:
            points = trie_decision_points(artifact, config.k, ids)
            config.decision_points[ARM_B].append(-1 if points is None else points)
    for arm in ARMS:
        out["arms"][arm] = {
            "answer_ms": summarize([s * 1e3 for s in config.answer_s[arm]]) if config.answer_s[arm] else None,
            "batch_ms": summarize([s * 1e3 for s in config.batch_s[arm]]) if config.batch_s[arm] else None,
            "forward_passes_per_answer": _mean(config.forwards[arm]),
            "model_calls_per_batch": _mean(config.calls[arm]),
            "tokens_per_answer": _mean([len(ids) for runs in config.tokens[arm].values() for ids in runs]),
            "decision_points_per_answer": _mean(config.decision_points.get(arm, [])),
        }
    a, a2, b, c = (out["arms"][arm]["answer_ms"] for arm in ARMS)
    out["ratios"] = {
        "c/a": c["median"] / a["median"] if a and c else None,
        "c/a'": c["median"] / a2["median"] if a2 and c else None,
        "c/b": c["median"] / b["median"] if b and c else None,
        "b/a": b["median"] / a["median"] if a and b else None,
    }
    mismatches = []
    for q in config.queries:
        b_runs, c_runs = config.tokens[ARM_B].get(q, []), config.tokens[ARM_C].get(q, [])
        for b_ids, c_ids in zip(b_runs, c_runs, strict=False):
            if b_ids != c_ids:
                mismatches.append({"query": QUERIES[q], "b": b_ids, "c": c_ids, "b_text": tokenizer.decode(b_ids),
                                   "c_text": tokenizer.decode(c_ids)})
        distinct = {tuple(ids) for ids in b_runs} | {tuple(ids) for ids in c_runs}
        if len(distinct) > 1 and not any(m["query"] == QUERIES[q] for m in mismatches):
            mismatches.append({"query": QUERIES[q], "runs_differ": [list(ids) for ids in distinct]})
    out["b_vs_c_mismatches"] = mismatches
    out["b_errors"] = config.b_errors
    c_passes = config.forwards[ARM_C]
    c_points = config.decision_points[ARM_C]
    out["c_passes_plus_speculated_equal_decision_points"] = all(
        p + s == d for p, s, d in zip(c_passes, config.speculated, c_points, strict=True)) if c_passes else None
    out["c_speculated_per_answer"] = _mean(config.speculated)
    out["answers"] = {QUERIES[q]: runs[0] for q, runs in config.tokens[ARM_C].items()}
    return out


def print_report(prefix_rows: list[dict[str, Any]], summaries: list[dict[str, Any]],
                 texts: dict[tuple[int, str], str]) -> None:
    print_table(prefix_rows, title="One-time prefix build (outside every timer)")
    rows = []
    for s in summaries:
        for arm in ARMS:
            a = s["arms"][arm]
            rows.append({
                "k": s["k"], "batch": s["batch"], "arm": arm,
                "ms/answer": a["answer_ms"]["median"] if a["answer_ms"] else None,
                "ms/batch": a["batch_ms"]["median"] if a["batch_ms"] and s["batch"] > 1 else None,
                "samples": len(a["batch_ms"]["samples"]) if a["batch_ms"] else 0,
                "tokens/ans": a["tokens_per_answer"],
                "fwd/ans": a["forward_passes_per_answer"],
                "dec pts/ans": a["decision_points_per_answer"],
                "calls/batch": a["model_calls_per_batch"] if s["batch"] > 1 else None,
            })
    print_table(rows, title="Decode cost per answer (median ms; batch 1: per query turn; batch 16: batch time / 16)")
    print_table([{
        "k": s["k"], "batch": s["batch"],
        "(c)/(a)": s["ratios"]["c/a"], "(c)/(a')": s["ratios"]["c/a'"], "(c)/(b)": s["ratios"]["c/b"],
        "(b)/(a)": s["ratios"]["b/a"],
        f"(c)/(a) <= {TARGET_C_OVER_A}": "-" if s["ratios"]["c/a"] is None else
        ("yes" if s["ratios"]["c/a"] <= TARGET_C_OVER_A else "NO"),
        "(c) fwd + spec == dec pts": s["c_passes_plus_speculated_equal_decision_points"],
        "(b) != (c)": len(s["b_vs_c_mismatches"]),
        "(b) errors": s["b_errors"],
    } for s in summaries], title="Ratios of medians, and checks")
    for s in summaries:
        for m in s["b_vs_c_mismatches"]:
            print(f"MISMATCH k={s['k']} batch={s['batch']}: {m}")
    print_table([{"k": k, "query": query, "answer (c)": text} for (k, query), text in sorted(texts.items())],
                title="Answers (engine, batch 16)")


# -- main ---------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", default="1,3", help="tools per answer (default 1,3)")
    parser.add_argument("--repeats", type=int, default=3, help="timed turns at batch 16 (default 3)")
    parser.add_argument("--batch1-queries", type=int, default=8,
                        help="queries answered one at a time at batch 1, spread over the list (default 8)")
    parser.add_argument("--batch1-repeats", type=int, default=2, help="timed turns per batch-1 query (default 2)")
    parser.add_argument("--budget-s", type=float, default=330.0,
                        help="seconds for the whole run: a repeat after the first is skipped when it would end "
                             "later (default 330)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch intra-op threads (default 1: with 2 on a shared 2-core machine, a busy core "
                             "stalls OpenMP and a loop now and then takes 40x longer)")
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu (default) or cuda")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--weights", choices=("default", "random"), default="default",
                        help="the default model's base weights, or its architecture with random weights")
    parser.add_argument("--out", default=str(RESULTS_DIR / "decode.json"), help="results file")
    args = parser.parse_args(argv)
    args.k_list = [int(part) for part in args.ks.split(",") if part.strip()]
    if args.repeats < 1 or args.batch1_repeats < 1 or not 1 <= args.batch1_queries <= len(QUERIES):
        parser.error(f"--repeats and --batch1-repeats must be >= 1, --batch1-queries 1..{len(QUERIES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    began = clock()
    load_average_start = machine_info()["load_average"]
    t0 = clock()
    dtype = getattr(torch, args.dtype)
    if args.weights == "random":
        model, model_name, tokenizer_name = random_default_model(dtype=dtype), "random weights", DEFAULT_TOKENIZER
    else:
        model, info = load_model(adapter=False, dtype=dtype)
        model_name, tokenizer_name = info.name, info.tokenizer
    model = model.to(args.device)
    load_s = clock() - t0
    tokenizer = TokenizerInfo.load(tokenizer_name)
    t0 = clock()
    artifact = compile_registry(load_registry(CATALOG_PATH), tokenizer, progress=False)
    compile_s = clock() - t0
    engine = Engine(model, tokenizer, artifact, max_batch=len(QUERIES))  # lowered per run: engine.max_batch
    counter = Counter(model.get_decoder().norm)  # the decoder's last module: once per forward pass, every arm
    everyone = list(range(len(QUERIES)))
    step_size = len(QUERIES) / args.batch1_queries
    batch1 = sorted({int(i * step_size) for i in range(args.batch1_queries)})

    prefix_rows, configs, texts = [], [], {}
    plans = []  # (config, arms per group)
    for k in args.k_list:
        # The prefix cache of (a)/(b), built as the engine builds its own: same text, ids and decoder call.
        prefix_text, suffix_text = engine.prompt_parts(k)
        t0 = clock()
        prefix_ids = tokenizer.encode(prefix_text)
        with torch.inference_mode():
            prefix = model.get_decoder()(input_ids=torch.tensor([prefix_ids], device=model.device),
                                         use_cache=True).past_key_values
        prefix_s = clock() - t0
        suffix_ids = {}
        for q in everyone:  # the prompt is tokenized whole, as the engine does; the prefix must be its start
            prompt_ids = tokenizer.encode(prefix_text + QUERIES[q] + suffix_text)
            if prompt_ids[: len(prefix_ids)] != prefix_ids:
                raise RuntimeError(f"query {QUERIES[q]!r} merges with the prompt's prefix; choose another")
            suffix_ids[q] = prompt_ids[len(prefix_ids):]
        # Warm-up and N: the engine answers every query once (batch 16), untimed; it builds its prefix here.
        engine.max_batch = len(QUERIES)
        t0 = clock()
        answers = engine.run([Request(QUERIES[q], k) for q in everyone])
        first_run_s = clock() - t0
        prefix_rows.append({"k": k, "prefix tokens": len(prefix_ids), "build s": prefix_s,
                            "engine first run s (incl. its build)": first_run_s})
        lengths = {q: len(a.token_ids) for q, a in zip(everyone, answers, strict=True)}
        for q, a in zip(everyone, answers, strict=True):
            texts[(k, QUERIES[q])] = f"{a.text!r} ({a.finish_reason})"
        prefix_rows[-1]["query tokens (median)"] = median([float(len(s)) for s in suffix_ids.values()])
        prefix_rows[-1]["answer tokens (median)"] = median([float(n) for n in lengths.values()])
        shared = {"model": model, "engine": engine, "artifact": artifact, "prefix": prefix,
                  "prefix_len": len(prefix_ids), "suffix_ids": suffix_ids, "lengths": lengths, "counter": counter}
        big = Config(k=k, batch=len(QUERIES), queries=everyone, groups=[everyone])
        one = Config(k=k, batch=1, queries=batch1, groups=[[q] for q in batch1])
        if k == args.k_list[0]:  # untimed warm-up of the loop and of the cpu backend (Numba)
            hf_loop(model, prefix, len(prefix_ids), [suffix_ids[0]], lengths=[2], pad_id=artifact.eos_id)
            hf_loop(model, prefix, len(prefix_ids), [suffix_ids[0], suffix_ids[1]], lengths=[2, 1],
                    pad_id=artifact.eos_id)
            tooltrie_step(artifact, BatchState.start(artifact, [k, k]), torch.zeros((2, model.config.vocab_size)),
                          backend="cpu")
        configs += [big, one]
        plans.append((big, args.repeats, [make_arms(big, g, **shared) for g in big.groups]))
        plans.append((one, args.batch1_repeats, [make_arms(one, g, **shared) for g in one.groups]))

    # Timed turns: every configuration's first repeat, then further repeats while they fit in the budget (a repeat
    # is expected to take as long as the configuration's previous one).
    deadline = began + args.budget_s
    turn = 0
    for repeat in range(max(args.repeats, args.batch1_repeats)):
        for config, repeats, groups in plans:
            if repeat >= repeats or (repeat > 0 and clock() + config.last_repeat_s > deadline):
                continue
            started = clock()
            for arms in groups:
                run_turn(config, arms, turn)
                turn += 1
            config.repeats_done += 1
            config.last_repeat_s = clock() - started
            print(f"  k={config.k} batch={config.batch} repeat {repeat + 1} done ({clock() - began:.0f} s)",
                  file=sys.stderr)

    summaries = [summarize_config(config, artifact, tokenizer) for config in configs]
    print_report(prefix_rows, summaries, texts)
    settings = {
        "model": model_name, "model_dtype": str(dtype), "tokenizer": tokenizer_name, "device": args.device,
        "gpu": torch.cuda.get_device_name() if model.device.type == "cuda" else None,
        "registry": "catalog", "n_tools": artifact.trie.n_tools, "ks": args.k_list,
        "batches": [len(QUERIES), 1], "queries": list(QUERIES), "batch1_queries": [QUERIES[q] for q in batch1],
        "repeats_batch16": args.repeats, "repeats_batch1": args.batch1_repeats, "budget_s": args.budget_s,
        "torch_threads": torch.get_num_threads(), "load_average_at_start": load_average_start,
        "prefix_cache": "built once outside the timers: by the engine in its untimed warm-up run (its shared-prefix "
                        "decoder stores the prefix's keys/values once, for every row and every k), and with the "
                        "same ids through the model's decoder for (a)/(b), whose Hugging Face cache every request "
                        "copies inside the timers",
        "arms": {
            ARM_A: "HF-style greedy loop, model(..., logits_to_keep=1) full [B, V] logits + torch.argmax, exactly "
                   "N tokens per query (N = the engine's answer length for that query)",
            ARM_A2: "Engine.run(requests with constrained=False, max_new_tokens=N): the engine's shared-prefix "
                    "decoder and the full head, plain greedy: separates what the decoder saves from what the "
                    "grammar saves",
            ARM_B: "same loop, full logits + tooltrie.kernels.step(backend='cpu') (trie mask + argmax), one "
                   "forward per token until the slot is done",
            ARM_C: "Engine.run(requests), max_batch = batch (sparse head, forced chains, prefix cache, "
                   "continuous batching)",
        },
        "batching": "(a)/(b): query parts left-padded, prefilled in one forward, done rows leave the batch; "
                    "(a')/(c): the engine's continuous batching (new rows prefilled together, packed; a done "
                    "row frees its cache slot)",
        "timing": "take_turns, first arm rotating per turn; batch 1: a turn is one query; batch 16: the batch",
        "warm_up": "one untimed engine run over all queries per k (also gives N)",
        "target_c_over_a_max": TARGET_C_OVER_A,
    }
    results = {
        "load_model_s": load_s, "compile_s": compile_s, "prefix_build": prefix_rows,
        "configs": summaries, "wall_s": clock() - began,
    }
    path = write_results("decode", settings=settings, results=results, out=args.out)
    print(f"\nwrote {path} ({clock() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
