"""``python -m support.training_server REGISTRY CACHE EVENTS PORT_FILE``, run from ``tests/``: a discovery server in
a process of its own (the tiny Llama, SmolLM2's tokenizer) whose adapters are trained by
``training_stub.StubJob(EVENTS)`` into ``CACHE/adapters``; it writes its port to PORT_FILE once it is bound. For tests
that kill a server."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import uvicorn

from support.training_stub import BASE_FINGERPRINT, StubJob
from tooltrie.compiler import TokenizerInfo
from tooltrie.serve.prompt import Prompt
from tooltrie.serve.server import create_app
from tooltrie.serve.service import DiscoveryService
from tooltrie.serve.training import AdapterTrainer
from tooltrie.testing import tiny_llama


def main(registry: str, cache: str, events: str, port_file: str) -> None:
    trainer = AdapterTrainer(job=StubJob(Path(events)), base_model=None, base_fingerprint=BASE_FINGERPRINT,
                             cache_dir=Path(cache) / "adapters")
    service = DiscoveryService.from_paths([Path(registry)], tiny_llama(), TokenizerInfo.load("smollm2-135m"),
                                          cache_dir=Path(cache) / "compiled", prompt=Prompt.style("short"),
                                          trainer=trainer)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    Path(port_file + ".tmp").write_text(str(sock.getsockname()[1]))
    Path(port_file + ".tmp").rename(port_file)
    uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    main(*sys.argv[1:])
