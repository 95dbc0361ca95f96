"""What the simulator cannot check: the kernels type-check for sm_90, and ptxas enforces constant memory.

Runs ``python -m tooltrie.kernels.ptx_check`` in a subprocess (it must not run under the simulator). Needs
numba-cuda's NVRTC (``tooltrie[ptx]``, installed by ``make test``) and a CUDA toolkit with libNVVM and ptxas;
skipped with the reason where they are absent.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
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


def _ptx_checks(*runs: tuple[str, ...]) -> list[list[dict]]:
    """Each run's results; the runs compile side by side, one process each (compiling is single-threaded). Their
    output goes to files, so a process never waits on a full pipe while another is read."""
    env = {**os.environ, "CUDA_HOME": str(CUDA_HOME), "NUMBA_ENABLE_CUDASIM": "0"}
    with contextlib.ExitStack() as files:
        started = []
        for args in runs:
            out, err = (files.enter_context(tempfile.TemporaryFile("w+")) for _ in range(2))
            command = [sys.executable, "-m", "tooltrie.kernels.ptx_check", *args]
            started.append((subprocess.Popen(command, env=env, text=True, stdout=out, stderr=err), out, err))
        results = []
        for process, out, err in started:
            process.wait(timeout=600)
            out.seek(0), err.seek(0)
            assert process.returncode == 0, err.read()[-3000:]
            results.append([json.loads(line) for line in out.read().splitlines()])
    return results


def test_catalog_kernels_live_in_constant_memory_and_assemble(artifacts):
    scores = ("--scores", "float32", "bfloat16-bits", "float16", "sparse-head")
    runs = _ptx_checks(*((str(artifacts["catalog"]), "--layout", layout, *scores) for layout in ("warp", "thread")))
    results = [result for run in runs for result in run]
    assert len(results) == 8
    for result in results:
        assert result["placement"] == "constant"
        assert result["uses_constant_memory"], result
        assert result["ptxas_ok"], result


def test_large_registry_is_routed_to_global_memory_not_to_a_link_error(artifacts):
    (auto,), (forced,) = _ptx_checks((str(artifacts["bfcl"]),), (str(artifacts["bfcl"]), "--placement", "constant"))
    assert auto["placement"] == "global" and not auto["uses_constant_memory"] and auto["ptxas_ok"], auto
    assert not forced["ptxas_ok"]
    assert "too much global constant data" in forced["ptxas_message"]
