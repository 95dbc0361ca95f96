"""Helpers shared by the benchmark scripts: machine info, turn-taking timing, tables and the results file.

Every script writes ``bench/results/<name>.json`` as ``{"machine", "versions", "settings", "results"}``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tooltrie.eval.files import json_text, relative_paths, write_text

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
PACKAGES = ("tooltrie", "numpy", "tokenizers", "torch", "transformers", "xgrammar", "llguidance", "outlines_core")


# -- machine and versions ---------------------------------------------------------------------------------------

def machine_info() -> dict[str, Any]:
    """Platform, CPU model, cores (all, and usable by this process), memory, load average and Python version."""
    return {
        "platform": platform.platform(),
        "cpu": _proc_field("/proc/cpuinfo", "model name") or platform.processor() or None,
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_bytes": _meminfo_bytes("MemTotal"),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,  # 1, 5, 15 min, when written
        "python": sys.version.split()[0],
    }


def package_versions(packages: Sequence[str] = PACKAGES) -> dict[str, str | None]:
    """Installed versions (``None`` when a package is missing), plus the repository's git commit."""
    versions: dict[str, str | None] = {}
    for package in packages:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    versions["tooltrie_git"] = _git_commit()
    return versions


def _proc_field(path: str, key: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as lines:
            for line in lines:
                name, _, value = line.partition(":")
                if name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return None


def _meminfo_bytes(key: str) -> int | None:
    value = _proc_field("/proc/meminfo", key)  # e.g. "24587124 kB"
    return int(value.split()[0]) * 1024 if value else None


def _git_commit() -> str | None:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_DIR, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_DIR,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{commit}{'-dirty' if dirty else ''}"


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far: ``VmHWM`` from ``/proc/self/status`` where there is one.

    ``ru_maxrss`` (the fallback, see :func:`ru_maxrss_bytes`) survives ``execve``: a child started from a large
    parent reports at least the parent's peak, so it overstates a fresh process's baseline. ``VmHWM`` belongs
    to the process's own address space and starts afresh at ``exec``.
    """
    value = _proc_field("/proc/self/status", "VmHWM")  # e.g. "126042 kB"
    return int(value.split()[0]) * 1024 if value else ru_maxrss_bytes()


def ru_maxrss_bytes() -> int:
    """``getrusage(RUSAGE_SELF).ru_maxrss`` in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# -- statistics and timing ---------------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), interpolating linearly between order statistics like numpy's default.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 50), percentile([5.0], 90)
    (2.5, 5.0)
    """
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and the raw samples, for the results file."""
    return {"median": median(values), "min": min(values), "max": max(values), "samples": list(values)}


class StopArm(Exception):
    """Raised by an arm to leave the remaining turns (a timeout, an infeasible size); the message is kept."""


@dataclass
class ArmTimes:
    """One arm's samples: ``"wall"`` (the call) plus any part timings the arm returned, one per repeat."""

    samples: dict[str, list[float]] = field(default_factory=dict)
    stopped: str | None = None  # why the arm left early, if it did

    def add(self, key: str, value: float) -> None:
        self.samples.setdefault(key, []).append(value)


Arm = Callable[[], object]  # may return a Mapping[str, float] of part timings


def take_turns(arms: Mapping[str, Arm], repeats: int, *, warmup: int = 0) -> dict[str, ArmTimes]:
    """Time every arm ``repeats`` times, taking turns: each repeat runs each arm once, and the starting arm rotates
    from repeat to repeat, so drift (frequency, caches, background load) hits all arms alike.

    An arm may return a mapping of its parts' timings (e.g. measured inside a subprocess); they are recorded
    beside ``"wall"``; any other return value is ignored. An arm that raises :class:`StopArm` sits out the
    remaining turns.

    >>> times = take_turns({"a": lambda: None, "b": lambda: {"part": 1.0}}, repeats=2)
    >>> len(times["a"].samples["wall"]), times["b"].samples["part"]
    (2, [1.0, 1.0])
    >>> def give_up() -> None:
    ...     raise StopArm("too slow")
    >>> take_turns({"a": give_up}, repeats=3, warmup=1)["a"]
    ArmTimes(samples={}, stopped='too slow')
    """
    names = list(arms)
    times = {name: ArmTimes() for name in names}
    for repeat in range(-warmup, repeats):
        start = repeat % len(names)
        for name in names[start:] + names[:start]:
            if times[name].stopped is not None:
                continue
            began = time.perf_counter()
            try:
                parts = arms[name]()
            except StopArm as stop:
                times[name].stopped = str(stop)
                continue
            if repeat < 0:  # warm-up
                continue
            times[name].add("wall", time.perf_counter() - began)
            if isinstance(parts, Mapping):
                for key, value in parts.items():
                    times[name].add(str(key), float(value))
    return times


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float, *, what: str = "tooltrie serve",
                 poll_s: float = 0.2) -> None:
    """Until ``url``'s ``/healthz`` answers 200 (a ``tooltrie serve`` or ``proxy`` started as ``process``); raises
    when the process exits first or ``timeout_s`` passes."""
    import httpx

    began = time.perf_counter()
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        if time.perf_counter() - began > timeout_s:
            raise TimeoutError(f"{what} was not ready in {timeout_s:.0f} s")
        try:
            if httpx.get(url + "/healthz", timeout=60).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(poll_s)


def run_json_worker(argv: Sequence[str], timeout_s: float) -> dict[str, Any]:
    """Run ``python argv...`` in a fresh process and parse the JSON object on its last stdout line.

    Raises :class:`subprocess.TimeoutExpired` past ``timeout_s`` (the child is killed) and ``RuntimeError`` when it
    fails.
    """
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {list(argv)} exited with {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    lines = proc.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(f"worker {list(argv)} printed nothing")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# -- output ----------------------------------------------------------------------------------------------------

def print_table(rows: Sequence[Mapping[str, object]], *, title: str | None = None) -> None:
    """Print rows (column -> cell) as an aligned text table; numbers right-aligned, the rest left-aligned."""
    if not rows:
        return
    columns = list(dict.fromkeys(key for row in rows for key in row))
    cells = [[_cell(row.get(column, "")) for column in columns] for row in rows]
    widths = [max(len(column), *(len(line[i]) for line in cells)) for i, column in enumerate(columns)]
    numeric = [all(_looks_numeric(line[i]) for line in cells) for i in range(len(columns))]

    def join(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True))

    if title:
        print(f"\n{title}")
    print(join(columns).rstrip())
    print("  ".join("-" * w for w in widths))
    for line in cells:
        print(join(line).rstrip())


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _looks_numeric(text: str) -> bool:
    stripped = text.replace(",", "").replace("x", "").replace("%", "").strip()
    try:
        float(stripped)
    except ValueError:
        return text == "-"
    return True


def write_results(name: str, *, settings: Mapping[str, Any], results: Any, out: str | Path | None = None,
                  compact: bool = False) -> Path:
    """Write ``{"machine", "versions", "settings", "results"}`` to ``bench/results/<name>.json`` (or ``out``),
    atomically: a reader sees the old file or the whole new one. ``compact``: one line (a sweep's many cells)."""
    path = Path(out) if out is not None else RESULTS_DIR / f"{name}.json"
    payload = relative_paths({"machine": machine_info(), "versions": package_versions(), "settings": dict(settings),
                              "results": results}, root=REPO_DIR)
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n" if compact else json_text(payload)
    return write_text(path, text)


def eval_once(out: Path, arguments: Sequence[str]) -> Path:
    """``tooltrie eval <arguments> --no-plots -o out``, unless ``out`` holds its results already (a sweep run again
    reads the runs it made); ``out``."""
    if not (out / "results.json").is_file():
        subprocess.run([sys.executable, "-m", "tooltrie.cli", "eval", *arguments, "--no-plots", "-o", str(out)],
                       check=True, cwd=REPO_DIR)
    return out
