"""Compile the CUDA kernels to PTX without a GPU, and assemble them with ptxas where it is installed.

The CUDA simulator runs kernels as Python and checks neither typing nor the 64 KiB constant-memory limit; this
does both: ``python -m tooltrie.kernels.ptx_check ARTIFACT [...]`` prints one JSON line per kernel variant.
Needs numba-cuda's NVRTC (``pip install tooltrie[ptx]``) and a CUDA toolkit's libNVVM (``CUDA_HOME``); must run
without ``NUMBA_ENABLE_CUDASIM``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

from tooltrie.compiler.artifact import Artifact

SCORE_KINDS = ("float32", "bfloat16-bits", "float16", "sparse-head")


@contextmanager
def _pretend_device(compute_capability: tuple[int, int]) -> Iterator[None]:
    """Numba asks the current device for its compute capability when it compiles device functions; with no
    GPU there is none, so answer for the target we compile for."""
    import numba.cuda.dispatcher as dispatcher

    class Device:
        pass

    device = Device()
    device.compute_capability = compute_capability
    with mock.patch.object(dispatcher, "get_current_device", lambda: device):
        yield


def compile_variant(artifact: Artifact, *, placement: str, layout: str, score_kind: str,
                    compute_capability: tuple[int, int] = (9, 0)) -> dict[str, str]:
    """The PTX of one variant's kernels for this artifact: the choice for ``score_kind``, and accept, forced runs,
    the bitmask fill, the fused values (float32 logits) and the logits mask (for the logits' integer width)."""
    from numba import cuda, types

    from tooltrie.kernels.cuda import _mask_kernel, make_kernels

    index, count = types.int32[::1], types.int64
    table, counts, allowed = types.int32[:, ::1], types.int32[:, ::1], types.uint8[:, ::1]
    dense = types.float32[::1]  # what a dense choice passes for hidden: an empty 1-D array
    scores, hidden = {
        "float32": (types.float32[:, ::1], dense),
        "bfloat16-bits": (types.int16[:, ::1], dense),
        "float16": (types.float16[:, ::1], dense),
        "sparse-head": (types.float32[:, ::1], types.float32[:, ::1]),
    }[score_kind]
    trie = (index, index)  # the packed buffer and its offsets (stand-ins in the constant placement)
    state = (table, counts, allowed)
    outputs = (index, types.float64[:, ::1], types.int32[:, ::1], types.int32[:, ::1], index)
    signatures = {
        "choose": (*trie, count, count, count, *state, index, scores, hidden, count, index, index, *outputs,
                   types.float32[:, ::1], index, index),  # the ranker and the per-edge tool lists
        "accept": (*trie, count, count, count, *state, index, types.int32[:, ::1], index),
        "forced": (*trie, count, count, *state, index, types.int32[:, ::1], index),
        "fill": (*trie, count, count, *state, index, types.int32[:, ::1]),
        "fuse": (*trie, count, count, *state, index, types.float32[:, ::1], types.int32[:, ::1], dense, index,
                 types.float32[:, ::1], index, index),  # float32 logits, their bits, the ranker
    }
    bits = types.int16[:, ::1] if score_kind in ("bfloat16-bits", "float16") else types.int32[:, ::1]
    with _pretend_device(compute_capability):
        kernels = make_kernels(artifact.trie.arrays() if placement == "constant" else None, layout)
        ptx = {name: str(cuda.compile_ptx(kernels[name].py_func, signature, cc=compute_capability)[0])
               for name, signature in signatures.items()}
        ptx["mask"] = str(cuda.compile_ptx(_mask_kernel.py_func, (types.int32[:, ::1], index, bits, count),
                                           cc=compute_capability)[0])
    return ptx


def assemble(ptx: str, compute_capability: tuple[int, int] = (9, 0)) -> tuple[bool, str]:
    """Run ptxas on ``ptx``: (ok, its message). ptxas enforces the 64 KiB constant-memory limit."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return False, "ptxas not found"
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        arch = f"sm_{compute_capability[0]}{compute_capability[1]}"
        done = subprocess.run([ptxas, f"-arch={arch}", str(source), "-o", str(Path(tmp) / "kernel.cubin")],
                              capture_output=True, text=True, check=False)
    return done.returncode == 0, done.stderr.strip()


def check(artifact: Artifact, *, placement: str, layout: str, score_kind: str) -> dict[str, Any]:
    ptx = compile_variant(artifact, placement=placement, layout=layout, score_kind=score_kind)
    assembled = {name: assemble(text) for name, text in ptx.items()}
    trie_kernels = [name for name in ptx if name != "mask"]  # the mask reads a bitmask, not the trie
    return {"registry": artifact.registry.name, "device_bytes": artifact.trie.device_bytes, "placement": placement,
            "layout": layout, "scores": score_kind, "kernels": sorted(ptx),
            "ptx_bytes": sum(len(text) for text in ptx.values()),
            "uses_constant_memory": all(".const" in ptx[name] for name in trie_kernels),
            "ptxas_ok": all(ok for ok, _ in assembled.values()),
            "ptxas_message": "; ".join(f"{name}: {message}" for name, (ok, message) in assembled.items() if not ok)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("--placement", choices=("auto", "constant", "global"), default="auto")
    parser.add_argument("--layout", choices=("warp", "thread"), nargs="+", default=["warp"])
    parser.add_argument("--scores", choices=SCORE_KINDS, nargs="+", default=["float32"])
    args = parser.parse_args(argv)
    for path in args.artifacts:
        artifact = Artifact.load(path)
        placement = artifact.placement() if args.placement == "auto" else args.placement
        for layout in args.layout:
            for score_kind in args.scores:
                print(json.dumps(check(artifact, placement=placement, layout=layout, score_kind=score_kind)),
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
