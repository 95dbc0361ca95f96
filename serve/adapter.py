"""A trained LoRA adapter on disk: what it holds, what it was trained against, and how it is merged into a base.

An adapter directory has three files:

- ``adapter_model.safetensors``: the LoRA matrices under peft's names
  (``base_model.model.<module>.lora_A.weight`` [r, in] and ``...lora_B.weight`` [out, r]), stored in float16;
- ``adapter_config.json``: peft's ``LoraConfig``, so ``peft.PeftModel.from_pretrained(base, directory)`` loads it too;
- ``tooltrie.json``: the record: the base model (name and ``model_fingerprint``), the registry (name, sha256), the
  tokenizer fingerprint and the contract sha256 of the artifact it was trained against, the prompt style, the
  training settings and the loss and validation curves, and the sha256 of the weights file (``verify_adapter``).

Merging needs no peft: every adapted linear layer becomes ``W + scale * B @ A`` (``scale = alpha / r``), computed in
float32. That takes a few milliseconds for SmolLM2-135M, so a merged model loads as fast as its base.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from tooltrie.errors import ModelError

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "RECORD_FILE",
    "AdapterError",
    "AdapterRecord",
    "is_adapter_dir",
    "low_rank_updates",
    "merge_adapter",
    "read_adapter",
    "verify_adapter",
    "write_adapter",
]

ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
RECORD_FILE = "tooltrie.json"
RECORD_FORMAT = "tooltrie-adapter"
RECORD_FORMAT_VERSION = 1
_PEFT_PREFIX = "base_model.model."
_LORA_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B"}
# LoRA variants whose merge is not W + (alpha / r) * B @ A: refused rather than merged wrongly.
_UNSUPPORTED_FLAGS = ("use_dora", "fan_in_fan_out", "use_qalora", "lora_bias")


class AdapterError(ModelError):
    """An adapter directory is unreadable, incomplete, or does not fit the model it is merged into."""


@dataclass(frozen=True)
class AdapterRecord:
    """What ``tooltrie.json`` says about an adapter: the inputs it was trained against."""

    path: Path
    base_model: str  # the default model's name, or the directory of another base
    base_fingerprint: str  # ``model_fingerprint`` of that base, in float32
    registry_name: str
    registry_sha256: str
    tokenizer_fingerprint: str
    contract_sha256: str
    prompt_style: str  # the ``serve.prompt`` style of the training data ("short")
    record: Mapping[str, Any] = field(repr=False)  # the whole record: training settings, curves, versions


def is_adapter_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding an adapter record (``tooltrie.json``)."""
    return (Path(path) / RECORD_FILE).is_file()


def read_adapter(directory: str | Path) -> AdapterRecord:
    """Read and check an adapter directory's record; raises ``AdapterError`` saying what is wrong."""
    path = Path(directory)
    for name in (RECORD_FILE, ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
        if not (path / name).is_file():
            raise AdapterError(f"{path}: not an adapter directory: {name} is missing")
    record = _read_json(path / RECORD_FILE)
    if record.get("format") != RECORD_FORMAT or record.get("format_version") != RECORD_FORMAT_VERSION:
        raise AdapterError(f"{path / RECORD_FILE}: expected format {RECORD_FORMAT!r} version "
                           f"{RECORD_FORMAT_VERSION}, found {record.get('format')!r} "
                           f"version {record.get('format_version')!r}")
    try:
        return AdapterRecord(
            path=path,
            base_model=str(record["base_model"]["name"]),
            base_fingerprint=str(record["base_model"]["fingerprint"]),
            registry_name=str(record["registry"]["name"]),
            registry_sha256=str(record["registry"]["sha256"]),
            tokenizer_fingerprint=str(record["tokenizer"]["fingerprint"]),
            contract_sha256=str(record["contract_sha256"]),
            prompt_style=str(record["prompt_style"]),
            record=record,
        )
    except (KeyError, TypeError) as exc:
        raise AdapterError(f"{path / RECORD_FILE}: the record lacks {exc}") from exc


def verify_adapter(record: AdapterRecord) -> None:
    """Check what ``read_adapter`` leaves to the merge: the weights are the bytes the record hashed
    (``weights_sha256``, written by ``write_adapter``) and the LoRA config is one that merges. Raises
    ``AdapterError``: a truncated or corrupt file, or a record without the hash (an adapter written before records
    had it), cannot be told from a sound one."""
    weights = record.path / ADAPTER_WEIGHTS_FILE
    expected = record.record.get("weights_sha256")
    if not isinstance(expected, str):
        raise AdapterError(f"{record.path / RECORD_FILE}: no weights_sha256 (written before adapter records held "
                           f"it), so {weights.name} cannot be checked")
    try:
        found = _sha256(weights)
    except OSError as exc:
        raise AdapterError(f"{weights}: unreadable: {exc}") from exc
    if found != expected:
        raise AdapterError(f"{weights}: sha256 {found[:12]} is not the {expected[:12]} its record says: the file is "
                           f"truncated or corrupt")
    _scales(_read_json(record.path / ADAPTER_CONFIG_FILE), record.path)


def write_adapter(directory: str | Path, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                  record: Mapping[str, Any], *, dtype: torch.dtype = torch.float16) -> Path:
    """Write an adapter directory atomically (built beside it, then renamed into place; an old one is replaced).

    ``tensors`` are the LoRA matrices under peft's names, ``config`` peft's ``LoraConfig`` as a dict, ``record`` the
    contents of ``tooltrie.json`` without its format fields and the weights' sha256 (added here).
    """
    from safetensors.torch import save_file

    out = Path(directory)
    stored = {name: tensor.detach().to("cpu", dtype).contiguous() for name, tensor in tensors.items()}
    for name, tensor in stored.items():
        if not torch.isfinite(tensor).all():
            raise AdapterError(f"{out}: {name} has values that are not finite in {dtype}; training diverged")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        save_file(stored, tmp / ADAPTER_WEIGHTS_FILE, metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True, default=_jsonable) + "\n",
                                               encoding="utf-8")
        full = {"format": RECORD_FORMAT, "format_version": RECORD_FORMAT_VERSION, **record,
                "weights_sha256": _sha256(tmp / ADAPTER_WEIGHTS_FILE)}
        (tmp / RECORD_FILE).write_text(json.dumps(full, indent=1, default=_jsonable) + "\n", encoding="utf-8")
        for child in tmp.iterdir():
            child.chmod(0o644)
        tmp.chmod(0o755)
        _replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def merge_adapter(model: torch.nn.Module, record: AdapterRecord) -> int:
    """Add the adapter's ``scale * B @ A`` to each adapted linear layer of ``model``, in place; returns how many.

    Raises ``AdapterError`` when a named layer is missing or its shape does not fit: the adapter was trained on
    another model.
    """
    updates = low_rank_updates(model, record)
    threads = torch.get_num_threads()
    # Rank-r products are too small to share: on a busy 2-core machine two threads wait on each other ~8 ms per
    # layer, one thread takes ~0.3 ms.
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            for layer, (a, b) in updates.items():
                weight = cast(torch.Tensor, layer.weight)
                if weight.dtype == torch.float32:
                    weight.addmm_(b, a)  # in place: no [out, in] temporaries
                else:
                    weight.copy_((weight.float() + b @ a).to(weight.dtype))
    finally:
        torch.set_num_threads(threads)
    return len(updates)


def low_rank_updates(model: torch.nn.Module,
                     record: AdapterRecord) -> dict[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The adapter as ``{linear layer of model: (A, scale * B)}`` in float32: the layer's update is ``B @ A``.

    Raises ``AdapterError`` when a named layer is missing or its shape does not fit: the adapter was trained on
    another model.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = _read_json(record.path / ADAPTER_CONFIG_FILE)
    scale_of = _scales(config, record.path)
    try:
        tensors = load_file(record.path / ADAPTER_WEIGHTS_FILE)
    except (SafetensorError, OSError) as exc:
        raise AdapterError(f"{record.path / ADAPTER_WEIGHTS_FILE}: unreadable: {exc}") from exc
    updates = {}
    for module_name, (a, b) in sorted(_pairs(tensors, record.path).items()):
        try:
            layer = model.get_submodule(module_name)
        except AttributeError as exc:
            raise AdapterError(f"{record.path}: the model has no layer {module_name}; the adapter was trained "
                               "on another model") from exc
        weight = getattr(layer, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise AdapterError(f"{record.path}: {module_name} is not a linear layer")
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank or (b.shape[0], a.shape[1]) != weight.shape:
            raise AdapterError(f"{record.path}: {module_name}: A {tuple(a.shape)} and B {tuple(b.shape)} do not "
                               f"fit its weight {tuple(weight.shape)}; the adapter was trained on another model")
        device = weight.device
        updates[layer] = (a.to(device, torch.float32), b.to(device, torch.float32) * scale_of(module_name, rank))
    return updates


# --- internals -------------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{path}: unreadable: {exc}") from exc
    if not isinstance(value, dict):
        raise AdapterError(f"{path}: expected a JSON object")
    return value


def _scales(config: dict[str, Any], path: Path) -> Any:
    """``scale(module, rank)`` for this LoRA config: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: a {config.get('peft_type')} adapter; only LoRA is merged")
    for flag in _UNSUPPORTED_FLAGS:
        if config.get(flag):
            raise AdapterError(f"{path}: {flag} is set; only plain LoRA (W + alpha/r * B @ A) is merged")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise AdapterError(f"{path}: the adapter trains biases or whole modules; only LoRA matrices are merged")
    alpha = float(config.get("lora_alpha", 8))
    alpha_pattern: dict[str, float] = config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora"))

    def scale(module: str, rank: int) -> float:
        module_alpha = next((float(v) for k, v in alpha_pattern.items() if module.endswith(k)), alpha)
        return module_alpha / (rank ** 0.5 if rslora else rank)

    return scale


def _pairs(tensors: dict[str, torch.Tensor], path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module name: (A, B)} from peft's tensor names."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        suffix = next((s for s in _LORA_SUFFIXES if name.endswith(s)), None)
        if suffix is None or not name.startswith(_PEFT_PREFIX):
            raise AdapterError(f"{path}: unexpected tensor {name!r} (expected peft's LoRA names "
                               f"{_PEFT_PREFIX}<module>.lora_A.weight / .lora_B.weight)")
        module = name[len(_PEFT_PREFIX) : -len(suffix)]
        found.setdefault(module, {})[_LORA_SUFFIXES[suffix]] = tensor
    pairs = {}
    for module, parts in found.items():
        if set(parts) != {"A", "B"}:
            raise AdapterError(f"{path}: {module} has lora_{next(iter(parts))} but not its partner")
        pairs[module] = (parts["A"], parts["B"])
    if not pairs:
        raise AdapterError(f"{path}: the adapter holds no LoRA matrices")
    return pairs


def _replace(tmp: Path, out: Path) -> None:
    if out.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.rename(out, trash / out.name)
        os.rename(tmp, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, out)


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(value)
    if isinstance(value, Path):
        return str(value)
    return str(value)  # enums (peft's PeftType) and the like
