"""The NumPy reference step: one row at a time through ``kernels/rules.py``. Slow, obvious, the oracle.

One step takes logits ``[B, V]`` and returns the chosen token per slot (-1 for slots that are not running):
the argmax over the legal tokens, ties toward the lower token id. Rows without a grammar take plain argmax;
rows still thinking take plain argmax and start the constraint after the reasoning-end marker.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from tooltrie.compiler.artifact import Artifact
from tooltrie.kernels.rules import Status, advance, fail, legal_moves
from tooltrie.kernels.state import DONE, RUNNING, BatchState
from tooltrie.kernels.vocab import VocabMap


def step(artifact: Artifact, state: BatchState, logits: npt.NDArray[np.floating], *,
         reasoning_end_id: int | None = None, vocab: VocabMap | None = None) -> npt.NDArray[np.int32]:
    """Choose one token per slot and advance ``state`` in place; returns full-vocabulary token ids."""
    vocab = vocab or VocabMap.identity(logits.shape[1])
    chosen = np.full(len(state), -1, dtype=np.int32)
    for row in range(len(state)):
        if state.status[row] != RUNNING:
            continue
        if not state.constrained[row] or state.thinking[row]:
            token = vocab.output_to_full[int(np.argmax(logits[row]))]  # first maximum: the lowest id
            chosen[row] = token
            if state.thinking[row] and token == reasoning_end_id:
                state.thinking[row] = False
            elif not state.constrained[row] and token == artifact.eos_id:
                state.status[row] = DONE
            continue
        slot = state.slot(row)
        moves = legal_moves(artifact.trie, slot, artifact.eos_id)
        scored = [(float(logits[row, vocab.full_to_output[token]]), -token)
                  for token in moves if vocab.full_to_output[token] >= 0]
        if not scored:
            state.set_slot(row, fail(slot))
            continue
        best = -max(scored, key=_nan_lowest)[1]
        chosen[row] = best
        state.set_slot(row, advance(artifact.trie, slot, moves[best]))
    return chosen


def _nan_lowest(score: tuple[float, int]) -> tuple[float, int]:
    value, neg_token = score
    return (-np.inf if np.isnan(value) else value, neg_token)


__all__ = ["Status", "step"]
