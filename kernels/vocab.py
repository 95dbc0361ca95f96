"""A reduced (pruned) output vocabulary: the one place where output ids and full ids meet.

Engines that prune their vocabulary produce logits over ``V_out`` output ids; the trie speaks full ids.
``output_to_full[o]`` is the full id of output id ``o``; ``full_to_output[t]`` is -1 for a pruned token, which
is then never legal (a constrained slot whose every legal token is pruned fails loudly).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from tooltrie.errors import DecodeError

if TYPE_CHECKING:
    from tooltrie.compiler.artifact import Artifact


@dataclass(frozen=True, eq=False)
class VocabMap:
    output_to_full: npt.NDArray[np.int32]
    full_to_output: npt.NDArray[np.int32]

    @classmethod
    def identity(cls, vocab_size: int) -> VocabMap:
        """The map of an unpruned vocabulary (cached: steps ask for it every time)."""
        return _identity(vocab_size)

    @classmethod
    def from_output_ids(cls, output_to_full: npt.ArrayLike, full_vocab_size: int) -> VocabMap:
        """Build from the engine's output->full map (distinct full ids below ``full_vocab_size``)."""
        forward = np.asarray(output_to_full, dtype=np.int64).reshape(-1)
        if forward.size and (forward.min() < 0 or forward.max() >= full_vocab_size):
            raise DecodeError(f"output->full id map has ids outside 0..{full_vocab_size - 1}")
        if len(np.unique(forward)) != len(forward):
            raise DecodeError("output->full id map repeats a full id")
        inverse = np.full(full_vocab_size, -1, dtype=np.int32)
        inverse[forward] = np.arange(len(forward), dtype=np.int32)
        return cls(output_to_full=forward.astype(np.int32), full_to_output=inverse)


@lru_cache(maxsize=8)
def _identity(vocab_size: int) -> VocabMap:
    ids = np.arange(vocab_size, dtype=np.int32)
    ids.setflags(write=False)
    return VocabMap(output_to_full=ids, full_to_output=ids)


def check_step_inputs(artifact: Artifact, n_slots: int, n_rows: int, n_cols: int, vocab: VocabMap) -> None:
    """Refuse scores and maps that do not cover the batch and the trie's tokens: compiled backends would read
    out of bounds. Costs a few comparisons per step."""
    if n_rows < n_slots:
        raise DecodeError(f"scores have {n_rows} rows for {n_slots} slots")
    if len(vocab.output_to_full) != n_cols:
        raise DecodeError(f"scores have {n_cols} columns but the vocabulary map has {len(vocab.output_to_full)}")
    if len(vocab.full_to_output) <= artifact.max_token_id:
        raise DecodeError(f"the vocabulary covers ids below {len(vocab.full_to_output)}, but the grammar uses token "
                          f"{artifact.max_token_id}: the scores must span the tokenizer's vocabulary")
