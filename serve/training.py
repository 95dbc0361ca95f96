"""A served registry's own adapter, trained in the background: ``tooltrie serve --train``.

For each registry without one, the ``AdapterTrainer`` runs a child process (``python -m tooltrie.train.job``) at the
lowest CPU priority, one registry at a time, that regenerates training data from the registry's own text (``gen-data
--no-queries --compose``) and trains a LoRA adapter on the model as served, with the bundled catalog's labelled
requests drawn beside that text, following a ``Recipe``. Meanwhile the
server answers with what it has (the fused ranker); when the adapter is written, the service swaps it in as a reload
swaps a registry: requests decoding finish on the old engine, later ones get the new. Serving never imports the
training code.

Adapters are cached under ``<cache>/adapters/<key>``, the key a sha256 of everything an adapter depends on: the
registry, tokenizer and contract (the artifact's hashes), the served model's fingerprint and the recipe. A restart
finds them there; a registry that changed gets a new key, so an adapter is never applied to tools it was not
trained on. The child writes the adapter atomically (``write_adapter``), so a half-trained one is never found.

Progress is read from the training log (one JSON line per step) and shown in ``/v1/registries`` and ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tooltrie.compiler.artifact import Artifact
from tooltrie.ranker import Weights
from tooltrie.serve.adapter import AdapterError, AdapterRecord, is_adapter_dir, read_adapter

__all__ = ["AdapterTrainer", "Recipe", "TrainingStatus", "adapter_cache_dir"]

logger = logging.getLogger(__name__)

KEY_VERSION = 1  # bumped when what an adapter depends on changes
_POLL_S = 1.0  # how often the child's progress is read
_ERROR_TAIL = 2_000  # characters of a failed child's output kept in its status
CHILD_MODULE = "tooltrie.train.job"  # what the child runs (training code is imported there, never by serving)


@dataclass(frozen=True)
class Recipe:
    """How a served registry's adapter is trained: data from the registry's own text, then a short LoRA run sized
    for a 2-core CPU (a 1,853-tool registry: see docs/training.md)."""

    compose: int = 2_000  # multi-tool requests composed from the tools' descriptions (``train.compose``)
    self_instruct: int = 0  # requests per tool written by the instruct model (``train.self_instruct``)
    # The bundled registry ("catalog" or "bfcl") whose labelled requests are drawn beside the registry's text
    # (``train.job``; None: the text alone). Text alone teaches the tools but unlearns how requests read: on BFCL,
    # 54.0 % exact sets fused without them, 58.4 % with the catalog's (docs/training.md#training-while-serving).
    replay: str | None = "catalog"
    hard_negatives: bool = False  # each tool's requests beside its nearest tool's (``train.hard_negatives``)
    # Train the choices through ``fused`` as they are served (``train.priors``): the model learns what retrieval misses
    through_prior: bool = False
    prompt_style: str = "short"  # the prompt the adapter learns to answer (``serve.prompt``)
    steps: int = 200
    batch_size: int = 16
    learning_rate: float = 1e-3
    warmup_steps: int = 20
    rank: int = 32
    alpha: int = 64
    top_layers: int = 15  # the backward pass stops halfway: a step costs about 0.6x
    loss: str = "both"
    seed: int = 0
    threads: int = 1  # one core for training, the other for serving
    # What the adapter's answers rank by: alone it knows the tools less well than retrieval does, fused with it
    # (these weights, chosen on BFCL's validation split) it answers better than either.
    fused: Weights = field(default_factory=lambda: Weights(model=1.0, retrieval=100.0))

    def key(self, artifact: Artifact, base_fingerprint: str) -> str:
        """The cache key of this recipe's adapter for ``artifact`` on the base with ``base_fingerprint``."""
        parts = [KEY_VERSION, artifact.registry.sha256, artifact.tokenizer_fingerprint, artifact.contract.sha256,
                 base_fingerprint, asdict(self)]
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode("utf-8")).hexdigest()

    def arguments(self) -> list[str]:
        return ["--recipe", json.dumps(asdict(self), sort_keys=True)]

    @classmethod
    def from_json(cls, text: str) -> Recipe:
        fields = json.loads(text)
        return cls(**{**fields, "fused": Weights(**fields["fused"])})


def adapter_cache_dir() -> Path:
    """``$TOOLTRIE_CACHE_DIR/adapters``, else ``$XDG_CACHE_HOME/tooltrie/adapters``, else ``~/.cache/...``."""
    from tooltrie.serve.model import default_model_cache_dir

    return default_model_cache_dir().parent / "adapters"


@dataclass
class TrainingStatus:
    """Where a registry's adapter stands: ``queued``, ``training`` (``phase`` data or steps), ``ready`` or
    ``failed`` (``error`` says why)."""

    state: str
    steps: int
    key: str = ""  # the cache key of the adapter it is about (``Recipe.key``)
    step: int = 0
    phase: str | None = None
    adapter: str | None = None  # its directory, once ready
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        seconds = None if self.started_at is None else (self.finished_at or time.time()) - self.started_at
        return {"state": self.state, "phase": self.phase, "step": self.step, "steps": self.steps,
                "adapter": self.adapter, "seconds": None if seconds is None else round(seconds, 1),
                "error": self.error}


Ready = Callable[[str, AdapterRecord], Awaitable[None]]


class AdapterTrainer:
    """Trains the adapters of registries ``request``\\ ed, one at a time, while ``run`` is being awaited."""

    def __init__(self, *, base_model: str | None, base_fingerprint: str, base_adapter: bool = True,
                 recipe: Recipe | None = None, cache_dir: Path | None = None, python: str = sys.executable) -> None:
        """The model adapters are trained on is ``serve.model.load_model(base_model, adapter=base_adapter)``, the
        model as served (None: the default model, with its shipped adapter merged), whose float32 weights have
        ``base_fingerprint``."""
        self.base_model, self.base_adapter, self.base_fingerprint = base_model, base_adapter, base_fingerprint
        self.recipe = recipe or Recipe()
        self.cache_dir = cache_dir or adapter_cache_dir()
        self.python = python
        self.status: dict[str, TrainingStatus] = {}
        self._queue: deque[tuple[str, Artifact, TrainingStatus]] = deque()
        self._wake = asyncio.Event()
        self._child: subprocess.Popen[bytes] | None = None

    def directory(self, artifact: Artifact) -> Path:
        return self.cache_dir / self.recipe.key(artifact, self.base_fingerprint)

    def cached(self, artifact: Artifact) -> AdapterRecord | None:
        """The adapter trained for ``artifact`` by this recipe on this base, if one is in the cache."""
        directory = self.directory(artifact)
        if not is_adapter_dir(directory):
            return None
        try:
            return read_adapter(directory)
        except AdapterError as exc:  # damaged: trained again when asked
            logger.warning("ignoring the cached adapter %s: %s", directory, exc)
            return None

    def request(self, name: str, artifact: Artifact) -> TrainingStatus:
        """Queue ``name``'s adapter for ``artifact``: nothing new when that one is queued or training already, or
        in the cache. A registry reloaded meanwhile is queued for its new version, whose status ``name`` then
        shows; an older version still waiting leaves the queue, one training finishes (and is not swapped in:
        it no longer fits)."""
        key = self.directory(artifact).name
        current = self.status.get(name)
        if current is not None and current.state in ("queued", "training") and current.key == key:
            return current
        self._queue = deque(entry for entry in self._queue if entry[0] != name)
        cached = self.cached(artifact)
        if cached is not None:  # trained already (the service swaps it in when it loads the registry)
            self.status[name] = TrainingStatus("ready", steps=self.recipe.steps, key=key, step=self.recipe.steps,
                                               adapter=str(cached.path))
            return self.status[name]
        status = self.status[name] = TrainingStatus("queued", steps=self.recipe.steps, key=key)
        self._queue.append((name, artifact, status))
        self._wake.set()
        return status

    async def run(self, ready: Ready) -> None:
        """Train what is queued, one registry at a time, calling ``ready(name, adapter)`` after each; until
        cancelled (the child is then killed)."""
        try:
            while True:
                while not self._queue:
                    self._wake.clear()
                    await self._wake.wait()
                name, artifact, status = self._queue.popleft()
                try:
                    record = await self._train(status, artifact)
                    await ready(name, record)
                except Exception as exc:  # the server goes on with what it had
                    logger.exception("training an adapter for registry %r failed", name)
                    status.state, status.error = "failed", status.error or f"{type(exc).__name__}: {exc}"
                else:
                    status.state, status.adapter = "ready", str(record.path)
                finally:
                    status.finished_at = time.time()
        finally:
            self.stop()

    def stop(self) -> None:
        """Kill the child that is training, if any."""
        child = self._child
        if child is not None and child.poll() is None:
            child.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=10)

    async def _train(self, status: TrainingStatus, artifact: Artifact) -> AdapterRecord:
        output = self.directory(artifact)
        work = self.cache_dir / f".{output.name}.work"
        work.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(artifact.save, work / "registry.trie")  # a large one takes a moment
        log = work / "train.log.jsonl"
        log.unlink(missing_ok=True)
        command = [self.python, "-m", CHILD_MODULE, str(work / "registry.trie"), str(output),
                   "--work", str(work), *self.recipe.arguments()]
        if self.base_model is not None:
            command += ["--base-model", self.base_model]
        if not self.base_adapter:
            command.append("--no-base-adapter")
        status.state, status.phase, status.started_at = "training", "data", time.time()
        logger.info("training an adapter for registry %r (%d tools) in the background, into %s",
                    artifact.registry.name, artifact.trie.n_tools, output)
        with (work / "child.log").open("wb") as out:
            self._child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL)
            while self._child.poll() is None:
                await asyncio.sleep(_POLL_S)
                step = _last_step(log)
                if step is not None:
                    status.phase, status.step = "steps", step
        code, self._child = self._child.returncode, None
        if code != 0:
            tail = (work / "child.log").read_text(encoding="utf-8", errors="replace")[-_ERROR_TAIL:]
            status.error = f"the training process exited with status {code}: {tail.strip()}"
            raise RuntimeError(status.error)
        status.step = self.recipe.steps
        shutil.rmtree(work / "data", ignore_errors=True)  # the log stays, beside the adapter
        return read_adapter(output)


def _last_step(log: Path) -> int | None:
    """The step of the training log's last complete line, or None before the first."""
    try:
        with log.open("rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - 4096))
            lines = file.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        with contextlib.suppress(ValueError):
            return int(json.loads(line)["step"])
    return None
