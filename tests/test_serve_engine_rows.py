"""What an engine row holds and how long it may hold the batch: a long prompt is read ``prefill`` tokens a pass beside
the other rows' steps (the answers are those of one pass over the whole prompt), a cancelled row is never fed again,
and a row keeps no copy of its trie state (the batch state holds it). The tiny random Llama, SmolLM2's tokenizer."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from support.serve import small_artifact, tiny_model

from tooltrie.compiler import Artifact, TokenizerInfo
from tooltrie.serve import engine as engine_module
from tooltrie.serve.engine import Engine, Request

LONG_QUERY = "find every user and search the web for them " * 12  # ~110 tokens after the cached prefix
SHORT_QUERIES = ("get a user", "search the web", "a")


@contextmanager
def feeds_recorded(engine: Engine) -> Iterator[list[dict[int, int]]]:
    """Each forward pass's tokens fed per cache slot (speculated runs apart)."""
    passes: list[dict[int, int]] = []
    forward = engine.decoder.forward

    def recording(slots: list[int], feeds: list[list[int]], runs: Any = None) -> Any:
        passes.append({slot: len(feed) for slot, feed in zip(slots, feeds, strict=True)})
        return forward(slots, feeds, runs)

    engine.decoder.forward = recording  # type: ignore[method-assign]
    try:
        yield passes
    finally:
        del engine.decoder.forward


@pytest.fixture(scope="module")
def artifact(smollm: TokenizerInfo) -> Artifact:
    return small_artifact(smollm)


def test_a_long_prompt_is_read_in_chunks_beside_the_others(smollm: TokenizerInfo, artifact: Artifact) -> None:
    requests = [Request(LONG_QUERY, 2), *(Request(query, k) for query, k in zip(SHORT_QUERIES, (1, 2, 3),
                                                                              strict=True))]
    whole = Engine(tiny_model(), smollm, artifact, prefill=10_000).run(requests)
    chunked = Engine(tiny_model(), smollm, artifact, prefill=16)
    with feeds_recorded(chunked) as passes:
        answers = chunked.run(requests)
    for request, got, expected in zip(requests, answers, whole, strict=True):
        assert (got.token_ids, [t.name for t in got.tools], got.finish_reason) == (
            expected.token_ids, [t.name for t in expected.tools], expected.finish_reason), request
    assert max(n for fed in passes for n in fed.values()) <= 16  # no row fed more than a chunk in any pass
    assert answers[0].forward_passes > whole[0].forward_passes  # the long one took more passes, the others none
    assert all(a.forward_passes == b.forward_passes for a, b in zip(answers[1:], whole[1:], strict=True))
    assert Engine(tiny_model(), smollm, artifact).prefill == engine_module.PREFILL_TOKENS
    with pytest.raises(ValueError, match="prefill must be at least 1"):
        Engine(tiny_model(), smollm, artifact, prefill=0)


def test_a_cancelled_row_is_not_fed_again(smollm: TokenizerInfo, artifact: Artifact) -> None:
    engine = Engine(tiny_model(), smollm, artifact, prefill=8)
    with feeds_recorded(engine) as passes:
        long_ticket = engine.submit(Request(LONG_QUERY, 2))
        short_ticket = engine.submit(Request(SHORT_QUERIES[0], 1))
        engine.step()  # the long prompt's first chunk, the short one's whole prompt
        long_slot = next(slot for slot, n in passes[0].items() if n == 8)
        assert engine.cancel(long_ticket)
        answers: dict[int, Any] = {}
        while engine.busy:
            answers.update(engine.step())
    assert list(answers) == [short_ticket]
    assert all(long_slot not in fed for fed in passes[1:]), passes


def test_a_row_holds_no_copy_of_its_trie_state() -> None:
    """Status, thinking, node and tools are the batch state's; the row keeps what the engine owns."""
    fields = {field.name for field in dataclasses.fields(engine_module._Row)}
    assert not fields & {"thinking", "status", "finish_reason", "node", "depth", "used", "tools", "emitted"}, fields
