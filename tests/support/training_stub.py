"""A stand-in for the training job (``serve.training.TrainingJob``): a real child process that trains nothing.

``StubJob(events, behaviour)`` gives the trainer the command ``python training_stub.py ...``, which, like the real
job, calls ``exit_with_server()`` first, then appends ``started PID`` to ``events/log`` and behaves:

- ``block``: waits for the file ``events/release``, then writes a small adapter that fits ``tiny_llama`` (zero
  updates on one layer) and appends ``landed PID``;
- ``hang``: sleeps for ever;
- ``stubborn``: sleeps for ever; a ``SIGTERM`` only appends ``term PID``;
- ``orphan``: starts a process that inherits every descriptor it has (the key's lock among them) and sleeps, appends
  ``orphan PID`` (that process's), then writes the adapter and exits, leaving it running.

At its start it appends ``overlap PID`` if another stub started and not landed is still alive: two trainers at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STEPS = 3
BASE_FINGERPRINT = "f" * 64


@dataclass(frozen=True)
class StubJob:
    events: Path
    behaviour: str = "block"
    steps: int = STEPS

    def key(self, artifact: Any, base_fingerprint: str) -> str:
        parts = [artifact.registry.sha256, artifact.tokenizer_fingerprint, artifact.contract.sha256,
                 base_fingerprint, "stub"]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()

    def command(self, artifact_file: Path, output: Path, *, work: Path, base_model: str | None,
                base_adapter: bool) -> list[str]:
        return [sys.executable, __file__, str(artifact_file), str(output), str(self.events), self.behaviour]


def events(directory: Path) -> list[tuple[str, int]]:
    """The stubs' log: (event, pid) in order."""
    log = directory / "log"
    if not log.exists():
        return []
    return [(word, int(pid)) for word, pid in (line.split() for line in log.read_text().splitlines())]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"))  # a zombie is gone


def _note(directory: Path, word: str) -> None:
    with (directory / "log").open("a") as log:
        log.write(f"{word} {os.getpid()}\n")


def _write_adapter(artifact_file: Path, output: Path) -> None:
    import torch

    from tooltrie.compiler.artifact import Artifact
    from tooltrie.serve.adapter import write_adapter

    artifact = Artifact.load(artifact_file)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {f"{prefix}.lora_A.weight": torch.zeros(2, 64), f"{prefix}.lora_B.weight": torch.zeros(64, 2)}
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    record = {"base_model": {"name": "tiny", "fingerprint": BASE_FINGERPRINT},
              "registry": {"name": artifact.registry.name, "sha256": artifact.registry.sha256},
              "tokenizer": {"fingerprint": artifact.tokenizer_fingerprint},
              "contract_sha256": artifact.contract.sha256, "prompt_style": "short"}
    write_adapter(output, tensors, config, record)


def main(artifact_file: str, output: str, directory: str, behaviour: str) -> None:
    from tooltrie.serve.lifeline import exit_with_server

    exit_with_server()
    events_dir = Path(directory)
    if behaviour == "stubborn":  # notes the SIGTERM, and goes on
        import signal

        signal.signal(signal.SIGTERM, lambda *_: _note(events_dir, "term"))
    started = {pid for word, pid in events(events_dir) if word == "started"}
    landed = {pid for word, pid in events(events_dir) if word == "landed"}
    if any(alive(pid) for pid in started - landed):
        _note(events_dir, "overlap")
    _note(events_dir, "started")
    if behaviour == "orphan":
        import subprocess

        orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], close_fds=False)
        with (events_dir / "log").open("a") as log:
            log.write(f"orphan {orphan.pid}\n")
        _write_adapter(Path(artifact_file), Path(output))
        _note(events_dir, "landed")
        return
    if behaviour != "block":
        while True:
            time.sleep(1)
    while not (events_dir / "release").exists():
        time.sleep(0.05)
    _write_adapter(Path(artifact_file), Path(output))
    _note(events_dir, "landed")


if __name__ == "__main__":
    main(*sys.argv[1:])
