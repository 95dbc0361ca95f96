"""What an engine row holds and how long it may hold the batch: a long prompt is read ``prefill`` tokens a pass beside
the other rows' steps (the answers are those of one pass over the whole prompt), a cancelled row is never fed again,
and a row keeps no copy of its trie state (the batch state holds it). The tiny random Llama, SmolLM2's tokenizer."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from support.serve import small_artifact, tiny_model

from tooltrie.compiler import Artifact, TokenizerInfo
from tooltrie.kernels.rules import committed
from tooltrie.kernels.state import DONE, RUNNING
from tooltrie.ranker import Ranker
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
        long_request = engine.submit(Request(LONG_QUERY, 2))
        short_request = engine.submit(Request(SHORT_QUERIES[0], 1))
        engine.step()  # the long prompt's first chunk, the short one's whole prompt
        long_slot = next(slot for slot, n in passes[0].items() if n == 8)
        assert engine.cancel(long_request)
        finished: list[Request] = []
        while engine.busy:
            finished += engine.step()
    assert finished == [short_request]
    assert all(long_slot not in fed for fed in passes[1:]), passes


def test_a_row_holds_no_copy_of_its_trie_state() -> None:
    """Status, thinking, node and tools are the batch state's; the row keeps what the engine owns."""
    fields = {field.name for field in dataclasses.fields(engine_module._Row)}
    assert not fields & {"thinking", "status", "finish_reason", "node", "depth", "used", "tools", "emitted"}, fields


ALLOWED_NAMES = ("get", "get_user", "search_web", "a")


def test_a_rows_state_is_its_requests_all_along(smollm: TokenizerInfo, artifact: Artifact) -> None:
    """Before every pass, a request being decoded has, in its slot of the batch state, its k, status running, the
    tools it may name (``allow``), its prior (the model's weight, then each tool's weighted prior, following the tools
    the answer has committed to: ``rules.committed``) and the tools emitted so far, each time a prefix of its
    answer's; when it finishes, status done and its answer's tools; then the slot is free. The engine's own row
    holds the request, its prompt's length and the tokens taken so far (a prefix of the answer's), and the prior's
    weights. Each expected value is worked out here, not read from the
    engine: the allowed ids from the registry's names, the prior from a ranker of its own."""
    registry = artifact.registry
    query, k = "get the user, then search the web for a", 2
    engine = Engine(tiny_model(), smollm, artifact, ranker=Ranker(registry, prior="lexical"), prefill=4, speculate=0)
    prior = Ranker(registry, prior="lexical").row(query, "fused")
    assert prior.scores is not None and prior.scores.any()
    allowed = {registry.names.index(name) for name in ALLOWED_NAMES}
    prefix, suffix = engine.prompt_parts(k)
    prompt_tokens = len(smollm.encode_prompt(prefix, query, suffix))
    seen: list[dict[str, Any]] = []
    finished: list[dict[str, Any]] = []
    forward, finish = engine.decoder.forward, engine._finish

    def state_of(row: Any) -> dict[str, Any]:
        state = engine.batch.fetch()
        slot = row.cache_slot
        return {"slot": slot, "k": int(state.k[slot]), "status": int(state.status[slot]), "tools": state.tools(slot),
                "allowed": set(np.flatnonzero(state.allowed[slot]).tolist()) if len(state.allowed) else None,
                "ranker": state.ranker[slot].copy() if len(state.ranker) else None,
                "committed": committed(artifact.trie, state.slot(slot)),
                "request": row.request, "prompt_tokens": row.prompt_tokens, "token_ids": list(row.token_ids),
                "weights": dict(row.ranker)}

    def recording(slots: list[int], feeds: list[list[int]], runs: Any = None) -> Any:
        seen.extend(state_of(row) for row in engine._active)
        return forward(slots, feeds, runs)

    def finishing(row: Any) -> Any:
        finished.append(state_of(row))
        return finish(row)

    engine.decoder.forward = recording  # type: ignore[method-assign]
    engine._finish = finishing  # type: ignore[method-assign]
    request = Request(query, k, allow=ALLOWED_NAMES, ranker="fused")
    (answer,) = engine.run([request])
    answer_tools = [registry.names.index(tool.name) for tool in answer.tools]
    assert answer.finish_reason == "stop" and len(answer_tools) == k and set(answer_tools) <= allowed
    assert len(seen) >= 3, seen  # the prompt in chunks of 4, then a pass a decision
    for row in seen:
        assert row["request"] is request and row["slot"] == seen[0]["slot"]
        assert (row["k"], row["status"], row["allowed"]) == (k, RUNNING, allowed)
        assert row["ranker"] is not None and row["ranker"][0] == prior.model_weight
        assert prior.follow is not None
        np.testing.assert_array_equal(row["ranker"][1:], prior.follow(row["committed"]))
        assert row["tools"] == answer_tools[: len(row["tools"])]
        assert row["token_ids"] == answer.token_ids[: len(row["token_ids"])]
        assert row["prompt_tokens"] == prompt_tokens == answer.prompt_tokens
        assert row["weights"] == prior.weights.as_dict() == answer.ranker
    assert {len(row["tools"]) for row in seen} == {0, 1}  # seen before its first tool and between the two
    assert {len(row["committed"]) for row in seen} == {0, 1}  # the first tool's prior, then the second's
    (last,) = finished
    assert (last["status"], last["tools"], last["token_ids"]) == (DONE, answer_tools, answer.token_ids)
    state = engine.batch.fetch()
    assert int(state.status[last["slot"]]) == DONE and not int(state.constrained[last["slot"]])  # the slot is free
