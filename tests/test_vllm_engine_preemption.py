"""vLLM's engine (its CPU build) with the processor registered by name and a KV cache of 8 blocks of 32 tokens: a
batch of 16 requests cannot keep its rows, so the scheduler preempts requests and recomputes them later. Their
answers are still exactly k distinct tools, and the same as each request answered alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.vllm_engine import VLLM_WARNINGS, answer_is_valid, engine, require_cpu_engine, save_tiny_model

require_cpu_engine()

from vllm import SamplingParams  # noqa: E402

from tooltrie.compiler import Artifact, TokenizerInfo  # noqa: E402
from tooltrie.integrations.vllm import request_args  # noqa: E402

pytestmark = VLLM_WARNINGS


@pytest.fixture(scope="module")
def artifact_path(tmp_path_factory: pytest.TempPathFactory, catalog_artifact: Artifact) -> Path:
    return catalog_artifact.save(tmp_path_factory.mktemp("vllm-preemption") / "catalog.trie.safetensors")


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model = save_tiny_model(tmp_path_factory.mktemp("vllm-preemption") / "model")
    with engine(model, logits_processors=["tooltrie.integrations.vllm:TrieVllmProcessorV1"], max_num_seqs=16,
                enable_prefix_caching=False, block_size=32, num_gpu_blocks_override=8, max_model_len=128,
                disable_log_stats=False) as llm:
        yield llm


def preemptions(llm: Any) -> float:
    return sum(getattr(metric, "value", 0) for metric in llm.get_metrics() if metric.name == "vllm:num_preemptions")


def test_preempted_requests_answer_as_they_do_alone(llm: Any, artifact_path: Path, catalog_artifact: Artifact,
                                                   smollm: TokenizerInfo) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=64, extra_args=request_args(artifact_path, 3))
    prompts = [{"prompt_token_ids": (smollm.encode(f"Query: request {i}, the weather\nTools:") * 4)[-28:]}
               for i in range(16)]  # 28 prompt tokens: every answer crosses into a second block
    alone = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt in prompts]
    before = preemptions(llm)
    together = llm.generate(prompts, params, use_tqdm=False)
    assert preemptions(llm) > before
    assert all(answer_is_valid(catalog_artifact, output, 3) for output in together)
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
