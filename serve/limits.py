"""The discovery service's limits, in one place: each with its default and what raising it costs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeLimits:
    """What one server accepts and how much it holds at once.

    A request beyond a limit is refused with a 4xx (or 429) whose message names the limit; it never reaches the
    engine, so it cannot disturb the requests being decoded.
    """

    max_batch: int = 16
    """Rows decoded together per registry (continuous batching); 1 turns batching off. Cost: each forward pass
    grows with the rows (their key/value caches, ~1,300 prompt tokens each with the catalog prompt)."""

    queue: int = 128
    """Requests accepted but not yet decoding, over all registries; one more gets ``429`` with ``Retry-After``.
    Cost: a queued request waits about ``queue / max_batch`` answer times, so keep that below ``timeout_s``."""

    timeout_s: float = 30.0
    """Seconds from arrival to answer, queueing included; past it the request is cancelled (its slot freed) and
    answered ``504``."""

    max_query_chars: int = 2_000
    """Characters in a query; longer ones get ``422``. Cost: prompt tokens (a few characters each) go through
    the model once per request, and the prompt must fit the model's context (8,192 tokens for SmolLM2, of which
    the catalog prompt takes ~1,300)."""

    max_body_bytes: int = 16_384
    """Bytes in a request body (HTTP and MCP); a larger one gets ``413`` before any of it is parsed."""

    def __post_init__(self) -> None:
        for name in ("max_batch", "queue", "max_query_chars", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServeLimits.{name} must be at least 1, got {getattr(self, name)}")
        if not self.timeout_s > 0:
            raise ValueError(f"ServeLimits.timeout_s must be positive, got {self.timeout_s}")
