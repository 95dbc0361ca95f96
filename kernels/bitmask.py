"""The shared token-bitmask convention (XGrammar, llguidance and outlines-core agree on it).

A bitmask is int32 ``[batch, ceil(vocab / 32)]``; bit ``t % 32`` of word ``t // 32`` set means token ``t`` is
allowed. NumPy arrays and torch tensors both work; torch is imported only when a tensor is passed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

BITS_PER_WORD = 32


def get_bitmask_shape(batch_size: int, vocab_size: int) -> tuple[int, int]:
    """The shape of a bitmask for ``batch_size`` rows over ``vocab_size`` tokens.

    >>> get_bitmask_shape(2, 49152)
    (2, 1536)
    """
    return batch_size, (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def allocate_token_bitmask(batch_size: int, vocab_size: int) -> npt.NDArray[np.int32]:
    """An all-allowed bitmask (every bit set)."""
    return np.full(get_bitmask_shape(batch_size, vocab_size), -1, dtype=np.int32)


def set_allowed(row: npt.NDArray[np.int32], tokens: Iterable[int]) -> None:
    """Make ``row`` allow exactly ``tokens``."""
    words = row.view(np.uint32)
    words[:] = 0
    ids = np.fromiter(tokens, dtype=np.int64)
    np.bitwise_or.at(words, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))


def allowed_tokens(row: npt.NDArray[np.int32], vocab_size: int) -> npt.NDArray[np.int64]:
    """The token ids a bitmask row allows (below ``vocab_size``)."""
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size]
    return np.nonzero(bits)[0]


def apply_token_bitmask_inplace(logits: Any, bitmask: Any, *, indices: Iterable[int] | None = None) -> None:
    """Set the logits of disallowed tokens to -inf, in place, for ``indices`` rows (default: all).

    Row ``i`` of ``bitmask`` masks row ``i`` of ``logits``; columns past the bitmask's width are masked too.
    """
    rows = list(range(logits.shape[0])) if indices is None else [int(i) for i in indices]
    if not rows:
        return
    vocab = logits.shape[-1]
    if isinstance(logits, np.ndarray):
        allowed = np.unpackbits(np.asarray(bitmask)[rows].view(np.uint8), axis=-1, bitorder="little")
        allowed = np.pad(allowed, ((0, 0), (0, max(0, vocab - allowed.shape[1]))))[:, :vocab].astype(bool)
        logits[rows] = np.where(allowed, logits[rows], -np.inf)
        return
    import torch

    bits = torch.arange(BITS_PER_WORD, device=logits.device, dtype=torch.int32)
    words = torch.as_tensor(np.asarray(bitmask)[rows] if isinstance(bitmask, np.ndarray) else bitmask[rows],
                            device=logits.device)
    allowed_bits = ((words.unsqueeze(-1) >> bits) & 1).bool().flatten(1)
    if allowed_bits.shape[1] < vocab:
        allowed_bits = torch.nn.functional.pad(allowed_bits, (0, vocab - allowed_bits.shape[1]))
    index = torch.as_tensor(rows, device=logits.device, dtype=torch.long)
    logits[index] = logits[index].masked_fill(~allowed_bits[:, :vocab], float("-inf"))
