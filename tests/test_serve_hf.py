"""The Hugging Face integration (tooltrie.integrations.hf.TrieLogitsProcessor) under ``model.generate``, with the tiny
random Llama that has SmolLM2's vocabulary: greedy ``generate`` under the processor gives the engine's answers token
for token, and the reference decoder's on the full head (see ``support.serve``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from support.serve import prompt_ids, reference_trace, small_artifact, tiny_model
from transformers import LogitsProcessorList

from tooltrie.compiler import Artifact, TokenizerInfo
from tooltrie.errors import DecodeError
from tooltrie.integrations.hf import TrieLogitsProcessor
from tooltrie.kernels import TrieMatcher
from tooltrie.kernels.rules import Slot, legal_moves
from tooltrie.serve.engine import Engine

QUERIES = ("What is the weather in Paris?", "stock price of ACME",
           "Find me a cheap flight from Boston to Denver next Tuesday, and also check the exchange rate for euros")
MAX_NEW_TOKENS = 40  # longer than any answer here, so every answer ends with the stop token


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model()


@pytest.fixture(scope="module")
def engines(model: Any, smollm: TokenizerInfo, catalog_artifact: Artifact) -> dict[str, Engine]:
    return {"small": Engine(model, smollm, small_artifact(smollm)), "catalog": Engine(model, smollm, catalog_artifact)}


def generate(model: Any, artifact: Artifact, prompts: Sequence[Sequence[int]], processor: TrieLogitsProcessor,
             ) -> list[list[int]]:
    """Greedy ``generate`` under ``processor``, prompts left-padded (with the stop token, masked out); the tokens
    after the prompt, per row."""
    width = max(len(p) for p in prompts)
    pad = artifact.eos_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=attention_mask,
                             logits_processor=LogitsProcessorList([processor]), do_sample=False,
                             max_new_tokens=MAX_NEW_TOKENS, eos_token_id=artifact.eos_id, pad_token_id=pad)
    return [row[width:].tolist() for row in out]


def until_stop(tokens: list[int], eos: int) -> list[int]:
    assert eos in tokens, f"no stop token in {tokens}"
    return tokens[: tokens.index(eos) + 1]


@pytest.mark.parametrize(("registry", "k", "query"), [
    *[("small", k, query) for k in (1, 2, 3) for query in QUERIES[:2]],
    ("small", 3, QUERIES[2]),
    ("catalog", 1, QUERIES[0]),
    ("catalog", 3, QUERIES[2]),
], ids=lambda value: value[:12] if isinstance(value, str) else str(value))
def test_generate_equals_the_engine_and_the_reference_decoder(engines: dict[str, Engine], model: Any, registry: str,
                                                              k: int, query: str) -> None:
    engine = engines[registry]
    artifact = engine.artifact
    prompt = prompt_ids(engine, query, k)
    (tokens,) = generate(model, artifact, [prompt], TrieLogitsProcessor(artifact, k))
    answer = engine.answer(query, k)
    assert tokens == answer.token_ids
    trace = reference_trace(model, artifact, prompt, tokens, k)
    assert trace.min_margin > 1e-4, "near-tie in the fixture: choose another query"
    assert trace.tokens == tokens and trace.done
    names = artifact.contract.parse(engine.tokenizer.decode(tokens[:-1]))
    assert len(names) == k == len(set(names)) and set(names) <= set(artifact.registry.names)


@pytest.mark.parametrize("registry", ["small", "catalog"])
def test_a_left_padded_batch_of_two_gives_each_prompt_its_answer(engines: dict[str, Engine], model: Any,
                                                                 registry: str) -> None:
    engine = engines[registry]
    artifact, k = engine.artifact, 2
    queries = ("hi", QUERIES[2])  # prompts of different lengths: the first row is padded
    prompts = [prompt_ids(engine, query, k) for query in queries]
    assert len(prompts[0]) < len(prompts[1])
    rows = generate(model, artifact, prompts, TrieLogitsProcessor(artifact, k))
    for query, row in zip(queries, rows, strict=True):
        answer = until_stop(row, artifact.eos_id)
        assert set(row[len(answer):]) <= {artifact.eos_id}  # finished rows are padded
        names = artifact.contract.parse(engine.tokenizer.decode(answer[:-1]))
        assert len(names) == k == len(set(names)) and set(names) <= set(artifact.registry.names)
        assert answer == [*artifact.token_path(names), artifact.eos_id]
        assert answer == engine.answer(query, k).token_ids, query


def test_the_processor_masks_every_illegal_token(smollm: TokenizerInfo) -> None:
    artifact = small_artifact(smollm)
    processor = TrieLogitsProcessor(artifact, 2)
    scores = torch.randn(2, 49_152, generator=torch.Generator().manual_seed(0))
    masked = processor(torch.tensor([[1, 2, 3], [4, 5, 6]]), scores.clone())
    legal = sorted(legal_moves(artifact.trie, Slot.start(artifact.trie, 2), artifact.eos_id))
    for row in range(2):
        finite = torch.isfinite(masked[row]).nonzero().flatten().tolist()
        assert finite == legal
        assert torch.equal(masked[row, legal], scores[row, legal])
        assert bool((masked[row] == float("-inf")).sum() == 49_152 - len(legal))


def test_tools_names_the_tools_of_the_answer(engines: dict[str, Engine], model: Any) -> None:
    engine = engines["small"]
    artifact = engine.artifact
    for k in (1, 3):
        processor = TrieLogitsProcessor(artifact, k)
        prompt = prompt_ids(engine, QUERIES[0], k)
        (tokens,) = generate(model, artifact, [prompt], processor)
        expected = [artifact.contract.parse(engine.tokenizer.decode(until_stop(tokens, artifact.eos_id)[:-1]))]
        assert processor.tools(torch.tensor([prompt + tokens])) == expected, k


def test_reset_readies_the_processor_for_the_next_generate(engines: dict[str, Engine], model: Any) -> None:
    engine = engines["small"]
    artifact, k = engine.artifact, 2
    processor = TrieLogitsProcessor(artifact, k)
    generate(model, artifact, [prompt_ids(engine, QUERIES[0], k)], processor)
    processor.reset()
    (tokens,) = generate(model, artifact, [prompt_ids(engine, QUERIES[1], k)], processor)
    assert tokens == engine.answer(QUERIES[1], k).token_ids


def test_a_processor_reused_without_reset_fails_loudly_or_answers_right(engines: dict[str, Engine], model: Any) -> None:
    engine = engines["small"]
    artifact, k = engine.artifact, 3
    processor = TrieLogitsProcessor(artifact, k)
    generate(model, artifact, [prompt_ids(engine, QUERIES[1], k)], processor)
    with contextlib.suppress(DecodeError):  # refusing is fine; a wrong answer is not
        (tokens,) = generate(model, artifact, [prompt_ids(engine, QUERIES[2], k)], processor)
        assert tokens == engine.answer(QUERIES[2], k).token_ids


@pytest.mark.parametrize("bad_k", [0, 8])
def test_k_outside_one_to_n_tools_is_refused(engines: dict[str, Engine], model: Any, bad_k: int) -> None:
    engine = engines["small"]
    with pytest.raises(DecodeError, match=f"k={bad_k}"):
        generate(model, engine.artifact, [prompt_ids(engine, "hi", 1)], TrieLogitsProcessor(engine.artifact, bad_k))


@pytest.mark.parametrize("search", [{"num_beams": 3, "num_return_sequences": 3}, {"prompt_lookup_num_tokens": 3}],
                         ids=["beam-search", "assisted"])
def test_beams_and_drafts_are_replayed_into_exactly_k_tools(engines: dict[str, Engine], model: Any,
                                                            search: dict[str, int]) -> None:
    """Beam search reorders rows between calls and assisted decoding rolls drafted tokens back: each row is
    replayed from its prompt, and every returned sequence is k distinct tools the trie accepts."""
    engine = engines["small"]
    artifact = engine.artifact
    for query in QUERIES:
        for k in (2, 3):
            prompt = prompt_ids(engine, query, k)
            processor = TrieLogitsProcessor(artifact, k)
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt]), logits_processor=LogitsProcessorList([processor]),
                                     do_sample=False, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=artifact.eos_id,
                                     pad_token_id=artifact.eos_id, **search)
            for row in out:
                answer = until_stop(row[len(prompt):].tolist(), artifact.eos_id)
                matcher = TrieMatcher(artifact, k)
                assert all(matcher.accept_token(t) for t in answer) and matcher.is_terminated(), (query, k, answer)
