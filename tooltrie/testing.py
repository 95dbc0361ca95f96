"""Model factories for tests and benchmarks: tiny random models, and the default model's architecture with random
weights. Their answers mean nothing; they exercise the code paths and cost what a real model's forward pass costs.

Nothing here is used when serving: ``tooltrie.serve.model`` loads the real models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from tooltrie.serve.model import DEFAULT_VOCAB_SIZE

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["DEFAULT_ARCHITECTURE", "random_default_model", "tiny_llama"]


def tiny_llama(
    tokenizer_vocab: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
    *,
    eos_token_id: int | None = 2,
    dtype: torch.dtype = torch.float32,
    head_dim: int = 16,
) -> PreTrainedModel:
    """A tiny randomly initialised ``LlamaForCausalLM`` (hidden 64, 2 layers, 4 heads of 16, 2 key-value heads,
    embeddings tied like SmolLM2's) with a real vocabulary size, for tests of other components.

    The same ``seed`` gives the same weights; the caller's random state is left as it was. ``eos_token_id`` defaults
    to SmolLM2's ``<|im_end|>`` (2). ``head_dim=32`` makes 2 heads of 32 and 1 key-value head instead: vLLM's CPU
    attention takes head sizes from 32 up.
    """
    heads = 64 // head_dim
    return _random_llama(
        seed, dtype, vocab_size=tokenizer_vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=heads // 2, head_dim=head_dim, max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100_000.0},
        initializer_range=0.2,  # logits of order one, so greedy choices are clear-cut even in float16
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=eos_token_id)


# The default model's architecture: the converted SmolLM2-135M-Instruct's config.json, less its weights' provenance
# (tests/test_serve_model.py checks it against the installed default).
DEFAULT_ARCHITECTURE: dict[str, Any] = {
    "vocab_size": DEFAULT_VOCAB_SIZE, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 100_000.0},
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def random_default_model(seed: int = 0, *, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The default model's architecture with random weights: what the benchmarks time (``--weights random``) where
    the real weights cannot be had, as on a GPU machine with no network. Its answers mean nothing; a token costs
    what it costs the default model."""
    return _random_llama(seed, dtype, **DEFAULT_ARCHITECTURE)


def _random_llama(seed: int, dtype: torch.dtype, **config: Any) -> PreTrainedModel:
    """A randomly initialised ``LlamaForCausalLM``; the same seed gives the same weights, the caller's random state
    is left as it was."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = LlamaForCausalLM(LlamaConfig(**config))
    return cast("PreTrainedModel", model.to(dtype).eval())
