"""What the simulator cannot check: the kernels type-check for sm_90, and ptxas enforces constant memory.

Runs ``python -m tooltrie.kernels.ptx_check`` in a subprocess (it must not run under the simulator). Needs
numba-cuda's NVRTC (``tooltrie[ptx]``, installed by ``make test``) and a CUDA toolkit with libNVVM and ptxas;
skipped with the reason where they are absent.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tooltrie.compiler import TokenizerInfo, compile_registry
from tooltrie.registry import BFCL_PATH, CATALOG_PATH, load_registry


def _cuda_home() -> str | None:
    for candidate in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if candidate and any(Path(candidate).glob("**/libnvvm.so*")):
            return candidate
    return None


CUDA_HOME = _cuda_home()
pytestmark = [
    pytest.mark.skipif(CUDA_HOME is None, reason="no CUDA toolkit with libNVVM (set CUDA_HOME)"),
    pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas is not on the PATH"),
    pytest.mark.skipif(importlib.util.find_spec("nvidia") is None,
                       reason="NVRTC wheel missing: pip install 'tooltrie[ptx]'"),
]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tokenizer = TokenizerInfo.load("smollm2-135m")
    folder = tmp_path_factory.mktemp("ptx")
    return {name: compile_registry(load_registry(path), tokenizer).save(folder / f"{name}.safetensors")
            for name, path in (("catalog", CATALOG_PATH), ("bfcl", BFCL_PATH))}


def _ptx_check(*args: str) -> list[dict]:
    env = {**os.environ, "CUDA_HOME": str(CUDA_HOME), "NUMBA_ENABLE_CUDASIM": "0"}
    done = subprocess.run([sys.executable, "-m", "tooltrie.kernels.ptx_check", *args], capture_output=True,
                          text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_catalog_kernels_live_in_constant_memory_and_assemble(artifacts):
    results = _ptx_check(str(artifacts["catalog"]), "--layout", "warp", "thread",
                         "--scores", "float32", "bfloat16-bits", "float16", "sparse-head")
    assert len(results) == 8
    for result in results:
        assert result["placement"] == "constant"
        assert result["uses_constant_memory"], result
        assert result["ptxas_ok"], result


def test_large_registry_is_routed_to_global_memory_not_to_a_link_error(artifacts):
    (auto,) = _ptx_check(str(artifacts["bfcl"]))
    assert auto["placement"] == "global" and not auto["uses_constant_memory"] and auto["ptxas_ok"], auto
    (forced,) = _ptx_check(str(artifacts["bfcl"]), "--placement", "constant")
    assert not forced["ptxas_ok"]
    assert "too much global constant data" in forced["ptxas_message"]
