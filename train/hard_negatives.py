"""Hard negatives: the tool each tool is most easily taken for.

Fused with retrieval, the model earns its weight where retrieval confuses two tools, so training puts each tool's
requests beside those of the tool retrieval finds nearest it (``batches.balanced_batches(partners=)``): the
cosine of their texts' all-MiniLM-L6-v2 embeddings (``retrieval.tool_text``: name, description, parameters), the
same embeddings the fused ranker's prior reads.
"""

from __future__ import annotations

from tooltrie.registry import Registry
from tooltrie.retrieval import SentenceEncoder

__all__ = ["confused_tools"]


def confused_tools(registry: Registry, *, encoder: SentenceEncoder | None = None) -> dict[str, str]:
    """Each tool's name to the name of the other tool whose text is nearest its own (ties: the tool listed first);
    empty for a registry of one tool."""
    from tooltrie.retrieval import EmbeddingRetriever

    if len(registry) < 2:
        return {}
    embeddings = EmbeddingRetriever(registry, encoder=encoder).tool_embeddings
    similar = embeddings @ embeddings.T
    similar.fill_diagonal_(float("-inf"))
    names = registry.names
    return {names[i]: names[j] for i, j in enumerate(similar.argmax(dim=1).tolist())}
