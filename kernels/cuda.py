"""The CUDA backend: one launch per decode step for the whole batch; the host never walks the trie.

Placement. When the trie's arrays fit the constant-memory budget (``CONSTANT_MEMORY_BUDGET``, below the 64 KiB a
module may hold) they are captured as constants of a kernel compiled for that artifact: Numba puts a closure's
NumPy arrays in constant memory when the kernel is compiled. Constant memory is per compiled module, so each
artifact gets its own kernel (a factory cached by artifact hash) and two grammars can never overwrite each
other. Larger tries are passed as global-memory arrays to one shared kernel.

Layouts. ``warp`` (the default): a block of one warp per slot; the lanes split the candidate tokens, each keeps
its best, and a shared-memory tree reduction under the total order (score desc, token asc) picks the winner, so
the result never depends on thread timing; lane 0 advances the slot. ``thread``: a thread per slot walking its
candidates alone; its constant-memory reads broadcast while slots sit at the same node, but the candidates'
score reads are serial. ``bench/bench_kernel.py`` measures both.

Inputs come as the model makes them: torch CUDA tensors (or CuPy arrays) through ``__cuda_array_interface__``,
zero-copy, launched on torch's current stream; float32/float16 logits as they are, bfloat16 viewed as int16
bits (``kernels/walk.py`` orders them exactly, with no conversion pass).
"""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from typing import Any

import numpy as np
from numba import config, cuda

from tooltrie.compiler.artifact import CONSTANT_MEMORY_BUDGET, Artifact
from tooltrie.kernels import walk
from tooltrie.kernels.cpu import check_stats
from tooltrie.kernels.state import RUNNING, STATUS
from tooltrie.kernels.vocab import VocabMap, check_step_inputs

if config.ENABLE_CUDASIM:  # the simulator runs Python: give it the walk as Python too
    walk = walk.python_twin()
beats, best_move, best_plain, is_plain, plain_excluded, take_move, take_plain = (
    walk.beats, walk.best_move, walk.best_plain, walk.is_plain, walk.plain_excluded, walk.take_move, walk.take_plain)
lse_merge, no_stats, put_stats = walk.lse_merge, walk.no_stats, walk.put_stats

LOG = logging.getLogger(__name__)
WARP = 32
LAYOUTS = ("warp", "thread")
THREADS_PER_BLOCK = 128  # thread layout: slots per block
_KERNEL_CACHE_SIZE = 16
_LAUNCHES_CACHED = 256  # configured launches per stepper: (grid, block, stream) kinds seen
_kernels: OrderedDict[tuple[str, str, str], Any] = OrderedDict()

TRIE_FIELDS = ("node_edge_start", "edge_token", "edge_child", "edge_tool_count", "node_tool", "trie_root",
               "phase_trie", "tool_path_start", "tool_path_edges")


@cuda.jit(device=True)
def _warp_row(trie: Any, n_tools: int, eos_id: int, reasoning_end_id: int, table: Any, counts: Any, allowed: Any,
              scores: Any, hidden: Any, n_cols: int, full_to_output: Any, output_to_full: Any, chosen: Any,
              stats: Any) -> None:
    row, lane = cuda.blockIdx.x, cuda.threadIdx.x
    if table[row, STATUS] != RUNNING:  # uniform across the block: every lane leaves together
        if lane == 0:
            chosen[row] = -1
            no_stats(stats, row)
        return
    s_value = cuda.shared.array(WARP, dtype=np.float64)
    s_token = cuda.shared.array(WARP, dtype=np.int64)
    s_kind = cuda.shared.array(WARP, dtype=np.int64)
    s_edge = cuda.shared.array(WARP, dtype=np.int64)
    s_runner_up = cuda.shared.array(WARP, dtype=np.float64)
    s_lse_max = cuda.shared.array(WARP, dtype=np.float64)
    s_lse_sum = cuda.shared.array(WARP, dtype=np.float64)
    with_stats = stats.shape[0] > 0  # uniform across the block
    plain = is_plain(table, row)
    if plain:
        value, token, runner_up, lse_max, lse_sum = best_plain(
            row, lane, WARP, n_cols, scores, hidden, output_to_full, plain_excluded(table, row, eos_id), with_stats)
        kind, edge = -1, -1
    else:
        value, token, kind, edge, runner_up, lse_max, lse_sum = best_move(
            row, lane, WARP, trie, n_tools, eos_id, table, counts, allowed, scores, hidden, full_to_output,
            with_stats)
    s_value[lane], s_token[lane], s_kind[lane], s_edge[lane] = value, token, kind, edge
    s_runner_up[lane], s_lse_max[lane], s_lse_sum[lane] = runner_up, lse_max, lse_sum
    cuda.syncthreads()
    width = WARP // 2
    while width > 0:  # a fixed tree: the same inputs always merge in the same order (deterministic sums)
        other = lane + width
        if lane < width:
            other_wins = s_token[other] >= 0 and beats(s_value[other], s_token[other], s_value[lane], s_token[lane])
            if with_stats:  # the runner-up: the larger of both runners-up and the losing best
                losing = s_value[lane] if other_wins else s_value[other]
                s_runner_up[lane] = max(max(s_runner_up[lane], s_runner_up[other]), losing)
                s_lse_max[lane], s_lse_sum[lane] = lse_merge(s_lse_max[lane], s_lse_sum[lane], s_lse_max[other],
                                                             s_lse_sum[other])
            if other_wins:
                s_value[lane], s_token[lane], s_kind[lane], s_edge[lane] = (
                    s_value[other], s_token[other], s_kind[other], s_edge[other])
        cuda.syncthreads()
        width //= 2
    if lane == 0:
        put_stats(stats, row, s_value[0], s_runner_up[0], s_lse_max[0], s_lse_sum[0])
        if plain:
            take_plain(row, s_token[0], eos_id, reasoning_end_id, table, chosen)
        else:
            take_move(row, s_token[0], s_kind[0], s_edge[0], trie, table, chosen)


@cuda.jit(device=True)
def _thread_row(trie: Any, n_tools: int, eos_id: int, reasoning_end_id: int, table: Any, counts: Any, allowed: Any,
                scores: Any, hidden: Any, n_cols: int, full_to_output: Any, output_to_full: Any, chosen: Any,
                stats: Any) -> None:
    row = cuda.grid(1)
    if row >= table.shape[0]:
        return
    with_stats = stats.shape[0] > 0
    if table[row, STATUS] != RUNNING:
        chosen[row] = -1
        no_stats(stats, row)
    elif is_plain(table, row):
        value, token, runner_up, lse_max, lse_sum = best_plain(
            row, 0, 1, n_cols, scores, hidden, output_to_full, plain_excluded(table, row, eos_id), with_stats)
        put_stats(stats, row, value, runner_up, lse_max, lse_sum)
        take_plain(row, token, eos_id, reasoning_end_id, table, chosen)
    else:
        value, token, kind, edge, runner_up, lse_max, lse_sum = best_move(
            row, 0, 1, trie, n_tools, eos_id, table, counts, allowed, scores, hidden, full_to_output, with_stats)
        put_stats(stats, row, value, runner_up, lse_max, lse_sum)
        take_move(row, token, kind, edge, trie, table, chosen)


_ROW_FUNCTIONS = {"warp": _warp_row, "thread": _thread_row}


def make_constant_kernel(arrays: dict[str, np.ndarray[Any, Any]], layout: str) -> Any:
    """A kernel with this trie's arrays baked into its constant memory (one module per grammar)."""
    row_function = _ROW_FUNCTIONS[layout]
    nes, et, ec, etc, nt, tr, pt, tps, tpe = (np.ascontiguousarray(arrays[name]) for name in TRIE_FIELDS)

    @cuda.jit
    def constant_kernel(n_tools: int, eos_id: int, reasoning_end_id: int, table: Any, counts: Any, allowed: Any,
                        scores: Any, hidden: Any, n_cols: int, full_to_output: Any, output_to_full: Any,
                        chosen: Any, stats: Any) -> None:
        trie = (cuda.const.array_like(nes), cuda.const.array_like(et), cuda.const.array_like(ec),
                cuda.const.array_like(etc), cuda.const.array_like(nt), cuda.const.array_like(tr),
                cuda.const.array_like(pt), cuda.const.array_like(tps), cuda.const.array_like(tpe))
        row_function(trie, n_tools, eos_id, reasoning_end_id, table, counts, allowed, scores, hidden, n_cols,
                     full_to_output, output_to_full, chosen, stats)

    return constant_kernel


def make_global_kernel(layout: str) -> Any:
    """A kernel reading the trie from global-memory arrays passed at launch (any size, shared by all)."""
    row_function = _ROW_FUNCTIONS[layout]

    @cuda.jit
    def global_kernel(nes: Any, et: Any, ec: Any, etc: Any, nt: Any, tr: Any, pt: Any, tps: Any, tpe: Any,
                      n_tools: int, eos_id: int, reasoning_end_id: int, table: Any, counts: Any, allowed: Any,
                      scores: Any, hidden: Any, n_cols: int, full_to_output: Any, output_to_full: Any,
                      chosen: Any, stats: Any) -> None:
        row_function((nes, et, ec, etc, nt, tr, pt, tps, tpe), n_tools, eos_id, reasoning_end_id, table, counts,
                     allowed, scores, hidden, n_cols, full_to_output, output_to_full, chosen, stats)

    return global_kernel


@cuda.jit
def _gather_rows(old_table: Any, order: Any, new_table: Any) -> None:
    row, column = cuda.grid(2)
    if row < new_table.shape[0] and column < new_table.shape[1]:
        new_table[row, column] = old_table[order[row], column]


@cuda.jit
def _zero_counts(counts: Any) -> None:
    row, edge = cuda.grid(2)
    if row < counts.shape[0] and edge < counts.shape[1]:
        counts[row, edge] = 0


@cuda.jit
def _count_subset_paths(tool_path_start: Any, tool_path_edges: Any, n_tools: int, n_tries: int, allowed: Any,
                        counts: Any) -> None:
    """Each allowed tool adds one to every edge on its paths (one per trie): ``edge_tool_count`` of the subset."""
    row, tool = cuda.grid(2)
    if row < allowed.shape[0] and tool < n_tools and allowed[row, tool] != 0:
        for trie in range(n_tries):
            path = trie * n_tools + tool
            for i in range(tool_path_start[path], tool_path_start[path + 1]):
                cuda.atomic.add(counts, (row, tool_path_edges[i]), 1)


def _cached_kernel(key: tuple[str, str, str], make: Any) -> Any:
    if key in _kernels:
        _kernels.move_to_end(key)
        return _kernels[key]
    kernel = _kernels[key] = make()
    if len(_kernels) > _KERNEL_CACHE_SIZE:
        _kernels.popitem(last=False)
    return kernel


class CudaStepper:
    """Runs decode steps of one artifact on the GPU.

    ``placement`` is ``"auto"`` (constant memory when the trie fits ``constant_budget`` bytes), ``"constant"``
    or ``"global"``; the choice is in ``self.placement`` and logged.
    """

    def __init__(self, artifact: Artifact, *, placement: str = "auto", layout: str = "warp",
                 constant_budget: int = CONSTANT_MEMORY_BUDGET) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")
        if placement == "auto":
            placement = artifact.placement(constant_budget)
        if placement not in ("constant", "global"):
            raise ValueError(f"unknown placement {placement!r}; choose 'auto', 'constant' or 'global'")
        self.artifact, self.placement, self.layout = artifact, placement, layout
        arrays = artifact.trie.arrays()
        if placement == "constant":
            self._kernel = _cached_kernel((artifact.sha256, placement, layout),
                                          lambda: make_constant_kernel(dict(arrays), layout))
            self._trie_args: tuple[Any, ...] = ()
        else:
            self._kernel = _cached_kernel(("*", placement, layout), lambda: make_global_kernel(layout))
            self._trie_args = tuple(cuda.to_device(arrays[name]) for name in TRIE_FIELDS)
        LOG.info("tooltrie: registry %r (%d device bytes) decodes from %s memory, %s layout",
                 artifact.registry.name, artifact.trie.device_bytes, placement, layout)
        # No rows: every slot has the whole registry (the kernel reads the compiled counts).
        self._whole_registry = (cuda.device_array((0, 0), np.int32), cuda.device_array((0, 0), np.uint8))
        self._no_stats = cuda.device_array((0, 3), np.float64)  # no rows: statistics not wanted
        self._no_hidden = cuda.device_array(0, np.float32)  # 1-D: the dense step (a launch cannot pass None)
        self._paths: tuple[Any, Any] | None = None
        self._launches: dict[tuple[int, int, int | None], Any] = {}  # see _configured

    def step(self, table: Any, logits: Any, chosen: Any, *, subsets: tuple[Any, Any] | None = None,
             reasoning_end_id: int | None = None, vocab: VocabMap | None = None, stream: Any = None,
             stats: Any = None) -> None:
        """One step: ``table`` is the slot-state table on the device (advanced in place), ``logits`` ``[B, V]``,
        ``chosen`` an int32 ``[B]`` output; ``subsets`` (from :meth:`subsets`) limits rows to their allowed
        tools; ``stats`` (float64 ``[B, 3]``, optional) receives each row's (best, runner-up, log-sum-exp) over its
        candidates (float logits only: bfloat16 is compared as bits, which order but are not values). Torch
        tensors are launched on torch's current stream."""
        if stats is not None and stats.shape[0] and str(getattr(logits, "dtype", "")) in (
                "torch.bfloat16", "int16", "torch.int16"):
            raise ValueError("stats need float16/float32 logits: bfloat16 logits are compared as their bits")
        logits = _bf16_as_bits(logits)
        self._launch(table, subsets, logits, self._no_hidden, logits.shape[0], logits.shape[1], chosen,
                     reasoning_end_id, vocab, stream, stats)

    def sparse_step(self, table: Any, hidden: Any, output_embedding: Any, chosen: Any, *,
                    subsets: tuple[Any, Any] | None = None, reasoning_end_id: int | None = None,
                    vocab: VocabMap | None = None, stream: Any = None, stats: Any = None) -> None:
        """One step from hidden states ``[B, H]`` and ``W [V, H]``: dot products for legal tokens only, and the
        selection, in the same launch; no ``[B, V]`` logits exist. ``stats`` as in :meth:`step`: what a score of
        the decision needs (logprob = best - log-sum-exp, margin = best - runner-up), from the same products."""
        self._launch(table, subsets, output_embedding, hidden, hidden.shape[0], output_embedding.shape[0], chosen,
                     reasoning_end_id, vocab, stream, stats)

    def subsets(self, allowed: Any) -> tuple[Any, Any]:
        """Per-row subsets on the device from a bitmap ``allowed [B, n_tools]`` (uint8, 1 = allowed): the rows'
        edge counts are computed there, one thread per (row, tool), from the compiled tool paths."""
        trie = self.artifact.trie
        if self._paths is None:
            self._paths = (cuda.to_device(trie.tool_path_start), cuda.to_device(trie.tool_path_edges))
        allowed = cuda.to_device(np.ascontiguousarray(allowed, dtype=np.uint8)) if isinstance(
            allowed, np.ndarray) else allowed
        rows = allowed.shape[0]
        counts = cuda.device_array((rows, trie.n_edges), np.int32)
        threads = (4, 64)
        _zero_counts[((rows + 3) // 4, (trie.n_edges + 63) // 64), threads](counts)
        _count_subset_paths[((rows + 3) // 4, (trie.n_tools + 63) // 64), threads](
            *self._paths, trie.n_tools, trie.n_tries, allowed, counts)
        return counts, allowed

    def _launch(self, table: Any, subsets: tuple[Any, Any] | None, scores: Any, hidden: Any, n_rows: int,
                n_cols: int, chosen: Any, reasoning_end_id: int | None, vocab: VocabMap | None, stream: Any,
                stats: Any) -> None:
        vocab = vocab or VocabMap.identity(n_cols)
        check_step_inputs(self.artifact, table.shape[0], n_rows, n_cols, vocab)
        if stats is None:
            stats = self._no_stats
        check_stats(stats, table.shape[0])
        maps = _device_maps(vocab)
        batch = table.shape[0]
        if self.layout == "warp":
            grid, block = batch, WARP
        else:
            grid, block = (batch + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK, THREADS_PER_BLOCK
        if stream is not None:  # the caller's own stream
            launch = self._kernel[grid, block, stream]
        else:
            launch = self._configured(grid, block, _torch_stream_handle(scores))
        artifact = self.artifact
        counts, allowed = subsets if subsets is not None else self._whole_registry
        launch(*self._trie_args, artifact.trie.n_tools, artifact.eos_id,
               -1 if reasoning_end_id is None else reasoning_end_id, table, counts, allowed, scores, hidden, n_cols,
               *maps, chosen, stats)

    def _configured(self, grid: int, block: int, torch_stream: int | None) -> Any:
        """The kernel configured for this grid, block and torch stream (None: the default stream), made once per
        kind: configuring makes Numba objects (the stream's too) on every launch, and warns about grids under 128
        blocks, which one block per slot makes this kernel's usual case."""
        key = (grid, block, torch_stream)
        launch = self._launches.get(key)
        if launch is None:
            if len(self._launches) >= _LAUNCHES_CACHED:
                self._launches.clear()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r".*Grid size \d+ will likely result in GPU under-util")
                launch = (self._kernel[grid, block] if torch_stream is None
                          else self._kernel[grid, block, cuda.external_stream(torch_stream)])
            self._launches[key] = launch
        return launch


def compact_on_device(table: Any, batch_mapping: Any) -> Any:
    """The slot table after an eviction (``batch_mapping[i]``: old slot i's new index, or -1), gathered on the
    device; returns a new device array."""
    mapping = np.asarray(batch_mapping, dtype=np.int64)
    kept = int((mapping >= 0).sum())
    order = np.empty(kept, dtype=np.int64)
    order[mapping[mapping >= 0]] = np.nonzero(mapping >= 0)[0]
    new_table = cuda.device_array((kept, table.shape[1]), dtype=np.int32)
    if kept:
        threads = (8, 32)
        blocks = ((kept + 7) // 8, (table.shape[1] + 31) // 32)
        _gather_rows[blocks, threads](table, cuda.to_device(order), new_table)
    return new_table


_maps_cache: dict[int, tuple[Any, Any, VocabMap]] = {}


def _device_maps(vocab: VocabMap) -> tuple[Any, Any]:
    """Device copies of a vocabulary map, made once per map."""
    cached = _maps_cache.get(id(vocab))
    if cached is None or cached[2] is not vocab:
        cached = (cuda.to_device(vocab.full_to_output), cuda.to_device(vocab.output_to_full), vocab)
        _maps_cache[id(vocab)] = cached
    return cached[0], cached[1]


def _bf16_as_bits(logits: Any) -> Any:
    """bfloat16 has no Numba type: hand its bits over as int16 (``walk.score`` orders them exactly)."""
    dtype = getattr(logits, "dtype", None)
    if dtype is not None and str(dtype) == "torch.bfloat16":
        return logits.view(__import__("torch").int16)
    return logits


def _torch_stream_handle(array: Any) -> int | None:
    """The handle of torch's current stream on ``array``'s device, when it is a torch CUDA tensor."""
    if type(array).__module__.startswith("torch") and getattr(array, "is_cuda", False):
        import torch

        return int(torch.cuda.current_stream(array.device).cuda_stream)
    return None
