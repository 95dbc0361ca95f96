"""Per-step decode cost on the CPU: tooltrie against the bitmask engines, on the same walks, taking turns.

A *walk* decodes one answer (batch 1) under tooltrie's CPU backend with seeded random logits ``[1, V]`` float32,
one fresh draw per step. The logits and the tokens our decoder picks are recorded, then every arm replays that
token sequence: each does its whole per-step work on the recorded logits (mask, select, advance) and then
advances by *our* token, so all arms take the same number of steps over the same tokens. Arms:

- ``tooltrie cpu``: ``tooltrie.kernels.step(artifact, state, logits, backend="cpu")`` (Numba; no-repeat on);
- ``cpu twin, no-repeat on`` / ``cpu twin, no-repeat off``: the library's ``choose_rows`` (``kernels/walk.py``:
  search + advance, no statistics, no forced run) called directly with inputs built once. "On" is the library's
  own compiled module; "off" is ``walk.variant(no_repeat=False)``, the same walk compiled with no-repeat switched
  off (a compile-time constant: no used-tools code at all; a used tool may be chosen again). Same wrapper, same
  walk otherwise: on/off - 1 is the cost of no-repeat. Where "off" chooses a used tool again it leaves the walk;
  it is put back on the walk's state after the timer (counted), so both take the same steps;
- ``cpu twin, no-repeat on (A/A)``: ``walk.variant(no_repeat=True)``, a second compilation of the "on" code,
  timed like the others: on/A/A - 1 is what the noise of the machine it runs on makes of two identical arms,
  the resolution of the on/off ratio;
- ``tooltrie reference``: the NumPy/Python oracle (``backend="reference"``), for context;
- ``TrieMatcher bitmask``: ``fill_next_token_bitmask`` + ``tooltrie.kernels.apply_token_bitmask_inplace``
  (NumPy) + argmax + ``accept_token``, the path for engines that want a bitmask;
- ``xgrammar``: ``GrammarMatcher.fill_next_token_bitmask`` + ``xgr.apply_token_bitmask_inplace`` (torch CPU
  tensor) + argmax + ``accept_token``, grammar ``exactly_k_ebnf(names, k)``;
- ``llguidance``: the same EBNF converted to Lark (``llguidance.grammar_from("gbnf", ...)``), ``LLMatcher``;
  ``llguidance.numpy`` fill + apply, argmax, ``consume_token``;
- ``outlines-core``: ``Index`` of the equivalent regex (k names joined by the escaped separator) over a
  ``Vocabulary`` built from the tokenizer's decoded tokens; ``outlines_core.kernels.numpy`` fill + apply,
  argmax, ``Guide.advance``. Its index is built in a subprocess under ``--build-timeout``. Its Guide has no
  transition on the stop token, so our last step (the stop) is mask + apply + argmax without an advance.

An untimed dry run feeds each walk's tokens to each bitmask matcher first; a walk a peer refuses is left out of
that peer's turns and recorded with the reason (outlines-core 0.2.14 offers only the stop token at an accepting
state of its index: regex ``a(cb)?`` allows nothing but the stop after ``a``, so ``help_me`` cannot be the last
tool of an answer when ``help`` is a tool too). The peers' own argmax often differs from our token (their masks
admit non-canonical tokenizations, and repeats); it is counted, and the walk's token is taken anyway.

Every peer's argmax is a NumPy argmax over the masked row (torch's CPU argmax over 49k floats is ~20x slower
than NumPy's; the argmax is not grammar work). Copying the recorded logits into the arm's buffer is outside the
timer; matchers are reset (ours: a fresh ``BatchState``) between walks, outside the timer. Torch runs with
``--torch-threads`` intra-op threads (default 1: a single request, like our single-threaded step).

Statistics: medians and p90 over every step of every walk and repeat; per answer, the sum of a walk's steps
(median over walks and repeats). Because other processes may share the machine, each arm also gets the sum of
each step's minimum over the repeats ("min of repeats"), which filters out preemption.

Rebuild-and-retry (catalog, k = 3): what a string-level engine does to enforce no-repeat with XGrammar: the
first tool under the precompiled one-tool grammar; after each tool, compile (no cache) the one-tool grammar of
the remaining names preceded by the separator, make a matcher, and go on. Each segment's tokens are the walk's
own; how the engine learns where a tool ends is ignored, so this is a lower bound on its cost. Reported per
answer, beside our per-answer latency (the sum of our steps).

The targets are reported, never asserted.

    python bench/bench_step.py [--repeats 7] [--walks 30] [--seed 0]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from _common import RESULTS_DIR, Arm, StopArm, median, percentile, print_table, take_turns, write_results
from bench_compile import hf_tokenizer

from tooltrie.compiler import Artifact, Contract, TokenizerInfo, compile_registry
from tooltrie.compiler.ebnf import exactly_k_ebnf
from tooltrie.kernels import TrieMatcher
from tooltrie.kernels import step as tooltrie_step
from tooltrie.kernels import walk as walk_module
from tooltrie.kernels.bitmask import allocate_token_bitmask
from tooltrie.kernels.bitmask import apply_token_bitmask_inplace as tooltrie_apply
from tooltrie.kernels.cpu import CpuBackend, no_rows
from tooltrie.kernels.state import DONE, RUNNING, BatchState
from tooltrie.registry import BFCL_PATH, CATALOG_PATH, load_registry

REGISTRIES = {"catalog": CATALOG_PATH, "bfcl": BFCL_PATH}
TARGETS = {
    "xgrammar_over_cpu_min": 20.0,  # XGrammar per-step median / tooltrie cpu per-step median, every config
    "outlines_over_cpu_min": 5.0,  # outlines-core / tooltrie cpu, every config where it was built
    "no_repeat_overhead_max": 0.10,  # per-answer twin on / twin off - 1, every config
}
ARM_CPU, ARM_ON, ARM_OFF, ARM_REF = "tooltrie cpu", "cpu twin, no-repeat on", "cpu twin, no-repeat off", \
    "tooltrie reference"
ARM_AA = "cpu twin, no-repeat on (A/A)"
ARM_MATCHER, ARM_XGR, ARM_LLG, ARM_OC = "TrieMatcher bitmask", "xgrammar", "llguidance", "outlines-core"
ARM_REBUILD = "xgrammar rebuild-and-retry"
PEERS = (ARM_XGR, ARM_LLG, ARM_OC)


# -- the no-repeat twins: compiled copies of kernels/walk.py, called the same way ---------------------------------

class Twin:
    """``choose_rows`` of one compiled copy of ``kernels/walk.py`` (the main module, or ``walk.variant``), called on
    one row as ``kernels/cpu.py``'s ``step`` calls it (identity vocabulary, no statistics, no forced run), with the
    inputs built once: every twin pays the same small wrapper, so their ratios are the walks' own."""

    def __init__(self, module: Any, artifact: Artifact, vocab: int) -> None:
        backend = CpuBackend(artifact)
        self.choose_rows = module.choose_rows
        self.trie, self.n_tools, self.eos_id = backend.trie, backend.n_tools, backend.eos_id
        self.rows, self.chosen = np.zeros(1, np.int32), np.empty(1, np.int32)
        self.ids = np.arange(vocab, dtype=np.int32)
        self.unwanted = (no_rows(3, dtype=np.float64), no_rows(3), no_rows(0), no_rows())
        self.unranked = module.no_ranker()

    def __call__(self, state: BatchState, logits: np.ndarray) -> int:
        self.choose_rows(self.trie, self.n_tools, self.eos_id, -1, state.table, state.counts, state.allowed,
                         self.rows, logits, None, logits.shape[1], self.ids, self.ids, self.chosen, *self.unwanted,
                         self.unranked)
        return int(self.chosen[0])


def twin_walks() -> dict[str, Any]:
    """The twins' compiled copies of the walk: "on" is the library's own module, "off" a variant without
    no-repeat, and the A/A arm a second compilation of the "on" code (``walk.variant(no_repeat=True)``)."""
    return {ARM_ON: walk_module, ARM_OFF: walk_module.variant(no_repeat=False),
            ARM_AA: walk_module.variant(no_repeat=True)}


# -- walks --------------------------------------------------------------------------------------------------------

@dataclass
class Walk:
    logits: list[np.ndarray]  # [1, V] float32 per step
    tokens: list[int]
    after: list[np.ndarray]  # the state's table after each step, where a twin that went elsewhere is put back
    constrained: list[bool]  # whether no-repeat can bite at this step (a tool is already used)
    tools: list[str]


def make_walks(artifact: Artifact, k: int, n_walks: int, vocab: int, seed: int, config: int) -> list[Walk]:
    walks = []
    for w in range(n_walks):
        rng = np.random.default_rng([seed, config, w])
        state = BatchState.start(artifact, [k])
        walk = Walk([], [], [], [], [])
        while state.status[0] == RUNNING:
            used_tools = int(state.emitted[0]) > 0
            logits = rng.standard_normal((1, vocab), dtype=np.float32)
            token = int(tooltrie_step(artifact, state, logits, backend="cpu")[0])
            walk.logits.append(logits)
            walk.tokens.append(token)
            walk.after.append(state.table.copy())
            walk.constrained.append(used_tools)
        if state.status[0] != DONE:
            raise RuntimeError(f"walk {w} ended in status {int(state.status[0])}")
        walk.tools = [artifact.registry.tools[t].name for t in state.tools(0)]
        if len(set(walk.tools)) != k:
            raise RuntimeError(f"walk {w} repeats a tool: {walk.tools}")
        walks.append(walk)
    return walks


# -- arms ---------------------------------------------------------------------------------------------------------

@dataclass
class Samples:
    """One arm's per-step samples (µs) and per-answer sums, per timed call (the warm-up call is dropped)."""

    calls: list[dict[str, list[float]]] = field(default_factory=list)
    argmax_differs: int = 0  # steps where the arm's own choice was not our token (last call)
    build_s: float | None = None
    status: str = "ok"
    refused: list[dict[str, Any]] = field(default_factory=list)  # walks the arm cannot replay (left out)
    walk_steps: list[int] | None = None  # steps of the walks it replays, when some were left out

    def new_call(self) -> dict[str, list[float]]:
        self.calls.append({})
        self.argmax_differs = 0
        return self.calls[-1]

    def values(self, key: str) -> list[float]:
        return [v for call in self.calls[1:] for v in call.get(key, [])]

    def position_minima(self, key: str) -> np.ndarray | None:
        """Each sample position's minimum over the timed calls (same walks, same steps each call): the cost with
        the background load filtered out; None when calls differ in length (an arm that stopped)."""
        rows = [call.get(key, []) for call in self.calls[1:]]
        if not rows or not rows[0] or len({len(row) for row in rows}) != 1:
            return None
        return np.min(np.asarray(rows), axis=0)


US = 1e6
clock = time.perf_counter


def arm_backend(backend: str, artifact: Artifact, k: int, walks: list[Walk], out: Samples) -> Arm:
    """A tooltrie backend (``cpu`` or ``reference``) stepping through the walks."""
    def run() -> None:
        call = out.new_call()
        steps, answers = call.setdefault("step", []), call.setdefault("answer", [])
        for walk in walks:
            state = BatchState.start(artifact, [k])
            total = 0.0
            for logits, expected in zip(walk.logits, walk.tokens, strict=True):
                began = clock()
                token = tooltrie_step(artifact, state, logits, backend=backend)[0]
                spent = clock() - began
                steps.append(spent * US)
                total += spent
                if token != expected:
                    raise StopArm(f"picked {token}, the walk has {expected}")
            answers.append(total * US)
    return run


def arm_twin(twin: Twin, artifact: Artifact, k: int, walks: list[Walk], out: Samples, must_match: bool) -> Arm:
    """A twin choosing (search + advance) at every step of the walks. One that reaches another state than the walk
    (the "off" twin choosing a used tool again) is put back on the walk's state after the timer, so every twin takes
    the same steps; "on" twins must never need it."""
    def run() -> None:
        call = out.new_call()
        steps, answers = call.setdefault("step", []), call.setdefault("answer", [])
        late = call.setdefault("step_with_used_tools", [])
        for walk in walks:
            state = BatchState.start(artifact, [k])
            total = 0.0
            for logits, expected, after, constrained in zip(walk.logits, walk.tokens, walk.after, walk.constrained,
                                                            strict=True):
                began = clock()
                token = twin(state, logits)
                spent = clock() - began
                steps.append(spent * US)
                if constrained:
                    late.append(spent * US)
                total += spent
                if not np.array_equal(state.table, after):
                    if must_match:
                        raise StopArm(f"chose {token}, the walk has {expected}")
                    out.argmax_differs += 1
                    state.table[:] = after
            answers.append(total * US)
    return run


def _bitmask_arm(walks: list[Walk], out: Samples, buffer: np.ndarray, reset: Callable[[], None],
                 fill: Callable[[], object], apply: Callable[[], object], advance: Callable[[int], object],
                 last_no_advance: bool = False) -> Arm:
    """The common replay loop of the bitmask arms: fill, apply + argmax, advance by our token; ``buffer`` is
    the NumPy view of the logits the arm masks in place.

    An untimed dry run first feeds every walk's tokens to the matcher; a walk it refuses is left out of its
    turns and recorded in ``out.refused`` (a peer whose grammar does not accept one of our answers)."""
    row = buffer[0]
    kept = []
    for w, walk in enumerate(walks):
        reset()
        for i, token in enumerate(walk.tokens):
            if last_no_advance and i == len(walk.tokens) - 1:
                kept.append(walk)
                break
            try:
                ok = advance(token)
            except Exception as error:  # a peer's refusal may be an exception (outlines-core)
                ok, why = False, f"{type(error).__name__}: {error}"
            else:
                why = "advance returned False"
            if ok is False:
                out.refused.append({"walk": w, "step": i, "token": token, "tools": walk.tools, "error": why})
                break
        else:
            kept.append(walk)
    if len(kept) < len(walks):
        out.walk_steps = [len(walk.tokens) for walk in kept]
    walks = kept

    def run() -> None:
        call = out.new_call()
        steps, answers = call.setdefault("step", []), call.setdefault("answer", [])
        fills, applies, advances = call.setdefault("fill", []), call.setdefault("apply_argmax", []), \
            call.setdefault("advance", [])
        grammar = call.setdefault("fill_advance", [])
        for walk in walks:
            reset()
            total = 0.0
            last = len(walk.tokens) - 1
            for i, (logits, expected) in enumerate(zip(walk.logits, walk.tokens, strict=True)):
                np.copyto(buffer, logits)
                t0 = clock()
                fill()
                t1 = clock()
                apply()
                token = int(np.argmax(row))
                t2 = clock()
                try:
                    ok = True if last_no_advance and i == last else advance(expected)
                except Exception as error:
                    raise StopArm(f"{type(error).__name__} at step {i}: {error}") from None
                t3 = clock()
                fills.append((t1 - t0) * US)
                applies.append((t2 - t1) * US)
                advances.append((t3 - t2) * US)
                grammar.append((t3 - t2 + t1 - t0) * US)
                steps.append((t3 - t0) * US)
                total += t3 - t0
                if ok is False:
                    raise StopArm(f"refused the walk's token {expected} at step {i}")
                if token != expected:
                    out.argmax_differs += 1
            answers.append(total * US)
    return run


def arm_matcher(artifact: Artifact, k: int, walks: list[Walk], vocab: int, out: Samples) -> Arm:
    matcher = TrieMatcher(artifact, k)
    bitmask = allocate_token_bitmask(1, vocab)
    buffer = np.empty((1, vocab), dtype=np.float32)
    return _bitmask_arm(walks, out, buffer, matcher.reset, lambda: matcher.fill_next_token_bitmask(bitmask, 0),
                        lambda: tooltrie_apply(buffer, bitmask), matcher.accept_token)


def arm_xgrammar(compiled: Any, walks: list[Walk], vocab: int, out: Samples) -> Arm:
    import torch
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    logits = torch.empty((1, vocab), dtype=torch.float32)
    return _bitmask_arm(walks, out, logits.numpy(), matcher.reset,
                        lambda: matcher.fill_next_token_bitmask(bitmask),
                        lambda: xgr.apply_token_bitmask_inplace(logits, bitmask), matcher.accept_token)


def arm_llguidance(matcher: Any, walks: list[Walk], vocab: int, out: Samples) -> Arm:
    import llguidance.numpy as llg_np

    bitmask = llg_np.allocate_token_bitmask(1, vocab)
    buffer = np.empty((1, vocab), dtype=np.float32)
    return _bitmask_arm(walks, out, buffer, matcher.reset, lambda: llg_np.fill_next_token_bitmask(matcher, bitmask),
                        lambda: llg_np.apply_token_bitmask_inplace(buffer, bitmask), matcher.consume_token)


def arm_outlines(index: Any, walks: list[Walk], vocab: int, out: Samples) -> Arm:
    import outlines_core
    from outlines_core.kernels import numpy as oc_np

    guide = outlines_core.Guide(index)
    bitmask = allocate_token_bitmask(1, vocab)
    buffer = np.empty((1, vocab), dtype=np.float32)
    # outlines-core's Guide has no transition on the stop token (advance raises at a final state): its engine
    # stops there, so the last step (our stop token) is mask + apply + argmax without an advance.
    return _bitmask_arm(walks, out, buffer, guide.reset, lambda: oc_np.fill_next_token_bitmask(guide, bitmask),
                        lambda: oc_np.apply_token_bitmask_inplace(buffer, bitmask),
                        lambda token: guide.advance(token, return_tokens=False), last_no_advance=True)


def segment_ebnf(names: Sequence[str], prefix: str) -> str:
    """``exactly_k_ebnf(names, 1)``, with ``prefix`` (the separator) in front of the tool when not empty."""
    base = exactly_k_ebnf(names, 1)
    root, rest = base.split("\n", 1)
    assert root == "root ::= tool", root
    return base if not prefix else f"root ::= {json.dumps(prefix, ensure_ascii=False)} tool\n{rest}"


def segments(walk: Walk, token_bytes: Sequence[bytes], separator: str) -> list[tuple[int, int]]:
    """Step ranges of the walk's segments: tool 1, then separator + tool for the others (the stop token goes to
    the last); raises StopArm when a segment boundary falls inside a token."""
    ends, total = [], 0
    for i, name in enumerate(walk.tools):
        total += len(((separator if i else "") + name).encode("utf-8"))
        ends.append(total)
    ranges, start, position = [], 0, 0
    for i, token in enumerate(walk.tokens[:-1]):
        position += len(token_bytes[token])
        if len(ranges) < len(ends) - 1 and position == ends[len(ranges)]:
            ranges.append((start, i + 1))
            start = i + 1
        elif len(ranges) < len(ends) - 1 and position > ends[len(ranges)]:
            raise StopArm(f"a tool boundary falls inside token {token} ({walk.tools})")
    ranges.append((start, len(walk.tokens)))
    return ranges


def arm_rebuild(info: Any, names: Sequence[str], walks: list[Walk], vocab: int, separator: str,
                out: Samples) -> Arm:
    import torch
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    first = xgr.GrammarMatcher(compiler.compile_grammar(segment_ebnf(names, "")))  # the same for every request
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    logits = torch.empty((1, vocab), dtype=torch.float32)
    buffer = logits.numpy()
    row = buffer[0]
    token_bytes = list(info.decoded_vocab)
    plans = [segments(walk, token_bytes, separator) for walk in walks]

    def run() -> None:
        call = out.new_call()
        answers, compiles, steps = call.setdefault("answer", []), call.setdefault("compile", []), \
            call.setdefault("step", [])
        for walk, plan in zip(walks, plans, strict=True):
            first.reset()
            total = 0.0
            for s, (lo, hi) in enumerate(plan):
                if s == 0:
                    matcher = first
                else:
                    remaining = [n for n in names if n not in walk.tools[:s]]
                    t0 = clock()
                    matcher = xgr.GrammarMatcher(compiler.compile_grammar(segment_ebnf(remaining, separator)))
                    spent = clock() - t0
                    compiles.append(spent * US)
                    total += spent
                for i in range(lo, hi):
                    np.copyto(buffer, walk.logits[i])
                    t0 = clock()
                    matcher.fill_next_token_bitmask(bitmask)
                    xgr.apply_token_bitmask_inplace(logits, bitmask)
                    token = int(np.argmax(row))
                    ok = matcher.accept_token(walk.tokens[i])
                    spent = clock() - t0
                    steps.append(spent * US)
                    total += spent
                    if not ok:
                        raise StopArm(f"segment {s} refused token {walk.tokens[i]}")
                    if token != walk.tokens[i]:
                        out.argmax_differs += 1
            if not matcher.is_terminated():
                raise StopArm("the last segment's matcher did not terminate")
            answers.append(total * US)
    return run


# -- peers' builds --------------------------------------------------------------------------------------------------

_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def regex_escape(text: str) -> str:
    """Escape the meta characters of Rust's regex syntax (what outlines-core parses)."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def exactly_k_regex(names: Sequence[str], k: int, separator: str) -> str:
    tool = "(" + "|".join(regex_escape(name) for name in names) + ")"
    return tool + (f"({regex_escape(separator)}{tool}){{{k - 1}}}" if k > 1 else "")


def outlines_vocabulary(token_bytes: Sequence[bytes], eos_id: int, special: set[int]) -> Any:
    """outlines-core's Vocabulary from the decoded tokens (``Vocabulary.from_pretrained`` needs the network);
    special tokens other than the stop token are left out, as they are never text."""
    import outlines_core

    by_bytes: dict[bytes, list[int]] = {}
    for token, text in enumerate(token_bytes):
        if token != eos_id and token not in special:
            by_bytes.setdefault(text, []).append(token)
    return outlines_core.Vocabulary(eos_id, by_bytes)


def worker_outlines(args: argparse.Namespace) -> dict[str, Any]:
    """Build the outlines-core Index in this fresh process and pickle it to ``--index-out``."""
    import outlines_core
    import xgrammar as xgr

    tokenizer = TokenizerInfo.load(args.tokenizer)
    hf = hf_tokenizer(args.tokenizer, tokenizer.eos_token)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tokenizer.vocab_size, stop_token_ids=[tokenizer.eos_id])
    special = {i for i, added in hf.added_tokens_decoder.items() if added.special}
    names = load_registry(REGISTRIES[args.registry]).names
    began = clock()
    vocabulary = outlines_vocabulary(list(info.decoded_vocab), tokenizer.eos_id, special)
    built = clock()
    index = outlines_core.Index(exactly_k_regex(names, args.k, Contract().separator), vocabulary)
    done = clock()
    with open(args.index_out, "wb") as handle:
        pickle.dump(index, handle)
    return {"vocabulary_s": built - began, "index_s": done - built}


def build_outlines(args: argparse.Namespace, registry: str, k: int) -> tuple[Any, dict[str, Any]]:
    """(index or None, build record): the Index is built in a subprocess under ``--build-timeout``."""
    fd, path = tempfile.mkstemp(prefix="outlines-index-", suffix=".pkl")
    os.close(fd)
    argv = [sys.executable, __file__, "--worker", "outlines", "--registry", registry, "--k", str(k),
            "--tokenizer", args.tokenizer, "--index-out", path]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.build_timeout, check=False)
        if proc.returncode != 0:
            return None, {"status": f"build failed: {proc.stderr.strip()[-500:]}"}
        record = json.loads(proc.stdout.strip().splitlines()[-1])
        began = clock()
        with open(path, "rb") as handle:
            index = pickle.load(handle)
        record.update(status="ok", index_pickle_bytes=Path(path).stat().st_size, unpickle_s=clock() - began,
                      where="subprocess")
        return index, record
    except subprocess.TimeoutExpired:
        return None, {"status": f"timeout: no Index after {args.build_timeout:g} s (build in a subprocess)"}
    finally:
        Path(path).unlink(missing_ok=True)


# -- the benchmark ----------------------------------------------------------------------------------------------

@dataclass
class Shared:
    tokenizer: TokenizerInfo
    xgr_info: Any
    llg_tokenizer: Any
    setup_s: dict[str, float]
    walks: dict[str, Any]  # the twins' compiled copies of kernels/walk.py


def setup(args: argparse.Namespace) -> Shared:
    import llguidance.hf
    import xgrammar as xgr

    times = {}
    began = clock()
    tokenizer = TokenizerInfo.load(args.tokenizer)
    times["tooltrie_TokenizerInfo_load"] = clock() - began
    began = clock()
    hf = hf_tokenizer(args.tokenizer, tokenizer.eos_token)
    times["hf_PreTrainedTokenizerFast"] = clock() - began
    began = clock()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tokenizer.vocab_size, stop_token_ids=[tokenizer.eos_id])
    times["xgrammar_TokenizerInfo"] = clock() - began
    began = clock()
    llg = llguidance.hf.from_tokenizer(hf, n_vocab=tokenizer.vocab_size, eos_token=tokenizer.eos_id)
    times["llguidance_LLTokenizer"] = clock() - began
    return Shared(tokenizer, info, llg, times, twin_walks())


def stats(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": median(values), "p90": percentile(values, 90), "mean": sum(values) / len(values),
            "min": min(values), "max": max(values), "n": len(values)}


def bench_config(args: argparse.Namespace, shared: Shared, registry: str, artifact: Artifact, k: int,
                 config: int) -> dict[str, Any]:
    import llguidance
    import xgrammar as xgr

    names = artifact.registry.names
    vocab = shared.tokenizer.vocab_size
    separator = artifact.contract.separator
    print(f"\n[{registry}: {len(names):,} tools, k = {k}]", flush=True)
    walks = make_walks(artifact, k, args.walks, vocab, args.seed, config)
    samples = {name: Samples() for name in (ARM_CPU, ARM_ON, ARM_OFF, ARM_AA, ARM_REF, ARM_MATCHER, *PEERS)}
    arms: dict[str, Arm] = {
        ARM_CPU: arm_backend("cpu", artifact, k, walks, samples[ARM_CPU]),
        ARM_ON: arm_twin(Twin(shared.walks[ARM_ON], artifact, vocab), artifact, k, walks, samples[ARM_ON],
                         must_match=True),
        ARM_OFF: arm_twin(Twin(shared.walks[ARM_OFF], artifact, vocab), artifact, k, walks, samples[ARM_OFF],
                          must_match=False),
        ARM_AA: arm_twin(Twin(shared.walks[ARM_AA], artifact, vocab), artifact, k, walks, samples[ARM_AA],
                         must_match=True),
        ARM_REF: arm_backend("reference", artifact, k, walks, samples[ARM_REF]),
        ARM_MATCHER: arm_matcher(artifact, k, walks, vocab, samples[ARM_MATCHER]),
    }
    ebnf = exactly_k_ebnf(names, k, artifact.contract)

    began = clock()
    try:
        compiled = xgr.GrammarCompiler(shared.xgr_info, cache_enabled=False).compile_grammar(ebnf)
        samples[ARM_XGR].build_s = clock() - began
        arms[ARM_XGR] = arm_xgrammar(compiled, walks, vocab, samples[ARM_XGR])
    except Exception as error:  # a peer that cannot build is recorded, not fatal
        samples[ARM_XGR].status = f"build failed: {error}"

    began = clock()
    try:
        matcher = llguidance.LLMatcher(shared.llg_tokenizer, llguidance.grammar_from("gbnf", ebnf), log_level=0)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        samples[ARM_LLG].build_s = clock() - began
        arms[ARM_LLG] = arm_llguidance(matcher, walks, vocab, samples[ARM_LLG])
    except Exception as error:
        samples[ARM_LLG].status = f"build failed: {error}"

    if args.skip_outlines:
        samples[ARM_OC].status = "skipped (--skip-outlines)"
        outlines_build: dict[str, Any] = {"status": samples[ARM_OC].status}
    else:
        print(f"  building the outlines-core Index (subprocess, {args.build_timeout:g} s limit)", flush=True)
        index, outlines_build = build_outlines(args, registry, k)
        if index is None:
            samples[ARM_OC].status = outlines_build["status"]
        else:
            samples[ARM_OC].build_s = outlines_build["vocabulary_s"] + outlines_build["index_s"]
            arms[ARM_OC] = arm_outlines(index, walks, vocab, samples[ARM_OC])

    rebuild = k > 1 and registry == "catalog" and not args.skip_rebuild
    if rebuild:
        samples[ARM_REBUILD] = Samples()
        try:
            arms[ARM_REBUILD] = arm_rebuild(shared.xgr_info, names, walks, vocab, separator, samples[ARM_REBUILD])
        except StopArm as stop:
            samples[ARM_REBUILD].status = f"not applicable: {stop}"

    began = clock()
    times = take_turns(arms, repeats=args.repeats, warmup=1)
    print(f"  {len(arms)} arms x {args.repeats} repeats (+1 warm-up) of {len(walks)} walks: {clock() - began:.1f} s",
          flush=True)
    for name, arm_times in times.items():
        if arm_times.stopped is not None:
            samples[name].status = f"stopped: {arm_times.stopped}"

    n_steps = [len(walk.tokens) for walk in walks]
    arms_out: dict[str, Any] = {}
    for name, sample in samples.items():
        record: dict[str, Any] = {"status": sample.status, "build_s": sample.build_s,
                                  "step_us": stats(sample.values("step")), "answer_us": stats(sample.values("answer"))}
        for part in ("fill", "apply_argmax", "advance", "fill_advance", "compile", "step_with_used_tools"):
            if sample.values(part):
                record[f"{part}_us"] = stats(sample.values(part))
        if name not in (ARM_CPU, ARM_ON, ARM_AA, ARM_REF) and sample.calls:
            record["argmax_differs_steps"] = sample.argmax_differs  # in the last timed call
        minima = sample.position_minima("step")
        if minima is not None and name != ARM_REBUILD:
            starts = np.cumsum([0, *(sample.walk_steps or n_steps)])
            per_walk = [float(minima[a:b].sum()) for a, b in itertools.pairwise(starts)]
            record["min_of_repeats"] = {"step_us": stats(minima.tolist()), "answer_us": stats(per_walk),
                                        "total_us": float(minima.sum())}
        if sample.refused:
            record["refused_walks"] = sample.refused
            record["replayed_walks"] = len(walks) - len(sample.refused)
        arms_out[name] = record
    arms_out[ARM_OC]["build"] = outlines_build

    result: dict[str, Any] = {
        "registry": registry, "n_tools": len(names), "k": k, "walks": len(walks),
        "steps": {"total": sum(n_steps), "per_walk_mean": sum(n_steps) / len(n_steps), "min": min(n_steps),
                  "max": max(n_steps),
                  "with_used_tools": sum(sum(walk.constrained) for walk in walks)},
        "example_answer": walks[0].tools,
        "ebnf_bytes": len(ebnf.encode("utf-8")),
        "arms": arms_out,
    }
    result["ratios"] = ratios(arms_out)
    return result


def _median_of(arms: dict[str, Any], name: str, key: str) -> float | None:
    record = arms.get(name, {})
    value = record.get(key)
    return value["median"] if value and record.get("status") == "ok" else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(arms: dict[str, Any]) -> dict[str, Any]:
    cpu_step, cpu_answer = _median_of(arms, ARM_CPU, "step_us"), _median_of(arms, ARM_CPU, "answer_us")
    out: dict[str, Any] = {}
    for name in (*PEERS, ARM_REF, ARM_MATCHER):
        out[f"{name} / tooltrie cpu (step)"] = _ratio(_median_of(arms, name, "step_us"), cpu_step)
        out[f"{name} / tooltrie cpu (answer)"] = _ratio(_median_of(arms, name, "answer_us"), cpu_answer)
    on_answer, off_answer = _median_of(arms, ARM_ON, "answer_us"), _median_of(arms, ARM_OFF, "answer_us")
    on_step, off_step = _median_of(arms, ARM_ON, "step_us"), _median_of(arms, ARM_OFF, "step_us")
    answer_ratio, step_ratio = _ratio(on_answer, off_answer), _ratio(on_step, off_step)
    out["no-repeat overhead (answer)"] = None if answer_ratio is None else answer_ratio - 1
    out["no-repeat overhead (step)"] = None if step_ratio is None else step_ratio - 1
    late_on = arms.get(ARM_ON, {}).get("step_with_used_tools_us")
    late_off = arms.get(ARM_OFF, {}).get("step_with_used_tools_us")
    out["no-repeat overhead (steps after the first tool)"] = (
        late_on["median"] / late_off["median"] - 1 if late_on and late_off else None)
    on_min, off_min = arms.get(ARM_ON, {}).get("min_of_repeats"), arms.get(ARM_OFF, {}).get("min_of_repeats")
    out["no-repeat overhead (sum of per-step minima over repeats)"] = (
        on_min["total_us"] / off_min["total_us"] - 1 if on_min and off_min else None)
    aa_ratio = _ratio(on_answer, _median_of(arms, ARM_AA, "answer_us"))
    out["A/A: twin on / its second copy - 1 (answer)"] = None if aa_ratio is None else aa_ratio - 1
    out["twin on / tooltrie cpu (answer)"] = _ratio(on_answer, cpu_answer)
    for name in PEERS:
        out[f"{name} fill+advance only / tooltrie cpu (step)"] = _ratio(_median_of(arms, name, "fill_advance_us"),
                                                                        cpu_step)
    if ARM_REBUILD in arms:
        rebuild = _median_of(arms, ARM_REBUILD, "answer_us")
        out["rebuild-and-retry / tooltrie cpu (answer)"] = _ratio(rebuild, cpu_answer)
        out["rebuild-and-retry / xgrammar (answer)"] = _ratio(rebuild, _median_of(arms, ARM_XGR, "answer_us"))
    return out


def evaluate_targets(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def check(name: str, key: str, limit: float, at_least: bool) -> dict[str, Any]:
        values = {f"{c['registry']} k={c['k']}": c["ratios"].get(key) for c in configs}
        measured = [v for v in values.values() if v is not None]
        worst = (min(measured) if at_least else max(measured)) if measured else None
        met = None if worst is None else (worst >= limit if at_least else worst <= limit)
        missing = [where for where, v in values.items() if v is None]
        return {"target": name, "worst": worst, "limit": limit, "met": met, "values": values, "not_measured": missing}

    return [
        check("xgrammar / tooltrie cpu per-step median >= 20x", f"{ARM_XGR} / tooltrie cpu (step)",
              TARGETS["xgrammar_over_cpu_min"], at_least=True),
        check("outlines-core / tooltrie cpu per-step median >= 5x", f"{ARM_OC} / tooltrie cpu (step)",
              TARGETS["outlines_over_cpu_min"], at_least=True),
        check("no-repeat overhead per answer <= 10%", "no-repeat overhead (answer)",
              TARGETS["no_repeat_overhead_max"], at_least=False),
    ]


# -- report -------------------------------------------------------------------------------------------------------

def _fmt_us(value: dict[str, float] | None, key: str = "median") -> float | None:
    return None if value is None else value[key]


def _status(arm: dict[str, Any], walks: int) -> str:
    status = str(arm["status"])
    if arm.get("refused_walks"):
        status += f"; refused {len(arm['refused_walks'])} of {walks} walks (left out)"
    return status if len(status) < 70 else status[:67] + "..."


def print_report(shared: Shared, configs: list[dict[str, Any]], targets: list[dict[str, Any]]) -> None:
    print_table([{"setup (once per tokenizer)": name, "s": value} for name, value in shared.setup_s.items()],
                title="Setup")
    rows = []
    for c in configs:
        cpu = c["arms"][ARM_CPU]["step_us"]
        for name, arm in c["arms"].items():
            ok = arm["status"] == "ok"
            ratio = arm["step_us"]["median"] / cpu["median"] if ok and arm["step_us"] and cpu else None
            rows.append({
                "registry": c["registry"], "k": c["k"], "arm": name,
                "steps": arm["step_us"]["n"] if ok and arm["step_us"] else None,
                "build s": arm["build_s"],
                "med us": _fmt_us(arm["step_us"]) if ok else None,
                "p90 us": _fmt_us(arm["step_us"], "p90") if ok else None,
                "fill": _fmt_us(arm.get("fill_us")) if ok else None,
                "apply+argmax": _fmt_us(arm.get("apply_argmax_us")) if ok else None,
                "advance": _fmt_us(arm.get("advance_us")) if ok else None,
                "fill+adv": _fmt_us(arm.get("fill_advance_us")) if ok else None,
                "answer us": _fmt_us(arm["answer_us"]) if ok else None,
                "answer min-rep": _fmt_us(arm.get("min_of_repeats", {}).get("answer_us")) if ok else None,
                "x cpu": f"{ratio:.1f}x" if ratio is not None else None,
                "argmax!=ours": arm.get("argmax_differs_steps"),
                "status": _status(arm, c["walks"]),
            })
    print_table(rows, title="Per-step cost, batch 1 (µs; med/p90 over every step of every walk and repeat; "
                            "fill/apply+argmax/advance/fill+adv: medians of the parts; answer: median sum over a "
                            "walk; answer min-rep: median over walks of the sum of each step's minimum over repeats; "
                            "argmax!=ours: steps of the last repeat where the arm's own masked argmax was not the "
                            "walk's token)")
    ratio_rows = []
    for c in configs:
        for key, value in c["ratios"].items():
            if value is not None:
                shown = f"{value * 100:+.1f}%" if "overhead" in key or "A/A" in key else f"{value:.2f}x"
                ratio_rows.append({"registry": c["registry"], "k": c["k"], "ratio": key, "value": shown})
    print_table(ratio_rows, title="Ratios (of medians)")
    for c in configs:
        rebuild = c["arms"].get(ARM_REBUILD)
        if rebuild and rebuild["status"] == "ok":
            print_table([{
                "answer": name, "median us": c["arms"][name]["answer_us"]["median"],
                "p90 us": c["arms"][name]["answer_us"]["p90"],
                "compile us (median per rebuild)": _fmt_us(c["arms"][name].get("compile_us")),
            } for name in (ARM_CPU, ARM_XGR, ARM_REBUILD) if c["arms"][name]["status"] == "ok"],
                title=f"Rebuild-and-retry, {c['registry']} k={c['k']}: latency per answer")
    print_table([{
        "target": t["target"], "worst": None if t["worst"] is None else (
            f"{t['worst'] * 100:+.1f}%" if "overhead" in t["target"] else f"{t['worst']:.1f}x"),
        "met": {True: "yes", False: "NO", None: "not run"}[t["met"]],
        "not measured": ", ".join(t["not_measured"]) or "-",
    } for t in targets], title="Targets (reported, not asserted)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats of every arm (default 7)")
    parser.add_argument("--walks", type=int, default=30, help="answers decoded per configuration (default 30)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the logits (default 0)")
    parser.add_argument("--registries", default="catalog,bfcl", help="catalog and/or bfcl (default both)")
    parser.add_argument("--ks", default="1,3", help="tools per answer (default 1,3)")
    parser.add_argument("--tokenizer", default="smollm2-135m", help="bundled tokenizer name or tokenizer.json path")
    parser.add_argument("--build-timeout", type=float, default=180.0,
                        help="seconds allowed to one outlines-core Index build, in a subprocess (default 180)")
    parser.add_argument("--skip-outlines", action="store_true", help="leave outlines-core out")
    parser.add_argument("--skip-rebuild", action="store_true", help="leave the rebuild-and-retry baseline out")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--out", default=str(RESULTS_DIR / "step.json"), help="results file")
    parser.add_argument("--worker", choices=("outlines",), help=argparse.SUPPRESS)
    parser.add_argument("--registry", choices=tuple(REGISTRIES), help=argparse.SUPPRESS)
    parser.add_argument("--k", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--index-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.registry_list = [part.strip() for part in args.registries.split(",") if part.strip()]
    args.k_list = [int(part) for part in args.ks.split(",") if part.strip()]
    if args.repeats < 1 or args.walks < 1 or not args.k_list or min(args.k_list) < 1:
        parser.error("--repeats, --walks and every k must be at least 1")
    if not set(args.registry_list) <= set(REGISTRIES) or not args.registry_list:
        parser.error(f"--registries: choose from {sorted(REGISTRIES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker_outlines(args)))
        return 0
    import torch

    torch.set_num_threads(args.torch_threads)
    began = clock()
    shared = setup(args)
    configs = []
    for registry in args.registry_list:
        t0 = clock()
        artifact = compile_registry(load_registry(REGISTRIES[registry]), shared.tokenizer, Contract(), progress=False)
        compile_s = clock() - t0
        for k in args.k_list:
            result = bench_config(args, shared, registry, artifact, k, config=len(configs))
            result["tooltrie_compile_s"] = compile_s
            configs.append(result)
    targets = evaluate_targets(configs)
    print_report(shared, configs, targets)
    settings = {
        "repeats": args.repeats, "walks": args.walks, "seed": args.seed, "registries": args.registry_list,
        "ks": args.k_list, "tokenizer": args.tokenizer, "vocab_size": shared.tokenizer.vocab_size, "batch": 1,
        "torch_threads": args.torch_threads, "build_timeout_s": args.build_timeout,
        "logits": "standard normal float32 [1, V], a fresh draw per step, seeded per (seed, config, walk)",
        "replay": "every arm does its per-step work on the recorded logits, then advances by the walk's token",
        "timed": "per step: mask + select + advance; logits copy-in and per-walk resets (matcher.reset(), a fresh "
                 "BatchState) are outside the timer",
        "argmax": "NumPy argmax over the masked row for every bitmask arm (torch's CPU argmax is ~20x slower)",
        "apply": {ARM_MATCHER: "tooltrie.kernels.apply_token_bitmask_inplace (NumPy)",
                  ARM_XGR: "xgrammar.apply_token_bitmask_inplace on a torch CPU tensor",
                  ARM_LLG: "llguidance.numpy.apply_token_bitmask_inplace",
                  ARM_OC: "outlines_core.kernels.numpy.apply_token_bitmask_inplace (Numba)"},
        "grammars": {ARM_XGR: "exactly_k_ebnf(names, k), GrammarCompiler(cache_enabled=False)",
                     ARM_LLG: "llguidance.grammar_from('gbnf', exactly_k_ebnf(names, k)) (Lark)",
                     ARM_OC: "regex (n1|n2|...)(, (n1|n2|...)){k-1}, Rust-regex escaped; Vocabulary from "
                             "XGrammar's decoded tokens, special tokens left out",
                     ARM_REBUILD: "first tool: exactly_k_ebnf(names, 1), compiled once; then per tool "
                                  "root ::= \", \" tool over the remaining names, compiled per answer "
                                  "(cache_enabled=False) + a new GrammarMatcher; tool boundaries known "
                                  "(a lower bound)"},
        "no_repeat_twins": "kernels/walk.py's choose_rows called directly (search + advance, no statistics, no "
                           "forced run) from three compilations: 'on' the library's module, 'off' "
                           "walk.variant(no_repeat=False) (no-repeat compiled out), 'A/A' walk.variant(no_repeat="
                           "True); a twin that leaves the walk's state is put back on it after the timer",
        "outlines_stop": "outlines-core's Guide has no transition on the stop token: the last step is not advanced",
        "order": "arms take turns within each repeat, the first arm rotating; one untimed warm-up call per arm",
        "targets": TARGETS,
    }
    results = {"setup_s": shared.setup_s, "configs": configs, "targets": targets, "wall_s": clock() - began}
    path = write_results("step", settings=settings, results=results, out=args.out, compact=True)
    print(f"\nwrote {path} ({clock() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
