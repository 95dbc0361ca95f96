"""The background trainer's child and the event loop (``serve/training.py``), with a stand-in job
(``support/training_stub.py``):

- what a training child started and left running when it exited, holding the key's lock it inherited, is ended with
  it: the lock is free at once, and training that adapter again starts without waiting;
- an adapter's weights are hashed (``verify_adapter``) in a worker thread, never on the event loop: after a training,
  on ``POST /v1/registries/{name}/train`` and on a reload that finds the adapter in the cache.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.serve_http import catalog_tools, smollm_tokenizer, wait_until, write_registry
from support.training_stub import BASE_FINGERPRINT, StubJob, alive, events

import tooltrie.serve.training as training_module
from tooltrie.compiler import compile_registry
from tooltrie.serve.adapter import AdapterRecord
from tooltrie.serve.prompt import Prompt
from tooltrie.serve.service import DiscoveryService
from tooltrie.serve.training import AdapterTrainer
from tooltrie.testing import tiny_llama

pytestmark = pytest.mark.usefixtures("loopback_only")


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[Path]:
    """The stand-ins' events folder; whatever they started is killed after the test (a failing one, say)."""
    directory = tmp_path / "jobs"
    directory.mkdir()
    yield directory
    for word, pid in events(directory):
        if word in ("started", "orphan") and alive(pid):
            os.kill(pid, signal.SIGKILL)


def _registry(path: Path, n_tools: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_registry(path, "tools", catalog_tools(0, n_tools))
    return path


async def _trained(trainer: AdapterTrainer, name: str = "tools") -> None:
    """Run ``trainer`` until ``name`` is trained (or failed)."""
    run = asyncio.create_task(trainer.run(_ignore))
    while trainer.status[name].state not in ("ready", "failed"):
        await asyncio.sleep(0.02)
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)


async def _ignore(name: str, record: AdapterRecord) -> None:
    pass


def test_what_a_training_child_leaves_running_is_ended_with_it(tmp_path: Path, jobs: Path) -> None:
    """The child exits 0 having written the adapter; the process it started sleeps on with the key's lock."""
    artifact = compile_registry(write_registry(tmp_path / "tools.yaml", "tools", catalog_tools(0, 6)),
                                smollm_tokenizer())
    cache = tmp_path / "adapters"
    trainer = AdapterTrainer(job=StubJob(jobs, "orphan"), base_model=None, base_fingerprint=BASE_FINGERPRINT,
                             cache_dir=cache)
    trainer.request("tools", artifact)
    asyncio.run(asyncio.wait_for(_trained(trainer), 120))
    assert trainer.status["tools"].state == "ready", trainer.status["tools"].error
    [orphan] = [pid for word, pid in events(jobs) if word == "orphan"]
    wait_until(lambda: not alive(orphan), timeout_s=10, what="the process the child left to end")
    lock = os.open(cache / f".{trainer.directory(artifact).name}.lock", os.O_RDWR)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: BlockingIOError while the orphan held it
    finally:
        os.close(lock)
    # Training that adapter again (its cache emptied) starts without waiting for the lock.
    shutil.rmtree(trainer.directory(artifact))
    trainer.request("tools", artifact)
    phases: list[str | None] = []

    async def again() -> None:
        run = asyncio.create_task(trainer.run(_ignore))
        while trainer.status["tools"].state not in ("ready", "failed"):
            phases.append(trainer.status["tools"].phase)
            await asyncio.sleep(0.02)
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)

    asyncio.run(asyncio.wait_for(again(), 120))
    assert trainer.status["tools"].state == "ready" and "waiting" not in phases
    assert [word for word, _ in events(jobs)] == ["started", "orphan", "landed"] * 2


def test_adapter_weights_are_hashed_off_the_event_loop(tmp_path: Path, jobs: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """After a training, on a train request for a cached adapter, and on a reload back to tools whose adapter is
    cached: each hash runs where no event loop runs."""
    on_loop: list[bool] = []
    verify = training_module.verify_adapter

    def recording(record: AdapterRecord) -> None:
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        verify(record)

    monkeypatch.setattr(training_module, "verify_adapter", recording)
    (jobs / "release").touch()
    registry = _registry(tmp_path / "tools.yaml", 6)
    service = _service(registry, tmp_path, jobs)
    on_loop.clear()  # made outside any loop: the start-up's lookups (none here: nothing is cached yet)

    async def train_then_ask() -> dict[str, Any]:
        await _trained(service.trainer)  # type: ignore[arg-type]
        return await service.train("tools")

    asyncio.run(asyncio.wait_for(train_then_ask(), 120))
    assert on_loop == [False, False]  # the trained adapter checked, then the cached one a train request finds

    # A server on five of the tools, reloaded onto the six trained above: the cached adapter is found and hashed.
    five = _registry(tmp_path / "five" / "tools.yaml", 5)
    other = _service(five, tmp_path, jobs)
    on_loop.clear()
    _registry(five, 6)
    reloaded = asyncio.run(asyncio.wait_for(other.reload("tools"), 120))
    assert reloaded["changed"] and other.served("tools").adapter is not None
    assert on_loop == [False]


def _service(registry: Path, tmp_path: Path, jobs: Path) -> DiscoveryService:
    trainer = AdapterTrainer(job=StubJob(jobs), base_model=None, base_fingerprint=BASE_FINGERPRINT,
                             cache_dir=tmp_path / "cache" / "adapters")
    return DiscoveryService.from_paths([registry], tiny_llama(), smollm_tokenizer(),
                                       cache_dir=tmp_path / "cache" / "compiled", prompt=Prompt.style("short"),
                                       trainer=trainer)
