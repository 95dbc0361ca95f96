"""Helpers for ``test_serve_http.py`` and ``test_serve_mcp.py``: the real discovery server (uvicorn, in a thread, on a
loopback port; or ``tooltrie serve`` in a process of its own), a gate that holds the model's forward passes (to stage
queues, disconnects and reloads deterministically), and the checks every answer must pass. The guard that fails any
connection beyond loopback is ``conftest.py``'s ``loopback_only`` fixture.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import uvicorn
import yaml

from tooltrie.compiler import TokenizerInfo
from tooltrie.ranker import DEFAULT_PRIOR
from tooltrie.registry import CATALOG_PATH, Registry, load_registry
from tooltrie.serve.limits import ServeLimits
from tooltrie.serve.policy import Policy
from tooltrie.serve.prefilter import Prefilter
from tooltrie.serve.prompt import Prompt
from tooltrie.serve.server import create_app
from tooltrie.serve.service import PROBE_TOOLS, DiscoveryService
from tooltrie.testing import tiny_llama

PROBE_NAMES = {tool["name"] for tool in PROBE_TOOLS}


@cache
def smollm_tokenizer() -> TokenizerInfo:
    return TokenizerInfo.load("smollm2-135m")


@cache
def catalog() -> Registry:
    return load_registry(CATALOG_PATH)


# -- the server ---------------------------------------------------------------------------------------------------

@dataclass
class Running:
    url: str  # http://127.0.0.1:PORT
    service: DiscoveryService

    def metric(self, text: str, name: str, **labels: str) -> float:
        """A sample's value in a ``/metrics`` text (0 when absent)."""
        wanted = name + ("{" + ",".join(f'{key}="{value}"' for key, value in sorted(labels.items())) + "}"
                         if labels else "")
        for line in text.splitlines():
            if line.startswith(wanted + " "):
                return float(line.split()[-1])
        return 0.0


@contextmanager
def running_server(service: DiscoveryService, *, log_level: str = "warning", app: Any = None) -> Iterator[Running]:
    """Serve ``service`` (its app, or ``app`` made for it) with uvicorn on a free loopback port, in a thread; stop it
    on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app if app is not None else create_app(service), log_level=log_level,
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield Running(url=f"http://127.0.0.1:{port}", service=service)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@dataclass
class ServeProcess:
    url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen[bytes]
    output: str = ""  # what it printed (stdout and stderr), once it has stopped


@contextmanager
def serve_command(options: Sequence[str], folder: Path) -> Iterator[ServeProcess]:
    """``tooltrie serve OPTIONS`` as a user runs it, in a process of its own on a free loopback port (its compile
    cache in ``folder/cache``), once it answers ``/healthz``; stopped with SIGTERM on exit."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "tooltrie.cli", "serve", "--port", str(port), *options]
    env = {**os.environ, "TOOLTRIE_CACHE_DIR": str(folder / "cache")}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    served = ServeProcess(url=f"http://127.0.0.1:{port}", process=process)
    try:
        def up() -> bool:
            assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
            try:
                return httpx.get(served.url + "/healthz", timeout=10).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, timeout_s=120, what="tooltrie serve to answer /healthz")
        yield served
    finally:
        process.terminate()
        served.output = process.communicate(timeout=60)[0].decode()


def tiny_service(registries: Sequence[Path], cache_dir: Path, *, limits: ServeLimits | None = None,
                 model: Any = None, prompt: Prompt | None = None, policy: Policy | None = None,
                 prefilter: Prefilter | None = None, prior: str = DEFAULT_PRIOR) -> DiscoveryService:
    """A service on the tiny random Llama (SmolLM2's vocabulary; or ``model``) and the bundled SmolLM2 tokenizer;
    ``prior``: its retrieval prior (lexical: BM25 alone, no sentence encoder)."""
    return DiscoveryService.from_paths(registries, model if model is not None else tiny_llama(), smollm_tokenizer(),
                                       limits=limits, cache_dir=cache_dir, prompt=prompt, policy=policy,
                                       prefilter=prefilter, prior=prior)


class Gate:
    """Holds every forward pass of ``model`` while closed (a pre-hook on its input embeddings, which every decoder
    pass starts with). ``entered`` is set when a pass arrives at the gate; ``fail_next`` fails the next pass."""

    def __init__(self, model: Any) -> None:
        self._opened = threading.Event()
        self._opened.set()
        self.entered = threading.Event()
        self.fail_next = False  # make the next forward pass raise, as a bug in decoding would
        model.get_input_embeddings().register_forward_pre_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected failure")
        self.entered.set()
        if not self._opened.wait(timeout=60):
            raise RuntimeError("the test gate stayed closed for 60 s")

    def close(self) -> None:
        self.entered.clear()
        self._opened.clear()

    def open(self) -> None:
        self._opened.set()

    def wait_entered(self, timeout_s: float = 30) -> None:
        if not self.entered.wait(timeout_s):
            raise AssertionError("no forward pass reached the gate")


def wait_until(condition: Callable[[], bool], *, timeout_s: float = 30, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


# -- registry files -------------------------------------------------------------------------------------------------

def write_registry(path: Path, name: str, tools: Sequence[tuple[str, str]],
                   tags: dict[str, list[str]] | None = None) -> Registry:
    """Write a native YAML registry of ``(name, description)`` tools (with ``tags`` by tool name); the registry as
    the server will read it."""
    data = {"name": name, "tools": [{"name": tool, "description": about, **({"tags": (tags or {})[tool]}
                                                                           if tool in (tags or {}) else {})}
                                    for tool, about in tools]}
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return load_registry(path)


def catalog_tools(start: int, stop: int) -> list[tuple[str, str]]:
    return [(tool.name, tool.description) for tool in catalog().tools[start:stop]]


# -- checks ---------------------------------------------------------------------------------------------------------

def check_answer(body: dict[str, Any], registry: Registry, k: int) -> None:
    """Exactly k distinct tools of ``registry`` with their pointers, ranked 1..k, finished."""
    assert body["finish_reason"] == "stop", body
    assert body["registry"] == registry.name
    assert body["registry_sha256"] == registry.sha256
    tools = body["tools"]
    names = [tool["name"] for tool in tools]
    assert len(names) == k and len(set(names)) == k, names
    pointers = {tool.name: tool.pointer for tool in registry.tools}
    for rank, tool in enumerate(tools, start=1):
        assert tool["rank"] == rank
        assert tool["name"] in pointers, f"{tool['name']} is not in registry {registry.name}"
        assert tool["pointer"] == pointers[tool["name"]]
    usage = body["usage"]
    assert usage["decision_points"] <= usage["forward_passes"] + usage["speculated"]


def same_answer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same tools in the same order; scores equal up to float rounding between batch compositions."""
    return ([(t["name"], t["pointer"]) for t in a["tools"]] == [(t["name"], t["pointer"]) for t in b["tools"]]
            and all(abs(x["score"] - y["score"]) < 2e-3 for x, y in zip(a["tools"], b["tools"], strict=True)))
