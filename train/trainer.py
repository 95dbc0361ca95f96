"""The LoRA fine-tuning loop: seeded, teacher-forced, loss on the answer tokens only, validated as it goes.

Each step draws a full batch from a seeded stream (balanced over the gold sets by default, or shuffled epochs),
runs the shared prompt prefix once and the rows after it (``train.batches``), takes the loss at the answer positions
(``train.loss``: ``plain``, ``trie`` or ``both``), and makes one AdamW step on the LoRA matrices (linear warm-up,
then cosine decay to zero; gradients clipped). The
training passes run under bfloat16 autocast by default (about 1.6x faster on a CPU with AMX); validation
runs in float32, as the model is served, every ``eval_every`` steps and at the end, on a fixed seeded sample.

Every step and every validation is a JSON line in the log; the adapter directory records the settings, the loss
curve and the validation curve (``train.adapter``).
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tooltrie.compiler.artifact import Artifact
from tooltrie.serve.adapter import write_adapter
from tooltrie.train.batches import balanced_batches, make_batch, passes, shuffled_batches, stratified_sample
from tooltrie.train.data import Example, TrainingData, check_alike
from tooltrie.train.lora import attach_lora, lora_tensors
from tooltrie.train.loss import LOSSES, Scale, ValidationTotals, answer_hidden
from tooltrie.train.settings import TrainSettings

__all__ = ["TrainResult", "TrainSettings", "train"]

PRECISIONS = {"bf16": torch.bfloat16, "fp32": torch.float32}  # settings.PRECISION_NAMES


@dataclass(frozen=True)
class TrainResult:
    output: Path  # the adapter directory
    record: dict[str, Any]  # what its tooltrie.json holds
    seconds: float
    validation: dict[str, Any] | None  # the last validation's summary


def train(data: TrainingData, artifact: Artifact, model: Any, *, base_name: str, output: str | Path,
          settings: TrainSettings | None = None, log_path: str | Path | None = None,
          progress: bool = True, ranker: Mapping[str, Any] | None = None,
          also: Sequence[TrainingData] = (), partners: Mapping[str, str] | None = None) -> TrainResult:
    """Fine-tune ``model`` (a Hugging Face causal LM, float32; changed in place: LoRA layers are injected) on
    ``data`` made for ``artifact``, and write the adapter to ``output``.

    ``also``: training data made alike for other registries (``check_alike``), drawn from with ``data``'s; e.g. a
    registry's text beside another's labelled queries, so the adapter learns how requests read on tools it was not
    given labels for. The adapter is ``artifact``'s: validation, its record's registry and ``--ranker auto`` are
    that registry's; the others are listed in the record.

    ``partners``: hard negatives for ``data``'s tools (``train.hard_negatives.confused_tools``), drawn beside them
    in each batch (balanced sampling only).

    ``base_name`` is what the adapter records as its base: the default model's name, or the base's directory.
    The log (JSON lines) goes to ``log_path``, by default ``<output>.log.jsonl`` beside the adapter. ``ranker``: what
    the record says about ranking with this adapter (``tooltrie.ranker_policy``); by default,
    for an adapter trained through the prior (``settings.prior_weight``), the fused ranker at that weight, over the
    prior it was trained through (``settings.prior``).
    """
    from tooltrie.serve.weights import model_fingerprint

    settings = settings or TrainSettings()
    if partners is not None and settings.sampling != "balanced":
        raise ValueError(f"hard negatives are drawn by balanced sampling, not {settings.sampling!r}")
    for other in also:
        check_alike(data, other)
    for one in (data, *also):
        if any((example.bonus is not None) != (settings.prior_weight > 0) for example in one.train):
            raise ValueError(f"{one.directory}: prior_weight is {settings.prior_weight:g}, so every example must "
                             f"{'carry' if settings.prior_weight > 0 else 'lack'} the fused ranker's bonuses "
                             "(train.priors.retrieval_priors)")
    out = Path(output)
    log_file = Path(log_path) if log_path is not None else out.with_name(out.name + ".log.jsonl")
    base_fingerprint = model_fingerprint(model)
    started = time.perf_counter()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    try:
        with torch.random.fork_rng(devices=[]), log_file.open("w", encoding="utf-8") as log:
            torch.manual_seed(settings.seed)
            peft_model = attach_lora(model, settings.lora)
            loop = _Loop(peft_model, artifact, data, also, settings, log, progress=progress, started=started,
                         partners=partners)
            loop.run()
            tensors, config = lora_tensors(peft_model)
    finally:
        torch.set_num_threads(previous_threads)
    seconds = time.perf_counter() - started
    record = _record(data, also, artifact, settings, base_name=base_name, base_fingerprint=base_fingerprint,
                     loop=loop, seconds=seconds, parameters=sum(t.numel() for t in tensors.values()))
    if ranker is None and settings.prior_weight > 0:  # trained to add to the prior: answers rank as they trained
        ranker = {"fused": {"model": 1.0, "retrieval": settings.prior_weight}, "prior": settings.prior,
                  "fused_from": "the prior weight it was trained through; nothing measured"}
    if ranker is not None:
        record["ranker"] = dict(ranker)
    # peft writes the base's load path (a cache folder of the training machine); the record's name says it anywhere.
    write_adapter(out, tensors, {**config, "base_model_name_or_path": base_name}, record)
    return TrainResult(output=out, record=record, seconds=seconds, validation=loop.last_validation)


class _Loop:
    def __init__(self, peft_model: Any, artifact: Artifact, data: TrainingData, also: Sequence[TrainingData],
                 settings: TrainSettings, log: IO[str], *, progress: bool, started: float,
                 partners: Mapping[str, str] | None = None) -> None:
        self.model, self.settings, self.log, self.progress, self.started = peft_model, settings, log, progress, started
        self.partners = partners
        base = peft_model.get_base_model()
        self.decoder = base.get_decoder()
        self.head = base.get_output_embeddings().weight
        self.pad_id = artifact.eos_id
        self.loss_fn = LOSSES[settings.loss]
        self.trainable = [p for p in peft_model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=settings.learning_rate,
                                           weight_decay=settings.weight_decay)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.train_examples, self.also_examples = data.train, [other.train for other in also]
        self.validation = _sample(data.validation, settings.eval_examples, seed=settings.seed)
        self.losses: list[tuple[int, float]] = []
        self.validations: list[dict[str, Any]] = []
        self.last_validation: dict[str, Any] | None = None
        self.train_seconds = self.train_cpu_seconds = 0.0

    def _lr_factor(self, step: int) -> float:
        warmup, total = self.settings.warmup_steps, self.settings.steps
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    def run(self) -> None:
        from tqdm import tqdm

        settings = self.settings
        if settings.sampling == "balanced":
            stream = balanced_batches(self.train_examples, settings.batch_size, seed=settings.seed,
                                      also=self.also_examples, partners=self.partners)
        else:
            everything = [*self.train_examples, *(example for examples in self.also_examples for example in examples)]
            stream = shuffled_batches(everything, settings.batch_size, seed=settings.seed)
        bar = tqdm(total=settings.steps, desc="train", unit="step", file=sys.stderr, disable=not self.progress,
                   dynamic_ncols=True)
        with bar:
            for step in range(1, settings.steps + 1):
                lr = self.schedule.get_last_lr()[0]  # the rate this step takes (the schedule moves on after it)
                loss, seconds, cpu_seconds = self._step(next(stream))
                self.losses.append((step, loss))
                # CPU seconds beside wall seconds: on a shared machine they say what the step itself cost.
                self._write({"step": step, "loss": round(loss, 5), "lr": lr,
                             "step_seconds": round(seconds, 3), "cpu_seconds": round(cpu_seconds, 3),
                             "elapsed_seconds": self._elapsed()})
                postfix = {"loss": f"{loss:.3f}", "s/step": f"{seconds:.2f}"}
                if self.validation and (step == settings.steps or (settings.eval_every
                                                                   and step % settings.eval_every == 0)):
                    summary = self.validate(step)
                    postfix["val_exact"] = f"{summary['constrained_exact']:.3f}"
                bar.set_postfix(postfix)
                bar.update()

    def _step(self, examples: list[Example]) -> tuple[float, float, float]:
        started, cpu_started = time.perf_counter(), time.process_time()
        self.model.train()
        dtype, scale, loss = PRECISIONS[self.settings.precision], Scale.of(examples), 0.0
        for part in passes(examples, self.settings.max_attention_cells):
            batch = make_batch(part, pad_id=self.pad_id)
            # SDPA's math backend: on a CPU, the fused (flash) attention's backward costs ~12 ms a layer at these
            # short lengths, a third of a step; the math backend's is a few small matmuls (same loss; a step 1.6x
            # faster on the same batches, ~1.3x over whole runs).
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32), sdpa_kernel(SDPBackend.MATH):
                part_loss = self.loss_fn(answer_hidden(self.decoder, batch), self.head, batch, scale)
            part_loss.backward()  # type: ignore[no-untyped-call]
            loss += float(part_loss.detach())
        torch.nn.utils.clip_grad_norm_(self.trainable, self.settings.max_grad_norm)
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
        self.train_seconds += seconds
        self.train_cpu_seconds += cpu_seconds
        return loss, seconds, cpu_seconds

    def validate(self, step: int) -> dict[str, Any]:
        started = time.perf_counter()
        self.model.eval()
        totals = ValidationTotals()
        with torch.no_grad():
            for chunk in _chunks(self.validation, 2 * self.settings.batch_size):
                for part in passes(chunk, self.settings.max_attention_cells):
                    batch = make_batch(part, pad_id=self.pad_id)
                    totals.add(answer_hidden(self.decoder, batch), self.head, batch)
        summary = {"step": step, **totals.summary(), "seconds": round(time.perf_counter() - started, 2)}
        self.validations.append(summary)
        self.last_validation = summary
        self._write({"step": step, "validation": summary, "elapsed_seconds": self._elapsed()})
        return summary

    def _elapsed(self) -> float:
        return round(time.perf_counter() - self.started, 2)

    def _write(self, line: dict[str, Any]) -> None:
        self.log.write(json.dumps(line) + "\n")
        self.log.flush()


def _record(data: TrainingData, also: Sequence[TrainingData], artifact: Artifact, settings: TrainSettings, *,
            base_name: str,
            base_fingerprint: str, loop: _Loop, seconds: float, parameters: int) -> dict[str, Any]:
    registry = artifact.registry
    every = max(1, settings.steps // 100)  # about 100 points on the curve, each the mean of its steps
    curve = [[chunk[-1][0], round(sum(loss for _, loss in chunk) / len(chunk), 4)]
             for chunk in _chunks(loop.losses, every)]
    examples_seen = settings.steps * settings.batch_size
    train_examples = len(loop.train_examples) + sum(len(examples) for examples in loop.also_examples)
    return {
        "base_model": {"name": base_name, "fingerprint": base_fingerprint},
        "registry": {"name": registry.name, "sha256": registry.sha256, "tools": len(registry)},
        "tokenizer": {"fingerprint": artifact.tokenizer_fingerprint, "source": artifact.tokenizer_meta.get("source")},
        "contract": artifact.contract.to_dict(),
        "contract_sha256": artifact.contract.sha256,
        "artifact_sha256": artifact.sha256,
        "prompt_style": data.meta.prompt_style,
        "lora": {**asdict(settings.lora), "parameters": parameters, "stored_dtype": "float16"},
        "training": {
            "settings": {k: v for k, v in asdict(settings).items() if k != "lora"},
            "data": {"directory": str(data.directory), "train_examples": len(data.train),
                     "validation_examples": len(data.validation), "meta": dict(data.meta.raw)},
            "also": [{"directory": str(other.directory), "train_examples": len(other.train),
                      "registry": {"name": other.meta.registry_name, "sha256": other.meta.registry_sha256}}
                     for other in also],
            "hard_negatives": None if loop.partners is None else len(loop.partners),  # tools with a partner
            "examples_seen": examples_seen,
            "epochs": round(examples_seen / train_examples, 3),
            "seconds": round(seconds, 1),
            "train_step_seconds": round(loop.train_seconds / settings.steps, 3),
            "train_step_cpu_seconds": round(loop.train_cpu_seconds / settings.steps, 3),
            "machine": {"processor": platform.processor() or platform.machine(), "threads": settings.threads},
            "versions": _versions(),
        },
        "loss_curve": curve,
        "validation": loop.validations,
    }


def _versions() -> dict[str, str | None]:
    import importlib.metadata

    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "tooltrie"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    return versions


def _sample(examples: Sequence[Example], count: int, *, seed: int) -> list[Example]:
    """A fixed seeded sample stratified like the test split, sorted by length so validation batches carry little
    padding."""
    chosen = stratified_sample(examples, count, seed=seed)
    return sorted(chosen, key=lambda e: len(e.prompt_ids) + len(e.completion_ids))


def _chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
