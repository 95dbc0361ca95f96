"""The reference backend: one row at a time through ``kernels/rules.py``. Slow, obvious, the oracle.

A choice takes the argmax over the legal tokens, ties toward the lower token id, NaN as -inf. Rows without a
grammar take plain argmax (by the same order); rows still thinking take plain argmax except the stop token, and
start the constraint after the reasoning-end marker. Every backend is tested against this one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from tooltrie.compiler.artifact import Artifact
from tooltrie.compiler.trie import CompiledTrie
from tooltrie.kernels.bitmask import apply_token_bitmask_inplace, set_allowed
from tooltrie.kernels.cpu import HostState, Outputs, as_numpy_scores, check_stats, logits_bits, no_rows
from tooltrie.kernels.rules import Move, Slot, Status, advance, fail, legal_moves
from tooltrie.kernels.state import DONE, ERROR, RUNNING, BatchState
from tooltrie.kernels.vocab import VocabMap, check_step_inputs


class ReferenceBackend(HostState):
    """The backend protocol (``kernels/batch.py``) row by row over readable ``Slot``s."""

    name = "reference"

    def __init__(self, artifact: Artifact, *, reasoning_end_id: int | None = None) -> None:
        self.artifact, self.trie, self.eos_id = artifact, artifact.trie, artifact.eos_id
        self.reasoning_end_id = reasoning_end_id
        self._crossing: dict[int, list[int]] = {}  # edge -> the tools whose path crosses it, found by looking

    def _moves(self, state: BatchState, row: int) -> tuple[Slot, dict[int, Move]]:
        slot = state.slot(row)
        return slot, legal_moves(self.trie, slot, self.eos_id)

    def accept(self, state: BatchState, rows: npt.NDArray[np.int32], tokens: npt.NDArray[np.int32],
               n_tokens: npt.NDArray[np.int32]) -> None:
        for i, row in enumerate(rows.tolist()):
            for token in tokens[i, : n_tokens[i]].tolist() if row >= 0 else []:
                if state.status[row] != RUNNING:
                    break  # done (later tokens are padding) or failed for good
                if not state.constrained[row] or state.thinking[row]:
                    self._take_plain(state, row, token)
                    continue
                slot, moves = self._moves(state, row)
                move = moves.get(token)
                state.set_slot(row, fail(slot) if move is None else advance(self.trie, slot, move))

    def _take_plain(self, state: BatchState, row: int, token: int) -> None:
        if token < 0 or (state.thinking[row] and token == self.eos_id):
            state.status[row] = ERROR  # nothing to take, or a stop before the answer that is owed
        elif state.thinking[row] and token == self.reasoning_end_id:
            state.thinking[row] = False
        elif not state.constrained[row] and token == self.eos_id:
            state.status[row] = DONE

    def follow_forced(self, state: BatchState, rows: npt.NDArray[np.int32], out: Outputs) -> None:
        for i, row in enumerate(rows.tolist()):
            self._follow(state, row, i, out)

    def _follow(self, state: BatchState, row: int, i: int, out: Outputs) -> None:
        n = 0
        while (row >= 0 and n < out.forced.shape[1] and state.status[row] == RUNNING and state.constrained[row]
               and not state.thinking[row]):
            slot, moves = self._moves(state, row)
            if len(moves) != 1:
                break
            (move,) = moves.values()
            state.set_slot(row, advance(self.trie, slot, move))
            out.forced[i, n] = move.token
            n += 1
        if out.n_forced.shape[0]:
            out.n_forced[i] = n

    def fill_bitmask(self, state: BatchState, rows: npt.NDArray[np.int32], bitmask: npt.NDArray[np.int32]) -> None:
        for i, row in enumerate(rows.tolist()):
            if row < 0:
                continue
            if state.status[row] == RUNNING and (not state.constrained[row] or state.thinking[row]):
                tokens = np.arange(bitmask.shape[1] * 32)
                set_allowed(bitmask[i], tokens[tokens != self.eos_id] if state.constrained[row] else tokens)
                continue
            legal = sorted(self._moves(state, row)[1]) if state.status[row] == RUNNING else []
            if state.status[row] == RUNNING and not legal:
                state.status[row] = ERROR
            set_allowed(bitmask[i], legal if legal else [self.eos_id])

    def mask_logits_(self, state: BatchState, rows: npt.NDArray[np.int32], logits: Any, bitmask: Any) -> None:
        self.fill_bitmask(state, rows, bitmask)
        apply_token_bitmask_inplace(logits, bitmask, indices=np.flatnonzero(rows >= 0))

    def fuse_logits_(self, state: BatchState, rows: npt.NDArray[np.int32], logits: Any) -> None:
        """After ``mask_logits_``: each ranked row's legal logits become its option values (``fused_values``), the
        group of hops (a name that may end or go on) permuted so the hop ``fused_values`` would emit holds the
        group's maximum, and every other value tied with the chosen token's (as float32) one float step down;
        ``walk.fuse_row`` is the compiled twin."""
        values_out = logits_bits(logits)[0].view(np.float32)
        for i, row in enumerate(rows.tolist()):
            if (row < 0 or state.status[row] != RUNNING or not state.constrained[row] or state.thinking[row]
                    or not state.ranker.shape[0] or math.isnan(state.ranker[row, 0])):
                continue
            slot, moves = self._moves(state, row)
            out = values_out[i]
            candidates = [(_value(float(out[t])), t) for t in moves if t < len(out)]
            values, chosen = self._ranked(slot, moves, candidates, state.ranker[row])
            if chosen < 0:
                continue
            for value, token in values:
                out[token] = value
            kinds = {moves[token].kind for _, token in candidates}
            if "hop" in kinds and "edge" in kinds:  # grouped: the name may end here or go on
                hops = [(raw, token) for raw, token in candidates if moves[token].kind == "hop"]
                _, hop_token = self._ranked(slot, moves, hops, state.ranker[row])  # by the next tool's prior
                value_of = {token: value for value, token in values}  # float64, as the walk compares them
                holder = _best([(value_of[t], t) for _, t in hops])
                out[hop_token], out[holder] = out[holder], out[hop_token]
            top = out[chosen]
            if top != -np.inf:
                for _, token in candidates:
                    if token != chosen and out[token] == top:
                        out[token] = np.nextafter(out[token], np.float32(-np.inf))

    def choose(self, state: BatchState, rows: npt.NDArray[np.int32], scores: Any, hidden: Any,
               vocab: VocabMap | None, out: Outputs) -> None:
        scores = as_numpy_scores(scores)
        hidden = None if hidden is None else as_numpy_scores(hidden)
        if hidden is not None and scores.dtype == np.int16:  # a bfloat16 head's bits: its 16 bits on top of a float32
            scores = (scores.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        n_cols = scores.shape[0] if hidden is not None else scores.shape[1]
        vocab = vocab or VocabMap.identity(n_cols)
        check_step_inputs(self.artifact, len(rows), scores.shape[0] if hidden is None else hidden.shape[0], n_cols,
                          vocab)
        check_stats(out.stats, len(rows))

        def value(i: int, col: int) -> float:
            if hidden is None:
                return _value(float(scores[i, col]))
            total = 0.0  # summed in order in float64, as the compiled walk does
            for h, w in zip(hidden[i].tolist(), scores[col].tolist(), strict=True):
                total += h * w
            return _value(total)

        for i, row in enumerate(rows.tolist()):
            out.chosen[i] = -1
            if out.n_forced.shape[0]:
                out.n_forced[i] = 0
            if row < 0 or state.status[row] != RUNNING:
                _put_stats(out.stats, i, [], nan=True)
                continue
            if not state.constrained[row] or state.thinking[row]:
                excluded = self.eos_id if state.constrained[row] else -1
                if hidden is None:  # every column: vectorised (the values are the logits, no sums to order)
                    token = _plain_choice(scores[i], vocab, excluded, out.stats, i)
                else:
                    candidates = [(value(i, col), int(t)) for col, t in enumerate(vocab.output_to_full.tolist())
                                  if t != excluded]
                    token = _best(candidates)
                    _put_stats(out.stats, i, candidates)
                out.chosen[i] = token
                self._take_plain(state, row, token)
            else:
                slot, moves = self._moves(state, row)
                candidates = [(value(i, int(vocab.full_to_output[token])), token) for token in moves
                              if vocab.full_to_output[token] >= 0]
                if state.ranker.shape[0] and not math.isnan(state.ranker[row, 0]):
                    candidates, token = self._ranked(slot, moves, candidates, state.ranker[row])
                else:
                    token = _best(candidates)
                _put_stats(out.stats, i, candidates)
                if out.decision.shape[0]:
                    continuing = sum(moves[t].kind != "hop" for _, t in candidates)
                    out.decision[i] = (len(candidates), continuing, slot.emitted + (continuing == 0))
                out.chosen[i] = token
                state.set_slot(row, fail(slot) if token < 0 else advance(self.trie, slot, moves[token]))
            self._follow(state, row, i, out)


    def _ranked(self, slot: Slot, moves: dict[int, Move], candidates: list[tuple[float, int]],
                ranker: npt.NDArray[np.float32]) -> tuple[list[tuple[float, int]], int]:
        """The fused ranker by ``fused_values``, a token's prior found by looking at every tool."""
        return fused_values(self.trie, slot, moves, candidates, ranker, self._tools_crossing)

    def _tools_crossing(self, edge: int) -> list[int]:
        if edge not in self._crossing:
            trie = self.trie
            self._crossing[edge] = [t for r in range(trie.n_tries) for t in range(trie.n_tools)
                                    if edge in trie.tool_path(r, t).tolist()]
        return self._crossing[edge]


def fused_values(trie: CompiledTrie, slot: Slot, moves: dict[int, Move], candidates: list[tuple[float, int]],
                 ranker: npt.NDArray[np.float32],
                 tools_crossing: Callable[[int], Sequence[int]]) -> tuple[list[tuple[float, int]], int]:
    """The fused ranker (``kernels/walk.py``), written out: each candidate's value and the choice. ``ranker`` is the
    model's weight, then each tool's prior (already weighted); a token's prior is the best among the open tools
    whose path crosses its edge (``tools_crossing``). With every candidate's score 0 and the weight 1, the values
    are the priors alone: what the fused ranker adds to the model's scores (the trie loss of ``train.priors``)."""
    weight, prior = float(ranker[0]), [float(p) for p in ranker[1:]]
    tool = int(trie.node_tool[slot.node])

    def open_prior(edge: int, taken: int) -> float:
        return max((prior[t] for t in tools_crossing(edge)
                    if t != taken and t not in slot.used and (slot.allowed is None or t in slot.allowed)),
                   default=-math.inf)

    def fuse(raw: float, bonus: float) -> float:
        return bonus if weight == 0.0 else weight * raw + bonus

    kinds = {moves[t].kind for _, t in candidates}
    grouped = "hop" in kinds and "edge" in kinds  # the name may end here or go on
    values, hops = [], []
    for raw, token in candidates:
        move = moves[token]
        if move.kind == "stop":
            values.append((fuse(raw, prior[tool]), token))
        elif move.kind == "edge":
            values.append((fuse(raw, open_prior(move.edge, -1)), token))
        else:
            hops.append((fuse(raw, open_prior(move.edge, tool)), token))
            values.append((fuse(raw, prior[tool]) if grouped else hops[-1][0], token))
    if not grouped:
        return values, _best(values)
    ending = max(v for v, t in values if moves[t].kind == "hop")
    going_on = [(v, t) for v, t in values if moves[t].kind != "hop"]
    return values, _best([*going_on, (ending, _best(hops))])


def _value(logit: float) -> float:
    """NaN counts as -inf: it ranks lowest, and ties with -inf are broken by token id like any other."""
    return -math.inf if math.isnan(logit) else logit


def _best(candidates: list[tuple[float, int]]) -> int:
    """The highest value, then the lowest token id; -1 without candidates."""
    return -max((v, -t) for v, t in candidates)[1] if candidates else -1


def _plain_choice(logits: npt.NDArray[Any], vocab: VocabMap, excluded: int, stats: Any, i: int) -> int:
    """Argmax over every output column but ``excluded`` (by full token id on ties; NaN as -inf), and its
    statistics, as ``_best`` and ``_put_stats`` would give them; -1 when every column is excluded."""
    keep = vocab.output_to_full != excluded
    values = np.where(np.isnan(logits), -np.inf, logits).astype(np.float64)[keep]
    tokens = vocab.output_to_full[keep]
    if not len(values):
        _put_stats(stats, i, [])
        return -1
    best = values.max()
    token = int(tokens[values == best].min())
    if stats.shape[0]:
        runner_up = np.partition(values, -2)[-2] if len(values) > 1 else -math.inf
        finite = values[values != -np.inf]
        total = best + math.log(float(np.exp(finite - best).sum())) if len(finite) else -math.inf
        stats[i] = (best, runner_up, total)
    return token


def _put_stats(stats: Any, i: int, candidates: list[tuple[float, int]], *, nan: bool = False) -> None:
    if not stats.shape[0]:
        return
    if nan:
        stats[i] = np.nan
        return
    values = sorted((v for v, _ in candidates), reverse=True)
    finite = [v for v in values if v != -math.inf]
    top = max(finite, default=-math.inf)
    log_total = top + math.log(sum(math.exp(v - top) for v in finite)) if finite else -math.inf
    stats[i] = (values[0] if values else -math.inf, values[1] if len(values) > 1 else -math.inf, log_total)


def step(artifact: Artifact, state: BatchState, logits: npt.NDArray[np.floating], *,
         reasoning_end_id: int | None = None, vocab: VocabMap | None = None,
         stats: npt.NDArray[np.float64] | None = None) -> npt.NDArray[np.int32]:
    """Choose one token per slot and advance ``state`` in place; returns full-vocabulary token ids."""
    backend = ReferenceBackend(artifact, reasoning_end_id=reasoning_end_id)
    out = Outputs(np.empty(len(state), np.int32), no_rows(3, dtype=np.float64) if stats is None else stats,
                  no_rows(3), no_rows(0), no_rows())
    backend.choose(state, np.arange(len(state), dtype=np.int32), logits, None, vocab, out)
    chosen: npt.NDArray[np.int32] = out.chosen
    return chosen


__all__ = ["ReferenceBackend", "Status", "step"]
