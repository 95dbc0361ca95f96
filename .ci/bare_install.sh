#!/usr/bin/env bash
# The plain install: `pip install tooltrie` with no extra, in a fresh virtual environment, compiles, inspects and
# decodes (CPU) without torch or transformers; a command that needs an extra names it. Prints the import time of
# `tooltrie compile --help`. Usage: .ci/bare_install.sh [VENV_DIR] (default build/bare-venv).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-build/bare-venv}"
PYTHON="${PYTHON:-python3}"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
VENV="$(cd "$VENV" && pwd)"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q .
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"  # away from the source tree: the installed package is what runs
"$VENV/bin/python" - <<'PY'
import importlib.util
heavy = [m for m in ("torch", "transformers", "numba_cuda") if importlib.util.find_spec(m)]
assert not heavy, f"the plain install pulled in {heavy}"
PY
CATALOG="$("$VENV/bin/python" -c 'from tooltrie.registry import CATALOG_PATH; print(CATALOG_PATH)')"
"$VENV/bin/tooltrie" compile "$CATALOG" -o catalog.trie.safetensors
"$VENV/bin/tooltrie" inspect catalog.trie.safetensors > inspect.json
"$VENV/bin/python" -c 'import json; s = json.load(open("inspect.json")); assert s["trie"]["tools"] == 47, s["trie"]'
"$VENV/bin/tooltrie" decode catalog.trie.safetensors --k 3 --batch 2 > decoded.jsonl
"$VENV/bin/python" - <<'PY'
import json
rows = [json.loads(line) for line in open("decoded.jsonl")]
assert len(rows) == 2 and all(r["finish_reason"] == "stop" and len(set(r["tools"])) == 3 for r in rows), rows
PY
# The matcher API (the vLLM-style per-request object) on the same artifact.
"$VENV/bin/python" - <<'PY'
import sys
from tooltrie.compiler import Artifact
from tooltrie.kernels import TrieMatcher
artifact = Artifact.load("catalog.trie.safetensors")
matcher = TrieMatcher(artifact, 2)
ids = [*artifact.token_path(["WeatherTool", "NewsTool"]), artifact.eos_id]
assert all(matcher.accept_token(t) for t in ids) and matcher.is_terminated()
assert "torch" not in sys.modules and "transformers" not in sys.modules
PY
# A part of an extra says what to install.
if "$VENV/bin/tooltrie" ask "weather in Paris" 2> ask.err; then echo "ask ran without the model extra" >&2; exit 1; fi
grep -q "pip install 'tooltrie\[model\]'" ask.err || { cat ask.err >&2; exit 1; }
# Import time of `tooltrie compile --help` (best of 5 fresh processes).
"$VENV/bin/python" - "$VENV/bin/tooltrie" <<'PY'
import subprocess, sys, time
best = min(
    (lambda began: (subprocess.run([sys.argv[1], "compile", "--help"], check=True, capture_output=True),
                    time.perf_counter() - began)[1])(time.perf_counter())
    for _ in range(5))
print(f"bare install: compile, inspect, decode ok; `tooltrie compile --help` takes {best * 1e3:.0f} ms (best of 5)")
PY
