#!/usr/bin/env bash
# The GPU checks, as one prepared run on a lent GPU machine (see the device tool's README), results under $OUT:
#   1. the CUDA kernel tests on the real GPU (not the simulator), incl. torch tensors and the two-grammar test;
#   2. bench/bench_kernel.py: step time for both placements and layouts vs torch and XGrammar, sparse head.
# The machine has no network: the project is installed from this tree without dependencies (its image has torch,
# numba-cuda, tokenizers, safetensors, pyyaml, pytest); XGrammar comes as wheels carried in .whl/ if present:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl xgrammar==0.2.8 apache-tvm-ffi
set -uo pipefail
OUT=${OUT:-build/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  nvidia-smi -L
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  fi
  python3 -m pytest -q -p no:cacheprovider tests/test_cuda_kernel.py -rs 2>&1
  python3 bench/bench_kernel.py --repeats 200 --out "$OUT/kernel.json" 2>&1
} 2>&1 | tee "$OUT/gpu_check.log"
