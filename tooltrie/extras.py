"""Which extra brings a missing module: a plain ``pip install tooltrie`` compiles, inspects and decodes (CPU); the
model, serving, training, evaluation and CUDA parts are extras, and a missing one is named with its pip command.

>>> print(missing_extra_message("torch"))
torch is not installed: it comes with the 'model' extra: pip install 'tooltrie[model]'
>>> missing_extra_message("numpy") is None  # a dependency of the plain install: nothing to advise
True
"""

from __future__ import annotations

import importlib.util

# Top-level module -> the extra that installs it (see pyproject.toml).
EXTRA_OF_MODULE = {
    "torch": "model",
    "transformers": "model",
    "jinja2": "model",
    "tqdm": "model",
    "gguf": "model",
    "accelerate": "model",
    "bm25s": "model",
    "fastapi": "serve",
    "uvicorn": "serve",
    "mcp": "serve",
    "httpx": "serve",
    "prometheus_client": "serve",
    "peft": "train",
    "matplotlib": "eval",
    "xgrammar": "eval",
    "numba_cuda": "cuda",
    "cupy": "cuda",
    "vllm": "vllm",
}


def missing_extra_message(module: str | None) -> str | None:
    """The advice for a missing ``module`` (as ``ModuleNotFoundError.name`` gives it), or None if no extra has it."""
    extra = EXTRA_OF_MODULE.get((module or "").split(".")[0])
    if extra is None:
        return None
    return f"{module} is not installed: it comes with the {extra!r} extra: pip install 'tooltrie[{extra}]'"


def require_extra(extra: str, *modules: str) -> None:
    """Raise ``ModuleNotFoundError`` naming the extra and its pip command when one of ``modules`` is missing (looked
    up, not imported: the check costs nothing when they are there)."""
    missing = [module for module in modules if importlib.util.find_spec(module) is None]
    if missing:
        raise ModuleNotFoundError(f"{', '.join(missing)} not installed: this part of tooltrie comes with the {extra!r} "
                                  f"extra: pip install 'tooltrie[{extra}]'", name=missing[0])
