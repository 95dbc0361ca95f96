"""What is checked and hashed about a loaded model's weights, wherever they came from: the fingerprint an adapter
and an artifact are matched against, the output rows a tokenizer must fit, and a copy ``save_pretrained`` accepts.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from tooltrie.errors import ModelError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["TensorSample", "check_tokenizer_fits", "fingerprint_of", "model_fingerprint", "output_rows", "plain_copy",
           "tensor_sample"]

# Config entries that name or date a model rather than decide its outputs (the weights' dtypes are hashed anyway).
_UNHASHED_CONFIG_KEYS = frozenset(
    {"_name_or_path", "name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype", "_commit_hash"}
)
_FINGERPRINT_SAMPLES = 4096  # elements read from each tensor for the weights digest


# What the fingerprint takes of one tensor: its shape, its dtype, and its sampled elements' bytes (None: on the meta
# device, no values).
TensorSample = tuple[tuple[int, ...], torch.dtype, bytes | None]


def model_fingerprint(model: torch.nn.Module) -> str:
    """A sha256 over the model's class, its config (less names and versions) and a cheap digest of its weights.

    The weights' digest covers every tensor's name, shape and dtype plus up to 4,096 evenly spaced elements of
    each: cheap (milliseconds for the default model) and different for any retrained or re-quantised model, though
    not a hash of every byte. A GGUF-loaded model and its converted copy fingerprint the same.
    """
    return fingerprint_of(model, [(name, tensor_sample(tensor)) for name, tensor in sorted(model.state_dict().items())])


def tensor_sample(tensor: torch.Tensor) -> TensorSample:
    """What ``model_fingerprint`` reads of one tensor."""
    if tensor.is_meta:
        return tuple(tensor.shape), tensor.dtype, None
    flat = tensor.detach().reshape(-1)
    step = max(1, flat.numel() // _FINGERPRINT_SAMPLES)
    sample = flat[::step][:_FINGERPRINT_SAMPLES].to("cpu").contiguous()
    return tuple(tensor.shape), tensor.dtype, sample.view(torch.uint8).numpy().tobytes()


def fingerprint_of(model: torch.nn.Module, samples: list[tuple[str, TensorSample]]) -> str:
    """``model_fingerprint`` from the model's class and config and its tensors' samples, by name in sorted order
    (``serve.weights_file`` takes them as it reads, in float32, for a model it holds in another dtype)."""
    digest = hashlib.sha256()
    digest.update(type(model).__name__.encode())
    config = getattr(model, "config", None)
    if config is not None:
        settings = {k: v for k, v in config.to_dict().items() if k not in _UNHASHED_CONFIG_KEYS}
        quantization = settings.get("quantization_config")
        if isinstance(quantization, dict) and quantization.get("quant_method") == "gguf":
            del settings["quantization_config"]  # GGUF weights are dequantised on load: the tensors say it all
        digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    for name, (shape, dtype, sample) in samples:
        digest.update(f"\0{name}:{shape}:{dtype}:".encode())
        digest.update(b"meta" if sample is None else sample)
    return digest.hexdigest()


def output_rows(model: PreTrainedModel) -> int:
    """Rows of the model's output layer (its config's vocab_size when the layer has no weight)."""
    output = cast(Any, model).get_output_embeddings()
    weight = getattr(output, "weight", None)
    return int(weight.shape[0]) if weight is not None else int(model.config.vocab_size)


def check_tokenizer_fits(model: PreTrainedModel, tokenizer_json: Path, *, exact: bool) -> None:
    """Every token id must have a logit; with ``exact`` the rows must be exactly the tokenizer's vocabulary."""
    tokens = _tokenizer_vocab_size(tokenizer_json)
    rows = output_rows(model)
    if rows < tokens or (exact and rows != tokens):
        raise ModelError(
            f"{tokenizer_json}: the tokenizer has {tokens} tokens but the model has {rows} output rows; "
            f"this model was not trained with this tokenizer"
        )


def plain_copy(model: PreTrainedModel) -> PreTrainedModel:
    """The same weights in a model whose config has no quantization entry, so ``save_pretrained`` accepts it.

    Built on the meta device with the weights assigned (no random initialisation, no second copy), the copy is for
    saving only: its non-persistent buffers (rotary frequencies) stay on the meta device.
    """
    settings = model.config.to_dict()
    settings.pop("quantization_config", None)
    settings.pop("_name_or_path", None)
    config = type(model.config).from_dict(settings)
    with torch.device("meta"):  # no random initialisation: the weights are assigned just below
        plain: Any = type(model)(config)
    plain.load_state_dict(model.state_dict(), strict=True, assign=True)
    plain.tie_weights()
    return cast("PreTrainedModel", plain.eval())


def _tokenizer_vocab_size(tokenizer_json: Path) -> int:
    from tokenizers import Tokenizer

    try:
        return int(Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True))
    except Exception as exc:  # the Rust side raises plain Exceptions for malformed files
        raise ModelError(f"{tokenizer_json}: not a Hugging Face tokenizer.json: {exc}") from exc
