"""The NumPy reference step: one row at a time through ``kernels/rules.py``. Slow, obvious, the oracle.

One step takes logits ``[B, V]`` and returns the chosen token per slot (-1 for slots that are not running):
the argmax over the legal tokens, ties toward the lower token id, NaN as -inf. Rows without a grammar take
plain argmax (by the same order); rows still thinking take plain argmax except the stop token, and start the
constraint after the reasoning-end marker.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from tooltrie.compiler.artifact import Artifact
from tooltrie.kernels.rules import Status, advance, fail, legal_moves
from tooltrie.kernels.state import DONE, ERROR, RUNNING, BatchState
from tooltrie.kernels.vocab import VocabMap, check_step_inputs


def step(artifact: Artifact, state: BatchState, logits: npt.NDArray[np.floating], *,
         reasoning_end_id: int | None = None, vocab: VocabMap | None = None) -> npt.NDArray[np.int32]:
    """Choose one token per slot and advance ``state`` in place; returns full-vocabulary token ids."""
    vocab = vocab or VocabMap.identity(logits.shape[1])
    check_step_inputs(artifact, len(state), logits.shape[0], logits.shape[1], vocab)
    chosen = np.full(len(state), -1, dtype=np.int32)
    for row in range(len(state)):
        if state.status[row] != RUNNING:
            continue
        if not state.constrained[row] or state.thinking[row]:
            # A constrained row may not stop before its answer, not even while it thinks.
            excluded = artifact.eos_id if state.constrained[row] else -1
            token = _plain_argmax(logits[row], vocab, excluded)
            chosen[row] = token
            if token < 0:
                state.status[row] = ERROR
            elif state.thinking[row] and token == reasoning_end_id:
                state.thinking[row] = False
            elif not state.constrained[row] and token == artifact.eos_id:
                state.status[row] = DONE
            continue
        slot = state.slot(row)
        moves = legal_moves(artifact.trie, slot, artifact.eos_id)
        scored = [(_value(logits[row, vocab.full_to_output[token]]), -token)
                  for token in moves if vocab.full_to_output[token] >= 0]
        if not scored:
            state.set_slot(row, fail(slot))
            continue
        best = -max(scored)[1]  # highest score, then the lowest token id
        chosen[row] = best
        state.set_slot(row, advance(artifact.trie, slot, moves[best]))
    return chosen


def _value(logit: float) -> float:
    """NaN counts as -inf: it ranks lowest, and ties with -inf are broken by token id like any other."""
    return -np.inf if np.isnan(logit) else float(logit)


def _plain_argmax(row: npt.NDArray[np.floating], vocab: VocabMap, excluded: int) -> int:
    """Argmax over every output column, by full token id on ties; -1 when every column is excluded."""
    values = np.where(np.isnan(row), -np.inf, row).astype(np.float64)
    allowed = vocab.output_to_full != excluded
    if not allowed.any():
        return -1
    values[~allowed] = np.nan  # out of the running (NaN never equals the maximum)
    best = np.nanmax(values)
    return int(vocab.output_to_full[(values == best) & allowed].min())


__all__ = ["Status", "step"]
