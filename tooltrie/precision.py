"""Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX, as oneDNN reports): where it does, the model
and the sentence encoder run in bfloat16 by default (``serve.model.serving_dtype``, ``retrieval.SentenceEncoder``)."""

from __future__ import annotations

import functools


@functools.cache
def native_bf16() -> bool:
    import torch

    try:  # a private helper of torch (its own tests use it), so a missing one means "no"
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


__all__ = ["native_bf16"]
