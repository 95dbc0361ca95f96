"""``bench/bench_step.py`` still runs against the library: its no-repeat twins call ``kernels/walk.py``'s move
search, so a change of its signature once broke the benchmark silently. A tiny run (two walks, one repeat, no
outlines-core, no rebuild baseline) must finish with every tooltrie arm measured and the "on" twins choosing
the walk's own tokens (the benchmark stops an arm that does not)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "bench_step.py"
TOOLTRIE_ARMS = ("tooltrie cpu", "cpu twin, no-repeat on", "cpu twin, no-repeat off", "cpu twin, no-repeat on (A/A)")


def test_bench_step_runs_with_the_library(tmp_path):
    out = tmp_path / "step.json"
    done = subprocess.run([sys.executable, str(BENCH), "--registries", "catalog", "--ks", "3", "--walks", "2",
                           "--repeats", "1", "--skip-outlines", "--skip-rebuild", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (config,) = json.loads(out.read_text(encoding="utf-8"))["results"]["configs"]
    for arm in TOOLTRIE_ARMS:
        assert config["arms"][arm]["status"] == "ok", (arm, config["arms"][arm]["status"])
    assert config["ratios"]["no-repeat overhead (answer)"] is not None
