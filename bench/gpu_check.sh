#!/usr/bin/env bash
# The GPU checks: the one script to run on a machine with one CUDA GPU and no network. Within 8 minutes in all
# (BUDGET_S, install included: each step's limit is cut to what is left), it writes under $OUT (default
# bench/results/gpu/) gpu_check.log (everything printed), pytest.xml, kernel.json and decode-{bfloat16,float32}.json:
#   1. every test file that uses a GPU where there is one (GPU_TESTS; tests/test_benches.py checks the list is
#      whole), on the real GPU: the CUDA kernels against the NumPy reference, CuPy and torch arrays taken as they
#      are, the launches on torch's streams, the batch state machine (CUDA backend against the oracle), the ranker
#      and the statistics on the device, the PTX the kernels compile to, the engine with the CUDA backend (model on
#      the CPU and on the GPU, float32 and bfloat16), the shared-prefix decoder on the GPU;
#   2. bench/bench_kernel.py: step time for both placements and layouts vs torch and XGrammar, the production path
#      (TrieBatch.choose; accept + mask_logits_ + argmax) with its wall time per step, the sparse head;
#   3. bench/bench_decode.py on the GPU: the engine against full-head decoding, bfloat16 and float32. The real
#      weights cannot travel (no network; a call carries 64 MiB), so the default's architecture runs with random
#      weights (--weights random): the same cost per token.
# Without a GPU, `NUMBA_ENABLE_CUDASIM=1 BUDGET_S=1800 bash bench/gpu_check.sh` runs the same steps under Numba's
# simulator (slower: hence the larger budget): the tests, and bench_kernel.py's smoke test of its code paths; the
# benchmarks that need torch on a GPU say they were skipped.
# The machine has no network: the project is installed from this tree without dependencies (its image has torch,
# numba, numba-cuda, tokenizers, safetensors, pyyaml, pytest, hypothesis; not CuPy, whose wheel is larger than a
# call carries: its test then reports itself skipped); what it lacks, or has in a version that does not work here,
# comes as wheels carried in .whl/ (here: `echo /.whl/ >> .git/info/exclude`, then):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl numpy==2.4.6 xgrammar==0.2.8 \
#     apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
#     typing-inspection==0.4.5
# numpy: the image's 2.5.2 has no np.row_stack, which numba-cuda 0.30.4 (the image's and ours) needs to compile.
# A failed step does not stop the next; the log ends with each step's exit status and time.
set -uo pipefail
OUT=${OUT:-bench/results/gpu}
PYTHON=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-480}
SIMULATOR=${NUMBA_ENABLE_CUDASIM:-0}
GPU_TESTS=(tests/test_cuda_kernel.py tests/test_cuda_ptx.py tests/test_kernels_batch_state.py
           tests/test_kernels_fused_logits.py tests/test_kernels_ranker.py tests/test_kernels_stats.py
           tests/test_serve_engine_kernels.py
           tests/test_serve_decoder.py tests/test_prior_follow.py tests/test_prior_asks.py)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG="$OUT/gpu_check.log"
DEADLINE=$((SECONDS + BUDGET_S))
SUMMARY=()

step() {  # step NAME SECONDS COMMAND...: run within its limit and what is left of the budget, log its status
  local name=$1 limit=$2 left=$((DEADLINE - SECONDS))
  shift 2
  ((left < limit)) || [[ $SIMULATOR == 1 ]] && limit=$left  # the simulator is slower: only the budget bounds it
  if ((limit < 5)); then
    echo "=== $name: not run, the ${BUDGET_S} s budget is spent"
    SUMMARY+=("$name: not run (budget spent)")
    return
  fi
  echo "=== $name ($(date +%T), limit ${limit}s)"
  local began=$SECONDS status
  timeout "$limit" "$@"
  status=$?
  ((status == 124)) && echo "=== $name: stopped at its limit"
  echo "=== $name: exit $status after $((SECONDS - began)) s"
  SUMMARY+=("$name: exit $status after $((SECONDS - began)) s")
}

skip() {  # skip NAME REASON
  echo "=== $1: skipped, $2"
  SUMMARY+=("$1: skipped ($2)")
}

{
  if [[ $SIMULATOR == 1 ]]; then
    echo "no GPU: NUMBA_ENABLE_CUDASIM=1, the CUDA kernels run under Numba's simulator"
  else
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  fi
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
  fi
  if ! "$PYTHON" -c "import tooltrie" 2>/dev/null; then
    "$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
  fi
  "$PYTHON" - <<'EOF'
import importlib.metadata as m, sys, torch
from numba import config, cuda
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda)
for name in ("numba", "numba-cuda", "llvmlite", "numpy", "transformers", "tokenizers", "xgrammar", "hypothesis", "cupy"):
    try:
        print(f"{name} {m.version(name)}", end=" | ")
    except m.PackageNotFoundError:
        print(f"{name} missing", end=" | ")
print("\nnumba.cuda from", cuda.__file__, "| device:",
      "the simulator" if config.ENABLE_CUDASIM else cuda.get_current_device().name)
EOF
  step "GPU tests" 230 "$PYTHON" -m pytest -p no:cacheprovider -q -rs --junitxml="$OUT/pytest.xml" "${GPU_TESTS[@]}"
  if [[ $SIMULATOR == 1 ]]; then
    step "bench_kernel (simulated: the code paths, no timing)" 120 "$PYTHON" bench/bench_kernel.py --simulate
    skip "bench_decode bfloat16" "it needs torch on a GPU"
    skip "bench_decode float32" "it needs torch on a GPU"
  else
    step "bench_kernel" 120 "$PYTHON" bench/bench_kernel.py --repeats 100 --out "$OUT/kernel.json"
    step "bench_decode bfloat16" 60 "$PYTHON" bench/bench_decode.py --device cuda --weights random \
      --dtype bfloat16 --budget-s 40 --out "$OUT/decode-bfloat16.json"
    step "bench_decode float32" 50 "$PYTHON" bench/bench_decode.py --device cuda --weights random \
      --dtype float32 --budget-s 30 --out "$OUT/decode-float32.json"
  fi
  echo "=== summary ($SECONDS s of ${BUDGET_S})"
  printf '%s\n' "${SUMMARY[@]}"
} 2>&1 | tee "$LOG"
