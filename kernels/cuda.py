"""The CUDA backend: every operation of ``kernels/batch.py`` is one launch for the whole batch, on state that lives
on the device; the host never walks the trie.

The trie. Its nine arrays are packed into one int32 buffer (``pack_trie``); a kernel unpacks views of it
(``offsets`` says where each array starts). When the buffer fits the constant-memory budget
(``CONSTANT_MEMORY_BUDGET``, below the 64 KiB a module may hold) it is captured as a constant of kernels compiled
for that artifact: Numba puts a closure's NumPy arrays in constant memory when the kernel is compiled. Constant
memory is per compiled module, so each artifact gets its own kernels (a factory cached by artifact hash) and two
grammars can never overwrite each other. Larger tries live in global memory, read by one set of kernels shared by
all artifacts.

Layouts of a choice. ``warp`` (the default): a block of one warp per row; the lanes split the candidate tokens,
each keeps its best, and a shared-memory tree reduction under the total order (score desc, token asc) picks the
winner, so the result never depends on thread timing; lane 0 advances the row and follows the forced run.
``thread``: a thread per row walking its candidates alone. ``bench/bench_kernel.py`` measures both. Accepting
tokens and forced runs take a thread per row; a mask takes a block per row (the lanes clear the row's words, lane 0
sets the legal bits), then one thread per logit writes -inf where a bit is clear.

Inputs come as the model makes them: torch CUDA tensors or CuPy arrays through ``__cuda_array_interface__``,
zero-copy; float32/float16 logits as they are, bfloat16 viewed as int16 bits (``kernels/walk.py`` orders them
exactly, with no conversion pass; a mask writes -inf's bits). Every launch and copy goes on torch's current stream
(where torch uses CUDA; else Numba's default stream), so the kernels run in order with the model's work on
whichever stream that is.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections import OrderedDict
from typing import Any

import numpy as np
from numba import config, cuda

from tooltrie.compiler.artifact import CONSTANT_MEMORY_BUDGET, Artifact
from tooltrie.kernels import walk
from tooltrie.kernels.cpu import MINUS_INF_BITS, TRIE_FIELDS, Outputs, check_stats
from tooltrie.kernels.state import RUNNING, STATUS, BatchState
from tooltrie.kernels.vocab import VocabMap, check_step_inputs

if config.ENABLE_CUDASIM:  # the simulator runs Python: give it the walk as Python too
    walk = walk.python_twin()
accept_token, beats, best_move, best_plain, choose_row, follow_forced = (
    walk.accept_token, walk.beats, walk.best_move, walk.best_plain, walk.choose_row, walk.follow_forced)
clear_words, is_plain, mark_row, plain_excluded = walk.clear_words, walk.is_plain, walk.mark_row, walk.plain_excluded
put_decision, take_move, take_plain = walk.put_decision, walk.take_move, walk.take_plain
fuse_row, has_ranker = walk.fuse_row, walk.has_ranker
lse_merge, no_stats, put_stats = walk.lse_merge, walk.no_stats, walk.put_stats

LOG = logging.getLogger(__name__)
WARP = 32
LAYOUTS = ("warp", "thread")
THREADS_PER_BLOCK = 128  # thread layout: rows per block
_KERNEL_CACHE_SIZE = 16
_LAUNCHES_CACHED = 256  # configured launches per backend: (kernel, grid, block, stream) kinds seen
_kernels: OrderedDict[tuple[str, str, str], Any] = OrderedDict()


def pack_trie(arrays: dict[str, np.ndarray[Any, Any]]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The trie's arrays as one int32 buffer, and the offsets where each starts (``len(TRIE_FIELDS) + 1``)."""
    parts = [np.ascontiguousarray(arrays[name], dtype=np.int32) for name in TRIE_FIELDS]
    offsets = np.zeros(len(parts) + 1, dtype=np.int32)
    offsets[1:] = np.cumsum([len(part) for part in parts])
    return np.concatenate(parts), offsets


@cuda.jit(device=True)
def _unpack(buffer: Any, offsets: Any) -> Any:
    return (buffer[offsets[0]:offsets[1]], buffer[offsets[1]:offsets[2]], buffer[offsets[2]:offsets[3]],
            buffer[offsets[3]:offsets[4]], buffer[offsets[4]:offsets[5]], buffer[offsets[5]:offsets[6]],
            buffer[offsets[6]:offsets[7]], buffer[offsets[7]:offsets[8]], buffer[offsets[8]:offsets[9]])


# -- the row functions (device code, written once for both placements) ----------------------------------------------

@cuda.jit(device=True)
def _warp_choice(trie: Any, n_tools: int, eos_id: int, reasoning_end_id: int, table: Any, counts: Any,
                 allowed: Any, rows: Any, scores: Any, hidden: Any, n_cols: int, full_to_output: Any,
                 output_to_full: Any, chosen: Any, stats: Any, decision: Any, forced: Any, n_forced: Any,
                 ranked: Any) -> None:
    srow, lane = cuda.blockIdx.x, cuda.threadIdx.x
    row = rows[srow]
    if row < 0 or table[row, STATUS] != RUNNING:  # uniform across the block: every lane leaves together
        if lane == 0:
            chosen[srow] = -1
            no_stats(stats, srow)
            if n_forced.shape[0] > 0:
                n_forced[srow] = 0
        return
    s_value = cuda.shared.array(WARP, dtype=np.float64)
    s_token = cuda.shared.array(WARP, dtype=np.int64)
    s_kind = cuda.shared.array(WARP, dtype=np.int64)
    s_edge = cuda.shared.array(WARP, dtype=np.int64)
    s_runner_up = cuda.shared.array(WARP, dtype=np.float64)
    s_lse_max = cuda.shared.array(WARP, dtype=np.float64)
    s_lse_sum = cuda.shared.array(WARP, dtype=np.float64)
    s_legal = cuda.shared.array(WARP, dtype=np.int32)
    s_continue = cuda.shared.array(WARP, dtype=np.int32)
    with_stats = stats.shape[0] > 0  # uniform across the block
    plain = is_plain(table, row)
    if plain:
        value, token, runner_up, lse_max, lse_sum = best_plain(
            row, srow, lane, WARP, n_cols, scores, hidden, output_to_full, plain_excluded(table, row, eos_id),
            with_stats)
        kind, edge, n_legal, n_continue = -1, -1, 0, 0
    elif has_ranker(ranked[0], row) and lane > 0:  # a ranked row is scanned by lane 0 alone (``walk.best_move``)
        value, token, kind, edge, runner_up, lse_max, lse_sum, n_legal, n_continue = (
            -np.inf, -1, -1, -1, -np.inf, -np.inf, 0.0, 0, 0)
    else:
        value, token, kind, edge, runner_up, lse_max, lse_sum, n_legal, n_continue = best_move(
            row, srow, lane, 1 if has_ranker(ranked[0], row) else WARP, trie, n_tools, eos_id, table, counts, allowed,
            scores, hidden, full_to_output, with_stats, ranked)
    s_value[lane], s_token[lane], s_kind[lane], s_edge[lane] = value, token, kind, edge
    s_runner_up[lane], s_lse_max[lane], s_lse_sum[lane] = runner_up, lse_max, lse_sum
    s_legal[lane], s_continue[lane] = n_legal, n_continue
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
            s_legal[lane] += s_legal[other]
            s_continue[lane] += s_continue[other]
            if other_wins:
                s_value[lane], s_token[lane], s_kind[lane], s_edge[lane] = (
                    s_value[other], s_token[other], s_kind[other], s_edge[other])
        cuda.syncthreads()
        width //= 2
    if lane == 0:
        put_stats(stats, srow, s_value[0], s_runner_up[0], s_lse_max[0], s_lse_sum[0])
        chosen[srow] = s_token[0]
        if plain:
            take_plain(row, s_token[0], eos_id, reasoning_end_id, table)
        else:
            put_decision(decision, srow, table, row, s_legal[0], s_continue[0])
            take_move(row, s_token[0], s_kind[0], s_edge[0], trie, table)
        follow_forced(row, srow, trie, n_tools, eos_id, table, counts, allowed, forced, n_forced)


@cuda.jit(device=True)
def _thread_choice(trie: Any, n_tools: int, eos_id: int, reasoning_end_id: int, table: Any, counts: Any,
                   allowed: Any, rows: Any, scores: Any, hidden: Any, n_cols: int, full_to_output: Any,
                   output_to_full: Any, chosen: Any, stats: Any, decision: Any, forced: Any, n_forced: Any,
                   ranked: Any) -> None:
    srow = cuda.grid(1)
    if srow < rows.shape[0]:
        choose_row(rows[srow], srow, trie, n_tools, eos_id, reasoning_end_id, table, counts, allowed, scores, hidden,
                   n_cols, full_to_output, output_to_full, chosen, stats, decision, forced, n_forced, ranked)


_CHOICES = {"warp": _warp_choice, "thread": _thread_choice}


@cuda.jit(device=True)
def _accept_row(trie: Any, n_tools: int, eos_id: int, reasoning_end_id: int, table: Any, counts: Any, allowed: Any,
                rows: Any, tokens: Any, n_tokens: Any) -> None:
    i = cuda.grid(1)
    if i < rows.shape[0] and rows[i] >= 0:
        for j in range(n_tokens[i]):
            accept_token(rows[i], tokens[i, j], trie, n_tools, eos_id, reasoning_end_id, table, counts, allowed)


@cuda.jit(device=True)
def _forced_row(trie: Any, n_tools: int, eos_id: int, table: Any, counts: Any, allowed: Any, rows: Any, forced: Any,
                n_forced: Any) -> None:
    i = cuda.grid(1)
    if i < rows.shape[0]:
        if rows[i] >= 0:
            follow_forced(rows[i], i, trie, n_tools, eos_id, table, counts, allowed, forced, n_forced)
        elif n_forced.shape[0] > 0:
            n_forced[i] = 0


@cuda.jit(device=True)
def _fuse_row(trie: Any, n_tools: int, eos_id: int, table: Any, counts: Any, allowed: Any, rows: Any, logits: Any,
              logits_bits: Any, hidden: Any, full_to_output: Any, ranked: Any) -> None:
    """Thread ``i`` writes score row ``i``'s fused values (``walk.fuse_row``; a ranked row is one lane's scan)."""
    i = cuda.grid(1)
    if i < rows.shape[0]:
        fuse_row(rows[i], i, trie, n_tools, eos_id, table, counts, allowed, logits, logits_bits, hidden,
                 full_to_output, ranked)


@cuda.jit(device=True)
def _fill_row(trie: Any, n_tools: int, eos_id: int, table: Any, counts: Any, allowed: Any, rows: Any,
              bitmask: Any) -> None:
    """Block ``i`` fills ``bitmask[i]`` (see ``walk.fill_rows`` for what each row gets)."""
    i, lane = cuda.blockIdx.x, cuda.threadIdx.x
    row = rows[i]
    if row < 0:
        return
    clear_words(row, i, lane, cuda.blockDim.x, table, bitmask)
    cuda.syncthreads()
    if lane == 0:
        mark_row(row, i, trie, n_tools, eos_id, table, counts, allowed, bitmask, bitmask[:0], rows[:0])  # edges walked


@cuda.jit
def _mask_kernel(bitmask: Any, rows: Any, logits_bits: Any, minus_inf: int) -> None:
    """``logits_bits[i, col] = minus_inf`` where the bit of ``col`` is clear (or past the bitmask), for ours."""
    i, first = cuda.grid(2)
    if i < rows.shape[0] and rows[i] >= 0:
        for col in range(first, logits_bits.shape[1], cuda.gridsize(2)[1]):
            word = col >> 5
            if word >= bitmask.shape[1] or (bitmask[i, word] >> (col & 31)) & 1 == 0:
                logits_bits[i, col] = minus_inf


def make_kernels(arrays: dict[str, np.ndarray[Any, Any]] | None, layout: str) -> dict[str, Any]:
    """The kernels of one placement: with ``arrays``, that trie baked into constant memory (one module per
    grammar); without, the trie comes at launch as a global-memory buffer and its offsets (any size, shared)."""
    choice_row = _CHOICES[layout]
    if arrays is None:
        load = _unpack
    else:
        packed, packed_offsets = pack_trie(arrays)

        @cuda.jit(device=True)
        def load(buffer: Any, offsets: Any) -> Any:
            return _unpack(cuda.const.array_like(packed), cuda.const.array_like(packed_offsets))

    @cuda.jit
    def choose(buffer: Any, offsets: Any, n_tools: int, eos_id: int, reasoning_end_id: int, table: Any, counts: Any,
               allowed: Any, rows: Any, scores: Any, hidden: Any, n_cols: int, full_to_output: Any,
               output_to_full: Any, chosen: Any, stats: Any, decision: Any, forced: Any, n_forced: Any, ranker: Any,
               below_start: Any, below_tools: Any) -> None:
        choice_row(load(buffer, offsets), n_tools, eos_id, reasoning_end_id, table, counts, allowed, rows, scores,
                   hidden, n_cols, full_to_output, output_to_full, chosen, stats, decision, forced, n_forced,
                   (ranker, below_start, below_tools))

    @cuda.jit
    def accept(buffer: Any, offsets: Any, n_tools: int, eos_id: int, reasoning_end_id: int, table: Any, counts: Any,
               allowed: Any, rows: Any, tokens: Any, n_tokens: Any) -> None:
        _accept_row(load(buffer, offsets), n_tools, eos_id, reasoning_end_id, table, counts, allowed, rows, tokens,
                    n_tokens)

    @cuda.jit
    def forced(buffer: Any, offsets: Any, n_tools: int, eos_id: int, table: Any, counts: Any, allowed: Any,
               rows: Any, forced: Any, n_forced: Any) -> None:
        _forced_row(load(buffer, offsets), n_tools, eos_id, table, counts, allowed, rows, forced, n_forced)

    @cuda.jit
    def fill(buffer: Any, offsets: Any, n_tools: int, eos_id: int, table: Any, counts: Any, allowed: Any, rows: Any,
             bitmask: Any) -> None:
        _fill_row(load(buffer, offsets), n_tools, eos_id, table, counts, allowed, rows, bitmask)

    @cuda.jit
    def fuse(buffer: Any, offsets: Any, n_tools: int, eos_id: int, table: Any, counts: Any, allowed: Any, rows: Any,
             logits: Any, logits_bits: Any, hidden: Any, full_to_output: Any, ranker: Any, below_start: Any,
             below_tools: Any) -> None:
        _fuse_row(load(buffer, offsets), n_tools, eos_id, table, counts, allowed, rows, logits, logits_bits, hidden,
                  full_to_output, (ranker, below_start, below_tools))

    return {"choose": choose, "accept": accept, "forced": forced, "fill": fill, "fuse": fuse}


@cuda.jit
def _zero_counts(counts: Any, rows: Any) -> None:
    i, edge = cuda.grid(2)
    if i < rows.shape[0] and edge < counts.shape[1]:
        counts[rows[i], edge] = 0


@cuda.jit
def _count_subset_paths(tool_path_start: Any, tool_path_edges: Any, n_tools: int, n_tries: int, allowed: Any,
                        rows: Any, counts: Any) -> None:
    """Each allowed tool adds one to every edge on its paths (one per trie): ``edge_tool_count`` of the subset."""
    i, tool = cuda.grid(2)
    if i < rows.shape[0] and tool < n_tools and allowed[rows[i], tool] != 0:
        for trie in range(n_tries):
            path = trie * n_tools + tool
            for j in range(tool_path_start[path], tool_path_start[path + 1]):
                cuda.atomic.add(counts, (rows[i], tool_path_edges[j]), 1)


def _cached_kernels(key: tuple[str, str, str], make: Any) -> Any:
    if key in _kernels:
        _kernels.move_to_end(key)
        return _kernels[key]
    kernels = _kernels[key] = make()
    if len(_kernels) > _KERNEL_CACHE_SIZE:
        _kernels.popitem(last=False)
    return kernels


class CudaBackend:
    """Every operation of the backend protocol (``kernels/batch.py``) as one launch, on device-resident state.

    ``placement`` is ``"auto"`` (constant memory when the trie fits ``constant_budget`` bytes), ``"constant"`` or
    ``"global"``; the choice is in ``self.placement`` and logged. The host ``BatchState`` is where rows are added,
    removed and moved (a few ints each, copied up by :meth:`sync`); steps advance the device copy, and
    :meth:`fetch` brings it back when the host reads a row.
    """

    name = "cuda"

    def __init__(self, artifact: Artifact, *, reasoning_end_id: int | None = None, placement: str = "auto",
                 layout: str = "warp", constant_budget: int = CONSTANT_MEMORY_BUDGET) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")
        if placement == "auto":
            placement = artifact.placement(constant_budget)
        if placement not in ("constant", "global"):
            raise ValueError(f"unknown placement {placement!r}; choose 'auto', 'constant' or 'global'")
        self.artifact, self.placement, self.layout = artifact, placement, layout
        self.n_tools, self.eos_id = artifact.trie.n_tools, artifact.eos_id
        self.reasoning_end_id = -1 if reasoning_end_id is None else reasoning_end_id
        arrays = artifact.trie.arrays()
        if placement == "constant":
            self.kernels = _cached_kernels((artifact.sha256, placement, layout),
                                           lambda: make_kernels(dict(arrays), layout))
            # Nothing to read at launch (a launch cannot pass None: one-element stand-ins).
            self._trie_args: tuple[Any, Any] = (cuda.to_device(np.zeros(1, np.int32)),) * 2
        else:
            self.kernels = _cached_kernels(("*", placement, layout), lambda: make_kernels(None, layout))
            buffer, offsets = pack_trie(arrays)
            self._trie_args = (cuda.to_device(buffer), cuda.to_device(offsets))
        LOG.info("tooltrie: registry %r (%d device bytes) decodes from %s memory, %s layout",
                 artifact.registry.name, artifact.trie.device_bytes, placement, layout)
        self._no_hidden = cuda.device_array(0, np.float32)  # 1-D: a dense choice (a launch cannot pass None)
        self._paths: tuple[Any, Any] | None = None
        self._launches: dict[tuple[str, int, Any, int | None], Any] = {}  # see _configured
        self._streams: dict[int, Any] = {}  # torch stream handle -> Numba's view of it
        self._outputs: dict[tuple[int, int], Outputs] = {}
        self.table: Any = None
        self.counts: Any = None
        self.allowed: Any = None
        self.ranker: Any = None
        self._below: dict[bool, tuple[Any, Any]] = {}  # see _ranked

    # -- the state on the device ---------------------------------------------------------------------------------

    def sync(self, state: BatchState, rows: Any) -> None:
        """Copy host rows up; the whole state when its shape changed (grown, wider k, first subset)."""
        stream = self._stream()
        if (self.table is None or self.table.shape != state.table.shape or self.counts.shape != state.counts.shape
                or self.ranker.shape != state.ranker.shape):
            self.table = cuda.to_device(state.table, stream=stream)
            self.counts = cuda.to_device(state.counts, stream=stream)
            self.allowed = cuda.to_device(state.allowed, stream=stream)
            self.ranker = cuda.to_device(state.ranker, stream=stream)
            return
        for row in np.asarray(rows).tolist():
            self.table[row:row + 1].copy_to_device(state.table[row:row + 1], stream=stream)
            if state.counts.shape[0]:
                self.counts[row:row + 1].copy_to_device(state.counts[row:row + 1], stream=stream)
                self.allowed[row:row + 1].copy_to_device(state.allowed[row:row + 1], stream=stream)
            if state.ranker.shape[0]:
                self.ranker[row:row + 1].copy_to_device(state.ranker[row:row + 1], stream=stream)

    def fetch(self, state: BatchState) -> None:
        stream = self._stream()
        self.table.copy_to_host(state.table, stream=stream)
        if stream:
            stream.synchronize()  # the host reads the statuses next

    def bitmask(self, shape: tuple[int, int]) -> Any:
        return cuda.device_array(shape, dtype=np.int32)

    def outputs(self, n_rows: int, *, forced_width: int) -> Outputs:
        """Device outputs, allocated once per shape (a step's results are copied out before the next step)."""
        key = (n_rows, forced_width)
        if key not in self._outputs:
            self._outputs[key] = Outputs(
                cuda.device_array(n_rows, np.int32), cuda.device_array((n_rows, 3), np.float64),
                cuda.device_array((n_rows, 3), np.int32), cuda.device_array((n_rows, forced_width), np.int32),
                cuda.device_array(n_rows, np.int32))
        return self._outputs[key]

    # -- the operations ------------------------------------------------------------------------------------------

    def accept(self, state: BatchState, rows: Any, tokens: Any, n_tokens: Any) -> None:
        self._launch("accept", _blocks(len(rows)), THREADS_PER_BLOCK, tokens, *self._trie_args, self.n_tools,
                     self.eos_id, self.reasoning_end_id, self.table, self.counts, self.allowed, self._device(rows),
                     self._device(tokens), self._device(n_tokens))

    def follow_forced(self, state: BatchState, rows: Any, out: Outputs) -> None:
        self._launch("forced", _blocks(len(rows)), THREADS_PER_BLOCK, None, *self._trie_args, self.n_tools,
                     self.eos_id, self.table, self.counts, self.allowed, self._device(rows), out.forced,
                     out.n_forced)

    def fill_bitmask(self, state: BatchState, rows: Any, bitmask: Any, *, like: Any = None) -> None:
        """``like``: the tensor whose torch stream the launch joins (default: the bitmask's)."""
        if len(rows):
            self._launch("fill", len(rows), WARP, bitmask if like is None else like, *self._trie_args, self.n_tools,
                         self.eos_id, self.table, self.counts, self.allowed, self._device(rows), bitmask)

    def mask_logits_(self, state: BatchState, rows: Any, logits: Any, bitmask: Any) -> None:
        if not len(rows):
            return
        device_rows = self._device(rows)
        self.fill_bitmask(state, device_rows, bitmask, like=logits)
        bits, minus_inf = _logits_bits(logits)
        # Each thread strides over the columns; the simulator (a Python thread per GPU thread) gets one block a row.
        column_blocks = 1 if config.ENABLE_CUDASIM else min(32, (bits.shape[1] + 255) // 256)
        self._configured(_mask_kernel, "mask", (len(rows), column_blocks), (1, 256), logits)(
            bitmask, device_rows, bits, minus_inf)

    def fuse_logits_(self, state: BatchState, rows: Any, logits: Any) -> None:
        """After ``mask_logits_``: each ranked row's legal logits become its option values, a thread per row."""
        if not len(rows):
            return
        # The kernel writes floats and nudges their bits: two views of one memory, so host logits go up once
        # (a launch would copy each view up and back on its own, the later copy undoing the earlier one's writes).
        values = cuda.to_device(logits, stream=self._stream()) if isinstance(logits, np.ndarray) else logits
        bits, _ = _logits_bits(values)
        full_to_output, _ = _device_maps(VocabMap.identity(bits.shape[1]), self._stream(logits))
        self._launch("fuse", _blocks(len(rows)), THREADS_PER_BLOCK, logits, *self._trie_args, self.n_tools,
                     self.eos_id, self.table, self.counts, self.allowed, self._device(rows), values, bits,
                     self._no_hidden, full_to_output, *self._ranked())
        if values is not logits:
            values.copy_to_host(logits, stream=self._stream())
            if self._stream():
                self._stream().synchronize()

    def choose(self, state: BatchState, rows: Any, scores: Any, hidden: Any, vocab: VocabMap | None,
               out: Outputs) -> None:
        if hidden is None:
            if ((out.stats.shape[0] or self.ranker.shape[0])
                    and str(getattr(scores, "dtype", "")) in ("torch.bfloat16", "int16", "torch.int16")):
                raise ValueError("stats and rankers need float16/float32 logits: bfloat16 logits are compared as "
                                 "their bits")
            scores = _bf16_as_bits(scores)
            n_score_rows, n_cols, hidden = scores.shape[0], scores.shape[1], self._no_hidden
        else:
            n_score_rows, n_cols = hidden.shape[0], scores.shape[0]
        vocab = vocab or VocabMap.identity(n_cols)
        check_step_inputs(self.artifact, len(rows), n_score_rows, n_cols, vocab)
        check_stats(out.stats, len(rows))
        if not len(rows):
            return
        grid, block = (len(rows), WARP) if self.layout == "warp" else (_blocks(len(rows)), THREADS_PER_BLOCK)
        self._launch("choose", grid, block, scores, *self._trie_args, self.n_tools, self.eos_id,
                     self.reasoning_end_id, self.table, self.counts, self.allowed, self._device(rows), scores,
                     hidden, n_cols, *_device_maps(vocab, self._stream(scores)), out.chosen, out.stats, out.decision,
                     out.forced, out.n_forced, *self._ranked())

    def _ranked(self) -> tuple[Any, Any, Any]:
        """The ranker and the trie's per-edge tool lists (``walk.edge_prior``; one-element stand-ins while no row
        is ranked), on the device, copied once."""
        ranked = self.ranker.shape[0] > 0
        if ranked not in self._below:
            start, tools = self.artifact.trie.tools_below() if ranked else walk.no_ranker()[1:]
            self._below[ranked] = (self._device(start), self._device(tools))
        return (self.ranker, *self._below[ranked])

    def subsets(self, allowed: Any) -> tuple[Any, Any]:
        """Per-row subsets counted on the device from a bitmap ``allowed [B, n_tools]`` (uint8, 1 = allowed): the
        rows' edge counts, one thread per (row, tool), from the compiled tool paths."""
        trie = self.artifact.trie
        if self._paths is None:
            self._paths = (self._device(trie.tool_path_start), self._device(trie.tool_path_edges))
        like = allowed
        allowed = self._device(np.ascontiguousarray(allowed, dtype=np.uint8)) if isinstance(allowed, np.ndarray) \
            else allowed
        n = allowed.shape[0]
        rows = self._device(np.arange(n, dtype=np.int32))
        counts = cuda.device_array((n, trie.n_edges), np.int32, stream=self._stream(like))
        threads = (4, 64)
        self._configured(_zero_counts, "zero counts", ((n + 3) // 4, (trie.n_edges + 63) // 64), threads, like)(
            counts, rows)
        self._configured(_count_subset_paths, "count subsets", ((n + 3) // 4, (trie.n_tools + 63) // 64), threads,
                         like)(*self._paths, trie.n_tools, trie.n_tries, allowed, rows, counts)
        return counts, allowed

    def _launch(self, kernel: str, grid: Any, block: Any, like: Any, *args: Any) -> None:
        self._configured(self.kernels[kernel], kernel, grid, block, like)(*args)

    def _configured(self, kernel: Any, name: str, grid: Any, block: Any, like: Any) -> Any:
        """The kernel configured for this grid, block and torch's current stream (on ``like``'s device, for a torch
        CUDA tensor), made once per kind: configuring makes Numba objects on every launch, and warns about grids
        under 128 blocks, which one block per row makes this backend's usual case."""
        handle = _torch_stream_handle(like)
        key = (name, id(kernel), (grid, block), handle)
        launch = self._launches.get(key)
        if launch is None or config.ENABLE_CUDASIM:  # the simulator's ``kernel[...]`` sets dims on the kernel itself
            if len(self._launches) >= _LAUNCHES_CACHED:
                self._launches.clear()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r".*Grid size \d+ will likely result in GPU under-util")
                launch = kernel[grid, block] if handle is None else kernel[grid, block, self._stream(like)]
            self._launches[key] = launch
        return launch

    def _stream(self, like: Any = None) -> Any:
        """Torch's current stream (on ``like``'s device, for a torch CUDA tensor) as a Numba stream, made once per
        handle; 0 (Numba's default stream) where torch does not use CUDA."""
        handle = _torch_stream_handle(like)
        if handle is None:
            return 0
        if handle not in self._streams:
            self._streams[handle] = cuda.external_stream(handle)
        return self._streams[handle]

    def _device(self, array: Any) -> Any:
        """Host index arrays go up (a few ints) on the launches' stream; device arrays pass as they are."""
        if isinstance(array, np.ndarray):
            return cuda.to_device(np.ascontiguousarray(array), stream=self._stream())
        return array


class CudaStepper:
    """One choice over a whole slot table on the device (score row i is table row i): the kernel-level view of
    :class:`CudaBackend`, for benchmarks and kernel tests that hold their own tables."""

    def __init__(self, artifact: Artifact, *, placement: str = "auto", layout: str = "warp",
                 constant_budget: int = CONSTANT_MEMORY_BUDGET) -> None:
        self.backend = CudaBackend(artifact, placement=placement, layout=layout, constant_budget=constant_budget)
        self.artifact, self.placement, self.layout = artifact, self.backend.placement, layout
        self._no_subsets = (cuda.device_array((0, 0), np.int32), cuda.device_array((0, 0), np.uint8))
        self._no_ranker = cuda.device_array((0, 1), np.float32)
        self._no_outputs = (cuda.device_array((0, 3), np.int32), cuda.device_array((0, 0), np.int32),
                            cuda.device_array(0, np.int32))

    def step(self, table: Any, logits: Any, chosen: Any, *, subsets: tuple[Any, Any] | None = None,
             reasoning_end_id: int | None = None, vocab: VocabMap | None = None, stats: Any = None) -> None:
        """``table`` on the device (advanced in place), logits ``[B, V]``, ``chosen`` int32 ``[B]``; ``stats``
        (float64 ``[B, 3]``) as in ``kernels/walk.py`` (float logits only: bfloat16 is compared as its bits)."""
        self._run(table, logits, None, chosen, subsets, reasoning_end_id, vocab, stats)

    def sparse_step(self, table: Any, hidden: Any, output_embedding: Any, chosen: Any, *,
                    subsets: tuple[Any, Any] | None = None, reasoning_end_id: int | None = None,
                    vocab: VocabMap | None = None, stats: Any = None) -> None:
        """From hidden states ``[B, H]`` and ``W [V, H]``: dot products for legal tokens only, in the launch."""
        self._run(table, output_embedding, hidden, chosen, subsets, reasoning_end_id, vocab, stats)

    def subsets(self, allowed: Any) -> tuple[Any, Any]:
        return self.backend.subsets(allowed)

    def _run(self, table: Any, scores: Any, hidden: Any, chosen: Any, subsets: tuple[Any, Any] | None,
             reasoning_end_id: int | None, vocab: VocabMap | None, stats: Any) -> None:
        backend = self.backend
        backend.reasoning_end_id = -1 if reasoning_end_id is None else reasoning_end_id
        backend.table = table
        backend.counts, backend.allowed = subsets if subsets is not None else self._no_subsets
        backend.ranker = self._no_ranker
        rows = np.arange(table.shape[0], dtype=np.int32)
        out = Outputs(chosen, cuda.device_array((0, 3), np.float64) if stats is None else stats, *self._no_outputs)
        backend.choose(BatchState(np.zeros((0, 0), np.int32)), rows, scores, hidden, vocab, out)


def _blocks(n: int) -> int:
    return max(1, (n + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK)


_maps_cache: dict[int, tuple[Any, Any, VocabMap]] = {}


def _device_maps(vocab: VocabMap, stream: Any) -> tuple[Any, Any]:
    """Device copies of a vocabulary map, made once per map (on ``stream``, where the launch that reads them goes)."""
    cached = _maps_cache.get(id(vocab))
    if cached is None or cached[2] is not vocab:
        cached = (cuda.to_device(vocab.full_to_output, stream=stream), cuda.to_device(vocab.output_to_full,
                                                                                      stream=stream), vocab)
        _maps_cache[id(vocab)] = cached
    return cached[0], cached[1]


def _bf16_as_bits(logits: Any) -> Any:
    """bfloat16 has no Numba type: hand its bits over as int16 (``walk.score`` orders them exactly)."""
    dtype = getattr(logits, "dtype", None)
    if dtype is not None and str(dtype) == "torch.bfloat16":
        return logits.view(__import__("torch").int16)
    return logits


def _logits_bits(logits: Any) -> tuple[Any, int]:
    """An integer view of device (or, under the simulator, host) logits and the bits of -inf in their dtype."""
    name = str(logits.dtype).removeprefix("torch.")
    if name not in MINUS_INF_BITS:
        raise ValueError(f"logits must be float32, float16 or bfloat16, got {logits.dtype}")
    int_type, minus_inf = MINUS_INF_BITS[name]
    if isinstance(logits, np.ndarray):
        return logits.view(int_type), minus_inf
    if type(logits).__module__.startswith("torch"):
        import torch

        return logits.view(torch.int32 if int_type is np.int32 else torch.int16), minus_inf
    return logits.view(int_type), minus_inf  # CuPy and Numba device arrays view like NumPy


def _torch_stream_handle(like: Any = None) -> int | None:
    """The handle of torch's current stream, on ``like``'s device for a torch CUDA tensor, else on the current
    device; None where torch has not started CUDA (nothing of torch's to run in order with)."""
    device = like.device if type(like).__module__.startswith("torch") and getattr(like, "is_cuda", False) else None
    return _torch_current_stream(device)


def _torch_current_stream(device: Any = None) -> int | None:
    """torch's current CUDA stream's handle (None without torch, or before torch has used CUDA). torch is not
    imported here: a pipeline that uses it has imported it already."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.current_stream(device).cuda_stream)
