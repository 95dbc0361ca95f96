"""The V1 adapter (``TrieVllmProcessorV1``) against what vLLM's engine really does around it, with vLLM's own
``BatchUpdate``, ``SamplingParams`` and ``Sampler`` (``make test-vllm``, with vLLM 0.33 and 0.32; skipped without
vLLM):

- an update applies removed, then added, then moved (``BatchUpdate``'s contract): a row removed and added in one
  update holds the added, constrained request;
- async scheduling's placeholder (-1): vLLM writes the real id over it before the sampler runs the processors (its
  runner keeps output ids for custom processors and updates them first); one still there at ``apply`` fails its row
  (only stop), never a mask for the previous position;
- a stage after ours that writes a finite value into an illegal column of the returned buffer cannot reach the next
  request in that row (vLLM's ``Sampler`` runs the processors);
- a batch of plain rows and one constrained row is masked in place, without copying the plain rows.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm sets up an environment with it)")

from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata

with warnings.catch_warnings():  # what torch, imported by vLLM's sampler, warns about its own JIT
    warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning)
    from vllm.v1.sample.sampler import Sampler

from tooltrie.compiler import Artifact
from tooltrie.integrations.vllm import TrieVllmProcessorV1, request_args
from tooltrie.kernels import TrieMatcher


def allowed_after(artifact: Artifact, k: int, outputs: list[int]) -> list[int]:
    matcher = TrieMatcher(artifact, k, backend="reference")
    assert all(map(matcher.accept_token, outputs))
    legal = [artifact.eos_id] if matcher.is_terminated() else matcher.legal_tokens()
    assert legal is not None
    return sorted(legal)


def finite(row: torch.Tensor) -> list[int]:
    return torch.isfinite(row).nonzero().flatten().tolist()


def params(path: Path | None, k: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, extra_args=request_args(path, k) if path else None)


def update(size: int, *, removed: tuple[int, ...] = (), added: tuple[tuple[int, SamplingParams, list[int]], ...] = (),
           ) -> BatchUpdate:
    return BatchUpdate(batch_size=size, removed=list(removed),
                       added=[(row, sampling, None, outputs) for row, sampling, outputs in added], moved=[])


@pytest.fixture
def processor() -> TrieVllmProcessorV1:
    return TrieVllmProcessorV1(None, torch.device("cpu"), False)


def test_a_row_removed_and_added_in_one_update_holds_the_added_request(
        processor: TrieVllmProcessorV1, saved_catalog_artifact: Path, catalog_artifact: Artifact) -> None:
    vocab = catalog_artifact.max_token_id + 1
    processor.update_state(update(1, added=((0, params(saved_catalog_artifact, 2), []),)))
    processor.apply(torch.zeros(1, vocab))
    processor.update_state(update(1, removed=(0,), added=((0, params(saved_catalog_artifact, 1), []),)))
    assert finite(processor.apply(torch.zeros(1, vocab))[0]) == allowed_after(catalog_artifact, 1, [])


def test_vllm_writes_placeholders_over_before_the_processors_run() -> None:
    """The contract the adapter relies on, read from vLLM's runner: custom processors make the batch keep output ids,
    and ``_sample`` replaces the placeholders before the sampler (which runs the processors)."""
    import inspect

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert "logitsprocs_need_output_token_ids=bool(custom_logitsprocs)" in inspect.getsource(GPUModelRunner)
    sample = inspect.getsource(GPUModelRunner._sample)
    assert -1 < sample.index("update_async_output_token_ids()") < sample.index("self.sampler(")


def test_a_placeholder_written_over_is_the_token(processor: TrieVllmProcessorV1, saved_catalog_artifact: Path,
                                                 catalog_artifact: Artifact) -> None:
    vocab, outputs = catalog_artifact.max_token_id + 1, []
    processor.update_state(update(1, added=((0, params(saved_catalog_artifact, 2), outputs),)))
    first = allowed_after(catalog_artifact, 2, [])[0]
    assert finite(processor.apply(torch.zeros(1, vocab))[0]) == allowed_after(catalog_artifact, 2, [])
    outputs += [first, -1]  # sampled, then a placeholder for the step in flight
    second = allowed_after(catalog_artifact, 2, [first])[0]
    outputs[-1] = second  # vLLM writes the real id over the placeholder before the sampler
    assert finite(processor.apply(torch.zeros(1, vocab))[0]) == allowed_after(catalog_artifact, 2, [first, second])


def test_a_placeholder_left_at_apply_fails_the_row(processor: TrieVllmProcessorV1, saved_catalog_artifact: Path,
                                                   catalog_artifact: Artifact) -> None:
    vocab, outputs = catalog_artifact.max_token_id + 1, []
    processor.update_state(update(1, added=((0, params(saved_catalog_artifact, 2), outputs),)))
    processor.apply(torch.zeros(1, vocab))
    outputs += [allowed_after(catalog_artifact, 2, [])[0], -1]
    assert finite(processor.apply(torch.zeros(1, vocab))[0]) == [catalog_artifact.eos_id]


class FiniteWriter(LogitsProcessor):  # type: ignore[misc]
    """A stage after ours that writes a finite value into one column (as vLLM's thinking-budget forcing does)."""

    column: int | None = None

    def __init__(self, *args: Any) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.column is not None:
            logits[:, self.column] = 1e4
        return logits


def sampling_metadata(n_rows: int, processors: LogitsProcessors) -> SamplingMetadata:
    zeros = torch.zeros(n_rows)
    return SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None, generators={},
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None, frequency_penalties=zeros,
        presence_penalties=zeros, repetition_penalties=torch.ones(n_rows), output_token_ids=[[] for _ in range(n_rows)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=processors)


def test_a_finite_write_after_us_does_not_reach_the_next_request_in_the_row(
        processor: TrieVllmProcessorV1, saved_catalog_artifact: Path, catalog_artifact: Artifact) -> None:
    vocab, writer = catalog_artifact.max_token_id + 1, FiniteWriter()
    sampler, metadata = Sampler(), sampling_metadata(1, LogitsProcessors([processor, writer]))
    start = allowed_after(catalog_artifact, 1, [])
    illegal = next(token for token in range(vocab) if token not in start)
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0))

    processor.update_state(update(1, added=((0, params(saved_catalog_artifact, 1), []),)))
    writer.column = illegal  # overrides us for this request: it takes the illegal token
    assert sampler(logits.clone(), metadata).sampled_token_ids.flatten().tolist() == [illegal]

    processor.update_state(update(1, removed=(0,), added=((0, params(saved_catalog_artifact, 1), []),)))
    writer.column = None
    (token,) = sampler(logits.clone(), metadata).sampled_token_ids.flatten().tolist()
    assert token in start and token == max(start, key=lambda t: float(logits[0, t]))


def test_plain_rows_beside_one_constrained_row_are_not_copied(
        processor: TrieVllmProcessorV1, saved_catalog_artifact: Path, catalog_artifact: Artifact) -> None:
    vocab, n_rows = catalog_artifact.max_token_id + 1, 32
    processor.update_state(update(n_rows, added=tuple(
        (row, params(saved_catalog_artifact if row == 5 else None, 2), []) for row in range(n_rows))))
    logits = torch.randn(n_rows, vocab, generator=torch.Generator().manual_seed(1))
    original = logits.clone()
    masked = processor.apply(logits)
    assert masked is logits  # in place: one row masked, no plain row copied
    assert finite(masked[5]) == allowed_after(catalog_artifact, 2, [])
    assert torch.equal(masked[:5], original[:5]) and torch.equal(masked[6:], original[6:])

    processor.update_state(update(n_rows, added=tuple(
        (row, params(saved_catalog_artifact, 1 + row % 3), []) for row in range(n_rows))))
    masked = processor.apply(logits)
    assert masked is not logits  # every row constrained: the buffer of legal logits
    assert all(finite(masked[row]) == allowed_after(catalog_artifact, 1 + row % 3, []) for row in range(n_rows))
