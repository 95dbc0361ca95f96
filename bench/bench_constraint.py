"""The constraint's host time per step in a batch: accept each row's new token, then build the next mask.

For each registry (BFCL, 1,853 tools; a synthetic registry of 10,000 deterministic names, ``bench_compile``'s
``synthetic_names``) and batch size (1, 16, 64, 256), k tools per answer (default 3), bundled smollm2-135m tokenizer.

Rows are random legal walks recorded first with ``TrieMatcher`` (a uniformly random legal token at every step, until
the stop token), then replayed. Each row starts part-way into its first walk (a random number of its tokens accepted
before the timer), so the batch holds rows at every depth and phase, as a running engine's does. At each step every
row accepts the next token of its walk and the mask for the following token is built; a row whose walk ended (its
last step accepted the stop token and its mask was the stop token alone) is reset with its next walk before the
next step, outside the timer, and that step accepts nothing for it (a new request's first mask). The batch stays
full. Arms, on the same rows, taking turns:

- ``per-row reference``: ``TrieBatch(backend="reference")`` (``kernels/reference.py``: row by row through
  ``kernels/rules.py``, the per-row path that was the production path before the batch state) ``accept`` +
  ``fill_bitmask``;
- ``batch cpu``: ``TrieBatch(backend="cpu")`` (the compiled walk, one call per operation for the whole batch)
  ``accept`` + ``fill_bitmask`` into an int32 bitmask ``[B, ceil(V/32)]``;
- ``batch cpu + mask``: ``accept`` + ``mask_logits_`` on float32 CPU logits ``[B, V]`` (a torch tensor): the bitmask
  and -inf written over every illegal logit, what a vLLM adapter's ``apply`` does on CPU tensors;
- ``floor: fill -inf``: ``logits.fill_(-inf)`` on the same tensor: writing a whole ``[B, V]`` float32 mask, the
  memory-bandwidth floor under any mask applied to CPU logits (ours writes nearly every column);
- ``xgrammar``: one ``GrammarMatcher`` per row over ``exactly_k_ebnf(names, k)`` (XGrammar's grammar has no
  no-repeat: it allows a used tool again), its batched API: ``BatchGrammarMatcher.batch_accept_token`` +
  ``batch_fill_next_token_bitmask`` into its int32 bitmask (``--xgr-threads``, default its own "auto"); a reset row
  gets ``matcher.reset()``, and a row that has just accepted the stop token fills nothing (XGrammar refuses to).
  Its grammar is compiled once (minutes for 10,000 tools) and kept, serialized, under ``build/bench-constraint``;
- ``vllm v1 apply``: when vLLM is importable, the V1 adapter ``TrieVllmProcessorV1`` driven through vLLM's own
  ``BatchUpdate`` (rows added with ``SamplingParams(extra_args=request_args(path, k))`` and vLLM's live output-token
  lists, a reset row re-added at its index), CPU tensors; timed: ``apply(logits)`` alone (the new tokens are read from
  the lists vLLM appends to; ``update_state`` runs outside the timer). On a CPU it returns a buffer that holds -inf
  between steps and gets only the legal logits (``kernels.cpu.LegalLogits``), so it can beat the fill floor.

Before the timed turns, an untimed pass over the same steps checks that the arms agree: the cpu and reference
bitmasks are identical at every step, XGrammar's allowed set contains ours at every step (it allows more: repeats and
other tokenizations of the same text), and the finite logits left by ``mask_logits_`` and returned by the vLLM
adapter are exactly the bitmask's tokens, with the logits' values. Disagreement is recorded in the results
(``agreement``) and printed.

Statistics: per step (µs), the median and p90 over every step of every timed repeat, and the median over steps of
each step's minimum over the repeats ("min of repeats", which filters out other processes' preemption). Logits are
not refreshed between steps (a mask's cost does not depend on the values it overwrites). Torch runs with
``--torch-threads`` intra-op threads (default 1, as our walk is single-threaded). The targets are reported, never
asserted.

    python bench/bench_constraint.py [--batches 1,16,64,256] [--steps 32] [--repeats 5]
    build/vllm-env/bin/python bench/bench_constraint.py    # with the vLLM arm
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from _common import REPO_DIR, RESULTS_DIR, Arm, StopArm, median, percentile, print_table, take_turns, write_results
from bench_compile import hf_tokenizer, synthetic_names

from tooltrie.compiler import Artifact, Contract, TokenizerInfo, compile_registry
from tooltrie.compiler.ebnf import exactly_k_ebnf
from tooltrie.kernels import TrieBatch, TrieMatcher
from tooltrie.kernels.bitmask import get_bitmask_shape
from tooltrie.registry import BFCL_PATH, load_registry, make_registry

ARM_REF, ARM_CPU, ARM_MASK, ARM_FLOOR = "per-row reference", "batch cpu", "batch cpu + mask", "floor: fill -inf"
ARM_XGR, ARM_VLLM = "xgrammar", "vllm v1 apply"
TARGETS = {
    "batch_cpu_at_256_max_us": 1000.0,  # batch cpu (accept + fill_bitmask) per-step median at batch 256
    "xgrammar_over_batch_cpu_at_256_min": 5.0,  # xgrammar / batch cpu per-step medians at batch 256
    "vllm_apply_at_256_max_us": 2000.0,  # vllm v1 apply per-step median at batch 256
}
US = 1e6
clock = time.perf_counter
XGR_CACHE_DIR = REPO_DIR / "build" / "bench-constraint"


# -- rows -----------------------------------------------------------------------------------------------------------

@dataclass
class Rows:
    """What every arm replays: per row, the tokens accepted before the timer, then per step its token (-1: the row
    was reset before this step and accepts nothing)."""

    warm: list[list[int]]  # [row][...] accepted outside the timer, after the row is added
    events: np.ndarray  # int32 [rows, steps]
    walks: int  # walks recorded
    walk_steps: list[int]  # steps of each walk (its stop token included)

    def tokens(self, step: int, batch: int) -> list[list[int]]:
        return [[int(e)] if e >= 0 else [] for e in self.events[:batch, step]]

    def resets(self, step: int, batch: int) -> list[int]:
        return np.flatnonzero(self.events[:batch, step] < 0).tolist()


def random_walk(artifact: Artifact, k: int, rng: np.random.Generator) -> list[int]:
    """An answer the trie allows, a uniformly random legal token at every step (stop token included)."""
    matcher, tokens = TrieMatcher(artifact, k), []
    while not matcher.is_terminated():
        legal = matcher.legal_tokens()
        if not legal:
            raise RuntimeError(f"a walk reached a state with no legal token after {tokens}")
        tokens.append(int(legal[rng.integers(len(legal))]))
        if not matcher.accept_token(tokens[-1]):
            raise RuntimeError(f"the matcher refused its own legal token {tokens[-1]}")
    return tokens


def make_rows(artifact: Artifact, k: int, n_rows: int, steps: int, seed: int) -> Rows:
    rng = np.random.default_rng(seed)
    warm, events = [], np.full((n_rows, steps), -1, dtype=np.int32)
    lengths = []
    for row in range(n_rows):
        walk = random_walk(artifact, k, rng)
        lengths.append(len(walk))
        start = int(rng.integers(len(walk)))  # the row starts part-way into its first walk
        warm.append(walk[:start])
        stream = walk[start:]
        while len(stream) < steps:
            walk = random_walk(artifact, k, rng)
            lengths.append(len(walk))
            stream += [-1, *walk]  # -1: reset, then the next walk's first token at the step after
        events[row] = stream[:steps]
    return Rows(warm, events, len(lengths), lengths)


# -- arms -----------------------------------------------------------------------------------------------------------

@dataclass
class Setup:
    artifact: Artifact
    artifact_path: str
    k: int
    vocab: int
    rows: Rows
    xgr_compiled: Any  # None when XGrammar is not measured
    logits: Any  # torch float32 [max batch, V], shared by the arms that write masks (values never matter)


def new_batch(setup: Setup, backend: str, batch: int) -> TrieBatch:
    """A batch state with ``batch`` rows at their starting positions (outside the timer)."""
    state = TrieBatch(setup.artifact, backend=backend, capacity=batch)
    for row in range(batch):
        state.add(row, setup.k)
    state.accept(setup.rows.warm[:batch])
    return state


def reset_rows(state: TrieBatch, setup: Setup, rows: list[int]) -> None:
    for row in rows:
        state.add(row, setup.k)  # add over a finished row starts it afresh


def arm_trie_batch(setup: Setup, backend: str, batch: int, steps: int, *, mask: bool, out: list[list[float]],
                   accepts: list[list[float]]) -> Arm:
    """``TrieBatch`` accept + ``fill_bitmask`` (or + ``mask_logits_`` on the shared logits); the accept's part of
    each step goes to ``accepts``."""
    bitmask = np.empty(get_bitmask_shape(batch, setup.vocab), dtype=np.int32)
    logits = setup.logits[:batch]
    # Each step's tokens as an engine holds them after sampling: an int32 array, and how many each row takes (a row
    # reset before the step takes none).
    plan = [(*token_array(setup.rows.tokens(t, batch)), setup.rows.resets(t, batch)) for t in range(steps)]

    def run() -> None:
        state = new_batch(setup, backend, batch)
        times, accepted = [], []
        for tokens, lengths, resets in plan:
            reset_rows(state, setup, resets)
            began = clock()
            state.accept(tokens, lengths=lengths)
            middle = clock()
            if mask:
                state.mask_logits_(logits)
            else:
                state.fill_bitmask(bitmask)
            times.append((clock() - began) * US)
            accepted.append((middle - began) * US)
        out.append(times)
        accepts.append(accepted)
    return run


def token_array(tokens: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged per-row tokens as an int32 array ``[B, T]`` and each row's count."""
    lengths = np.array([len(row) for row in tokens], dtype=np.int32)
    array = np.zeros((len(tokens), max(1, int(lengths.max(initial=0)))), dtype=np.int32)
    for i, row in enumerate(tokens):
        array[i, : len(row)] = row
    return array, lengths


def arm_floor(setup: Setup, batch: int, steps: int, out: list[list[float]]) -> Arm:
    logits = setup.logits[:batch]

    def run() -> None:
        times = []
        for _ in range(steps):
            began = clock()
            logits.fill_(-float("inf"))
            times.append((clock() - began) * US)
        out.append(times)
    return run


class XgrRows:
    """One XGrammar ``GrammarMatcher`` per row, at the rows' starting positions."""

    def __init__(self, setup: Setup, batch: int, threads: int | str) -> None:
        import xgrammar as xgr

        self.matchers = [xgr.GrammarMatcher(setup.xgr_compiled) for _ in range(batch)]
        self.batched = xgr.BatchGrammarMatcher(threads)
        for matcher, warm in zip(self.matchers, setup.rows.warm[:batch], strict=True):
            for token in warm:
                if not matcher.accept_token(token):
                    raise StopArm(f"XGrammar refused a walk's token {token}")

    def plan(self, events: np.ndarray, eos_id: int) -> tuple[list[Any], list[int], list[Any], list[int]]:
        """One step's arguments, outside the timer: the matchers that accept a token and their tokens, then the
        matchers that fill and their bitmask rows. A matcher that has just accepted the stop token fills nothing
        (XGrammar refuses to; an engine finishes the request there)."""
        live = np.flatnonzero(events >= 0).tolist()
        filling = np.flatnonzero(events != eos_id).tolist()
        return ([self.matchers[i] for i in live], [int(events[i]) for i in live],
                [self.matchers[i] for i in filling], filling)

    def step(self, plan: tuple[list[Any], list[int], list[Any], list[int]], bitmask: Any) -> list[bool]:
        import xgrammar as xgr

        accepting, tokens, filling, indices = plan
        accepted = xgr.BatchGrammarMatcher.batch_accept_token(accepting, tokens)
        self.batched.batch_fill_next_token_bitmask(filling, bitmask, indices)
        return accepted


def arm_xgrammar(setup: Setup, batch: int, steps: int, threads: int | str, out: list[list[float]]) -> Arm:
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(batch, setup.vocab)

    def run() -> None:
        rows = XgrRows(setup, batch, threads)
        times = []
        for t in range(steps):
            events = setup.rows.events[:batch, t]
            for row in np.flatnonzero(events < 0).tolist():
                rows.matchers[row].reset()
            plan = rows.plan(events, setup.artifact.eos_id)
            began = clock()
            accepted = rows.step(plan, bitmask)
            times.append((clock() - began) * US)
            if not all(accepted):
                raise StopArm(f"XGrammar refused a walk's token at step {t}")
        out.append(times)
    return run


class VllmRows:
    """The V1 adapter driven through vLLM's ``BatchUpdate``, with vLLM's live output-token lists."""

    def __init__(self, setup: Setup, batch: int) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.v1.sample.logits_processor import BatchUpdate

        from tooltrie.integrations.vllm import TrieVllmProcessorV1, request_args

        self.BatchUpdate, self.batch = BatchUpdate, batch
        self.params = SamplingParams(temperature=0.0, extra_args=request_args(setup.artifact_path, setup.k))
        self.processor = TrieVllmProcessorV1(None, torch.device("cpu"), False)
        self.outputs: list[list[int]] = [list(warm) for warm in setup.rows.warm[:batch]]
        self.processor.update_state(BatchUpdate(batch_size=batch, removed=[], moved=[], added=[
            (row, self.params, [1, 2, 3], self.outputs[row]) for row in range(batch)]))

    def prepare(self, events: np.ndarray) -> None:
        """Before a step (outside the timer): vLLM appends each row's sampled token to its list; a finished row's
        request is replaced by a new one at its index."""
        added = []
        for row, event in enumerate(events.tolist()):
            if event < 0:
                self.outputs[row] = []
                added.append((row, self.params, [1, 2, 3], self.outputs[row]))
            else:
                self.outputs[row].append(event)
        self.processor.update_state(self.BatchUpdate(batch_size=self.batch, removed=[], moved=[], added=added)
                                    if added else None)


def arm_vllm(setup: Setup, batch: int, steps: int, out: list[list[float]]) -> Arm:
    logits = setup.logits[:batch]

    def run() -> None:
        rows = VllmRows(setup, batch)
        times = []
        for t in range(steps):
            rows.prepare(setup.rows.events[:batch, t])
            began = clock()
            rows.processor.apply(logits)
            times.append((clock() - began) * US)
        out.append(times)
    return run


# -- agreement (untimed) ------------------------------------------------------------------------------------------

def allowed_sets(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """bool [rows, V]: the bitmask's allowed tokens."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab].astype(bool)


def check_agreement(setup: Setup, batch: int, steps: int, *, xgr_threads: int | str, with_vllm: bool
                    ) -> dict[str, Any]:
    """Every arm over the same steps, untimed: the masks they build, compared step by step."""
    import torch

    shape = get_bitmask_shape(batch, setup.vocab)
    cpu, reference = new_batch(setup, "cpu", batch), new_batch(setup, "reference", batch)
    masked = new_batch(setup, "cpu", batch)
    cpu_bits, ref_bits = np.empty(shape, np.int32), np.empty(shape, np.int32)
    xgr_rows = XgrRows(setup, batch, xgr_threads) if setup.xgr_compiled is not None else None
    xgr_bits = torch.zeros(shape, dtype=torch.int32)
    vllm = VllmRows(setup, batch) if with_vllm else None
    generator = torch.Generator().manual_seed(batch)
    report: dict[str, Any] = {"steps": steps, "cpu_equals_reference": 0, "mask_logits_equals_bitmask": 0,
                              "xgrammar_contains_ours": 0 if xgr_rows else None,
                              "vllm_apply_equals_bitmask": 0 if vllm else None, "disagreements": [],
                              "xgrammar_extra_allowed_per_row": [] if xgr_rows else None}

    def disagree(what: str, step: int, rows: np.ndarray) -> None:
        if len(report["disagreements"]) < 20:
            report["disagreements"].append({"what": what, "step": step, "rows": rows.tolist()[:8]})

    for t in range(steps):
        tokens, resets = setup.rows.tokens(t, batch), setup.rows.resets(t, batch)
        for state in (cpu, reference, masked):
            reset_rows(state, setup, resets)
            state.accept(tokens)
        cpu.fill_bitmask(cpu_bits)
        reference.fill_bitmask(ref_bits)
        ours = allowed_sets(cpu_bits, setup.vocab)
        same = (cpu_bits == ref_bits).all(axis=1)
        report["cpu_equals_reference"] += int(same.all())
        if not same.all():
            disagree("cpu != reference", t, np.flatnonzero(~same))
        logits = torch.randn((batch, setup.vocab), generator=generator)
        masked.mask_logits_(logits)
        finite = torch.isfinite(logits).numpy()
        exact = (finite == ours).all(axis=1)
        report["mask_logits_equals_bitmask"] += int(exact.all())
        if not exact.all():
            disagree("mask_logits_ != bitmask", t, np.flatnonzero(~exact))
        if xgr_rows is not None:
            events = setup.rows.events[:batch, t]
            for row in np.flatnonzero(events < 0).tolist():
                xgr_rows.matchers[row].reset()
            plan = xgr_rows.plan(events, setup.artifact.eos_id)
            accepted = xgr_rows.step(plan, xgr_bits)
            if not all(accepted):
                disagree("xgrammar refused a walk's token", t, np.flatnonzero(events >= 0)[~np.asarray(accepted)])
            theirs = allowed_sets(xgr_bits.numpy(), setup.vocab)
            filled = np.zeros(batch, dtype=bool)
            filled[plan[3]] = True  # rows that just accepted the stop token have no XGrammar mask
            contains = ~(ours & ~theirs).any(axis=1) | ~filled
            report["xgrammar_contains_ours"] += int(contains.all())
            if not contains.all():
                disagree("xgrammar does not allow one of our tokens", t, np.flatnonzero(~contains))
            if filled.any():
                report["xgrammar_extra_allowed_per_row"].append(float((theirs & ~ours)[filled].sum(axis=1).mean()))
        if vllm is not None:
            vllm.prepare(setup.rows.events[:batch, t])
            logits = torch.randn((batch, setup.vocab), generator=generator)
            returned = vllm.processor.apply(logits.clone())
            legal = torch.from_numpy(ours)
            exact = (torch.isfinite(returned).numpy() == ours).all(axis=1) & (
                torch.where(legal, returned, 0) == torch.where(legal, logits, 0)).all(dim=1).numpy()
            report["vllm_apply_equals_bitmask"] += int(exact.all())
            if not exact.all():
                disagree("vllm apply != bitmask", t, np.flatnonzero(~exact))
    extra = report["xgrammar_extra_allowed_per_row"]
    if extra is not None:
        report["xgrammar_extra_allowed_per_row"] = {"mean": float(np.mean(extra)), "max": float(np.max(extra))}
    report["agree"] = not report["disagreements"]
    return report


# -- the benchmark --------------------------------------------------------------------------------------------------

def stats(calls: list[list[float]]) -> dict[str, Any] | None:
    timed = calls[1:]  # the first call is the warm-up
    values = [v for call in timed for v in call]
    if not values:
        return None
    minima = np.min(np.asarray(timed), axis=0).tolist() if len({len(c) for c in timed}) == 1 else None
    return {"median": median(values), "p90": percentile(values, 90), "mean": sum(values) / len(values),
            "min": min(values), "n": len(values),
            "min_of_repeats_median": median(minima) if minima else None}


def vllm_available() -> str | None:
    """None when the vLLM arm can run, else why not."""
    try:
        import vllm.v1.sample.logits_processor  # noqa: F401

        import tooltrie.integrations.vllm  # noqa: F401
    except Exception as error:  # vLLM is optional (CUDA-only wheels); any import failure skips the arm
        return f"vLLM not importable ({type(error).__name__}: {str(error)[:120]})"
    return None


def xgrammar_grammar(info: Any, ebnf: str, tokenizer: str, cache_dir: Path | None) -> tuple[Any, float | None]:
    """XGrammar's compiled grammar and its compile time (None when it came from ``cache_dir``). Compiling the
    10,000-tool grammar takes minutes, and only the matchers are measured here, so the compiled grammar is kept
    (serialized) under ``build/`` between runs, keyed by the EBNF, the tokenizer and XGrammar's version."""
    import xgrammar as xgr

    key = hashlib.sha256(f"{tokenizer}\n{importlib.metadata.version('xgrammar')}\n{ebnf}".encode()).hexdigest()[:24]
    path = cache_dir / f"{key}.json" if cache_dir is not None else None
    if path is not None and path.exists():
        return xgr.CompiledGrammar.deserialize_json(path.read_text(encoding="utf-8"), info), None
    began = clock()
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_grammar(ebnf)
    spent = clock() - began
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(compiled.serialize_json())
        os.replace(tmp, path)
    return compiled, spent


def load_case(name: str, size: int, seed: int) -> tuple[str, Any]:
    if name == "bfcl":
        return "bfcl", load_registry(BFCL_PATH)
    names = synthetic_names(size, seed)
    return f"synthetic-{size}", make_registry([{"name": n} for n in names], name=f"synthetic-{size}")


def bench_registry(args: argparse.Namespace, name: str, tokenizer: TokenizerInfo, xgr_info: Any, workdir: Path,
                   vllm_why: str | None) -> list[dict[str, Any]]:
    import torch

    label, registry = load_case(name, args.synthetic_size, args.seed)
    began = clock()
    artifact = compile_registry(registry, tokenizer, Contract(), progress=False)
    compile_s = clock() - began
    path = str(artifact.save(workdir / f"{label}.trie.safetensors"))
    n_rows = max(args.batch_list)
    rows = make_rows(artifact, args.k, n_rows, args.steps, args.seed)
    xgr_compiled, xgr_s, xgr_status = None, None, "ok"
    if args.skip_xgrammar:
        xgr_status = "skipped (--skip-xgrammar)"
    else:
        xgr_compiled, xgr_s = xgrammar_grammar(xgr_info, exactly_k_ebnf(registry.names, args.k, artifact.contract),
                                               args.tokenizer, None if args.no_xgr_cache else XGR_CACHE_DIR)
    vocab = tokenizer.vocab_size
    logits = torch.randn((n_rows, vocab), generator=torch.Generator().manual_seed(args.seed))
    setup = Setup(artifact, path, args.k, vocab, rows, xgr_compiled, logits)
    print(f"\n[{label}: {len(registry.names):,} tools, k = {args.k}; compiled in {compile_s:.1f} s, XGrammar "
          f"{'-' if xgr_s is None else f'{xgr_s:.1f} s'}; {rows.walks} walks, "
          f"{np.mean(rows.walk_steps):.1f} steps each on average]", flush=True)
    configs = []
    for batch in args.batch_list:
        began = clock()
        agreement = check_agreement(setup, batch, args.steps, xgr_threads=args.xgr_threads,
                                    with_vllm=vllm_why is None and not args.skip_vllm)
        samples: dict[str, list[list[float]]] = {n: [] for n in (ARM_REF, ARM_CPU, ARM_MASK, ARM_FLOOR, ARM_XGR,
                                                                   ARM_VLLM)}
        accepts: dict[str, list[list[float]]] = {ARM_REF: [], ARM_CPU: [], ARM_MASK: []}
        arms: dict[str, Arm] = {
            ARM_CPU: arm_trie_batch(setup, "cpu", batch, args.steps, mask=False, out=samples[ARM_CPU],
                                    accepts=accepts[ARM_CPU]),
            ARM_MASK: arm_trie_batch(setup, "cpu", batch, args.steps, mask=True, out=samples[ARM_MASK],
                                     accepts=accepts[ARM_MASK]),
            ARM_FLOOR: arm_floor(setup, batch, args.steps, samples[ARM_FLOOR]),
        }
        if not args.skip_reference:
            arms[ARM_REF] = arm_trie_batch(setup, "reference", batch, args.steps, mask=False, out=samples[ARM_REF],
                                           accepts=accepts[ARM_REF])
        if xgr_compiled is not None:
            arms[ARM_XGR] = arm_xgrammar(setup, batch, args.steps, args.xgr_threads, samples[ARM_XGR])
        if vllm_why is None and not args.skip_vllm:
            arms[ARM_VLLM] = arm_vllm(setup, batch, args.steps, samples[ARM_VLLM])
        times = take_turns(arms, repeats=args.repeats, warmup=1)
        status = {ARM_REF: "skipped (--skip-reference)", ARM_XGR: xgr_status,
                  ARM_VLLM: "skipped (--skip-vllm)" if args.skip_vllm else vllm_why}
        record: dict[str, Any] = {}
        for arm, calls in samples.items():
            stopped = times[arm].stopped if arm in times else None
            record[arm] = {"status": "ok" if arm in arms and not stopped else (
                f"stopped: {stopped}" if stopped else status.get(arm) or "not run"),
                "step_us": stats(calls) if arm in arms and not stopped else None}
            if arm in accepts and arm in arms and not stopped:
                record[arm]["accept_us"] = stats(accepts[arm])  # the accept's part of each step
        config = {"registry": label, "n_tools": len(registry.names), "k": args.k, "batch": batch,
                  "arms": record, "agreement": agreement, "ratios": ratios(record),
                  "tooltrie_compile_s": compile_s, "xgrammar_compile_s": xgr_s,
                  "walks": {"recorded": rows.walks, "mean_steps": float(np.mean(rows.walk_steps)),
                            "resets_in_steps": int((rows.events[:batch] < 0).sum())}}
        configs.append(config)
        print(f"  batch {batch}: {len(arms)} arms x {args.repeats} repeats (+1 warm-up) of {args.steps} steps, "
              f"checked and timed in {clock() - began:.1f} s; arms agree: {agreement['agree']}", flush=True)
    return configs


def _median(record: dict[str, Any], arm: str) -> float | None:
    step = record.get(arm, {}).get("step_us")
    return step["median"] if step else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(record: dict[str, Any]) -> dict[str, float | None]:
    cpu, mask = _median(record, ARM_CPU), _median(record, ARM_MASK)
    return {
        "per-row reference / batch cpu": _ratio(_median(record, ARM_REF), cpu),
        "xgrammar / batch cpu": _ratio(_median(record, ARM_XGR), cpu),
        "batch cpu + mask / batch cpu": _ratio(mask, cpu),
        "floor / batch cpu + mask": _ratio(_median(record, ARM_FLOOR), mask),
        "vllm v1 apply / batch cpu + mask": _ratio(_median(record, ARM_VLLM), mask),
    }


def evaluate_targets(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    top = max(c["batch"] for c in configs)
    at_top = [c for c in configs if c["batch"] == top]

    def check(name: str, value_of: Any, limit: float, *, at_least: bool) -> dict[str, Any]:
        values = {c["registry"]: value_of(c) for c in at_top}
        measured = [v for v in values.values() if v is not None]
        worst = (min(measured) if at_least else max(measured)) if measured else None
        met = None if worst is None else (worst >= limit if at_least else worst <= limit)
        return {"target": name, "batch": top, "worst": worst, "limit": limit, "met": met, "values": values,
                "not_measured": [r for r, v in values.items() if v is None]}

    return [
        check(f"batch cpu (accept + fill_bitmask) <= 1 ms per step at batch {top}",
              lambda c: _median(c["arms"], ARM_CPU), TARGETS["batch_cpu_at_256_max_us"], at_least=False),
        check(f"xgrammar batched / batch cpu >= 5x at batch {top}",
              lambda c: c["ratios"]["xgrammar / batch cpu"], TARGETS["xgrammar_over_batch_cpu_at_256_min"],
              at_least=True),
        check(f"vLLM V1 apply() <= 2 ms per step at batch {top}",
              lambda c: _median(c["arms"], ARM_VLLM), TARGETS["vllm_apply_at_256_max_us"], at_least=False),
    ]


def print_report(configs: list[dict[str, Any]], targets: list[dict[str, Any]]) -> None:
    rows = []
    for c in configs:
        cpu = _median(c["arms"], ARM_CPU)
        for arm, record in c["arms"].items():
            step = record["step_us"]
            rows.append({"registry": c["registry"], "batch": c["batch"], "arm": arm,
                         "med us": step["median"] if step else None, "p90 us": step["p90"] if step else None,
                         "min-rep us": step["min_of_repeats_median"] if step else None,
                         "accept us": record["accept_us"]["median"] if record.get("accept_us") else None,
                         "us/row": step["median"] / c["batch"] if step else None,
                         "x batch cpu": f"{step['median'] / cpu:.1f}x" if step and cpu else None,
                         "status": record["status"][:60]})
    print_table(rows, title="Constraint host time per step: accept every row's token + build the mask (µs; med/p90 "
                            "over every step of every repeat; min-rep: median over steps of each step's minimum "
                            "over repeats; accept: the median of the accept's part of a step)")
    print_table([{"registry": c["registry"], "batch": c["batch"], "steps": c["agreement"]["steps"],
                  "cpu == reference": c["agreement"]["cpu_equals_reference"],
                  "mask == bitmask": c["agreement"]["mask_logits_equals_bitmask"],
                  "xgrammar >= ours": c["agreement"]["xgrammar_contains_ours"],
                  "vllm == bitmask": c["agreement"]["vllm_apply_equals_bitmask"],
                  "agree": "yes" if c["agreement"]["agree"] else "NO"} for c in configs],
                title="Agreement (untimed pass; steps where every row agrees)")
    print_table([{"target": t["target"], "worst": None if t["worst"] is None else (
        f"{t['worst']:.1f}x" if "x at" in t["target"] else f"{t['worst']:,.0f} us"),
        "met": {True: "yes", False: "NO", None: "not run"}[t["met"]],
        "not measured": ", ".join(t["not_measured"]) or "-"} for t in targets],
        title="Targets (reported, not asserted)")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--registries", default="bfcl,synthetic", help="bfcl and/or synthetic (default both)")
    parser.add_argument("--synthetic-size", type=int, default=10_000, help="tools in the synthetic registry")
    parser.add_argument("--batches", default="1,16,64,256", help="batch sizes (default 1,16,64,256)")
    parser.add_argument("--k", type=int, default=3, help="tools per answer (default 3)")
    parser.add_argument("--steps", type=int, default=32, help="steps replayed per repeat (default 32)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of every arm (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the walks and the synthetic names")
    parser.add_argument("--tokenizer", default="smollm2-135m", help="bundled tokenizer name or tokenizer.json path")
    parser.add_argument("--xgr-threads", default="auto",
                        help="BatchGrammarMatcher max_threads (default auto: its hardware_concurrency / 2)")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--skip-reference", action="store_true", help="leave the per-row reference arm out")
    parser.add_argument("--skip-xgrammar", action="store_true", help="leave XGrammar out")
    parser.add_argument("--skip-vllm", action="store_true", help="leave the vLLM adapter out")
    parser.add_argument("--no-xgr-cache", action="store_true",
                        help="compile XGrammar's grammar afresh (default: kept under build/bench-constraint)")
    parser.add_argument("--out", default=str(RESULTS_DIR / "constraint.json"), help="results file")
    args = parser.parse_args(argv)
    args.registry_list = [part.strip() for part in args.registries.split(",") if part.strip()]
    try:
        args.batch_list = [int(part) for part in args.batches.split(",") if part.strip()]
    except ValueError:
        parser.error(f"--batches: comma-separated integers, got {args.batches!r}")
    if not args.registry_list or not set(args.registry_list) <= {"bfcl", "synthetic"}:
        parser.error("--registries: choose from bfcl, synthetic")
    if not args.batch_list or min(args.batch_list) < 1 or args.k < 1 or args.steps < 1 or args.repeats < 1:
        parser.error("--batches, --k, --steps and --repeats must be at least 1")
    if args.synthetic_size < args.k:
        parser.error("--synthetic-size must be at least k")
    if args.xgr_threads != "auto":
        try:
            args.xgr_threads = int(args.xgr_threads)
        except ValueError:
            parser.error(f"--xgr-threads: 'auto' or an integer, got {args.xgr_threads!r}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import xgrammar as xgr

    torch.set_num_threads(args.torch_threads)
    began, load_at_start = clock(), list(os.getloadavg())
    tokenizer = TokenizerInfo.load(args.tokenizer)
    hf = hf_tokenizer(args.tokenizer, tokenizer.eos_token)
    xgr_info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tokenizer.vocab_size,
                                                  stop_token_ids=[tokenizer.eos_id])
    vllm_why = None if args.skip_vllm else vllm_available()
    configs = []
    with tempfile.TemporaryDirectory(prefix="bench-constraint-") as workdir:
        for name in args.registry_list:
            configs += bench_registry(args, name, tokenizer, xgr_info, Path(workdir), vllm_why)
    targets = evaluate_targets(configs)
    print_report(configs, targets)
    settings = {
        "registries": args.registry_list, "synthetic_size": args.synthetic_size, "batches": args.batch_list,
        "k": args.k, "steps": args.steps, "repeats": args.repeats, "seed": args.seed, "tokenizer": args.tokenizer,
        "vocab_size": tokenizer.vocab_size, "xgr_threads": args.xgr_threads, "torch_threads": args.torch_threads,
        "rows": "random legal walks (TrieMatcher, a uniformly random legal token per step), each row starting "
                "part-way into its first walk; a finished row is reset with its next walk before the next step "
                "(outside the timer), which accepts nothing for it",
        "timed": {ARM_REF: "TrieBatch(backend='reference').accept + fill_bitmask",
                  ARM_CPU: "TrieBatch(backend='cpu').accept + fill_bitmask (int32 [B, ceil(V/32)])",
                  ARM_MASK: "TrieBatch(backend='cpu').accept + mask_logits_ (torch float32 CPU [B, V])",
                  ARM_FLOOR: "logits.fill_(-inf) on the same torch float32 CPU [B, V]",
                  ARM_XGR: "BatchGrammarMatcher.batch_accept_token + batch_fill_next_token_bitmask, one "
                           "GrammarMatcher per row, exactly_k_ebnf(names, k) (no no-repeat)",
                  ARM_VLLM: "TrieVllmProcessorV1.apply(logits) (torch float32 CPU [B, V]); update_state and the "
                            "output lists' appends outside the timer"},
        "logits": "not refreshed between steps (a mask's cost does not depend on the values it overwrites)",
        "order": "arms take turns within each repeat, the first arm rotating; one untimed warm-up call per arm",
        "agreement": "an untimed pass over the same steps before the timed turns (see results.configs[].agreement)",
        "vllm": vllm_why or "importable",
        "xgrammar_compile": "xgrammar_compile_s is null where the compiled grammar was read from a cache under build/ "
                            "(not measured here; see bench_compile.py)",
        "targets": TARGETS,
        "load_average_at_start": load_at_start,  # 1, 5, 15 min; machine.load_average is taken when written
    }
    results = {"configs": configs, "targets": targets, "wall_s": clock() - began}
    path = write_results("constraint", settings=settings, results=results, out=args.out)
    print(f"\nwrote {path} ({clock() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
