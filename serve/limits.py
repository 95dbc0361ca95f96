"""The discovery service's limits, in one place: each with its default and what raising it costs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tooltrie.compiler.artifact import Artifact


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
    """Characters in a query; longer ones get ``422``. A first, cheap bound, checked before the query is tokenized;
    ``max_query_tokens`` is the one that bounds the work."""

    max_query_tokens: int = 1_024
    """Tokens of a query (as the model reads it, without the prompt around it); more get ``422``. 1,024 takes every
    query of the bundled evaluation sets (BFCL's longest: 1,007; 99 % of them under 175). Cost: each token goes
    through the model once, ``prefill_tokens`` a pass (a 1,024-token query is 16 passes); read whole in one pass on
    one thread of a shared 2-core AMD EPYC VM, SmolLM2-135M took 5.6 s for 512 tokens and 15 s for 1,024."""

    prefill_tokens: int = 64
    """Prompt tokens one request reads per forward pass (``Engine.prefill``): a longer query is read in chunks between
    the other rows' steps, so no request holds the batch for more than one such slice (a pass reads at most
    ``max_batch * prefill_tokens`` prompt tokens). An ordinary query (MetaTool's 99th percentile: 69 tokens) is read
    in one or two passes. Cost: a long query needs one pass per chunk."""

    max_body_bytes: int = 16_384
    """Bytes in a request body; a larger one gets ``413`` before any of it is parsed. A tool search's (HTTP and
    MCP), which may carry the agent's tool list, has ``max_tools_body_bytes``."""

    max_tools_body_bytes: int = 8 << 20
    """Bytes in a tool-search body (``/v1/tool-search``, MCP): room for an agent's list of a few thousand tools."""

    max_agent_tools: int = 20_000
    """Tools in an agent's own list (``tools`` of a tool search); more get ``422``."""

    agent_lists: int = 8
    """Distinct agent tool lists held compiled at once, each with its own engine (its key/value caches: ~47 MB at
    ``max_batch`` 16 with SmolLM2-135M); the one searched least recently goes once ``timeout_s`` has passed since
    its last search, and while none has, a new list gets ``503``. Cost: a new list is compiled (about a second for
    3,000 tools on 2 cores) before its first answer."""

    def __post_init__(self) -> None:
        for name in ("max_batch", "queue", "max_query_chars", "max_query_tokens", "prefill_tokens", "max_body_bytes",
                     "max_tools_body_bytes", "max_agent_tools", "agent_lists"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServeLimits.{name} must be at least 1, got {getattr(self, name)}")
        if not self.timeout_s > 0:
            raise ValueError(f"ServeLimits.timeout_s must be positive, got {self.timeout_s}")


def answer_budget(artifact: Artifact, k: int) -> int:
    """The tokens an answer of ``k`` tools may take, its stop token included: what admission keeps free of the
    model's context beside the prompt, and what a vLLM server may generate for it (``max_tokens``). A tool takes at
    most the trie's deepest path (``max_depth``, the separator's tokens included); two tokens a tool more are spare.
    """
    return k * (artifact.trie.max_depth + 2) + 1
