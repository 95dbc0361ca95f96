"""vLLM's OpenAI server with tooltrie's processor, started as a user starts it for ``tooltrie serve --vllm-url``, and
hostile ``vllm_xargs`` to throw at it: for the tests (``tests/test_vllm_serve_remote.py``) and the benchmark
(``bench/fuzz_vllm.py``), which run where vLLM's CPU build is installed (``make test-vllm``).

A hostile request is a valid one with one to three of tooltrie's keys given a hostile value (wrong types, numbers
that overflow float32, huge lists and strings, paths, unicode), dropped, or pointing at another file of the artifact
root (another vocabulary's artifact, the processor's own lexical index, a name whose file is swapped between
requests). What admission must do with it is decided here, before the reply, by the code the processor runs
(``parse_request_args``) against the same root and served model (:func:`outcome`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

PROCESSOR = "tooltrie.integrations.vllm:TrieVllmProcessorV1"  # by name: the CPU worker imports it after its scan
START_S = 900  # vLLM's start-up on two shared cores (eager mode, no torch.compile)
KEYS = ("tooltrie_artifact", "tooltrie_k", "tooltrie_tools", "tooltrie_prior", "tooltrie_model_weight",
        "tooltrie_query", "tooltrie_follow", "tooltrie_follow_version", "tooltrie_sha256", "tooltrie_other")
OUTCOMES = ("refused", "answered", "plain")  # a 400; exactly k distinct tools; not tooltrie's (no key of ours left)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_vllm(model_dir: Path, port: int, log: BinaryIO, root: Path) -> subprocess.Popen[bytes]:
    """vLLM's OpenAI server as a user starts it for ``tooltrie serve --vllm-url``, sized for a small CPU machine.
    (The CPU build's ``vllm serve`` looks up the version of a package named ``vllm`` and fails; its server module
    runs the same server.)"""
    # -P: the working directory (the repository root, whose kernels/ transformers would import as Hugging Face's
    # `kernels` package, numba and all) stays off the server's and its workers' import path.
    command = [sys.executable, "-P", "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
               "--max-model-len", "2048", "--max-num-seqs", "16", "--seed", "0", "--logits-processors", PROCESSOR,
               "--logprobs-mode", "processed_logprobs",
               # A request may bring its chat template: the proxy's test renders its tools as a tool-calling model's
               # template does (SmolLM2's ignores them).
               "--trust-request-chat-template"]
    env = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "TOOLTRIE_ARTIFACT_ROOT": str(root)}
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_up(process: subprocess.Popen[bytes], url: str, log: Path) -> None:
    import httpx

    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(2)
    raise RuntimeError(f"vllm serve did not start within {START_S} s:\n{log.read_text()[-4000:]}")


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)  # its engine and worker processes too
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)


def resident_bytes(process: subprocess.Popen[bytes]) -> int:
    """The resident memory of the server's processes (its process group: front end, engine, workers), from /proc."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != process.pid:
                continue
            status = (entry / "status").read_text()
        except (OSError, ProcessLookupError):
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def hostile_values() -> Any:
    """The values a hostile key gets (a hypothesis strategy; hypothesis is imported here, not at import)."""
    from hypothesis import strategies as st

    return st.one_of(
        st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False),
        st.sampled_from([1e39, -1e39, 1e300, 3e38, 10**400]), st.text(max_size=40),
        st.sampled_from(["../catalog.trie.safetensors", "/etc/passwd", ".served", "catalög.trie.safetensors", "\x00",
                         "f32:" + "A" * 2_000_000, "f32:AAAA", "x" * 100_000]),
        st.lists(st.one_of(st.integers(-5, 100), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=3)),
                 max_size=60),
        st.sampled_from([[1e39] * 47, [0.0] * 100_000, list(range(48)), [5, 5], [1.0, 1.0, 0.5, 3.0],
                         [1.0, 1e30, 0.5, 3.0]]))


def hostile(draw: Callable[[Any], Any], base: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """``base`` (valid flat xargs) with one to three keys given hostile values, dropped, or pointed at another file
    of the root (``names``: :func:`root_files`)."""
    from hypothesis import strategies as st

    xargs = dict(base)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(KEYS))
        action = draw(st.sampled_from(("value", "value", "drop", "file")))
        if action == "drop":
            xargs.pop(key, None)
        elif action == "file":
            xargs["tooltrie_artifact"] = draw(st.sampled_from(sorted(names.values())))
        else:
            xargs[key] = draw(hostile_values())
    return xargs


def outcome(xargs: dict[str, Any], root: Path) -> str:
    """What admission must do with ``xargs`` (``OUTCOMES``), as this process parses them (the code the processor
    runs) against the same root and the served model (the default model's tokenizer, recorded as the processor
    records it)."""
    from types import SimpleNamespace

    from tooltrie.compiler import TokenizerInfo
    from tooltrie.integrations.vllm_rows import ROOT_ENV, SERVED_DIR, ServedModel, parse_request_args, record_served

    if not (root / SERVED_DIR / f"{os.getpid()}.json").is_file():  # recorded once, as the processor records it
        tokenizer = TokenizerInfo.load()
        record_served(ServedModel(tokenizer.fingerprint, tokenizer.vocab_size, tokenizer.eos_id), root=root)
    before = os.environ.get(ROOT_ENV)
    os.environ[ROOT_ENV] = str(root)
    try:
        args = parse_request_args(SimpleNamespace(extra_args=json.loads(json.dumps(xargs))))
    except ValueError:
        return "refused"
    finally:
        if before is None:
            del os.environ[ROOT_ENV]
        else:
            os.environ[ROOT_ENV] = before
    return "plain" if args is None else "answered"


def root_files(root: Path, catalog: str) -> dict[str, str]:
    """The root's files a hostile request names: the catalog's artifact (``catalog``, already published there),
    another vocabulary's artifact (the catalog compiled for GPT-2, made once), the lexical index beside an artifact
    (when one was made), and a name whose file alternates between the two artifacts at each call."""
    from tooltrie.compiler import TokenizerInfo, compile_registry
    from tooltrie.registry import CATALOG_PATH, load_registry

    gpt2 = root / "gpt2-catalog.trie.safetensors"
    if not gpt2.exists():
        compile_registry(load_registry(CATALOG_PATH), TokenizerInfo.load("gpt2")).save(gpt2)
    swapped = root / "swapped.trie.safetensors"
    now_catalog = swapped.exists() and swapped.stat().st_size == (root / catalog).stat().st_size
    shutil.copy(gpt2 if now_catalog else root / catalog, swapped)
    lexical = next(root.glob("*.lexical.safetensors"), None)
    return {"catalog": catalog, "gpt2": gpt2.name, "swapped": swapped.name,
            **({"lexical": lexical.name} if lexical else {})}


__all__ = ["KEYS", "OUTCOMES", "PROCESSOR", "START_S", "free_port", "hostile", "hostile_values", "outcome",
           "resident_bytes", "root_files", "start_vllm", "stop", "wait_up"]
