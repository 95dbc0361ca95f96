"""A made-up sentence encoder standing in for all-MiniLM-L6-v2 (``tooltrie.ranker.Ranker(encoder=)``): a fixed random
unit vector per text, by its checksum, so nothing is downloaded and every run ranks alike."""

from __future__ import annotations

import zlib

import numpy as np
import torch


class MadeUpEncoder:
    """A unit vector per text, fixed by its checksum; counts the texts it encodes."""

    def __init__(self, dimensions: int = 16) -> None:
        self.dimensions = dimensions
        self.encoded: list[str] = []

    def encode(self, texts: list[str]) -> torch.Tensor:
        self.encoded += texts
        rows = [np.random.default_rng(zlib.crc32(t.encode())).standard_normal(self.dimensions) for t in texts]
        return torch.nn.functional.normalize(torch.tensor(np.array(rows), dtype=torch.float32), dim=-1)
