"""GPU decode step: our kernel (both placements, both thread layouts) against the masked full-vocabulary argmax
of torch and XGrammar's ``apply_token_bitmask_inplace`` + argmax, on the same logits and the same slot states;
the production path (``TrieBatch`` on the CUDA backend, state resident on the device): ``choose`` with its outputs
copied to the host, and ``accept`` + ``mask_logits_`` + argmax (what the vLLM adapters do); and the fused sparse
head against a full ``h @ W.T`` + argmax.

Kernel time is read from the CUDA profiler (torch.profiler, CUPTI): the sum of the GPU kernels each arm launches,
so Python's launch overhead is excluded; the wall time of a synchronised call is reported beside it.

    python bench/bench_kernel.py                 # on a GPU machine
    NUMBA_ENABLE_CUDASIM=1 python bench/bench_kernel.py --simulate   # smoke test of the code paths, no timing
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _common import print_table, write_results

from tooltrie.compiler import Artifact, TokenizerInfo, compile_registry
from tooltrie.kernels import BatchState, step
from tooltrie.kernels.bitmask import allocate_token_bitmask, set_allowed
from tooltrie.kernels.rules import legal_moves
from tooltrie.kernels.state import RUNNING
from tooltrie.registry import BFCL_PATH, CATALOG_PATH, load_registry

HIDDEN_SIZE = 576  # SmolLM2-135M


def trajectory(artifact: Artifact, batch: int, k: int, vocab: int, seed: int,
               chosen: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """Slot tables at every step of a real decode (CPU backend, random logits), so each timed launch sees the
    states a decode goes through: roots with many edges, deep nodes with one. ``chosen`` gets each step's tokens
    (the tokens that lead from table i to table i + 1)."""
    rng = np.random.default_rng(seed)
    state = BatchState.start(artifact, [k] * batch)
    tables = []
    while (state.status == RUNNING).any():
        tables.append(state.table.copy())
        tokens = step(artifact, state, rng.standard_normal((batch, vocab), dtype=np.float32), backend="cpu")
        if chosen is not None:
            chosen.append(tokens)
    return tables


def legal_bitmasks(artifact: Artifact, tables: list[np.ndarray], vocab: int) -> list[np.ndarray]:
    """The legal set of every slot at every step, as XGrammar-layout bitmasks (for the mask-based peers)."""
    masks = []
    for table in tables:
        state = BatchState(table.copy())
        bitmask = allocate_token_bitmask(len(state), vocab)
        for row in range(len(state)):
            set_allowed(bitmask[row], legal_moves(artifact.trie, state.slot(row), artifact.eos_id))
        masks.append(bitmask)
    return masks


def kernel_time_us(run: Callable[[], None], repeats: int) -> tuple[float, float]:
    """(median GPU kernel time per call from the profiler, median synchronised wall time per call), in µs."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    walls = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - began) * 1e6)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    device_us = sum(event.device_time_total for event in prof.key_averages()) / repeats
    return device_us, statistics.median(walls)


def bench_registry(name: str, artifact: Artifact, batch: int, layouts: list[str], repeats: int, seed: int,
                   vocab: int) -> list[dict[str, Any]]:
    import torch
    from numba import cuda

    from tooltrie.kernels import TrieBatch
    from tooltrie.kernels.cuda import CudaStepper

    steps: list[np.ndarray] = []
    tables = trajectory(artifact, batch, 3, vocab, seed, steps)
    device = torch.device("cuda")
    logits = torch.randn(batch, vocab, device=device)
    tables_dev = [torch.from_numpy(t).to(device) for t in tables]
    work_table = tables_dev[0].clone()
    chosen = torch.empty(batch, dtype=torch.int32, device=device)
    masks = [torch.from_numpy(m).to(device) for m in legal_bitmasks(artifact, tables, vocab)]
    bits = torch.arange(32, device=device, dtype=torch.int32)
    bool_masks = [((m.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab] for m in masks]
    position = {"i": 0}

    def next_state() -> int:
        i = position["i"] = (position["i"] + 1) % len(tables)
        return i

    rows = []
    for placement in ("constant", "global"):
        if placement == "constant" and artifact.placement() != "constant":
            continue  # does not fit: constant memory would not link
        for layout in layouts:
            stepper = CudaStepper(artifact, placement=placement, layout=layout)

            def ours(stepper: CudaStepper = stepper) -> None:
                work_table.copy_(tables_dev[next_state()])
                stepper.step(work_table, logits, chosen)

            rows.append(_row(name, batch, f"tooltrie {placement}/{layout}", *kernel_time_us(ours, repeats)))
    production = TrieBatch(artifact, backend="cuda", capacity=batch)
    for row in range(batch):
        production.add(row, 3)
    production.backend.table = cuda.as_cuda_array(work_table)  # the trajectory's states are copied into it
    scratch_logits = logits.clone()
    step_tokens = [token[:, None].astype(np.int32) for token in steps]

    def batch_choose() -> None:
        work_table.copy_(tables_dev[next_state()])
        production.choose(logits)

    def batch_accept_mask() -> None:
        i = next_state()
        work_table.copy_(tables_dev[i])
        scratch_logits.copy_(logits)
        production.accept(step_tokens[i])
        production.mask_logits_(scratch_logits)
        scratch_logits.argmax(-1)

    rows.append(_row(name, batch, "TrieBatch.choose (+ host outputs)", *kernel_time_us(batch_choose, repeats)))
    rows.append(_row(name, batch, "TrieBatch accept+mask+argmax", *kernel_time_us(batch_accept_mask, repeats)))
    copy_only = _row(name, batch, "(state copy alone)", *kernel_time_us(
        lambda: work_table.copy_(tables_dev[next_state()]), repeats))
    rows.append(copy_only)

    def torch_masked() -> None:
        torch.where(bool_masks[next_state()], logits, float("-inf")).argmax(-1)

    rows.append(_row(name, batch, "torch masked argmax", *kernel_time_us(torch_masked, repeats)))
    try:
        import xgrammar as xgr
    except ImportError:
        rows.append({"registry": name, "batch": batch, "arm": "xgrammar", "note": "xgrammar not installed"})
    else:
        scratch = logits.clone()

        def xgrammar_apply() -> None:
            scratch.copy_(logits)
            xgr.apply_token_bitmask_inplace(scratch, masks[next_state()])
            scratch.argmax(-1)

        rows.append(_row(name, batch, "xgrammar apply+argmax", *kernel_time_us(xgrammar_apply, repeats)))
        rows.append(_row(name, batch, "(logits copy alone)", *kernel_time_us(lambda: scratch.copy_(logits),
                                                                             repeats)))
    return rows


def bench_dtypes(artifact: Artifact, batch: int, repeats: int, seed: int, vocab: int) -> list[dict[str, Any]]:
    """bfloat16 logits: read as int16 bits in the kernel, against converting to float32 first."""
    import torch

    from tooltrie.kernels.cuda import CudaStepper

    tables = [torch.from_numpy(t).cuda() for t in trajectory(artifact, batch, 3, vocab, seed)]
    work = tables[0].clone()
    chosen = torch.empty(batch, dtype=torch.int32, device="cuda")
    stepper = CudaStepper(artifact)
    rows = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        logits = torch.randn(batch, vocab, device="cuda").to(dtype)

        def run(logits: Any = logits) -> None:
            work.copy_(tables[1])
            stepper.step(work, logits, chosen)

        rows.append(_row(artifact.registry.name, batch, f"tooltrie {str(dtype)[6:]}", *kernel_time_us(run, repeats)))
    bf16 = torch.randn(batch, vocab, device="cuda").to(torch.bfloat16)

    def converted() -> None:
        work.copy_(tables[1])
        stepper.step(work, bf16.float(), chosen)

    rows.append(_row(artifact.registry.name, batch, "tooltrie bf16 via .float()", *kernel_time_us(converted, repeats)))
    return rows


def bench_sparse_head(artifact: Artifact, batch: int, repeats: int, seed: int, vocab: int) -> list[dict[str, Any]]:
    import torch

    from tooltrie.kernels.cuda import CudaStepper

    generator = torch.Generator(device="cuda").manual_seed(seed)
    weights = torch.randn(vocab, HIDDEN_SIZE, device="cuda", generator=generator)
    hidden = torch.randn(batch, HIDDEN_SIZE, device="cuda", generator=generator)
    tables = [torch.from_numpy(t).cuda() for t in trajectory(artifact, batch, 3, vocab, seed)]
    work = tables[0].clone()
    chosen = torch.empty(batch, dtype=torch.int32, device="cuda")
    stepper = CudaStepper(artifact)

    def sparse() -> None:
        work.copy_(tables[1])
        stepper.sparse_step(work, hidden, weights, chosen)

    def full() -> None:
        (hidden @ weights.T).argmax(-1)

    name = artifact.registry.name
    return [_row(name, batch, "sparse head (fused)", *kernel_time_us(sparse, repeats)),
            _row(name, batch, "full head h@W.T + argmax", *kernel_time_us(full, repeats))]


def _row(registry: str, batch: int, arm: str, kernel_us: float, wall_us: float) -> dict[str, Any]:
    return {"registry": registry, "batch": batch, "arm": arm, "kernel_us": kernel_us, "wall_us": wall_us}


def simulate(artifacts: dict[str, Artifact], vocab: int) -> None:
    """Exercise every code path under the CUDA simulator at toy sizes: no timing, only that it runs."""
    from tooltrie.kernels.cuda import CudaStepper

    for artifact in artifacts.values():
        for layout in ("warp", "thread"):
            tables = trajectory(artifact, 2, 3, vocab, 0)
            stepper = CudaStepper(artifact, layout=layout)
            chosen = np.zeros(2, dtype=np.int32)
            stepper.step(tables[0].copy(), np.random.default_rng(0).standard_normal((2, vocab), dtype=np.float32),
                         chosen)
            legal_bitmasks(artifact, tables[:2], vocab)
            print(f"simulated {artifact.registry.name} {stepper.placement}/{layout}: chose {chosen.tolist()}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--layouts", default="warp,thread")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--simulate", action="store_true", help="smoke-test under NUMBA_ENABLE_CUDASIM=1")
    args = parser.parse_args()
    tokenizer = TokenizerInfo.load("smollm2-135m")
    vocab = tokenizer.vocab_size
    artifacts = {"catalog": compile_registry(load_registry(CATALOG_PATH), tokenizer),
                 "bfcl": compile_registry(load_registry(BFCL_PATH), tokenizer)}
    if args.simulate:
        if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
            parser.error("--simulate needs NUMBA_ENABLE_CUDASIM=1")
        simulate(artifacts, vocab)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench_kernel: no CUDA GPU here (torch.cuda.is_available() is False); nothing measured",
              file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    layouts = args.layouts.split(",")
    rows: list[dict[str, Any]] = []
    for batch in batches:
        for name, artifact in artifacts.items():
            rows += bench_registry(name, artifact, batch, layouts, args.repeats, args.seed, vocab)
    rows += bench_dtypes(artifacts["catalog"], batches[-1], args.repeats, args.seed, vocab)
    for batch in batches:
        rows += bench_sparse_head(artifacts["catalog"], batch, args.repeats, args.seed, vocab)
    print_table(rows, title=f"decode step on {torch.cuda.get_device_name()} (µs, medians of {args.repeats})")
    settings = {"batches": batches, "layouts": layouts, "repeats": args.repeats, "vocab": vocab, "k": 3,
                "hidden_size": HIDDEN_SIZE, "gpu": torch.cuda.get_device_name(),
                "placements": {name: a.placement() for name, a in artifacts.items()}}
    path = write_results("kernel", settings=settings, results=rows, out=args.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
