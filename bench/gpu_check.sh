#!/usr/bin/env bash
# The GPU checks, as one prepared run on a machine with one CUDA GPU and no network, results under $OUT:
#   1. the tests that use a GPU where there is one, on the real GPU (not the simulator): the CUDA kernels against
#      the NumPy reference, the batch state machine (CUDA backend against the oracle), CuPy arrays, the kernel's
#      statistics, the engine with the CUDA backend (model on the CPU and on the GPU, float32 and bfloat16), the
#      shared-prefix decoder on the GPU against the model's own forward;
#   2. bench/bench_kernel.py: step time for both placements and layouts vs torch and XGrammar, the production
#      path (TrieBatch.choose; accept + mask_logits_ + argmax) with its wall time per step, the sparse head;
#   3. bench/bench_decode.py on the GPU: the engine against full-head decoding, bfloat16 and float32. The real
#      weights cannot travel (the machine has no network; a call carries 64 MiB), so the default's architecture
#      runs with random weights (--weights random): the same cost per token.
# The machine has no network: the project is installed from this tree without dependencies (its image has torch,
# numba, numba-cuda, tokenizers, safetensors, pyyaml, pytest, hypothesis); what it lacks, or has in a version that
# does not work here, comes as wheels carried in .whl/ (here: `echo /.whl/ >> .git/info/exclude`, then):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl numpy==2.4.6 xgrammar==0.2.8 \
#     apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
#     typing-inspection==0.4.5
# numpy: the image's 2.5.2 has no np.row_stack, which numba-cuda 0.30.4 (the image's and ours) needs to compile.
# Each step has its own time limit and a failed step does not stop the next.
set -uo pipefail
OUT=${OUT:-build/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG="$OUT/gpu_check.log"

step() {  # step NAME SECONDS COMMAND...: run with a limit, log its status
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(date +%T), limit ${limit}s)"
  local began=$SECONDS
  timeout "$limit" "$@"
  echo "=== $name: exit $? after $((SECONDS - began)) s"
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
  fi
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
  python3 - <<'EOF'
import importlib.metadata as m, sys, torch
from numba import cuda
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda)
for name in ("numba", "numba-cuda", "llvmlite", "numpy", "transformers", "tokenizers", "xgrammar", "hypothesis", "cupy"):
    try:
        print(f"{name} {m.version(name)}", end=" | ")
    except m.PackageNotFoundError:
        print(f"{name} missing", end=" | ")
print("\nnumba.cuda from", cuda.__file__, "| device:", cuda.get_current_device().name)
EOF
  step "GPU tests" 240 python3 -m pytest -p no:cacheprovider -rs --junitxml="$OUT/pytest.xml" \
    tests/test_cuda_kernel.py tests/test_kernels_batch_state.py tests/test_kernels_stats.py \
    tests/test_serve_engine_kernels.py tests/test_serve_decoder.py
  step "bench_kernel" 150 python3 bench/bench_kernel.py --repeats 100 --out "$OUT/kernel.json"
  step "bench_decode bfloat16" 120 python3 bench/bench_decode.py --device cuda --weights random --dtype bfloat16 \
    --budget-s 60 --out "$OUT/decode-gpu-bfloat16.json"
  step "bench_decode float32" 100 python3 bench/bench_decode.py --device cuda --weights random --dtype float32 \
    --budget-s 45 --out "$OUT/decode-gpu-float32.json"
} 2>&1 | tee "$LOG"
