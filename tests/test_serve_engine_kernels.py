"""The engine's backends against the oracle: the Numba walk (``backend="cpu"``, the default on a CPU) and the fused
CUDA kernels (``backend="cuda"``, on a GPU or under ``NUMBA_ENABLE_CUDASIM=1``) give the same answers as the readable
rules (``backend="reference"``): the same tokens and tools, scores and margins within 1e-4, with mixed k, a subset
request and an unconstrained row in one batch. On a machine with a CUDA GPU the model also runs there: its decisions
default to the kernels, fed torch's CUDA tensors in place, and must match the oracle on the same GPU and the CPU
engine's answers.

The tiny random Llama with SmolLM2's vocabulary, the bundled SmolLM2 tokenizer; the simulator costs ~0.1-0.4 s per
block (one block per deciding row and step), so its cases are few.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from numba import config, cuda
from support.serve import small_artifact, tiny_model

from tooltrie.compiler import Artifact, TokenizerInfo
from tooltrie.serve.engine import Answer, Engine, Request, _decision_head, _decision_hidden

SMALL_QUERIES = ("What is the weather in Paris?", "hi", "stock price of ACME")
HAS_CUDA = bool(config.ENABLE_CUDASIM or cuda.is_available())
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no GPU here and NUMBA_ENABLE_CUDASIM is not set")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here (torch sees none)")


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model()


def _small_requests() -> list[Request]:
    """Mixed k, a subset (tool names) and an unconstrained row, decoded in one batch."""
    q = SMALL_QUERIES
    return [Request(q[0], 3), Request(q[1], 1), Request(q[2], 2, allow=("get", "get_users", "search", "ab")),
            Request(q[1], 1, constrained=False, max_new_tokens=3), Request(q[0], 2, allow=("search_web", "a"))]


def _same(got: Answer, expected: Answer) -> None:
    assert got.token_ids == expected.token_ids
    assert got.finish_reason == expected.finish_reason
    assert [t.name for t in got.tools] == [t.name for t in expected.tools]
    assert [t.score for t in got.tools] == pytest.approx([t.score for t in expected.tools], abs=1e-4)
    assert [t.margin for t in got.tools] == pytest.approx([t.margin for t in expected.tools], abs=1e-4)
    assert (got.forward_passes, got.decision_points, got.prompt_tokens) == (
        expected.forward_passes, expected.decision_points, expected.prompt_tokens)


def _compare(model: Any, tokenizer: TokenizerInfo, artifact: Artifact, requests: list[Request], backend: str,
             max_batch: int = 8) -> list[Answer]:
    expected = Engine(model, tokenizer, artifact, max_batch=max_batch, backend="reference").run(requests)
    engine = Engine(model, tokenizer, artifact, max_batch=max_batch, backend=backend)
    assert engine.backend == backend
    got = engine.run(requests)
    for request, answer, reference in zip(requests, got, expected, strict=True):
        _same(answer, reference)
        if request.constrained:
            assert answer.finish_reason == "stop" and len(answer.tools) == request.k, request
    return got


def test_the_default_backend_on_cpu_is_the_compiled_walk_and_unknown_ones_are_refused(model: Any,
                                                                                      smollm: TokenizerInfo) -> None:
    assert Engine(model, smollm, small_artifact(smollm)).backend == "cpu"
    with pytest.raises(ValueError, match="unknown backend"):
        Engine(model, smollm, small_artifact(smollm), backend="triton")


def test_cpu_backend_equals_the_oracle_on_the_small_registry(model: Any, smollm: TokenizerInfo) -> None:
    answers = _compare(model, smollm, small_artifact(smollm), _small_requests(), "cpu")
    assert sum(a.decision_points for a in answers) > 0
    subset = answers[2]
    assert {t.name for t in subset.tools} <= {"get", "get_users", "search", "ab"}


def test_cpu_backend_equals_the_oracle_on_the_catalog_with_continuous_batching(
        model: Any, smollm: TokenizerInfo, catalog_artifact: Artifact) -> None:
    q = ("What's the weather like in Paris tomorrow?", "hi", "convert 300 dollars to euros and book a hotel")
    requests = [Request(q[0], 3), Request(q[1], 1), Request(q[2], 2), Request(q[1], 3), Request(q[2], 1)]
    _compare(model, smollm, catalog_artifact, requests, "cpu", max_batch=2)  # rows join and leave


def test_a_bfloat16_model_decides_in_float32_on_every_backend(model: Any, smollm: TokenizerInfo) -> None:
    """``--dtype bfloat16`` (the default where the CPU has it): the passes run in bfloat16, the decisions multiply
    the legal head rows by the hidden state in float32 (bfloat16 products would differ by ~1e-2 and tie often)."""
    half = copy.deepcopy(model).to(torch.bfloat16)
    answers = _compare(half, smollm, small_artifact(smollm), _small_requests(), "cpu")
    assert sum(a.decision_points for a in answers) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_decision_inputs_meet_the_backend_s_head_on_its_device_in_its_dtype(dtype: torch.dtype) -> None:
    """What each backend multiplies, checked without a GPU: the CPU walks (``cpu``, ``reference``: a NumPy head, also
    for a model on a GPU) get float32 hidden states on the CPU; the CUDA kernels (a tensor head) get them on the
    head's device (here the ``meta`` device stands for a GPU) in the head's dtype. A model on a GPU with the ``cpu``
    or ``reference`` backend once asked the NumPy head for a torch dtype (a TypeError)."""
    generator = torch.Generator().manual_seed(0)
    head = torch.randn(50, 16, generator=generator).to(dtype)
    hidden = torch.randn(3, 16, generator=generator).to(dtype)
    for backend in ("cpu", "reference"):
        numpy_head = _decision_head(head, backend)
        assert isinstance(numpy_head, np.ndarray)
        if dtype == torch.bfloat16:  # its bits, shared with the model (no float32 copy), widened as they are read
            assert numpy_head.dtype == np.int16 and np.shares_memory(numpy_head, head.view(torch.int16).numpy())
            numpy_head = head.float().numpy()
        assert numpy_head.dtype == np.float32
        placed = _decision_hidden(hidden, numpy_head)
        assert placed.dtype == torch.float32 and placed.device.type == "cpu"
        np.testing.assert_array_equal(placed.numpy() @ numpy_head.T, hidden.float().numpy() @ head.float().numpy().T)
    for tensor_head in (head.float(), head.float().to("meta")):  # ``_decision_head`` on a GPU: float32 or as it was
        placed = _decision_hidden(hidden, tensor_head)
        assert (placed.dtype, placed.device) == (tensor_head.dtype, tensor_head.device)


@needs_cuda
def test_cuda_backend_equals_the_oracle_on_the_small_registry(model: Any, smollm: TokenizerInfo,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """One launch per decision step for all deciding rows, subsets included."""
    from tooltrie.kernels.cuda import CudaBackend

    launches: list[tuple[int, bool]] = []  # (rows, with subsets)
    choose = CudaBackend.choose

    def spy(self: CudaBackend, state: Any, rows: Any, *args: Any) -> None:
        launches.append((len(rows), state.counts.shape[0] > 0))
        choose(self, state, rows, *args)

    monkeypatch.setattr(CudaBackend, "choose", spy)
    answers = _compare(model, smollm, small_artifact(smollm), _small_requests(), "cuda")
    assert sum(a.decision_points for a in answers) > 0
    assert max(rows for rows, _ in launches) > 1 and any(subsets for _, subsets in launches)


@needs_cuda
def test_cuda_backend_equals_the_oracle_on_the_catalog(model: Any, smollm: TokenizerInfo,
                                                   catalog_artifact: Artifact) -> None:
    requests = [Request("What's the weather like in Paris tomorrow?", 3), Request("hi", 2)]
    _compare(model, smollm, catalog_artifact, requests, "cuda")


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_on_the_gpu_decides_with_the_kernel_on_torch_tensors(model: Any, smollm: TokenizerInfo,
                                                                     catalog_artifact: Artifact,
                                                                     dtype: torch.dtype) -> None:
    gpu = copy.deepcopy(model).to("cuda", dtype)
    assert Engine(gpu, smollm, catalog_artifact).backend == "cuda"
    requests = _small_requests()
    answers = _compare(gpu, smollm, small_artifact(smollm), requests, "cuda")
    catalog = [Request("What's the weather like in Paris tomorrow?", 3), Request("hi", 2),
               Request("convert 300 dollars to euros and book a hotel", 1)]
    _compare(gpu, smollm, catalog_artifact, catalog, "cuda", max_batch=2)  # rows join and leave
    if dtype == torch.float32:  # the same answers as on the CPU (the tiny model's choices are clear-cut)
        for answer, reference in zip(answers, Engine(model, smollm, small_artifact(smollm)).run(requests),
                                     strict=True):
            assert answer.token_ids == reference.token_ids
            assert [t.score for t in answer.tools] == pytest.approx([t.score for t in reference.tools], abs=1e-3)
