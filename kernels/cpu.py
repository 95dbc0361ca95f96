"""The CPU backend: the walk of ``kernels/walk.py`` compiled with Numba, one call per operation on the whole batch.

Same semantics as ``kernels/reference.py`` (tested against it). A choice reads only the legal tokens' scores, never
the whole row: with ``hidden`` and an output embedding ``W`` instead of logits it is the sparse head, computing
``hidden[row] . W[token]`` for the legal tokens alone. The state is the host's ``BatchState``; nothing is copied.
"""

from __future__ import annotations

import functools
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt

from tooltrie.compiler.artifact import Artifact
from tooltrie.errors import DecodeError
from tooltrie.kernels.state import BatchState
from tooltrie.kernels.vocab import VocabMap, check_step_inputs
from tooltrie.kernels.walk import (
    accept_rows,
    choose_rows,
    copy_legal,
    fill_rows,
    forced_rows,
    fuse_rows,
    mask_rows,
    no_ranker,
)

TRIE_FIELDS = ("node_edge_start", "edge_token", "edge_child", "edge_tool_count", "node_tool", "trie_root",
               "phase_trie", "tool_path_start", "tool_path_edges")

# The bit pattern of -inf in each float dtype, as an integer of the same width (a mask writes these).
MINUS_INF_BITS: dict[str, tuple[type[np.signedinteger[Any]], int]] = {
    "float32": (np.int32, -8388608), "float16": (np.int16, -1024), "bfloat16": (np.int16, -128)}


class Outputs:
    """What a choice writes, one row per score row: the chosen full token (-1: none), the statistics a score needs
    (float64 ``[n, 3]``: best, runner-up, log-sum-exp; NaN for rows that took no step), the decision counts
    (int32 ``[n, 3]``, ``walk.put_decision``) and the forced run after the choice (``forced [n, width]``, its length
    in ``n_forced``). Allocated by the backend, where its arrays live."""

    def __init__(self, chosen: Any, stats: Any, decision: Any, forced: Any, n_forced: Any) -> None:
        self.chosen, self.stats, self.decision, self.forced, self.n_forced = chosen, stats, decision, forced, n_forced


class HostState:
    """A backend whose state is the host's ``BatchState`` itself: nothing to copy either way; outputs are NumPy."""

    def sync(self, state: BatchState, rows: Any) -> None:
        pass

    def fetch(self, state: BatchState) -> None:
        pass

    def bitmask(self, shape: tuple[int, int]) -> npt.NDArray[np.int32]:
        return np.empty(shape, dtype=np.int32)

    def outputs(self, n_rows: int, *, forced_width: int) -> Outputs:
        return Outputs(np.empty(n_rows, np.int32), np.empty((n_rows, 3)), np.empty((n_rows, 3), np.int32),
                       np.empty((n_rows, forced_width), np.int32), np.empty(n_rows, np.int32))


class CpuBackend(HostState):
    """Every operation of ``kernels/batch.py``'s backend protocol, compiled for the CPU."""

    name = "cpu"

    def __init__(self, artifact: Artifact, *, reasoning_end_id: int | None = None, cached_min_edges: int = 16) -> None:
        """``cached_min_edges``: nodes with at least this many edges fill from a precomputed mask (``node_masks``)."""
        trie = artifact.trie
        self.artifact = artifact
        self.trie = tuple(np.ascontiguousarray(getattr(trie, name)) for name in TRIE_FIELDS)
        self.n_tools, self.eos_id = trie.n_tools, artifact.eos_id
        self.reasoning_end_id = -1 if reasoning_end_id is None else reasoning_end_id
        self.cached_min_edges = cached_min_edges

    def accept(self, state: BatchState, rows: npt.NDArray[np.int32], tokens: npt.NDArray[np.int32],
               n_tokens: npt.NDArray[np.int32]) -> None:
        accept_rows(self.trie, self.n_tools, self.eos_id, self.reasoning_end_id, state.table, state.counts,
                    state.allowed, rows, tokens, n_tokens)

    def follow_forced(self, state: BatchState, rows: npt.NDArray[np.int32], out: Outputs) -> None:
        forced_rows(self.trie, self.n_tools, self.eos_id, state.table, state.counts, state.allowed, rows, out.forced,
                    out.n_forced)

    def fill_bitmask(self, state: BatchState, rows: npt.NDArray[np.int32], bitmask: npt.NDArray[np.int32]) -> None:
        fill_rows(self.trie, self.n_tools, self.eos_id, state.table, state.counts, state.allowed, rows, bitmask,
                  *self.node_masks)

    def mask_logits_(self, state: BatchState, rows: npt.NDArray[np.int32], logits: Any, bitmask: Any) -> None:
        self.fill_bitmask(state, rows, bitmask)
        bits, minus_inf = logits_bits(logits)
        mask_rows(bitmask, rows, bits, minus_inf)

    def fuse_logits_(self, state: BatchState, rows: npt.NDArray[np.int32], logits: Any) -> None:
        """After ``mask_logits_``: each ranked row's legal logits become its option values (``walk.fuse_row``)."""
        bits, _ = logits_bits(logits)
        fuse_rows(self.trie, self.n_tools, self.eos_id, state.table, state.counts, state.allowed, rows,
                  bits.view(np.float32), bits, None, VocabMap.identity(bits.shape[1]).full_to_output,
                  self.ranked(state))

    def choose(self, state: BatchState, rows: npt.NDArray[np.int32], scores: Any, hidden: Any,
               vocab: VocabMap | None, out: Outputs) -> None:
        """Logits ``[n, V]`` (``hidden`` None) or hidden states ``[n, H]`` with ``scores`` the output embedding."""
        if hidden is not None:
            scores, hidden = as_numpy_head(scores), as_numpy_scores(hidden)
        else:
            scores = as_numpy_scores(scores)
        n_cols = scores.shape[0] if hidden is not None else scores.shape[1]
        vocab = vocab or VocabMap.identity(n_cols)
        check_step_inputs(self.artifact, len(rows), scores.shape[0] if hidden is None else hidden.shape[0], n_cols,
                          vocab)
        check_stats(out.stats, len(rows))
        choose_rows(self.trie, self.n_tools, self.eos_id, self.reasoning_end_id, state.table, state.counts,
                    state.allowed, rows, scores, hidden, n_cols, vocab.full_to_output, vocab.output_to_full,
                    out.chosen, out.stats, out.decision, out.forced, out.n_forced, self.ranked(state))

    def ranked(self, state: BatchState) -> tuple[npt.NDArray[Any], ...]:
        """The walk's ``ranked`` argument for this state."""
        return (state.ranker, *self.tools_below) if state.ranker.shape[0] else no_ranker()

    @cached_property
    def node_masks(self) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """(node_words, node_cached) of :func:`node_masks`, made on the first fill (a backend that only chooses
        never needs them)."""
        return node_masks(self.artifact, min_edges=self.cached_min_edges)

    @cached_property
    def tools_below(self) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        return self.artifact.trie.tools_below()


def node_masks(artifact: Artifact, *, min_edges: int = 16, budget_bytes: int = 8 << 20
               ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """The nodes with at least ``min_edges`` edges (the roots of a large registry and its widest prefixes; widest
    first, within ``budget_bytes``), each as a bitmask row of its edge tokens, and the row of each node (-1: none).
    A fill copies a row and corrects the few edges the used tools close, instead of walking hundreds of edges
    (``walk.mark_node``)."""
    trie = artifact.trie
    degree = np.diff(trie.node_edge_start)
    n_words = (artifact.max_token_id + 32) // 32
    wide = [int(node) for node in np.argsort(-degree, kind="stable") if degree[node] >= min_edges]
    wide = wide[: budget_bytes // (4 * n_words)]
    words = np.zeros((len(wide), n_words), dtype=np.int32)
    cached = np.full(trie.n_nodes, -1, dtype=np.int32)
    for index, node in enumerate(wide):
        tokens = trie.edge_token[trie.node_edge_start[node] : trie.node_edge_start[node + 1]].astype(np.int64)
        np.bitwise_or.at(words[index].view(np.uint32), tokens >> 5, np.uint32(1) << (tokens & 31).astype(np.uint32))
        cached[node] = index
    return words, cached


class LegalLogits:
    """Masked logits without writing every illegal one: a buffer that holds -inf between steps, into which each step
    writes only the constrained rows' legal logits (after setting back what it wrote there the step before) and copies
    the other rows whole (``walk.copy_legal``). A mask in place writes -inf over every illegal logit, the whole
    ``[rows, vocabulary]`` tensor, which on a CPU takes longer than everything else in a step.

    The buffer is returned instead of the logits, so this suits callers that take a processor's result (vLLM's
    samplers, Hugging Face's ``generate``) and that afterwards edit it only by writing -inf (top-k, top-p) or by
    arithmetic that keeps -inf (temperature, penalties, biases). One that wrote a finite value over an illegal logit
    (vLLM's thinking-budget forcing) would leave it there for the next step: such steps mask in place instead, and a
    row that passes to another request is ``reset`` whole."""

    ROOM = 2048  # columns remembered per row; a row with more legal tokens (one still thinking) is reset whole

    def __init__(self) -> None:
        self._out: Any = None
        self._written = np.zeros((0, self.ROOM), dtype=np.int32)
        self._n_written = np.zeros(0, dtype=np.int64)

    def reset(self, rows: npt.NDArray[np.integer[Any]]) -> None:
        """The next write to these rows sets them whole back to -inf first, not only the columns written last time:
        for a row that passes to another request, after a stage that may have written into what this returned."""
        rows = np.asarray(rows)
        self._n_written[rows[rows < len(self._n_written)]] = -1

    def __call__(self, logits: Any, bitmask: npt.NDArray[np.int32], constrained: npt.NDArray[np.bool_]) -> Any:
        """``logits`` ``[n, V]`` (CPU torch) masked by ``bitmask`` where ``constrained``, as a view of the buffer."""
        n, width = logits.shape
        out = self._out
        if out is None or out.shape[0] < n or out.shape[1] != width or out.dtype != logits.dtype:
            rows = max(n, 2 * (out.shape[0] if out is not None else 0), 16)
            out = self._out = logits.new_full((rows, width), float("-inf"))
            self._written = np.zeros((rows, self.ROOM), dtype=np.int32)
            self._n_written = np.zeros(rows, dtype=np.int64)
        view = out[:n]
        bits, minus_inf = logits_bits(logits.contiguous())
        out_bits, _ = logits_bits(view)
        copy_legal(bitmask, constrained, bits, out_bits, self._written, self._n_written, minus_inf)
        return view


def logits_bits(logits: Any) -> tuple[npt.NDArray[Any], np.integer[Any]]:
    """A writable integer view of CPU logits (float32, float16 or bfloat16; NumPy or torch) and the bit pattern of
    -inf in their dtype, an integer of the view's width (so the mask computes in that width: twice the vector lanes
    of a Python int's int64): one mask routine for every float width."""
    if isinstance(logits, np.ndarray):
        if logits.dtype.name not in MINUS_INF_BITS:
            raise DecodeError(f"logits must be float32 or float16, got {logits.dtype}")
        int_type, minus_inf = MINUS_INF_BITS[logits.dtype.name]
        return logits.view(int_type), int_type(minus_inf)
    import torch

    name = str(logits.dtype).removeprefix("torch.")
    if name not in MINUS_INF_BITS or logits.device.type != "cpu":
        raise DecodeError(f"the CPU backend masks float32/float16/bfloat16 CPU logits, got {logits.dtype} on "
                          f"{logits.device}")
    int_type, minus_inf = MINUS_INF_BITS[name]
    return logits.view(torch.int32 if int_type is np.int32 else torch.int16).numpy(), int_type(minus_inf)


def as_numpy_scores(values: Any) -> npt.NDArray[Any]:
    """A NumPy view of CPU scores; a torch tensor is shared when it can be. Half precision (float16, bfloat16)
    becomes float32: Numba's CPU target has no half types, and the conversion is exact."""
    if not isinstance(values, np.ndarray):
        import torch

        if values.dtype in (torch.bfloat16, torch.float16):
            values = values.float()
        values = values.detach().cpu().numpy()
    array: npt.NDArray[Any] = values.astype(np.float32) if values.dtype == np.float16 else values
    return array


def as_numpy_head(weights: Any) -> npt.NDArray[Any]:
    """A NumPy view of an output embedding ``W [V, H]`` for the sparse head: a bfloat16 one as its bits, int16 (the
    walk widens each weight exactly, ``walk._dot_bf16``: no float32 copy of the head), else as ``as_numpy_scores``."""
    if not isinstance(weights, np.ndarray) and str(weights.dtype) == "torch.bfloat16":
        import torch

        bits: npt.NDArray[Any] = weights.detach().cpu().view(torch.int16).numpy()
        return bits
    return as_numpy_scores(weights)


def check_stats(stats: Any, n_slots: int) -> None:
    """A statistics output must be float64 ``[B, 3]`` (or have no rows: not wanted)."""
    if stats.shape[0] and (tuple(stats.shape) != (n_slots, 3) or str(stats.dtype) not in ("float64", "torch.float64")):
        raise DecodeError(f"stats must be float64 [{n_slots}, 3], got {stats.dtype} {tuple(stats.shape)}")


@functools.cache  # one per shape: an array of no rows holds nothing to write, and a step asks for four
def no_rows(*shape: int, dtype: Any = np.int32) -> npt.NDArray[Any]:
    """An output that is not wanted: no rows."""
    return np.zeros((0, *shape), dtype=dtype)


def step(artifact: Artifact, state: BatchState, logits: Any, *, reasoning_end_id: int | None = None,
         vocab: VocabMap | None = None, stats: npt.NDArray[np.float64] | None = None) -> npt.NDArray[np.int32]:
    """One step for the whole batch (score row i is state row i): advances ``state`` in place and returns the
    chosen full token ids (-1 for rows that are not running). ``stats`` (float64 ``[B, 3]``, optional) receives
    (best, runner-up, log-sum-exp) per row."""
    return _step(artifact, state, logits, None, reasoning_end_id, vocab, stats)


def sparse_step(artifact: Artifact, state: BatchState, hidden: Any, output_embedding: Any, *,
                reasoning_end_id: int | None = None, vocab: VocabMap | None = None,
                stats: npt.NDArray[np.float64] | None = None) -> npt.NDArray[np.int32]:
    """One step from final hidden states ``[B, H]`` and the output embedding ``W [V, H]``: only the rows of
    ``W`` for legal tokens are multiplied (rows without a grammar still need the whole head).

    >>> import numpy as np
    >>> from tooltrie.compiler import TokenizerInfo, compile_registry
    >>> from tooltrie.registry import make_registry
    >>> artifact = compile_registry(make_registry([{"name": "get"}, {"name": "set"}], name="doc"),
    ...                             TokenizerInfo.load("gpt2"))
    >>> state = BatchState.start(artifact, [1])
    >>> weights = np.zeros((50257, 2), np.float32); weights[1136, 0] = 2.0  # "get": 2, "set" and the rest: 0
    >>> stats = np.empty((1, 3))
    >>> sparse_step(artifact, state, np.ones((1, 2), np.float32), weights, stats=stats).tolist()
    [1136]
    >>> stats.round(4).tolist()  # best, runner-up, log(e**2 + e**0) over the two legal tokens
    [[2.0, 0.0, 2.1269]]
    """
    return _step(artifact, state, output_embedding, hidden, reasoning_end_id, vocab, stats)


def _step(artifact: Artifact, state: BatchState, scores: Any, hidden: Any, reasoning_end_id: int | None,
          vocab: VocabMap | None, stats: npt.NDArray[np.float64] | None) -> npt.NDArray[np.int32]:
    backend = _step_backend(artifact, reasoning_end_id)
    rows = np.arange(len(state), dtype=np.int32)
    out = Outputs(np.empty(len(state), np.int32), no_rows(3, dtype=np.float64) if stats is None else stats,
                  no_rows(3), no_rows(0), no_rows())
    backend.choose(state, rows, scores, hidden, vocab, out)
    chosen: npt.NDArray[np.int32] = out.chosen
    return chosen


@functools.lru_cache(maxsize=8)  # a few artifacts at once (an artifact compares by identity)
def _step_backend(artifact: Artifact, reasoning_end_id: int | None) -> CpuBackend:
    """The backend ``step`` and ``sparse_step`` keep per artifact: made once, not at every step."""
    return CpuBackend(artifact, reasoning_end_id=reasoning_end_id)
