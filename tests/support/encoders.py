"""A made-up sentence encoder standing in for all-MiniLM-L6-v2 (``tooltrie.ranker.Ranker(encoder=)``): a fixed random
unit vector per text, by its checksum, so nothing is downloaded and every run ranks alike."""

from __future__ import annotations

import threading
import zlib

import numpy as np
import torch


class MadeUpEncoder:
    """A unit vector per text, fixed by its checksum (with ``distinct``, one of that many: texts that share one tie
    exactly); records each text it encodes (``encoded``) and the thread that asked (``threads``)."""

    def __init__(self, dimensions: int = 16, *, distinct: int | None = None) -> None:
        self.dimensions, self.distinct = dimensions, distinct
        self.encoded: list[str] = []
        self.threads: list[str] = []

    def encode(self, texts: list[str]) -> torch.Tensor:
        self.encoded += texts
        self.threads += [threading.current_thread().name] * len(texts)
        seeds = [zlib.crc32(t.encode()) % (self.distinct or 2**32) for t in texts]
        rows = [np.random.default_rng(seed).standard_normal(self.dimensions) for seed in seeds]
        return torch.nn.functional.normalize(torch.tensor(np.array(rows), dtype=torch.float32), dim=-1)

    def forget(self) -> None:
        """Forget what was encoded so far."""
        self.encoded.clear()
        self.threads.clear()
