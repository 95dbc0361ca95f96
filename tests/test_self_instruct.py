"""Self-instruct requests: the model's continuations of the few-shot prompt, kept exactly when retrieval ranks their
tool among the top N and they do not name it; gen-data turns them into verified records; the Hugging Face sampler
writes one line per prompt, in batches, the same for a seed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.serve import tiny_model

from tooltrie.compiler import TokenizerInfo, compile_registry
from tooltrie.registry import BFCL_PATH, CATALOG_PATH, load_registry, make_registry
from tooltrie.train.self_instruct import SHOTS, hf_generate, prompt_for, written_requests
from tooltrie.train.training_data import generate_training_data

REGISTRY = make_registry([{"name": f"tool_{i}", "description": f"Does task {i}."} for i in range(6)], name="si")


@settings(max_examples=60, deadline=None)
@given(data=st.data(), keep_top=st.integers(1, 6), per_tool=st.integers(1, 2))
def test_kept_exactly_when_retrieval_ranks_the_tool_high_enough(data: st.DataObject, keep_top: int,
                                                               per_tool: int) -> None:
    n = len(REGISTRY) * per_tool
    texts = data.draw(st.lists(st.sampled_from(["Do it for 3 people.", "", "Tool: tool_1: ...", "use tool_2 now",
                                                "What about Paris?\nTool: next"]), min_size=n, max_size=n))
    scores = np.array(data.draw(st.lists(st.lists(st.integers(0, 3), min_size=6, max_size=6), min_size=n,
                                         max_size=n)), dtype=float)
    prompts: list[str] = []

    def generate(batch: list[str]) -> list[str]:
        prompts.extend(batch)
        return texts

    def similarities(queries: list[str]) -> np.ndarray:  # a row per candidate, in order
        rows = [i for i, text in enumerate(texts) if _usable(text, prompts[i])]
        assert queries == [texts[i].strip().split("\n")[0] for i in rows]
        return scores[rows]

    kept, total = written_requests(REGISTRY, generate, similarities, per_tool=per_tool, keep_top=keep_top, seed=1)
    assert total == n and len(prompts) == n
    tools = [prompt.rsplit("Tool: ", 1)[1].split(":", 1)[0] for prompt in prompts]
    expected = []
    for i, (text, tool) in enumerate(zip(texts, tools, strict=True)):
        line = text.strip().split("\n")[0]
        if not _usable(text, prompts[i]):
            continue
        tool_id = REGISTRY.index(tool)
        if sum(score > scores[i, tool_id] for score in scores[i]) < keep_top:  # ties rank with the tool
            expected.append((line, (tool,)))
    assert [(item.query, item.tools) for item in kept] == expected


def _usable(text: str, prompt: str) -> bool:
    line = text.strip().split("\n")[0]
    tool = prompt.rsplit("Tool: ", 1)[1].split(":", 1)[0]
    return bool(line) and not line.startswith("Tool:") and tool not in line


def test_the_prompt_ends_with_the_tool_and_the_shots_name_no_bundled_tool() -> None:
    prompt = prompt_for(REGISTRY.tools[2])
    assert prompt.endswith("Tool: tool_2: Does task 2.\nRequest:")
    assert prompt.count("Request:") == len(SHOTS) + 1
    bundled = {name for path in (CATALOG_PATH, BFCL_PATH) for name in load_registry(path).names}
    assert not {text.split(":", 1)[0] for text, _ in SHOTS} & bundled


def test_written_requests_become_verified_records(smollm: TokenizerInfo, tmp_path: Path) -> None:
    artifact = compile_registry(REGISTRY, smollm)
    kept, _ = written_requests(REGISTRY, lambda prompts: [f"Please handle case {i}." for i in range(len(prompts))],
                               lambda queries: np.eye(len(queries), len(REGISTRY)), keep_top=1)
    meta = generate_training_data(tmp_path / "out", artifact=artifact, tokenizer=smollm, queries=[], written=kept,
                                  descriptions=False)
    assert meta["counts"]["by_source"]["train"] == {"written": len(kept)}
    records = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert sorted((r["query"], r["tools"][0]) for r in records) == sorted((q.query, q.tools[0]) for q in kept)
    assert all(r["completion_ids"] == [*artifact.token_path(r["tools"]), artifact.eos_id] for r in records)


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    transformers = pytest.importorskip("transformers")
    from tooltrie.compiler.tokenizer_info import BUNDLED_TOKENIZERS_DIR

    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(BUNDLED_TOKENIZERS_DIR / "smollm2-135m" / "tokenizer.json"), eos_token="<|im_end|>")
    return tokenizer


def test_hf_generate_shares_the_prefix_and_batches_without_changing_answers(hf_tokenizer: Any) -> None:
    """Greedy, the shared prefix cache and the batches of one length give what a plain generate gives each prompt
    alone; sampled, the same seed writes the same lines, one line each."""
    model = tiny_model()
    registry = make_registry([{"name": f"t{i}", "description": "Does " + "a bit more " * i} for i in range(5)],
                             name="lengths")
    prompts = [prompt_for(tool) for tool in [*registry.tools, registry.tools[1], registry.tools[3]]]
    greedy = hf_generate(model, hf_tokenizer, batch_size=2, max_new_tokens=5, sample=False)(prompts)
    for prompt, text in zip(prompts, greedy, strict=True):
        ids = torch.tensor([hf_tokenizer.encode(prompt, add_special_tokens=False)])
        alone = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                               eos_token_id=[hf_tokenizer.eos_token_id, *hf_tokenizer.encode("\n")],
                               pad_token_id=hf_tokenizer.eos_token_id)
        assert text == hf_tokenizer.decode(alone[0, ids.shape[1]:], skip_special_tokens=True)
    sampled = hf_generate(model, hf_tokenizer, seed=3, batch_size=2, max_new_tokens=6)(prompts)
    assert sampled == hf_generate(model, hf_tokenizer, seed=3, batch_size=2, max_new_tokens=6)(prompts)
    assert all(text.count("\n") <= 1 and (not text.count("\n") or text.endswith("\n")) for text in sampled)
