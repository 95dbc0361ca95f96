"""A model directory's safetensors read a tensor at a time, straight into the dtype the model is served in.

``transformers``' ``from_pretrained`` maps the weights file and converts from the mapping: every page read counts as
the process's memory while the file stays mapped, so loading SmolLM2-135M in bfloat16 from its float32 copy rose
0.94 GB above the imports at its peak and kept 0.43 GB (0.27 GB of weights). Here a model is made without
initialising its weights and each tensor is read with plain reads, used and let go: the peak is the model in its
dtype plus the largest tensor in float32.

While a tensor is in hand in float32 it also gives what ``model_fingerprint`` samples of it, so the fingerprint the
model has *in float32* (what an adapter records of its base) comes without a float32 model, and takes its adapter's
update there (``W + B @ A`` in float32, then the cast): the same weights as merging into a float32 model and casting
it, bit for bit.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from tooltrie.errors import ModelError
from tooltrie.serve.weights import TensorSample, fingerprint_of, tensor_sample

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from tooltrie.serve.adapter import AdapterRecord

__all__ = ["read_streamed", "safetensors_files"]

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
_MAX_HEADER = 100_000_000  # the format's own limit on a header's size
# safetensors' dtype names (its format's specification).
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def safetensors_files(path: Path) -> list[Path] | None:
    """The safetensors files holding a model directory's weights (one, or the shards its index names), or None
    when it has none or its config asks for a quantized load (``from_pretrained``'s work)."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # from_pretrained says what is wrong with it
    if not isinstance(config, dict) or "quantization_config" in config:
        return None
    if (path / WEIGHTS_FILE).is_file():
        return [path / WEIGHTS_FILE]
    try:
        index = json.loads((path / WEIGHTS_INDEX).read_text(encoding="utf-8"))
        return [path / name for name in sorted(set(index["weight_map"].values()))]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def read_streamed(path: Path, files: list[Path], *, dtype: torch.dtype,
                  adapter: AdapterRecord | None = None) -> tuple[PreTrainedModel, str]:
    """The causal LM of directory ``path`` in ``dtype``, its weights read from ``files`` a tensor at a time, and the
    fingerprint it has in float32. ``adapter``'s update is added to each layer it adapts, in float32, before the
    cast. Raises ``ModelError`` for an unreadable file, a missing tensor or one of the wrong shape."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from tooltrie.serve.adapter import low_rank_updates

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        with no_init_weights():  # every weight is read below: no random initialisation
            model: Any = cast(Any, AutoModelForCausalLM).from_config(config, dtype=dtype)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ... for a bad config
        raise ModelError(f"{path}: cannot load a causal language model: {type(exc).__name__}: {exc}") from exc
    model.tie_weights()
    targets = model.state_dict()  # name -> the tensor it is read into (tied names share one)
    aliases: dict[int, list[str]] = {}
    for name, tensor in targets.items():
        aliases.setdefault(tensor.data_ptr(), []).append(name)
    layers = {} if adapter is None else low_rank_updates(model, adapter)
    updates = {f"{name}.weight": layers[module] for name, module in model.named_modules() if module in layers}
    samples: dict[str, TensorSample] = {}
    with torch.no_grad():
        for file in files:
            for name, tensor in _tensors(file):
                target = targets.get(name)
                if target is None:
                    continue  # e.g. rotary frequencies an older transformers saved; from_pretrained skips them too
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ModelError(f"{file}: {name} has shape {tuple(tensor.shape)}, the model's is "
                                     f"{tuple(target.shape)}")
                wide = tensor.float() if tensor.is_floating_point() else tensor
                for alias in aliases[target.data_ptr()]:
                    samples[alias] = tensor_sample(wide)
                if name in updates:
                    a, b = updates[name]
                    wide.addmm_(b, a)  # in place: the buffer was read for this tensor alone
                target.copy_(wide)  # the cast rounds as ``.to(dtype)`` does
    missing = sorted(set(targets) - set(samples))
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise ModelError(f"{path}: the weights lack {len(missing)} tensor(s) the model needs ({shown})")
    return cast("PreTrainedModel", model.eval()), fingerprint_of(model, sorted(samples.items()))


def _tensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a safetensors file in file order, each read on its own (no mapping of the file)."""
    try:
        with open(file, "rb") as stream:
            size = int.from_bytes(stream.read(8), "little")
            if not 2 <= size <= min(_MAX_HEADER, file.stat().st_size - 8):
                raise ValueError(f"a header of {size:,} bytes")
            header = json.loads(stream.read(size))
            header.pop("__metadata__", None)
            start = 8 + size
            entries = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
            for name, entry in entries:
                begin, end = entry["data_offsets"]
                dtype, shape = _DTYPES[entry["dtype"]], tuple(entry["shape"])
                data = bytearray(end - begin)
                stream.seek(start + begin)
                if stream.readinto(data) != len(data):
                    raise ValueError(f"{name}: the file ends inside its data")
                yield name, (torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
                             ).reshape(shape)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError) as exc:
        raise ModelError(f"{file}: cannot load a causal language model: unreadable safetensors: "
                         f"{type(exc).__name__}: {exc}") from exc
