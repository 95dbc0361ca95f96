"""The production decode path: one persistent batch state under one artifact, advanced by a backend.

Every consumer drives the same object: the engine (``choose_sparse``), ``TrieMatcher`` (a one-row view), the
Hugging Face processor and the vLLM adapters (``accept`` the tokens they sampled, then ``mask_logits_`` or
``fill_bitmask``). Rows are added (k, subset, reasoning: counted once), removed and moved between steps; nothing
is rebuilt per step. Operations take ``rows``, the state row of each score row (-1: not ours, left alone), so a
consumer's logits rows need not be the state's rows (vLLM's V2 runner maps them through its request slots).

>>> import numpy as np
>>> from tooltrie.compiler import TokenizerInfo, compile_registry
>>> from tooltrie.registry import make_registry
>>> tok = TokenizerInfo.load("gpt2")
>>> artifact = compile_registry(make_registry([{"name": "get"}, {"name": "get_user"}], name="demo"), tok)
>>> batch = TrieBatch(artifact, capacity=2)
>>> batch.add(0, k=2); batch.add(1, k=1)
>>> logits = np.zeros((2, tok.vocab_size), np.float32)
>>> batch.accept([[1136], [1136]])  # both rows wrote "get"
>>> batch.mask_logits_(logits)
>>> [np.flatnonzero(row > -np.inf).tolist() for row in logits]  # row 0: "_" or ","; row 1: "_" or stop
[[11, 62], [62, 50256]]
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from tooltrie.compiler.artifact import Artifact
from tooltrie.errors import DecodeError
from tooltrie.kernels.bitmask import get_bitmask_shape
from tooltrie.kernels.cpu import Outputs
from tooltrie.kernels.state import DONE, ERROR, RUNNING, BatchState, FollowUp
from tooltrie.kernels.vocab import VocabMap

Rows = Sequence[int] | npt.NDArray[np.integer] | None
_INT32_MAX = 2**31 - 1


class Backend(Protocol):
    """One file per backend: ``reference`` (the oracle), ``cpu`` (Numba), ``cuda`` (Numba CUDA)."""

    name: str

    def sync(self, state: BatchState, rows: npt.NDArray[np.int32]) -> None:
        """Host rows changed (added, moved): copy them to where the backend keeps the state."""

    def fetch(self, state: BatchState) -> None:
        """Bring the backend's state back to the host arrays (a device backend copies; host backends share)."""

    def outputs(self, n_rows: int, *, forced_width: int) -> Outputs:
        """Output arrays for a choice, where the backend writes them."""

    def bitmask(self, shape: tuple[int, int]) -> Any:
        """An int32 bitmask of ``shape``, where the backend writes masks."""

    def accept(self, state: BatchState, rows: npt.NDArray[np.int32], tokens: npt.NDArray[np.int32],
               n_tokens: npt.NDArray[np.int32]) -> None: ...

    def follow_forced(self, state: BatchState, rows: npt.NDArray[np.int32], out: Outputs) -> None: ...

    def fill_bitmask(self, state: BatchState, rows: npt.NDArray[np.int32], bitmask: Any) -> None: ...

    def mask_logits_(self, state: BatchState, rows: npt.NDArray[np.int32], logits: Any, bitmask: Any) -> None: ...

    def fuse_logits_(self, state: BatchState, rows: npt.NDArray[np.int32], logits: Any) -> None: ...

    def choose(self, state: BatchState, rows: npt.NDArray[np.int32], scores: Any, hidden: Any,
               vocab: VocabMap | None, out: Outputs) -> None: ...


def _reference(artifact: Artifact, **options: Any) -> Backend:
    from tooltrie.kernels.reference import ReferenceBackend

    return ReferenceBackend(artifact, **options)


def _cpu(artifact: Artifact, **options: Any) -> Backend:
    from tooltrie.kernels.cpu import CpuBackend

    return CpuBackend(artifact, **options)


def _cuda(artifact: Artifact, **options: Any) -> Backend:
    try:
        from tooltrie.kernels.cuda import CudaBackend
    except ImportError as error:  # pragma: no cover - the cuda extra is missing
        raise ImportError(f"the cuda backend needs numba-cuda and a CUDA driver ({error}); "
                          "pip install 'tooltrie[cuda]'") from error
    return CudaBackend(artifact, **options)


BACKENDS: dict[str, Callable[..., Backend]] = {"reference": _reference, "cpu": _cpu, "cuda": _cuda}


def make_backend(name: str, artifact: Artifact, **options: Any) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose from {sorted(BACKENDS)}")
    return BACKENDS[name](artifact, **options)


@dataclass
class Choice:
    """A choice on the host, one entry per score row (see ``kernels/cpu.Outputs``)."""

    chosen: npt.NDArray[np.int32]
    stats: npt.NDArray[np.float64]
    decision: npt.NDArray[np.int32]
    forced: list[list[int]]


class TrieBatch:
    """The decode state of up to ``capacity`` requests (it grows on demand) and the backend that advances it.

    ``forced_width`` bounds the forced run a choice takes in the same call (longer runs go on at the next call).
    """

    def __init__(self, artifact: Artifact, *, backend: str = "cpu", capacity: int = 16,
                 reasoning_end_id: int | None = None, forced_width: int = 64, **options: Any) -> None:
        self.artifact = artifact
        self.backend = make_backend(backend, artifact, reasoning_end_id=reasoning_end_id, **options)
        self.state = BatchState.empty(capacity)
        self.forced_width = forced_width
        self._bitmask: Any = None  # scratch for mask_logits_, one row per score row
        self._walk: Any = None  # the CPU walk, for host-side queries (runs)
        self.backend.sync(self.state, np.arange(capacity, dtype=np.int32))

    def __len__(self) -> int:
        return len(self.state)

    # -- rows: added, removed, moved between steps ----------------------------------------------------------------

    def add(self, row: int, k: int, *, constrained: bool = True, thinking: bool = False,
            subset: Collection[int] | None = None, prior: npt.ArrayLike | None = None,
            model_weight: float = 1.0, follow: FollowUp | None = None) -> None:
        """Start a request in ``row``: exactly ``k`` distinct tools (of ``subset``, if given); with ``thinking``,
        the constraint starts after the reasoning-end marker; ``constrained=False``: a row without a grammar.
        With ``prior`` (a float per tool, already weighted), each choice ranks a legal token by ``model_weight``
        times its score plus the best prior among the unused tools below it (the fused ranker of
        ``kernels/walk.py``): with ``model_weight=0`` the answer is the prior's top k, best first.

        With ``follow`` too, the prior follows the answer: once the answer commits to a tool (``rules.committed``:
        its name has ended and cannot go on, or the next tool has begun), the row's prior becomes
        ``follow(committed tools)``, before the token that starts the next tool is chosen. On the host, between
        calls, on every backend alike (``tooltrie.ranker.FollowUp``)."""
        self.backend.fetch(self.state)  # a device backend's rows moved on: the host copy first
        size, ranked = len(self.state), self.state.ranker.shape[0]
        self.state.add(self.artifact, row, k, constrained=constrained, thinking=thinking, subset=subset, prior=prior,
                       model_weight=model_weight, follow=follow)
        self._synced([row] if len(self.state) == size and self.state.ranker.shape[0] == ranked
                     else range(len(self.state)))

    def remove(self, row: int) -> None:
        self.backend.fetch(self.state)  # a device backend's rows moved on: the host copy first
        shapes = self._shapes()
        self.state.remove(row)  # may release widths no row needs now: then every row is synced
        self._synced([row] if self._shapes() == shapes else range(len(self.state)))

    def _shapes(self) -> tuple[tuple[int, ...], ...]:
        return self.state.table.shape, self.state.counts.shape, self.state.ranker.shape

    def move(self, source: int, target: int) -> None:
        self.backend.fetch(self.state)  # a device backend's rows moved on: the host copy first
        size = len(self.state)
        self.state.move(source, target)
        self._synced([source, target] if len(self.state) == size else range(len(self.state)))

    def swap(self, a: int, b: int) -> None:
        self.backend.fetch(self.state)  # a device backend's rows moved on: the host copy first
        size = len(self.state)
        self.state.swap(a, b)
        self._synced([a, b] if len(self.state) == size else range(len(self.state)))

    def _synced(self, rows: Collection[int]) -> None:
        self.backend.sync(self.state, np.fromiter(rows, dtype=np.int32))

    # -- reading rows (a device backend copies the state back first) ---------------------------------------------

    def fetch(self) -> BatchState:
        """The host state, up to date."""
        self.backend.fetch(self.state)
        return self.state

    def tools(self, row: int) -> list[int]:
        return self.fetch().tools(row)

    def status(self, row: int) -> int:
        return int(self.fetch().status[row])

    def is_done(self, row: int) -> bool:
        return self.status(row) == DONE

    def is_error(self, row: int) -> bool:
        return self.status(row) == ERROR

    def is_running(self, row: int) -> bool:
        return self.status(row) == RUNNING

    def checkpoint(self, row: int) -> npt.NDArray[np.int32]:
        """The row's state (a few ints; its subset counts never change), for :meth:`restore` (rollback)."""
        saved: npt.NDArray[np.int32] = self.fetch().table[row].copy()
        return saved

    def restore(self, row: int, saved: npt.NDArray[np.int32]) -> None:
        self.backend.fetch(self.state)  # a device backend's rows moved on: the host copy first
        width = min(len(saved), self.state.table.shape[1])  # narrower since: the columns past its k (all -1)
        self.state.table[row, :width] = saved[:width]
        self.state.table[row, width:] = -1  # the table grew wider since (a larger k): no tools there
        self._synced([row])
        self._follow_answers()  # a row rolled back before a tool it had committed to gets that tool's prior back

    # -- the operations, one call each for the whole batch --------------------------------------------------------

    def accept(self, tokens: Sequence[Sequence[int]] | npt.NDArray[np.integer], rows: Rows = None, *,
               lengths: npt.NDArray[np.integer] | None = None) -> None:
        """Advance each row by tokens chosen elsewhere: ``tokens[i]`` for state row ``rows[i]`` (a ragged list of
        lists, or an int array ``[n, T]`` of which row i takes the first ``lengths[i]``, default all T). An illegal
        token puts that row in the error state (fail loudly); nothing raises for one bad row."""
        if isinstance(tokens, np.ndarray):
            ids = tokens if tokens.dtype == np.int32 and tokens.ndim == 2 else _int32_ids(tokens.reshape(len(tokens),
                                                                                                       -1))
            counts = np.full(len(ids), ids.shape[1], np.int32) if lengths is None else np.asarray(lengths, np.int32)
            if counts.shape != (len(ids),) or (len(counts) and not 0 <= counts.min() <= counts.max() <= ids.shape[1]):
                raise DecodeError(f"lengths {counts.tolist()} do not fit tokens of shape {tuple(ids.shape)}")
        else:
            ids, counts = ragged_ids(tokens)
        self.backend.accept(self.state, self._rows(rows, len(ids)), np.ascontiguousarray(ids), counts)
        self._follow_answers()

    def fill_bitmask(self, bitmask: Any, rows: Rows = None) -> None:
        """Row i of an int32 bitmask ``[n, ceil(V/32)]`` (XGrammar's layout) gets state row ``rows[i]``'s legal
        next tokens: only stop once the row is done or failed; every token but stop while it thinks."""
        self._check_width(bitmask.shape[1] * 32)
        self.backend.fill_bitmask(self.state, self._rows(rows, bitmask.shape[0]), bitmask)

    def mask_logits_(self, logits: Any, rows: Rows = None) -> None:
        """Set every illegal logit of row i to -inf, in place, on the logits' device (rows with ``rows[i] == -1``
        are left alone)."""
        self._check_width(logits.shape[1])
        shape = get_bitmask_shape(logits.shape[0], logits.shape[1])
        if self._bitmask is None or tuple(self._bitmask.shape) != shape:
            self._bitmask = self.backend.bitmask(shape)
        self.backend.mask_logits_(self.state, self._rows(rows, logits.shape[0]), logits, self._bitmask)

    def fuse_logits_(self, logits: Any, rows: Rows = None) -> None:
        """As :meth:`mask_logits_`, and a row with a ranker (``add(prior=...)``) gets its options' fused values over
        its legal logits (``walk.fuse_row``), in place: an argmax of row i (ties to the lower id) is the token
        :meth:`choose` would take, and its log-softmax is the choice's score, ``best - log_total`` of the stats.
        An engine that can only edit logits (vLLM's processors) then lets its greedy sampler take the fused
        choice. Ranked rows need float32 logits."""
        self.mask_logits_(logits, rows)
        self.fuse_legal_(logits, rows)

    def fuse_legal_(self, logits: Any, rows: Rows = None) -> None:
        """The second half of :meth:`fuse_logits_`, for logits already masked (a buffer that holds only the legal
        logits, as vLLM's CPU path builds): each ranked row's legal logits become its options' fused values."""
        state_rows = self._rows(rows, logits.shape[0])
        ours = state_rows[state_rows >= 0]
        if not self.state.ranker.shape[0] or np.isnan(self.state.ranker[ours, 0]).all():
            return  # no ranked row among these: the mask is all
        if str(logits.dtype).removeprefix("torch.") != "float32":
            raise DecodeError(f"fused values need float32 logits, got {logits.dtype}")
        self.backend.fuse_logits_(self.state, state_rows, logits)

    def choose(self, logits: Any, rows: Rows = None, *, vocab: VocabMap | None = None) -> Choice:
        """Argmax over each row's legal tokens (ties toward the lower id), the advance, the statistics a score
        needs, and the forced run after it, in one call."""
        return self._choose(logits, None, rows, vocab, logits.shape[0])

    def choose_sparse(self, hidden: Any, head: Any, rows: Rows = None, *, vocab: VocabMap | None = None) -> Choice:
        """As :meth:`choose`, from hidden states ``[n, H]`` and the output embedding ``[V, H]``: only the legal
        tokens' rows of the head are multiplied."""
        return self._choose(head, hidden, rows, vocab, hidden.shape[0])

    def follow_forced(self, rows: Rows = None) -> list[list[int]]:
        """Take the tokens the trie forces from where each row stands (a new request may be forced to its end)."""
        state_rows = self._rows(rows, len(self.state) if rows is None else len(rows))
        out = self.backend.outputs(len(state_rows), forced_width=self.forced_width)
        self.backend.follow_forced(self.state, state_rows, out)
        self._follow_answers()
        return _runs(out)

    def runs(self, row: int, budget: int) -> list[tuple[int, ...]]:
        """The runs from ``row``'s coming choice to its next one within the same name (``walk.next_runs``), up to
        ``budget`` tokens in all: what an engine may feed speculatively beside the row. Host-side (CPU walk)."""
        from tooltrie.kernels.walk import next_runs

        state = self.fetch()
        if state.status[row] != RUNNING or not state.constrained[row] or state.thinking[row] or budget <= 0:
            return []
        if self._walk is None:
            from tooltrie.kernels.cpu import CpuBackend

            self._walk = CpuBackend(self.artifact)
        tokens, lengths = np.empty(budget, np.int32), np.empty(budget + 1, np.int32)
        walk = self._walk
        n_runs = next_runs(walk.trie, walk.n_tools, walk.eos_id, state.table, state.counts, state.allowed, row,
                           budget, tokens, lengths)
        runs, start = [], 0
        for length in lengths[:n_runs].tolist():
            runs.append(tuple(tokens[start : start + length].tolist()))
            start += length
        return runs

    def _choose(self, scores: Any, hidden: Any, rows: Rows, vocab: VocabMap | None, n_rows: int) -> Choice:
        state_rows = self._rows(rows, n_rows)
        out = self.backend.outputs(len(state_rows), forced_width=self.forced_width)
        self.backend.choose(self.state, state_rows, scores, hidden, vocab, out)
        choice = Choice(_host(out.chosen), _host(out.stats), _host(out.decision), _runs(out))
        self._follow_answers()
        return choice

    def _follow_answers(self) -> None:
        """Each running row whose prior follows its answer (``add(follow=...)``) and whose committed tools changed
        gets the prior of its next tool. Nothing is read back from a device unless such a row exists."""
        following = [row for row, f in enumerate(self.state.following) if f is not None]
        if not following:
            return
        state = self.fetch()
        changed = []
        for row in following:
            entry = state.following[row]
            tools = state.committed(self.artifact, row)
            if entry is None or state.status[row] != RUNNING or tools == entry.tools:
                continue
            try:
                values = np.asarray(entry.follow_up(tools), dtype=np.float32)
                if values.shape != (self.artifact.trie.n_tools,) or not np.isfinite(values).all():
                    raise DecodeError(f"{values.shape} values, not {self.artifact.trie.n_tools} finite ones")
            except Exception as error:  # that row fails loudly; its neighbours go on
                logging.getLogger(__name__).error("slot %d: no prior after tools %s: %s", row, list(tools), error)
                state.status[row] = ERROR
            else:
                state.ranker[row, 1:] = values
            entry.tools = tools
            changed.append(row)
        if changed:
            self._synced(changed)

    def _rows(self, rows: Rows, n_rows: int) -> npt.NDArray[np.int32]:
        if rows is None:
            if n_rows > len(self.state):
                raise DecodeError(f"{n_rows} score rows for a batch of {len(self.state)}")
            return np.arange(n_rows, dtype=np.int32)
        array = np.ascontiguousarray(rows, dtype=np.int32).reshape(-1)
        if len(array) != n_rows:
            raise DecodeError(f"rows names {len(array)} state rows for {n_rows} score rows")
        if len(array) and (array.max() >= len(self.state) or array.min() < -1):
            raise DecodeError(f"rows {array.tolist()} reach outside the batch's 0..{len(self.state) - 1} (-1: none)")
        return array

    def _check_width(self, width: int) -> None:
        if width <= self.artifact.max_token_id:
            raise DecodeError(f"{width} columns, but the grammar uses token {self.artifact.max_token_id}: the mask "
                              "must span the tokenizer's vocabulary")


def ragged_ids(tokens: Sequence[Sequence[int]]) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """Ragged per-row token lists as ``accept`` takes them in one call: an int32 array ``[n, longest]`` and each
    row's length. One flat array, scattered into the rows' places (no Python loop over rows)."""
    counts = np.fromiter(map(len, tokens), dtype=np.int32, count=len(tokens))
    flat = np.fromiter(itertools.chain.from_iterable(tokens), dtype=np.int64, count=int(counts.sum()))
    wide = np.zeros((len(tokens), int(counts.max(initial=0))), dtype=np.int64)
    wide[np.arange(wide.shape[1]) < counts[:, None]] = flat
    return _int32_ids(wide), counts


def _int32_ids(tokens: npt.NDArray[np.integer]) -> npt.NDArray[np.int32]:
    """Token ids as int32; one that is no token (negative, or past int32) becomes -1: illegal anywhere."""
    wide = tokens.astype(np.int64)
    ids: npt.NDArray[np.int32] = np.where((wide < 0) | (wide > _INT32_MAX), -1, wide).astype(np.int32)
    return ids


def _host(array: Any) -> Any:
    return array if isinstance(array, np.ndarray) else array.copy_to_host()


def _runs(out: Outputs) -> list[list[int]]:
    forced, lengths = _host(out.forced), _host(out.n_forced)
    return [forced[i, : lengths[i]].tolist() for i in range(len(lengths))]

