"""The decoding engine (tooltrie.serve.engine) with a real model: the tiny random Llama that has SmolLM2's vocabulary,
the bundled SmolLM2 tokenizer, the 47-tool catalog and a small registry whose names are token-prefixes of each other.

Everything is checked against oracles that share none of the engine's shortcuts (``support.serve``): the model's
full forward pass over the whole prompt, with the full head, and the NumPy reference decoder or a plain argmax.
Every decision the tiny model makes in these fixtures leads its runner-up by far more than float32 rounding
(asserted, so a near-tie would show up as such rather than as a disagreement).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from support.serve import (
    SMALL_NAMES,
    Trace,
    greedy_check,
    greedy_decode,
    prompt_ids,
    reference_decode,
    reference_trace,
    small_artifact,
    tiny_model,
    whole_prompt_ids,
)
from torch.overrides import TorchFunctionMode

from tooltrie.compiler import Artifact, TokenizerInfo, compile_registry
from tooltrie.errors import ArtifactMismatchError, DecodeError
from tooltrie.registry import make_registry
from tooltrie.serve.engine import Answer, Engine, Request

QUERIES = {
    "catalog": (
        "What's the weather like in Paris tomorrow?",
        "hi",
        "Find me a cheap flight from Boston to Denver next Tuesday, convert 300 dollars to euros, and book a hotel "
        "near the airport for two nights",
    ),
    "small": (
        "What is the weather in Paris?",
        "hi",
        "stock price of ACME",
        "Find me a cheap flight from Boston to Denver next Tuesday, and also check the exchange rate for euros",
    ),
}
KS = (1, 2, 3)
NEAR_TIE = 1e-4  # a decision this close would be decided by float rounding; the fixtures must stay clear of it


@dataclass
class Setup:
    engine: Engine
    artifact: Artifact
    answers: dict[tuple[str, int], Answer]  # (query, k) -> the engine's answer, one request at a time
    traces: dict[tuple[str, int], Trace]

    def answer(self, query: str, k: int) -> Answer:
        if (query, k) not in self.answers:
            self.answers[query, k] = self.engine.run([Request(query, k)])[0]
        return self.answers[query, k]

    def trace(self, query: str, k: int) -> Trace:
        """The reference decoder along the engine's answer, on the full head, from the whole prompt (no cache)."""
        if (query, k) not in self.traces:
            self.traces[query, k] = reference_trace(self.engine.model, self.artifact,
                                                    prompt_ids(self.engine, query, k), self.answer(query, k).token_ids,
                                                    k)
        return self.traces[query, k]


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model()


@pytest.fixture(scope="module")
def setups(model: Any, smollm: TokenizerInfo, catalog_artifact: Artifact) -> dict[str, Setup]:
    artifacts = {"catalog": catalog_artifact, "small": small_artifact(smollm)}
    return {name: Setup(Engine(model, smollm, artifact), artifact, {}, {}) for name, artifact in artifacts.items()}


def _cases(registry: str) -> Iterator[tuple[str, int]]:
    for query in QUERIES[registry]:
        for k in KS:
            yield query, k


@contextmanager
def _count_calls(module: torch.nn.Module) -> Iterator[list[int]]:
    calls = [0]

    def hook(*_: Any) -> None:
        calls[0] += 1

    handle = module.register_forward_hook(hook)
    try:
        yield calls
    finally:
        handle.remove()


def _final_norm(engine: Engine) -> torch.nn.Module:
    """The decoder's last module: called once per forward pass over the batch (computing a prefix never reaches
    it: only keys and values are kept)."""
    return engine.model.get_decoder().norm  # type: ignore[no-any-return]


# --- valid answers ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("registry", ["catalog", "small"])
def test_every_answer_is_k_distinct_registry_tools_in_canonical_tokens(setups: dict[str, Setup], registry: str,
                                                                       smollm: TokenizerInfo) -> None:
    setup = setups[registry]
    artifact = setup.artifact
    for query, k in _cases(registry):
        answer = setup.answer(query, k)
        names = [tool.name for tool in answer.tools]
        assert answer.finish_reason == "stop", (query, k)
        assert len(names) == k == len(set(names)), (query, k, names)
        assert set(names) <= set(artifact.registry.names)
        assert [tool.rank for tool in answer.tools] == list(range(1, k + 1))
        assert [tool.pointer for tool in answer.tools] == [
            artifact.registry.tools[artifact.registry.index(name)].pointer for name in names]
        assert artifact.contract.parse(answer.text) == names
        assert answer.token_ids == [*smollm.encode(artifact.contract.render(names)), smollm.eos_id]
        assert answer.token_ids == [*artifact.token_path(names), artifact.eos_id]
        assert answer.prompt_tokens == len(prompt_ids(setup.engine, query, k))
        assert answer.latency_ms >= 0


def test_the_small_registry_exercises_stop_hop_and_forced_decisions(setups: dict[str, Setup]) -> None:
    """The small registry is there for the decisions the catalog rarely meets; make sure the answers meet them."""
    setup = setups["small"]
    eos = setup.artifact.eos_id
    traces = [setup.trace(query, k) for query, k in _cases("small")]
    decisions = [d for trace in traces for d in trace.decisions]
    assert any(eos in d.legal and d.chosen == eos for d in decisions), "no stop chosen over a longer name"
    assert any(eos in d.legal and d.chosen != eos for d in decisions), "no longer name chosen over the stop"
    assert any(d.kind == "hop" for d in decisions), "no hop chosen over a longer name"
    assert sum(trace.forced for trace in traces) > 0, "no forced token"


# --- the reference decoder on the full head -------------------------------------------------------------------------


@pytest.mark.parametrize("registry", ["catalog", "small"])
def test_engine_tokens_equal_the_reference_decoder_on_full_logits(setups: dict[str, Setup], registry: str) -> None:
    setup = setups[registry]
    for query, k in _cases(registry):
        answer, trace = setup.answer(query, k), setup.trace(query, k)
        assert trace.min_margin > NEAR_TIE, f"near-tie in the fixture ({query!r}, k={k}): choose another query"
        assert trace.tokens == answer.token_ids and trace.done, (query, k, trace.tokens, answer.token_ids)


@pytest.mark.parametrize("k", KS)
def test_engine_equals_the_step_by_step_reference_loop(setups: dict[str, Setup], model: Any, k: int) -> None:
    """The literal loop: one full forward pass over the whole prompt per token, one reference step per token."""
    setup = setups["small"]
    for query in QUERIES["small"][:2]:
        expected = reference_decode(model, setup.artifact, prompt_ids(setup.engine, query, k), k)
        assert setup.answer(query, k).token_ids == expected, (query, k)


@pytest.mark.parametrize("registry", ["catalog", "small"])
def test_sparse_head_choice_equals_full_head_masked_argmax(setups: dict[str, Setup], registry: str) -> None:
    """At every decision: the legal rows of the head times the hidden state (float64) pick what the full head's
    logits masked to the legal tokens pick, and that is the engine's token."""
    setup = setups[registry]
    head = setup.engine.model.get_output_embeddings().weight.detach()
    checked = 0
    for query, k in _cases(registry):
        answer, trace = setup.answer(query, k), setup.trace(query, k)
        for decision in trace.decisions:
            sparse = head[decision.legal].double() @ decision.hidden.double()
            sparse_choice = decision.legal[int(torch.argmax(sparse))]
            full = torch.full((head.shape[0],), -math.inf)
            full[decision.legal] = torch.from_numpy(decision.legal_logits)
            full_choice = int(torch.argmax(full))
            assert sparse_choice == full_choice == answer.token_ids[decision.position], (query, k, decision.position)
            assert torch.allclose(sparse.float(), torch.from_numpy(decision.legal_logits), atol=1e-4)
            checked += 1
    assert checked > 0


class _VocabSizedResults(TorchFunctionMode):
    """Records every torch operation whose result spans the vocabulary: the full head, however it is computed
    (the output layer's module, ``head @ hidden``, a gather of every row)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size, self.seen = vocab_size, list[str]()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        for tensor in result if isinstance(result, (tuple, list)) else [result]:
            if isinstance(tensor, torch.Tensor) and self.vocab_size in tensor.shape:
                self.seen.append(getattr(func, "__name__", str(func)))
        return result


def test_the_engine_never_computes_the_full_head(setups: dict[str, Setup]) -> None:
    setup = setups["catalog"]
    vocab_size = setup.engine.head.shape[0]
    with _VocabSizedResults(vocab_size) as full_head, _count_calls(_final_norm(setup.engine)) as decoder_calls:
        answers = setup.engine.run([Request("Which stock went up today?", 2), Request("news about Mars", 3)])
    assert full_head.seen == []
    assert decoder_calls[0] > 0
    assert all(answer.finish_reason == "stop" for answer in answers)
    with _VocabSizedResults(vocab_size) as full_head:  # the watch itself: a plain request takes the full head
        setup.engine.run([Request("hi", 1, constrained=False, max_new_tokens=2)])
    assert full_head.seen


def test_the_engine_never_walks_the_readable_rules(setups: dict[str, Setup], monkeypatch: pytest.MonkeyPatch) -> None:
    """The oracle (``kernels/rules.py``, ``BatchState.slot``) is for tests: the engine's decisions, forced runs and
    speculated runs come from the compiled batch state. The trap catches the reference backend."""
    from tooltrie.kernels import reference, rules, state

    def trap(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the readable rules were called on the engine's path")

    for module in (rules, reference):
        for name in ("legal_moves", "advance", "runs_to_next_choice"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, trap)
    monkeypatch.setattr(state.BatchState, "slot", trap)
    setup = setups["small"]
    requests = [Request("What is the weather in Paris?", 3), Request("hi", 1, allow=("get", "get_users"))]
    assert all(answer.finish_reason == "stop" for answer in setup.engine.run(requests))
    oracle = Engine(setup.engine.model, setup.engine.tokenizer, setup.artifact, backend="reference")
    with pytest.raises(AssertionError, match="readable rules"):
        oracle.run(requests)


# --- forced chains -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("registry", ["catalog", "small"])
def test_forced_chains_one_forward_pass_per_decision_not_speculated(setups: dict[str, Setup], registry: str) -> None:
    setup = setups[registry]
    forced_somewhere = False
    for query, k in _cases(registry):
        answer, trace = setup.answer(query, k), setup.trace(query, k)
        assert answer.decision_points == len(trace.decisions), (query, k)
        assert answer.forward_passes + answer.speculated == answer.decision_points, (query, k)
        assert len(answer.token_ids) == len(trace.decisions) + trace.forced
        if trace.forced:
            forced_somewhere = True
            assert answer.forward_passes < len(answer.token_ids), (query, k)
        if registry == "catalog":  # every catalog name is several tokens: most of each answer is forced
            assert trace.forced >= k, (query, k)
    assert forced_somewhere


def test_every_tool_at_once_ends_with_a_forced_tool(setups: dict[str, Setup]) -> None:
    """k = number of tools: the last tool is the one left, spelled and stopped without asking the model."""
    setup = setups["small"]
    k = len(SMALL_NAMES)
    query = QUERIES["small"][0]
    answer, trace = setup.answer(query, k), setup.trace(query, k)
    assert sorted(t.name for t in answer.tools) == sorted(SMALL_NAMES)
    assert answer.token_ids == [*setup.artifact.token_path([t.name for t in answer.tools]), setup.artifact.eos_id]
    assert trace.tokens == answer.token_ids and trace.done
    # Once one tool is left, nothing is decided: its name and the stop token are forced.
    last_decision = max(d.position for d in trace.decisions)
    assert len(answer.token_ids) - last_decision - 1 >= 2
    assert answer.forward_passes + answer.speculated == answer.decision_points == len(trace.decisions)
    assert answer.forward_passes < len(answer.token_ids)


def test_forward_passes_counts_the_model_calls(setups: dict[str, Setup]) -> None:
    """``forward_passes`` is what the decoder was actually asked for (the prefix is computed once)."""
    setup = setups["small"]
    setup.engine.run([Request("warm the prefix cache", 3)])
    with _count_calls(_final_norm(setup.engine)) as calls:
        answer = setup.engine.run([Request("get every user", 3)])[0]
    assert calls[0] == answer.forward_passes < len(answer.token_ids)


@pytest.fixture(scope="module")
def one_tool(model: Any, smollm: TokenizerInfo) -> tuple[Engine, Answer]:
    """A registry of one tool: with k=1 the whole answer is forced."""
    artifact = compile_registry(make_registry([{"name": "weather_lookup"}], name="one"), smollm)
    engine = Engine(model, smollm, artifact)
    return engine, engine.answer("Is it going to rain?", 1)


def test_a_wholly_forced_answer_needs_no_decision(one_tool: tuple[Engine, Answer], smollm: TokenizerInfo) -> None:
    _, answer = one_tool
    assert answer.finish_reason == "stop"
    assert [tool.name for tool in answer.tools] == ["weather_lookup"]
    assert answer.token_ids == [*smollm.encode("weather_lookup"), smollm.eos_id]
    assert answer.decision_points == 0
    assert answer.tools[0].score == 0.0  # probability one under the constraint
    assert answer.tools[0].margin == math.inf


def test_a_wholly_forced_answer_needs_no_forward_pass(one_tool: tuple[Engine, Answer]) -> None:
    _, answer = one_tool
    assert answer.forward_passes == answer.decision_points == 0


# --- speculated runs -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def unspeculated(setups: dict[str, Setup], model: Any, smollm: TokenizerInfo) -> dict[str, Engine]:
    return {name: Engine(model, smollm, setup.artifact, speculate=0) for name, setup in setups.items()}


# Catalog names that share a first token with another (Research|Finder, Trip|AdviceTool, ...): limited to them, every
# answer's first choice leads to a second one inside the name, which the prompt's pass speculates.
SHARED_STARTS = ("ResearchFinder", "ResearchHelper", "TripTool", "TripAdviceTool", "ProductSearch",
                 "ProductComparison", "MediaTool", "MediaModifyTool", "HouseRentingTool", "HousePurchasingTool")


@pytest.fixture(scope="module")
def every_pass(setups: dict[str, Setup], model: Any, smollm: TokenizerInfo) -> dict[str, Engine]:
    """Engines that speculate on every pass, as they do in half precision (this float32 model's engines speculate
    on the prompt's pass only)."""
    engines = {name: Engine(model, smollm, setup.artifact) for name, setup in setups.items()}
    for engine in engines.values():
        engine._runs_every_pass = True
    return engines


@pytest.mark.parametrize("passes", ["prompt", "every"])
@pytest.mark.parametrize("registry", ["catalog", "small"])
def test_speculated_runs_save_passes_and_change_nothing_else(setups: dict[str, Setup], every_pass: dict[str, Engine],
                                                             unspeculated: dict[str, Engine], registry: str,
                                                             passes: str) -> None:
    engine, saved = setups[registry].engine if passes == "prompt" else every_pass[registry], 0
    requests = [Request(query, k) for query, k in _cases(registry)]
    if registry == "catalog":
        requests += [Request(query, k, allow=SHARED_STARTS) for query, k in _cases(registry)]
    for request in requests:
        query, k = request.query, request.k
        got, plain = engine.run([request])[0], unspeculated[registry].run([request])[0]
        assert got.token_ids == plain.token_ids, (query, k)
        assert [t.score for t in got.tools] == pytest.approx([t.score for t in plain.tools], abs=1e-4)
        assert [t.margin for t in got.tools] == pytest.approx([t.margin for t in plain.tools], abs=1e-4)
        assert plain.speculated == 0 and plain.forward_passes == plain.decision_points, (query, k)
        assert got.decision_points == plain.decision_points == got.forward_passes + got.speculated, (query, k)
        saved += got.speculated
    assert saved > 0 or registry == "small", "no speculated run was taken: the test shows nothing"


def test_a_catalog_answer_of_one_tool_is_one_pass(setups: dict[str, Setup]) -> None:
    """Every run to a second choice inside a catalog name fits the default budget: one pass decides a name."""
    for query in QUERIES["catalog"]:
        for allow in (None, SHARED_STARTS):
            answer = setups["catalog"].engine.run([Request(query, 1, allow=allow)])[0]
            assert answer.forward_passes == 1, (query, allow)
            assert answer.speculated == (1 if allow else answer.decision_points - 1), (query, allow)


def test_speculated_runs_in_a_batch_equal_alone(setups: dict[str, Setup], unspeculated: dict[str, Engine]) -> None:
    engine = setups["catalog"].engine
    requests = [Request(q, k) for q in QUERIES["catalog"] for k in KS]
    together = engine.run(requests)
    for request, got in zip(requests, together, strict=True):
        alone = unspeculated["catalog"].answer(request.query, request.k)
        assert got.token_ids == alone.token_ids, request
        assert got.forward_passes + got.speculated == alone.forward_passes, request


def test_a_negative_speculation_budget_is_refused(model: Any, smollm: TokenizerInfo,
                                                  catalog_artifact: Artifact) -> None:
    with pytest.raises(ValueError, match="speculate must be at least 0, got -1"):
        Engine(model, smollm, catalog_artifact, speculate=-1)


# --- the prefix cache ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("registry", ["catalog", "small"])
def test_prefix_cache_reused_or_fresh_gives_the_same_answer(setups: dict[str, Setup], registry: str, model: Any,
                                                            smollm: TokenizerInfo) -> None:
    """The shared engine's prefix caches have served every other request of this module; a fresh engine per
    request computes its prefix just for it. Same tokens, same scores."""
    setup = setups[registry]
    for query, k in [(QUERIES[registry][0], 3), (QUERIES[registry][-1], 2), (QUERIES[registry][1], 1)]:
        shared = setup.answer(query, k)
        again = setup.engine.answer(query, k)
        fresh = Engine(model, smollm, setup.artifact).answer(query, k)
        for other in (again, fresh):
            assert other.token_ids == shared.token_ids, (query, k)
            assert [t.name for t in other.tools] == [t.name for t in shared.tools]
            assert [t.score for t in other.tools] == pytest.approx([t.score for t in shared.tools], rel=1e-9)
            assert (other.forward_passes, other.decision_points, other.prompt_tokens) == (
                shared.forward_passes, shared.decision_points, shared.prompt_tokens)


@pytest.mark.parametrize("registry", ["catalog", "small"])
def test_the_split_prompt_is_the_whole_prompt(setups: dict[str, Setup], registry: str) -> None:
    """For these queries, tokenizing the prefix and the rest apart gives the whole prompt's tokens: the reference
    decoder's runs above (from the whole prompt, no cache) are the no-prefix-cache decode."""
    setup = setups[registry]
    for query, k in _cases(registry):
        assert prompt_ids(setup.engine, query, k) == whole_prompt_ids(setup.engine, query, k), (query, k)


def test_prefix_cache_does_not_change_a_query_starting_with_blank_lines(setups: dict[str, Setup], model: Any) -> None:
    setup = setups["small"]
    query = "\n\nlist my files"
    for k in KS:
        whole = whole_prompt_ids(setup.engine, query, k)
        answer = setup.engine.answer(query, k)
        assert answer.prompt_tokens == len(whole)
        assert answer.token_ids == reference_decode(model, setup.artifact, whole, k), k


# --- continuous batching -------------------------------------------------------------------------------------------


def _requests(registry: str) -> list[Request]:
    q = QUERIES[registry]
    return [Request(q[0], 1), Request(q[2], 3), Request(q[1], 2), Request(q[-1], 3), Request(q[1], 1),
            Request(q[0], 2), Request(q[2], 1)]


def _same(got: Answer, expected: Answer) -> None:
    assert got.token_ids == expected.token_ids
    assert got.finish_reason == expected.finish_reason
    assert [t.name for t in got.tools] == [t.name for t in expected.tools]
    assert [t.score for t in got.tools] == pytest.approx([t.score for t in expected.tools], abs=1e-4)
    assert (got.forward_passes, got.decision_points, got.prompt_tokens) == (
        expected.forward_passes, expected.decision_points, expected.prompt_tokens)


@pytest.mark.parametrize("max_batch", [1, 2, 16])
@pytest.mark.parametrize("registry", ["catalog", "small"])
def test_continuous_batching_equals_one_request_at_a_time(setups: dict[str, Setup], registry: str, max_batch: int,
                                                          model: Any, smollm: TokenizerInfo) -> None:
    setup = setups[registry]
    requests = _requests(registry)
    alone = [setup.answer(r.query, r.k) for r in requests]
    batched = Engine(model, smollm, setup.artifact, max_batch=max_batch).run(requests)
    assert len(batched) == len(requests)
    for request, got, expected in zip(requests, batched, alone, strict=True):
        assert got.token_ids == expected.token_ids, (request, max_batch)
        _same(got, expected)


def test_newcomers_join_the_running_batch_in_its_one_pass_per_step(model: Any, smollm: TokenizerInfo,
                                                                   catalog_artifact: Artifact) -> None:
    engine = Engine(model, smollm, catalog_artifact, max_batch=4)
    queries = QUERIES["catalog"]
    submitted = [engine.submit(Request(queries[0], 3))]
    finished: list[Request] = []
    passes = []
    with _count_calls(_final_norm(engine)) as calls:
        while engine.busy:
            before = calls[0]
            if len(submitted) < 6:  # one more arrives at every step while others are mid-answer
                submitted.append(engine.submit(Request(queries[len(submitted) % len(queries)],
                                                       1 + len(submitted) % 3)))
            finished += engine.step()
            passes.append(calls[0] - before)
    assert set(finished) == set(submitted) and len(finished) == len(submitted)
    assert all(request.answer is not None and request.answer.finish_reason == "stop" for request in finished)
    assert max(passes) == 1  # newcomers' prompts and the others' next tokens share the step's pass
    assert calls[0] == len(passes) - passes.count(0)


def test_an_empty_run_answers_nothing(setups: dict[str, Setup]) -> None:
    assert setups["small"].engine.run([]) == []


@pytest.mark.parametrize(("registry", "max_batch"), [("catalog", 16), ("small", 2)])
def test_unconstrained_rows_decode_plainly_without_disturbing_the_others(
        setups: dict[str, Setup], registry: str, max_batch: int, model: Any, smollm: TokenizerInfo) -> None:
    setup = setups[registry]
    q = QUERIES[registry]
    requests = [Request(q[0], 2), Request(q[1], 1, constrained=False, max_new_tokens=6), Request(q[2], 3),
                Request(q[-1], 1, constrained=False, max_new_tokens=3), Request(q[1], 1)]
    answers = Engine(model, smollm, setup.artifact, max_batch=max_batch).run(requests)
    for request, answer in zip(requests, answers, strict=True):
        if request.constrained:
            _same(answer, setup.answer(request.query, request.k))
            continue
        prompt = prompt_ids(setup.engine, request.query, request.k)
        assert answer.tools == []
        assert answer.prompt_tokens == len(prompt)
        argmax, margin = greedy_check(model, prompt, answer.token_ids)
        assert margin > NEAR_TIE
        assert argmax == answer.token_ids, request
        if answer.finish_reason == "length":
            assert len(answer.token_ids) == request.max_new_tokens
            assert smollm.eos_id not in answer.token_ids
        else:
            assert answer.finish_reason == "stop" and answer.token_ids[-1] == smollm.eos_id
    small_case = requests[3]  # the literal greedy loop too, on the shortest prompt
    assert answers[3].token_ids == greedy_decode(model, prompt_ids(setup.engine, small_case.query, 1),
                                                 small_case.max_new_tokens, smollm.eos_id)


def test_an_unconstrained_request_is_asked_for_its_own_k(setups: dict[str, Setup], model: Any) -> None:
    setup = setups["small"]
    query = QUERIES["small"][0]
    answer = setup.engine.run([Request(query, 3, constrained=False, max_new_tokens=4)])[0]
    prompt = prompt_ids(setup.engine, query, 3)
    assert answer.prompt_tokens == len(prompt)
    assert answer.token_ids == greedy_decode(model, prompt, 4, setup.artifact.eos_id)


# --- scores and the JSON response ----------------------------------------------------------------------------------


@pytest.mark.parametrize("registry", ["catalog", "small"])
def test_scores_are_constrained_log_probabilities(setups: dict[str, Setup], registry: str) -> None:
    setup = setups[registry]
    for query, k in _cases(registry):
        answer, trace = setup.answer(query, k), setup.trace(query, k)
        for tool in answer.tools:
            assert math.isfinite(tool.score) and tool.score <= 0, (query, k, tool)
            assert tool.margin >= 0, (query, k, tool)
        # However the decisions are shared out among the tools, they add up to the answer's log-probability under
        # the constraint, and the smallest margin is the smallest lead at any decision.
        assert sum(t.score for t in answer.tools) == pytest.approx(sum(d.logprob for d in trace.decisions), abs=1e-4)
        assert min(t.margin for t in answer.tools) == pytest.approx(trace.min_margin, abs=1e-4)


def test_each_tool_is_scored_with_the_decisions_that_choose_it(setups: dict[str, Setup]) -> None:
    """ToolChoice.score: 'log-probability of choosing this tool, under the constraint, given the ones before it'.
    With SmolLM2 every hop token is ',' (28): it ends the tool before it and says nothing about the next one."""
    setup = setups["small"]
    hops = 0
    for query, k in _cases("small"):
        answer, trace = setup.answer(query, k), setup.trace(query, k)
        hops += sum(d.kind == "hop" for d in trace.decisions)
        assert all(d.chosen == 28 for d in trace.decisions if d.kind == "hop")
        for rank, tool in enumerate(answer.tools):
            mine = [d for d in trace.decisions if d.tool == rank]
            assert tool.score == pytest.approx(sum(d.logprob for d in mine), abs=1e-4), (query, k, tool.name)
            assert tool.margin == pytest.approx(min((d.margin for d in mine), default=math.inf), abs=1e-4)
    assert hops > 0


def test_response_json(setups: dict[str, Setup]) -> None:
    setup = setups["catalog"]
    query = QUERIES["catalog"][2]
    answer = setup.answer(query, 3)
    body = answer.response()
    assert json.loads(json.dumps(body, allow_nan=False)) == body
    assert set(body) == {"tools", "finish_reason", "registry", "registry_sha256", "usage", "ranker", "latency_ms"}
    assert body["registry_sha256"] == setup.artifact.registry.sha256
    assert [tool["rank"] for tool in body["tools"]] == [1, 2, 3]
    for tool, choice in zip(body["tools"], answer.tools, strict=True):
        assert set(tool) == {"rank", "name", "pointer", "score", "chosen_by"} and tool["chosen_by"] == "decoded"
        assert tool["name"] == choice.name
        assert tool["pointer"] == f"catalog/{choice.name}"
        assert tool["score"] == round(choice.score, 4) <= 0
    assert body["finish_reason"] == "stop"
    assert body["registry"] == "catalog"
    assert body["usage"] == {"prompt_tokens": len(prompt_ids(setup.engine, query, 3)),
                             "completion_tokens": len(answer.token_ids), "forward_passes": answer.forward_passes,
                             "decision_points": answer.decision_points, "speculated": answer.speculated}
    assert body["usage"]["forward_passes"] < body["usage"]["completion_tokens"]
    assert isinstance(body["latency_ms"], float) and body["latency_ms"] >= 0


# --- refusals ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad_k", [0, -1, 48])
def test_k_outside_one_to_n_tools_is_refused_before_anything_runs(model: Any, smollm: TokenizerInfo,
                                                                  catalog_artifact: Artifact, bad_k: int) -> None:
    engine = Engine(model, smollm, catalog_artifact)
    with _count_calls(engine.model.get_decoder().embed_tokens) as calls, pytest.raises(DecodeError, match=f"k={bad_k}"):
        engine.run([Request("hi", 2), Request("hello", bad_k)])
    assert calls == [0]


def test_a_prompt_longer_than_the_model_reads_is_refused_before_any_pass(smollm: TokenizerInfo, bfcl: Any) -> None:
    """BFCL's 1,853 tools listed in the catalog prompt would take ~100,000 tokens: a clear error, not an attempt to
    allocate the attention of a prompt the model cannot read (the tiny model reads 2,048)."""
    from tooltrie.serve.prompt import Prompt

    model = tiny_model()
    engine = Engine(model, smollm, compile_registry(bfcl, smollm), prompt=Prompt.style("catalog"))
    with _count_calls(model.get_decoder().embed_tokens) as calls, pytest.raises(
            DecodeError, match=r"registry 'bfcl' takes [\d,]+ tokens and the model reads at most 2,048 \(it lists"):
        engine.run([Request("hi", 1)])
    assert calls == [0]


def test_artifact_for_another_tokenizer_is_refused(model: Any, smollm: TokenizerInfo, gpt2: TokenizerInfo) -> None:
    registry = make_registry([{"name": name} for name in SMALL_NAMES], name="small")
    for_gpt2 = compile_registry(registry, gpt2)
    with pytest.raises(ArtifactMismatchError, match="tokenizer"):
        Engine(model, smollm, for_gpt2)
    with pytest.raises(ArtifactMismatchError, match="tokenizer"):
        Engine(model, gpt2, small_artifact(smollm))


def test_a_model_head_too_small_for_the_grammar_is_refused(smollm: TokenizerInfo) -> None:
    from tooltrie.testing import tiny_llama

    artifact = small_artifact(smollm)
    with pytest.raises(ValueError, match="head has 1000 rows"):
        Engine(tiny_llama(tokenizer_vocab=1000), smollm, artifact)


@pytest.mark.parametrize("max_batch", [0, -1])
def test_max_batch_below_one_is_refused(model: Any, smollm: TokenizerInfo, max_batch: int) -> None:
    with pytest.raises(ValueError, match="max_batch"):
        Engine(model, smollm, small_artifact(smollm), max_batch=max_batch)

