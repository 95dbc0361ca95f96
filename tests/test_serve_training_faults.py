"""The background trainer's faults (``serve/training.py``), with real processes on loopback and a stand-in job
(``support/training_stub.py``: a child process that trains nothing, in a second or two):

- a server killed with SIGKILL mid-training leaves no trainer behind, and its restart trains once;
- two trainers on one cache never run two children for one adapter: the second waits and takes the first's;
- a child that hangs is killed at the time limit and reported failed in ``/v1/registries`` and ``/metrics``;
- stopping the trainer (the server's shutdown) never blocks the event loop, even for a child that ignores SIGTERM;
- a cached adapter that is truncated, corrupt, or written before records held its weights' sha256 is trained again,
  never served; a sound one is served at start-up, its weights hashed once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.serve_http import catalog_tools, running_server, smollm_tokenizer, wait_until, write_registry
from support.training_stub import BASE_FINGERPRINT, StubJob, alive, events

import tooltrie.serve.adapter as adapter_module
from tooltrie.serve.adapter import ADAPTER_WEIGHTS_FILE, RECORD_FILE, read_adapter
from tooltrie.serve.prompt import Prompt
from tooltrie.serve.service import DiscoveryService
from tooltrie.serve.training import AdapterTrainer
from tooltrie.testing import tiny_llama

pytestmark = pytest.mark.usefixtures("loopback_only")

TESTS = Path(__file__).parent


@pytest.fixture(autouse=True)
def no_child_left(tmp_path: Path) -> Iterator[None]:
    """Whatever a test leaves (a failing one, say), no stand-in child outlives it."""
    yield
    for word, pid in events(tmp_path / "jobs"):
        if word == "started" and alive(pid):
            os.kill(pid, signal.SIGKILL)


def _registry(tmp_path: Path) -> Path:
    path = tmp_path / "tools.yaml"
    write_registry(path, "tools", catalog_tools(0, 6))
    return path


def _service(registry: Path, tmp_path: Path, job: StubJob, **options: Any) -> DiscoveryService:
    trainer = AdapterTrainer(job=job, base_model=None, base_fingerprint=BASE_FINGERPRINT,
                             cache_dir=tmp_path / "cache" / "adapters", **options)
    return DiscoveryService.from_paths([registry], tiny_llama(), smollm_tokenizer(),
                                       cache_dir=tmp_path / "cache" / "compiled", prompt=Prompt.style("short"),
                                       trainer=trainer)


async def _train(service: DiscoveryService) -> None:
    """Run ``service``'s trainer until registry ``tools`` is trained (or failed)."""
    run = asyncio.create_task(service.run_training())
    while service.trainer.status["tools"].state not in ("ready", "failed"):  # type: ignore[union-attr]
        await asyncio.sleep(0.05)
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)


def _started(directory: Path, count: int) -> list[int]:
    wait_until(lambda: sum(word == "started" for word, _ in events(directory)) >= count, timeout_s=120,
               what=f"training child {count} to start")
    return [pid for word, pid in events(directory) if word == "started"]


class ServerProcess:
    """``support/training_server.py`` in a process of its own."""

    def __init__(self, registry: Path, cache: Path, jobs: Path) -> None:
        self.port_file = cache.parent / f"port-{len(list(cache.parent.glob('port-*')))}"
        self.process = subprocess.Popen([sys.executable, "-m", "support.training_server", str(registry), str(cache),
                                         str(jobs), str(self.port_file)], cwd=TESTS)
        wait_until(lambda: self.port_file.exists() or self.process.poll() is not None, timeout_s=120,
                   what="the server to start")
        assert self.process.poll() is None, "the server process ended"
        self.url = f"http://127.0.0.1:{self.port_file.read_text()}"

    def training(self) -> dict[str, Any]:
        """The registry's ``training`` in ``/v1/registries`` (retried while the server starts listening)."""
        answer: list[dict[str, Any]] = []

        def listed() -> bool:
            with contextlib.suppress(httpx.TransportError):
                answer.append(httpx.get(self.url + "/v1/registries", timeout=30).json()["registries"][0])
            return bool(answer)

        wait_until(listed, timeout_s=60, what="the server to answer")
        return dict(answer[-1]["training"])

    def end(self, signal_number: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal_number)
        self.process.wait(60)


def test_a_server_killed_mid_training_leaves_no_trainer_and_its_restart_trains_once(tmp_path: Path) -> None:
    registry, cache, jobs = _registry(tmp_path), tmp_path / "cache", tmp_path / "jobs"
    jobs.mkdir()
    first = ServerProcess(registry, cache, jobs)
    try:
        [orphan] = _started(jobs, 1)
        assert first.training()["state"] == "training"
    finally:
        first.end(signal.SIGKILL)
    wait_until(lambda: not alive(orphan), timeout_s=30, what="the killed server's training child to end")
    second = ServerProcess(registry, cache, jobs)
    try:
        _, trainer = _started(jobs, 2)
        (jobs / "release").touch()
        wait_until(lambda: second.training()["state"] == "ready", timeout_s=60, what="the adapter")
        training = second.training()
    finally:
        second.end()
    assert events(jobs) == [("started", orphan), ("started", trainer), ("landed", trainer)]  # no overlap either
    assert read_adapter(training["adapter"]).registry_name == "tools"
    assert not alive(trainer)


def test_two_trainers_on_one_cache_train_an_adapter_once(tmp_path: Path) -> None:
    """The second waits on the first's lock (which its child holds too), then takes the adapter from the cache."""
    registry, jobs = _registry(tmp_path), tmp_path / "jobs"
    jobs.mkdir()
    services = [_service(registry, tmp_path, StubJob(jobs)) for _ in range(2)]

    async def scenario() -> list[dict[str, Any]]:
        runs = [asyncio.create_task(service.run_training()) for service in services]
        try:
            await asyncio.to_thread(_started, jobs, 1)
            while all(service.trainer.status["tools"].phase != "waiting" for service in services):  # type: ignore[union-attr]
                await asyncio.sleep(0.05)
            (jobs / "release").touch()
            while any(service.trainer.status["tools"].state != "ready" for service in services):  # type: ignore[union-attr]
                await asyncio.sleep(0.05)
            return [service.registries()[0] for service in services]
        finally:
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)

    listings = asyncio.run(asyncio.wait_for(scenario(), 120))
    [pid] = [pid for word, pid in events(jobs) if word == "started"]
    assert events(jobs) == [("started", pid), ("landed", pid)]
    assert listings[0]["adapter"]["path"] == listings[1]["adapter"]["path"]
    assert not alive(pid)


def test_a_hung_training_is_killed_at_its_time_limit_and_reported_failed(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    service = _service(_registry(tmp_path), tmp_path, StubJob(jobs, "stubborn"), time_limit_s=8)
    with running_server(service) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        [pid] = _started(jobs, 1)
        wait_until(lambda: client.get("/v1/registries").json()["registries"][0]["training"]["state"] == "failed",
                   timeout_s=60, what="the training to fail")
        training = client.get("/v1/registries").json()["registries"][0]["training"]
        metrics = client.get("/metrics").text
        answered = client.post("/v1/discover", json={"query": "weather in Paris", "k": 1})
    assert "time limit (8 s)" in training["error"] and "killed" in training["error"]
    assert server.metric(metrics, "tooltrie_adapter_training_failed", registry="tools") == 1
    assert answered.status_code == 200  # the server answers on, without the adapter
    assert not alive(pid)


def test_stopping_the_trainer_never_blocks_the_event_loop(tmp_path: Path) -> None:
    """Its child ignores SIGTERM, so stopping waits out the grace period before SIGKILL: the loop runs meanwhile."""
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    service = _service(_registry(tmp_path), tmp_path, StubJob(jobs, "stubborn"))

    async def scenario() -> int:
        ticks_while_stopping = 0  # loop turns after the child got SIGTERM, while it is still alive

        async def tick(pid: int) -> None:
            nonlocal ticks_while_stopping
            while True:
                await asyncio.sleep(0.01)
                ticks_while_stopping += ("term", pid) in events(jobs) and alive(pid)

        run = asyncio.create_task(service.run_training())
        [pid] = await asyncio.to_thread(_started, jobs, 1)
        ticker = asyncio.create_task(tick(pid))
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run
        ticker.cancel()
        return ticks_while_stopping

    ticks = asyncio.run(asyncio.wait_for(scenario(), 120))
    [pid] = [pid for word, pid in events(jobs) if word == "started"]
    assert ticks > 1  # the loop ran during the grace period (blocked, it could not turn once before SIGKILL)
    assert not alive(pid)


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "older"])
def test_a_damaged_cached_adapter_is_trained_again_never_served(tmp_path: Path, damage: str,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    registry, jobs = _registry(tmp_path), tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "release").touch()
    first = _service(registry, tmp_path, StubJob(jobs))
    asyncio.run(asyncio.wait_for(_train(first), 120))
    adapter = Path(first.trainer.status["tools"].adapter or "")  # type: ignore[union-attr]
    weights, record = adapter / ADAPTER_WEIGHTS_FILE, adapter / RECORD_FILE
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-9])
    elif damage == "corrupt":
        data = bytearray(weights.read_bytes())
        data[-5] ^= 0xFF
        weights.write_bytes(bytes(data))
    else:
        record.write_text(record.read_text().replace('"weights_sha256"', '"weights_sha256_unknown"'))
    again = _service(registry, tmp_path, StubJob(jobs))  # a restart: the cache is looked up
    assert again.served("tools").adapter is None  # never served
    assert again.registries()[0]["training"]["state"] == "queued"
    assert any("is not used, and is trained again" in message for message in caplog.messages)
    asyncio.run(asyncio.wait_for(_train(again), 120))
    assert again.registries()[0]["training"]["state"] == "ready"
    assert again.served("tools").adapter is not None and again.served("tools").adapter.path == adapter
    assert [word for word, _ in events(jobs)] == ["started", "landed"] * 2


def test_a_restart_serves_its_cached_adapter_hashing_the_weights_once(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache is looked up once per registry at start-up: the weights' sha256 is checked, and not again."""
    registry, jobs = _registry(tmp_path), tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "release").touch()
    asyncio.run(asyncio.wait_for(_train(_service(registry, tmp_path, StubJob(jobs))), 120))
    hashed: list[Path] = []
    sha256 = adapter_module._sha256
    monkeypatch.setattr(adapter_module, "_sha256", lambda path: hashed.append(path) or sha256(path))
    again = _service(registry, tmp_path, StubJob(jobs))
    adapter = again.served("tools").adapter
    assert adapter is not None and again.registries()[0]["training"]["state"] == "ready"
    assert hashed == [adapter.path / ADAPTER_WEIGHTS_FILE]
