"""tooltrie's V1 logits processor inside vLLM's own engine (vLLM's CPU build; ``make test-vllm``): one ``LLM`` on the
tiny model, the processor registered as a class object, requests through ``LLM.generate`` and the engine's own
request loop (``LLMEngine.add_request``/``step``/``abort_request``).

- greedy answers equal tooltrie's engine's, token for token, on held-out catalog queries at k = 1, 2, 3;
- one batch of 288 requests (more than the engine runs at once) mixing two artifacts with different k, vLLM's own
  structured outputs (the exactly-k grammar, XGrammar) and plain requests: each kind answers as it does alone;
- sampling (temperature, top-p, top-k, penalties, a logit bias on illegal tokens, logprobs): every constrained answer
  is still exactly k distinct tools;
- requests aborted mid-answer, and malformed arguments refused, leave the engine answering as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.vllm_engine import (
    VLLM_WARNINGS,
    answer_is_valid,
    answer_tokens,
    engine,
    require_cpu_engine,
    save_tiny_model,
    vllm_tiny_model,
)

require_cpu_engine()

from vllm import SamplingParams  # noqa: E402

from tooltrie.compiler import Artifact, TokenizerInfo  # noqa: E402
from tooltrie.eval.datasets import load_split  # noqa: E402
from tooltrie.integrations.vllm import TrieVllmProcessorV1, request_args  # noqa: E402
from tooltrie.serve.engine import Engine, Request  # noqa: E402
from tooltrie.serve.prompt import Prompt  # noqa: E402

pytestmark = VLLM_WARNINGS
MAX_NUM_SEQS = 64
QUERIES = [query.query for query in load_split("metatool-single", "test")[:6]]


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory, catalog_artifact: Artifact,
          smollm: TokenizerInfo) -> dict[str, Path]:
    from support.serve import small_artifact

    directory = tmp_path_factory.mktemp("vllm-engine")
    return {"model": save_tiny_model(directory / "model"),
            "catalog": catalog_artifact.save(directory / "catalog.trie.safetensors"),
            "small": small_artifact(smollm).save(directory / "small.trie.safetensors")}


@pytest.fixture(scope="module")
def llm(paths: dict[str, Path]) -> Iterator[Any]:
    with engine(paths["model"], logits_processors=[TrieVllmProcessorV1], max_num_seqs=MAX_NUM_SEQS,
                structured_outputs_config={"backend": "xgrammar"}) as llm:
        yield llm


def prompt_ids(artifact: Artifact, tokenizer: TokenizerInfo, query: str, k: int) -> list[int]:
    return Prompt().ids(tokenizer, artifact.registry, artifact.contract, query, k)


def constrained(path: Path, k: int, **sampling: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 64, **sampling}, extra_args=request_args(path, k))


def generate(llm: Any, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Any]:
    return list(llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False))


def test_greedy_answers_equal_the_engines(llm: Any, paths: dict[str, Path], catalog_artifact: Artifact,
                                          smollm: TokenizerInfo) -> None:
    requests = [(query, k) for k in (1, 2, 3) for query in QUERIES]
    ours = generate(llm, [prompt_ids(catalog_artifact, smollm, q, k) for q, k in requests],
                    [constrained(paths["catalog"], k) for _, k in requests])
    theirs = Engine(vllm_tiny_model(), smollm, catalog_artifact, max_batch=8).run([Request(q, k) for q, k in requests])
    eos = catalog_artifact.eos_id
    for (query, k), output, answer in zip(requests, ours, theirs, strict=True):
        assert answer_is_valid(catalog_artifact, output, k)
        assert answer_tokens(output, eos) == [t for t in answer.token_ids if t != eos], (query, k)
