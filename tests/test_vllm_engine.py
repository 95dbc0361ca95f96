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
from vllm.exceptions import VLLMValidationError  # noqa: E402
from vllm.sampling_params import StructuredOutputsParams  # noqa: E402

from tooltrie.compiler import Artifact, TokenizerInfo  # noqa: E402
from tooltrie.compiler.ebnf import exactly_k_ebnf  # noqa: E402
from tooltrie.eval.datasets import load_split  # noqa: E402
from tooltrie.integrations.vllm import TrieVllmProcessorV1, request_args  # noqa: E402
from tooltrie.kernels import TrieMatcher  # noqa: E402
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


def catalog_prompts(artifact: Artifact, tokenizer: TokenizerInfo, n: int, k: int) -> list[list[int]]:
    return [prompt_ids(artifact, tokenizer, QUERIES[i % len(QUERIES)] + f" ({i})", k) for i in range(n)]


def test_one_batch_mixing_artifacts_grammars_and_plain_requests(llm: Any, paths: dict[str, Path],
                                                                catalog_artifact: Artifact,
                                                                smollm: TokenizerInfo) -> None:
    from support.serve import small_artifact

    small = small_artifact(smollm)
    n = 288  # more than MAX_NUM_SEQS: requests wait, join and leave rows as others finish
    prompts = catalog_prompts(catalog_artifact, smollm, n, 2)
    grammar = StructuredOutputsParams(grammar=exactly_k_ebnf(catalog_artifact.registry.names, 2,
                                                              catalog_artifact.contract))
    kinds = ["catalog", "small", "grammar", "plain"]
    params = [constrained(paths["catalog"], 2) if kinds[i % 4] == "catalog"
              else constrained(paths["small"], 1 + i % 3) if kinds[i % 4] == "small"
              else SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=grammar)
              if kinds[i % 4] == "grammar"
              else SamplingParams(temperature=0.0, max_tokens=8) for i in range(n)]
    outputs = generate(llm, prompts, params)
    plain_alone = generate(llm, prompts[3::4], SamplingParams(temperature=0.0, max_tokens=8))
    names = set(catalog_artifact.registry.names)
    for i, output in enumerate(outputs):
        kind = kinds[i % 4]
        if kind == "catalog":
            assert answer_is_valid(catalog_artifact, output, 2), i
        elif kind == "small":
            assert answer_is_valid(small, output, 1 + i % 3), i
        elif kind == "grammar":  # vLLM's own grammar: k registry names (it cannot forbid repeats)
            tools = catalog_artifact.contract.parse(output.outputs[0].text)
            assert len(tools) == 2 and set(tools) <= names, (i, output.outputs[0].text)
    assert [list(o.outputs[0].token_ids) for o in outputs[3::4]] == [list(o.outputs[0].token_ids)
                                                                    for o in plain_alone]


def test_sampling_options_keep_every_answer_exactly_k_distinct_tools(llm: Any, paths: dict[str, Path],
                                                                     catalog_artifact: Artifact,
                                                                     smollm: TokenizerInfo) -> None:
    start = set(TrieMatcher(catalog_artifact, 3).legal_tokens() or [])
    illegal = [*[t for t in range(200, 400) if t not in start][:20], catalog_artifact.eos_id]
    params = [constrained(paths["catalog"], 3, temperature=1.5, top_p=0.9, top_k=40, repetition_penalty=1.3,
                          presence_penalty=0.5, frequency_penalty=0.5, logprobs=3, seed=i,
                          logit_bias={token: 50.0 for token in illegal}) for i in range(32)]
    outputs = generate(llm, catalog_prompts(catalog_artifact, smollm, 32, 3), params)
    assert all(answer_is_valid(catalog_artifact, output, 3) for output in outputs)
    assert all(output.outputs[0].logprobs for output in outputs)
    assert len({tuple(output.outputs[0].token_ids) for output in outputs}) > 1  # it did sample


def test_malformed_arguments_are_refused_and_the_engine_lives_on(llm: Any, paths: dict[str, Path],
                                                                catalog_artifact: Artifact,
                                                                smollm: TokenizerInfo) -> None:
    prompt = catalog_prompts(catalog_artifact, smollm, 1, 2)
    before = generate(llm, prompt, constrained(paths["catalog"], 2))
    name = request_args(paths["catalog"], 2, flat=True)["tooltrie_artifact"]  # the file's name in the root
    for extra, message in [({"tooltrie_artifact": name, "tooltrie_k": 0}, "k=0 is outside"),
                           ({"tooltrie": {"artifact": name}}, "must be"),
                           ({"tooltrie_artifact": str(paths["catalog"]), "tooltrie_k": 1}, "unknown artifact name"),
                           ({"tooltrie_artifact": "/nonexistent.safetensors", "tooltrie_k": 1},
                            "unknown artifact name")]:
        with pytest.raises((ValueError, VLLMValidationError), match=message):
            generate(llm, prompt, SamplingParams(temperature=0.0, max_tokens=16, extra_args=extra))
    after = generate(llm, prompt, SamplingParams(temperature=0.0, max_tokens=64,
                                                 extra_args=request_args(paths["catalog"], 2, flat=True)))
    assert after[0].outputs[0].token_ids == before[0].outputs[0].token_ids


def test_requests_aborted_mid_answer_leave_the_others_and_the_rows_as_they_were(
        llm: Any, paths: dict[str, Path], catalog_artifact: Artifact, smollm: TokenizerInfo) -> None:
    prompts = catalog_prompts(catalog_artifact, smollm, 8, 3)
    expected = [list(o.outputs[0].token_ids) for o in generate(llm, prompts, constrained(paths["catalog"], 3))]
    engine_loop = llm.llm_engine
    for i, ids in enumerate(prompts):
        engine_loop.add_request(f"abort-{i}", {"prompt_token_ids": ids}, constrained(paths["catalog"], 3))
    finished: dict[str, list[int]] = {}
    for _ in range(3):
        finished |= {o.request_id: list(o.outputs[0].token_ids) for o in engine_loop.step() if o.finished}
    engine_loop.abort_request([f"abort-{i}" for i in range(0, 8, 2)])
    while engine_loop.has_unfinished_requests():
        finished |= {o.request_id: list(o.outputs[0].token_ids) for o in engine_loop.step() if o.finished}
    assert all(finished[f"abort-{i}"] == expected[i] for i in range(1, 8, 2))
    again = generate(llm, prompts, constrained(paths["catalog"], 3))  # into the rows the aborted ones left
    assert [list(o.outputs[0].token_ids) for o in again] == expected
