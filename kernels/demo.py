"""Decode with synthetic logits: a check of the rules from the command line (``tooltrie decode``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from tooltrie.compiler.artifact import Artifact
from tooltrie.compiler.tokenizer_info import TokenizerInfo
from tooltrie.kernels import step
from tooltrie.kernels.state import DONE, ERROR, RUNNING, BatchState


def synthetic_logits(kind: str, batch: int, vocab_size: int, rng: np.random.Generator) -> np.ndarray[Any, Any]:
    """``random``: standard normal; ``ties``: three distinct values, so most legal tokens tie."""
    if kind == "random":
        return rng.standard_normal((batch, vocab_size), dtype=np.float32)
    if kind == "ties":
        return rng.integers(0, 3, size=(batch, vocab_size)).astype(np.float32)
    raise ValueError(f"unknown logits kind {kind!r}: expected 'random' or 'ties'")


def decode_demo(artifact: Artifact, tokenizer: TokenizerInfo, *, k: int, batch: int, seed: int, logits: str,
                backend: str = "auto") -> Iterator[dict[str, Any]]:
    """Decode ``batch`` answers of ``k`` tools; one JSON-ready dict per slot."""
    rng = np.random.default_rng(seed)
    vocab_size = max(tokenizer.vocab_size, int(artifact.trie.edge_token.max()) + 1, artifact.eos_id + 1)
    state = BatchState.start(artifact, [k] * batch)
    token_ids: list[list[int]] = [[] for _ in range(batch)]
    max_steps = k * (artifact.trie.max_depth + 1) + 1  # every step moves one token along a bounded path
    for _ in range(max_steps):
        if not (state.status == RUNNING).any():
            break
        chosen = step(artifact, state, synthetic_logits(logits, batch, vocab_size, rng), backend=backend)
        for row, token in enumerate(chosen):
            if token >= 0:
                token_ids[row].append(int(token))
    names = artifact.registry.names
    for row in range(batch):
        ids = token_ids[row]
        yield {
            "tools": [names[t] for t in state.tools(row)],
            "token_ids": ids,
            "text": tokenizer.decode(ids),
            "finish_reason": {DONE: "stop", ERROR: "error"}.get(int(state.status[row]), "length"),
        }
