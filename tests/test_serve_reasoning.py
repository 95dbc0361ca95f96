"""A reasoning model thinks freely (but never stops) until its end marker; the constraint starts after it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tooltrie.compiler import TokenizerInfo, compile_registry
from tooltrie.compiler.tokenizer_info import BUNDLED_TOKENIZERS_DIR
from tooltrie.errors import DecodeError
from tooltrie.registry import make_registry
from tooltrie.serve.engine import Engine, Request
from tooltrie.testing import tiny_llama

NAMES = ["get", "get_user", "search", "search_web", "a"]


@pytest.fixture(scope="module")
def thinking_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> TokenizerInfo:
    """The SmolLM2 tokenizer plus a ``</think>`` special token (id 49152)."""
    folder = tmp_path_factory.mktemp("thinking")
    spec = json.loads((BUNDLED_TOKENIZERS_DIR / "smollm2-135m" / "tokenizer.json").read_text(encoding="utf-8"))
    spec["added_tokens"].append({"id": 49152, "content": "</think>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    (folder / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        (folder / name).write_bytes((BUNDLED_TOKENIZERS_DIR / "smollm2-135m" / name).read_bytes())
    return TokenizerInfo.load(folder)


def _engine(tokenizer: TokenizerInfo) -> Engine:
    model = tiny_llama(tokenizer_vocab=49153, seed=1)
    artifact = compile_registry(make_registry([{"name": n} for n in NAMES], name="tools"), tokenizer)
    return Engine(model, tokenizer, artifact)


def test_marker_is_found(thinking_tokenizer: TokenizerInfo) -> None:
    assert thinking_tokenizer.reasoning_end_id == 49152


def test_answer_follows_the_marker(thinking_tokenizer: TokenizerInfo) -> None:
    engine = _engine(thinking_tokenizer)
    plain = engine.run([Request("find a user", 2)])[0]
    with torch.no_grad():  # now the marker wins the first thinking step by far
        engine.head[49152] = engine.head[49152] + 1e3 * torch.sign(plain_hidden_direction(engine, "find a user"))
    thought = engine.run([Request("find a user", 2, reasoning=True)])[0]
    assert thought.finish_reason == "stop"
    assert thought.token_ids[0] == 49152  # the marker, unconstrained output
    assert len({t.name for t in thought.tools}) == 2 and {t.name for t in thought.tools} <= set(NAMES)
    assert thought.text == ", ".join(t.name for t in thought.tools)
    assert plain.finish_reason == "stop"


def plain_hidden_direction(engine: Engine, query: str) -> torch.Tensor:
    """The last hidden state of the prompt, so a head row aligned with it scores highest there."""
    prefix, suffix = engine.prompt_parts(2)
    ids = engine.tokenizer.encode(prefix) + engine.tokenizer.encode(query + suffix)
    with torch.no_grad():
        return engine.model.get_decoder()(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]


def test_thinking_without_a_marker_runs_out_of_length(thinking_tokenizer: TokenizerInfo) -> None:
    engine = _engine(thinking_tokenizer)
    engine.reasoning_end_id = -1  # a marker the model can never emit
    answer = engine.run([Request("find a user", 2, reasoning=True, max_new_tokens=6)])[0]
    assert answer.finish_reason == "length" and answer.tools == []
    assert engine.artifact.eos_id not in answer.token_ids  # a constrained row never stops while thinking


def test_reasoning_needs_a_marker(tmp_path: Path) -> None:
    tokenizer = TokenizerInfo.load()
    artifact = compile_registry(make_registry([{"name": n} for n in NAMES], name="tools"), tokenizer)
    engine = Engine(tiny_llama(), tokenizer, artifact)
    with pytest.raises(DecodeError, match="no reasoning-end marker"):
        engine.run([Request("q", 1, reasoning=True)])


class FullHeadProducts(torch.overrides.TorchFunctionMode):
    """Counts matrix products with a full output layer (an operand with the vocabulary as a dimension)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.count = vocab, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if getattr(func, "__name__", "") in ("matmul", "__matmul__", "mm") and any(
                isinstance(a, torch.Tensor) and a.dim() == 2 and self.vocab in a.shape for a in args):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_thinking_and_plain_rows_take_one_full_head_product_a_step(thinking_tokenizer: TokenizerInfo) -> None:
    """Rows thinking and rows without a grammar are decided together, one product with the full head a step, and
    each answer is what it is decoded alone (batched = per row)."""
    engine = _engine(thinking_tokenizer)
    requests = [Request("find a user", 2, reasoning=True, max_new_tokens=5), Request("hi", 1, constrained=False,
                max_new_tokens=4), Request("search the web", 1), Request("get users", 2, reasoning=True,
                max_new_tokens=7), Request("anything", 1, constrained=False, max_new_tokens=6), Request("a b", 3)]
    alone = [_engine(thinking_tokenizer).run([request])[0] for request in requests]
    counter = FullHeadProducts(engine.head.shape[0])
    for request in requests:
        engine.submit(request)
    finished, steps = [], 0
    with counter:
        while engine.busy:
            finished += engine.step()
            steps += 1
    assert sorted(map(id, finished)) == sorted(map(id, requests))
    for request, single in zip(requests, alone, strict=True):
        got = request.answer
        assert got is not None
        assert (got.token_ids, got.finish_reason, [t.name for t in got.tools]) == (
            single.token_ids, single.finish_reason, [t.name for t in single.tools]), request
    assert 0 < counter.count <= steps, (counter.count, steps)
