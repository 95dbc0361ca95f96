"""The vLLM adapters against vLLM's real interface classes, on CPU (``make test-vllm`` runs them with vLLM 0.33's
CUDA wheel and with 0.32's CPU build; skipped without vLLM).

vLLM 0.33 cannot run here (its wheel is CUDA-only), but its logits-processor interfaces import on a CPU. These tests
drive the adapters the way each model runner does, with CPU tensors:

- V2 (``vllm.v1.worker.gpu.sample.logits_processor``): the real ``LogitsProcRequestState`` and ``LogitsContext``
  dataclasses around stand-in buffers (``.gpu`` / ``.np`` CPU tensors and arrays, where vLLM has UVA buffers),
  slots recycled, rows reordered every step, a request resumed after preemption;
- V1 (``vllm.v1.sample.logits_processor``): the real ``BatchUpdate`` with added, removed and moved (swapped) rows and
  vLLM's live output-token lists;
- both loaded through vLLM's own loaders (fully-qualified class names), their per-request arguments through real
  ``SamplingParams(extra_args=...)`` and vLLM's parameter validators;
- the ``vllm`` arms' requests (``SamplingParams``, ``StructuredOutputsParams(grammar=...)``) with a stand-in ``LLM``.

At every step each constrained row's mask must equal the readable oracle's for the same tokens (``TrieMatcher`` on the
reference backend; the batch rows themselves are checked against the engine in ``test_integrations_agree.py``), and
unconstrained rows must be untouched. vLLM's engine itself (scheduler, model runner, sampler, ``LLM.generate``,
``vllm serve``) is exercised by ``test_vllm_engine*.py`` with the CPU build.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm sets up an environment with it)")

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.sample.logits_processor import (
    BatchUpdate,
    MoveDirectionality,
    _load_logitsprocs_by_fqcns,
    validate_logits_processors_parameters,
)
from vllm.v1.worker.gpu.sample.logits_processor import (
    LogitsContext,
    LogitsProcRequestState,
    build_custom_logits_processors_params_validator,
)
from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs_by_fqcns

from tooltrie.compiler import Artifact, TokenizerInfo
from tooltrie.compiler.ebnf import exactly_k_ebnf
from tooltrie.eval.backends import EvalSetup
from tooltrie.eval.datasets import LabelledQuery
from tooltrie.eval.vllm_backend import VllmArm
from tooltrie.integrations.vllm import (
    TrieVllmProcessor,
    TrieVllmProcessorV1,
    processor_class,
    request_args,
)
from tooltrie.integrations.vllm_rows import publish_artifact
from tooltrie.kernels import TrieBatch, TrieMatcher
from tooltrie.ranker import PerAsk, Prior, Ranker, Weights
from tooltrie.serve.prompt import Prompt

MAX_REQS, MAX_LEN = 6, 96


def walk(artifact: Artifact, k: int, rng: random.Random) -> list[int]:
    """A random answer the trie allows (stop token included)."""
    matcher, tokens = TrieMatcher(artifact, k), []
    while not matcher.is_terminated():
        tokens.append(rng.choice(matcher.legal_tokens() or []))
        assert matcher.accept_token(tokens[-1])
    return tokens


def expected_allowed(artifact: Artifact, k: int, outputs: list[int]) -> list[int]:
    reference = TrieMatcher(artifact, k, backend="reference")
    for token in outputs:
        assert reference.accept_token(token)
    allowed = [artifact.eos_id] if reference.is_terminated() else reference.legal_tokens()
    assert allowed is not None
    return allowed


def finite(row: torch.Tensor) -> list[int]:
    return torch.isfinite(row).nonzero().flatten().tolist()


@pytest.fixture(scope="module")
def artifact_path(catalog_artifact: Artifact, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The catalog artifact's name in the processor's root ($TOOLTRIE_ARTIFACT_ROOT, conftest's)."""
    return publish_artifact(catalog_artifact.save(tmp_path_factory.mktemp("vllm") / "catalog.trie.safetensors"))


def params(path: str | None, k: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, extra_args=request_args(path, k) if path else None)


# --- loading and per-request arguments -----------------------------------------------------------------------------


def test_vllm_loads_both_adapters_by_qualified_name() -> None:
    assert _load_v2_logitsprocs_by_fqcns(["tooltrie.integrations.vllm:TrieVllmProcessor"]) == [
        TrieVllmProcessor]
    assert _load_logitsprocs_by_fqcns(["tooltrie.integrations.vllm:TrieVllmProcessorV1"]) == [
        TrieVllmProcessorV1]


def test_processor_class_follows_the_model_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms import current_platform

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)  # V1 on vLLM's CPU build: its only runner
    assert processor_class() is (TrieVllmProcessorV1 if current_platform.is_cpu() else TrieVllmProcessor)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert processor_class() is TrieVllmProcessor
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert processor_class() is TrieVllmProcessorV1


BAD_ARGS = [  # (extra_args, what vLLM's validator reports)
    ({"tooltrie": {"k": 1}}, "must be"),
    ({"tooltrie": {"artifact": "{path}", "k": "2"}}, "must be"),
    ({"tooltrie": {"artifact": "{path}", "k": 0}}, "k=0 is outside 1..47"),
    ({"tooltrie": {"artifact": "{path}", "k": 48}}, "k=48 is outside 1..47"),
    ({"tooltrie": {"artifact": "/nonexistent.safetensors", "k": 1}}, "unknown artifact name"),
]


@pytest.mark.parametrize(("extra", "message"), BAD_ARGS)
def test_bad_request_arguments_are_refused_by_vllms_validators(artifact_path: str, extra: dict[str, Any],
                                                                message: str) -> None:
    args = dict(extra["tooltrie"])
    if args.get("artifact") == "{path}":
        args["artifact"] = artifact_path
    bad = SamplingParams(extra_args={"tooltrie": args})
    validate_v2 = build_custom_logits_processors_params_validator([TrieVllmProcessor])
    with pytest.raises(VLLMValidationError, match=message):  # vLLM turns our ValueError into its own
        validate_v2(bad)
    with pytest.raises((ValueError, VLLMValidationError), match=message):
        validate_logits_processors_parameters([TrieVllmProcessorV1], bad)
    validate_v2(params(artifact_path, 3))  # good ones and plain ones pass
    validate_v2(SamplingParams())
    validate_logits_processors_parameters([TrieVllmProcessorV1], params(artifact_path, 3))


# --- the V2 model runner -------------------------------------------------------------------------------------------


class V2Runner:
    """What the V2 model runner does around a logits processor, with CPU tensors: slots, committed tokens, the
    per-step batch layout (rows reordered every step), and greedy sampling from the processed logits."""

    def __init__(self, artifact: Artifact) -> None:
        self.vocab = artifact.max_token_id + 1
        self.all_token_ids = torch.zeros((MAX_REQS, MAX_LEN), dtype=torch.int32)
        self.prompt_len = np.zeros(MAX_REQS, dtype=np.int32)
        self.total_len = np.zeros(MAX_REQS, dtype=np.int32)
        state = LogitsProcRequestState(
            device=torch.device("cpu"), max_num_reqs=MAX_REQS, vocab_size=self.vocab,
            all_token_ids=SimpleNamespace(gpu=self.all_token_ids), prompt_len=SimpleNamespace(np=self.prompt_len),
            prefill_len=SimpleNamespace(np=self.prompt_len.copy()), total_len=SimpleNamespace(gpu=None))
        self.processor = TrieVllmProcessor(None, state)

    def add(self, slot: int, sampling: SamplingParams, prompt: list[int], outputs: Sequence[int] = ()) -> bool:
        tokens = [*prompt, *outputs]
        self.all_token_ids[slot, : len(tokens)] = torch.tensor(tokens)
        self.prompt_len[slot], self.total_len[slot] = len(prompt), len(tokens)
        used = self.processor.add_request(slot, sampling)
        self.processor.apply_staged_writes()
        return used

    def step(self, slots: list[int], logits: torch.Tensor) -> torch.Tensor:
        ctx = LogitsContext(
            expanded_idx_mapping=torch.tensor(slots), idx_mapping=torch.tensor(slots), idx_mapping_np=np.array(slots),
            expanded_local_pos=torch.zeros(len(slots), dtype=torch.int32),
            input_ids=torch.tensor([int(self.all_token_ids[s, self.total_len[s] - 1]) for s in slots]),
            pos=torch.tensor([int(self.total_len[s]) - 1 for s in slots]),
            seq_lens_upper_bound_np=np.array([self.total_len[s] for s in slots]))
        return self.processor.apply(logits, ctx)

    def commit(self, slot: int, token: int) -> None:
        self.all_token_ids[slot, self.total_len[slot]] = token
        self.total_len[slot] += 1

    def outputs(self, slot: int) -> list[int]:
        return self.all_token_ids[slot, self.prompt_len[slot] : self.total_len[slot]].tolist()


def test_v2_masks_equal_the_core_while_slots_recycle_and_rows_reorder(catalog_artifact: Artifact,
                                                                        artifact_path: str) -> None:
    rng, torch_rng = random.Random(0), torch.Generator().manual_seed(0)
    runner = V2Runner(catalog_artifact)
    live: dict[int, tuple[int, list[int]]] = {}  # slot -> (k, the answer it will produce); None k: plain
    plain = {5}
    runner.add(5, SamplingParams(), prompt=[1, 2, 3])
    served = 0
    for _ in range(60):
        for slot in range(MAX_REQS - 1):  # fill free slots with new requests (slots are recycled)
            if slot not in live and served < 12:
                k = rng.choice([1, 2, 3])
                assert runner.add(slot, params(artifact_path, k), prompt=[7] * rng.randint(3, 9))
                live[slot], served = (k, walk(catalog_artifact, k, rng)), served + 1
        if not live:
            break
        slots = [*live, *plain]
        rng.shuffle(slots)
        logits = torch.randn((len(slots), runner.vocab), generator=torch_rng)
        before = logits.clone()
        after = runner.step(slots, logits)
        for row, slot in enumerate(slots):
            if slot in plain:
                assert torch.equal(after[row], before[row])
                continue
            k, answer = live[slot]
            outputs = runner.outputs(slot)
            assert finite(after[row]) == expected_allowed(catalog_artifact, k, outputs)
            token = answer[len(outputs)]
            assert torch.isfinite(after[row, token])
            runner.commit(slot, token)
            if token == catalog_artifact.eos_id:
                del live[slot]
    assert served == 12 and not live


def test_v2_catches_up_with_a_request_resumed_after_preemption(catalog_artifact: Artifact, artifact_path: str
                                                               ) -> None:
    runner = V2Runner(catalog_artifact)
    answer = walk(catalog_artifact, 3, random.Random(4))
    done = answer[: len(answer) // 2]
    runner.add(0, params(artifact_path, 3), prompt=[9, 9, 9, 9], outputs=done)  # refilled with partial output
    after = runner.step([0], torch.zeros((1, runner.vocab)))
    assert finite(after[0]) == expected_allowed(catalog_artifact, 3, done)
    runner.add(0, params(None), prompt=[1])  # the slot's next occupant is unconstrained: left alone
    assert torch.equal(runner.step([0], torch.ones((1, runner.vocab))), torch.ones((1, runner.vocab)))


def test_v2_a_request_with_a_prior_gets_the_fused_choice_from_vllms_argmax(catalog_artifact: Artifact,
                                                                          artifact_path: str) -> None:
    """A ranked row's logits become its fused option values: vLLM's greedy argmax takes the token the fused ranker
    chooses in process, step by step, and the row beside it (no prior) is only masked."""
    rng, torch_rng = np.random.default_rng(3), torch.Generator().manual_seed(3)
    n_tools = catalog_artifact.trie.n_tools
    prior = (rng.integers(-4, 5, n_tools) / 2).tolist()  # ties between tools
    runner = V2Runner(catalog_artifact)
    ranked = SamplingParams(temperature=0.0, extra_args=request_args(artifact_path, 3, prior=prior,
                                                                     model_weight=0.5, flat=True))
    assert runner.add(0, ranked, prompt=[7, 7]) and runner.add(1, params(artifact_path, 2), prompt=[7])
    oracle = TrieBatch(catalog_artifact, capacity=2)
    oracle.add(0, 3, prior=prior, model_weight=0.5)
    oracle.add(1, 2)

    def fused_score(row: int, slot: int, token: int, after: torch.Tensor, choice: Any) -> None:
        if slot == 0:
            best, _, log_total = choice.stats[row]
            logprob = float(torch.log_softmax(after[row].double(), 0)[token])
            assert logprob == pytest.approx(best - log_total, abs=1e-4)

    drive_greedily(runner, oracle, [0, 1], torch_rng, steps=60, check=fused_score)
    assert not oracle.is_running(0) and not oracle.is_running(1)


def drive_greedily(runner: V2Runner, oracle: TrieBatch, slots: list[int], torch_rng: torch.Generator, *,
                   steps: int, check: Any = None) -> None:
    """Random logits a step for the running ``slots``: vLLM's greedy argmax over the processor's logits must take
    the token the in-process ``oracle`` chooses from the same logits (``check`` sees each), then the forced run
    the oracle took, one token at a time."""
    for _ in range(steps):
        running = [slot for slot in slots if oracle.is_running(slot)]
        if not running:
            break
        logits = torch.randn((len(running), runner.vocab), generator=torch_rng)
        choice = oracle.choose(logits.numpy().copy(), running)
        after = runner.step(running, logits)
        for row, slot in enumerate(running):
            token = int(torch.argmax(after[row]))
            assert token == choice.chosen[row], slot
            if check is not None:
                check(row, slot, token, after, choice)
            runner.commit(slot, token)
            for forced in choice.forced[row]:  # the oracle took them; vLLM samples them one by one
                assert int(torch.argmax(runner.step([slot], torch.zeros((1, runner.vocab)))[0])) == forced
                runner.commit(slot, forced)


FOLLOWED = ("what is the weather in Paris and the news about flights there",
            "convert dollars to euros, then find a cheap hotel and a restaurant",
            "I want to buy a house and need a mortgage calculator and a moving company",
            "find house renting offers and a recipe for dinner")


def following_requests(artifact: Artifact, prior: str) -> list[tuple[Prior, int]]:
    """Requests of several needs, each with its prior that follows the answer (the made-up encoder's dense part)."""
    from support.encoders import MadeUpEncoder

    ranker = Ranker(artifact.registry, prior=prior, fused=Weights(model=1.0, retrieval=10.0), encoder=MadeUpEncoder(),
                    asks=False)  # each a request of one ask here: several asks are test_v2_a_request_of_several_asks...
    return [(discounting(ranker.row(query, "fused")), 2 + i % 2) for i, query in enumerate(FOLLOWED)]


def discounting(made: Prior) -> Prior:
    """``made`` with the chosen tools' words no longer counting: a follow-up that surely moves a lexical prior (the
    shipped ``FOLLOW`` discounts them by half, and a lexical prior keeps its weight: it may not move these)."""
    assert made.follow is not None
    return replace(made, follow=replace(made.follow, covered=0.0))


def answers_through_v2(artifact: Artifact, artifact_path: str, requests: list[tuple[Prior, int]], *,
                       follow: bool) -> list[list[int]]:
    """The requests in slots 0.. of a V2 runner (and a constrained one without a prior in the last), vLLM's greedy
    argmax over the processor's logits, each step's token the one the in-process batch (``TrieBatch.add`` with
    ``follow=Prior.follow`` when ``follow``) chooses from the same logits. Their answers' tools."""
    torch_rng = torch.Generator().manual_seed(5)
    runner = V2Runner(artifact)
    oracle = TrieBatch(artifact, capacity=len(requests) + 1)
    validate_v2 = build_custom_logits_processors_params_validator([TrieVllmProcessor])
    for slot, (made, k) in enumerate(requests):
        assert made.scores is not None and made.follow is not None
        sampling = SamplingParams(temperature=0.0, extra_args=request_args(
            artifact_path, k, prior=made.scores, model_weight=made.model_weight,
            follow=made.follow if follow else None, flat=True))
        validate_v2(sampling)
        validate_logits_processors_parameters([TrieVllmProcessorV1], sampling)
        assert runner.add(slot, sampling, prompt=[7] * (slot + 1))
        oracle.add(slot, k, prior=made.scores, model_weight=made.model_weight, follow=made.follow if follow else None)
    plain = len(requests)
    assert runner.add(plain, params(artifact_path, 2), prompt=[7])
    oracle.add(plain, 2)
    drive_greedily(runner, oracle, list(range(plain + 1)), torch_rng, steps=200)
    assert not any(oracle.is_running(slot) for slot in range(plain + 1))
    return [oracle.tools(slot) for slot in range(plain)]


@pytest.mark.parametrize("prior", ["lexical", "hybrid"])
def test_v2_a_prior_that_follows_the_answer_answers_as_in_process(catalog_artifact: Artifact, artifact_path: str,
                                                                 prior: str) -> None:
    """Requests that send how their prior follows the answer (``tooltrie_query``, ``tooltrie_follow``: vLLM's
    validators take them) answer as ``TrieBatch.add(follow=Prior.follow)`` does in process, token for token, beside
    one another and a row without a prior; the same requests without the follow-up answer otherwise (some of them)."""
    requests = following_requests(catalog_artifact, prior)
    following = answers_through_v2(catalog_artifact, artifact_path, requests, follow=True)
    static = answers_through_v2(catalog_artifact, artifact_path, requests, follow=False)
    assert [len(set(tools)) for tools in following] == [k for _, k in requests]
    assert following != static


@pytest.mark.parametrize("prior", ["dense", "hybrid"])
def test_v2_a_request_of_several_asks_answers_as_in_process(catalog_artifact: Artifact, artifact_path: str,
                                                            prior: str) -> None:
    """Requests that ask several things send each ask's prior (``tooltrie_asks``: vLLM's validators take them) and
    answer as ``TrieBatch.add(follow=PerAsk)`` does in process, token for token, beside one another and a row
    without a prior; without their asks (the first prior alone) some answer otherwise."""
    from support.encoders import MadeUpEncoder

    ranker = Ranker(catalog_artifact.registry, prior=prior, fused=Weights(model=1.0, retrieval=10.0),
                    encoder=MadeUpEncoder())
    requests = [(ranker.row(query, "fused"), k) for query, k in ASKED]
    assert all(isinstance(made.follow, PerAsk) for made, _ in requests)
    asked = answers_through_v2(catalog_artifact, artifact_path, requests, follow=True)
    static = answers_through_v2(catalog_artifact, artifact_path, requests, follow=False)
    assert [len(set(tools)) for tools in asked] == [k for _, k in ASKED]
    assert asked != static


ASKED = (("What's the weather in Paris? Also find me a hotel near the Louvre", 2),
         ("convert 100 dollars to euros, then find a cheap hotel and book a table at a restaurant", 3),
         ("1) translate this letter into French 2) check my stock portfolio 3) play some jazz", 3))


def test_v1_a_prior_that_follows_the_answer_answers_as_in_process(catalog_artifact: Artifact,
                                                                 artifact_path: str) -> None:
    """The V1 runner's adapter, its rows added and moved by ``BatchUpdate``: each request's answer is the in-process
    one with its prior following the answer (the prior alone: the answer is the follow-up's greedy top k)."""
    from support.encoders import MadeUpEncoder

    vocab, eos = catalog_artifact.max_token_id + 1, catalog_artifact.eos_id
    ranker = Ranker(catalog_artifact.registry, prior="hybrid", fused=Weights(model=0.0, retrieval=1.0),
                    encoder=MadeUpEncoder())
    processor = TrieVllmProcessorV1(None, torch.device("cpu"), False)
    made = [ranker.row(query, "fused") for query in FOLLOWED]
    outputs: list[list[int]] = [[] for _ in made]
    added = [(i, SamplingParams(temperature=0.0, extra_args=request_args(
        artifact_path, 3, prior=m.scores, model_weight=m.model_weight, follow=m.follow)), [1, 2], outputs[i])
        for i, m in enumerate(made)]
    processor.update_state(BatchUpdate(batch_size=len(made), removed=[], added=added, moved=[]))
    order = list(range(len(made)))  # batch index -> request
    for step in range(200):
        if step == 3:  # vLLM swaps rows 0 and 2 in its persistent batch
            processor.update_state(BatchUpdate(batch_size=len(made), removed=[], added=[],
                                               moved=[(0, 2, MoveDirectionality.SWAP)]))
            order[0], order[2] = order[2], order[0]
        else:
            processor.update_state(None)
        after = processor.apply(torch.zeros((len(made), vocab)))
        for index, request in enumerate(order):
            if outputs[request][-1:] != [eos]:
                outputs[request].append(int(torch.argmax(after[index])))
        if all(out[-1:] == [eos] for out in outputs):
            break
    moved = 0
    for m, out in zip(made, outputs, strict=True):
        replayed = TrieBatch(catalog_artifact, capacity=1)  # the answer's tokens are an answer: its tools
        replayed.add(0, 3)
        replayed.accept([out], [0])
        assert replayed.is_done(0), out
        assert replayed.tools(0) == prior_alone(catalog_artifact, m, 3, follow=True)
        moved += replayed.tools(0) != prior_alone(catalog_artifact, m, 3, follow=False)
    assert moved > 0


def prior_alone(artifact: Artifact, made: Prior, k: int, *, follow: bool) -> list[int]:
    """The in-process answer ranked by ``made``'s prior alone (the model's weight 0), following the answer or not."""
    batch = TrieBatch(artifact, capacity=1)
    batch.add(0, k, prior=made.scores, model_weight=0.0, follow=made.follow if follow else None)
    while batch.is_running(0):
        batch.choose(np.zeros((1, artifact.max_token_id + 1), np.float32), [0])
    return batch.tools(0)


# --- the V1 model runner -------------------------------------------------------------------------------------------


def test_v1_masks_equal_the_core_through_batch_updates(catalog_artifact: Artifact, artifact_path: str) -> None:
    rng, torch_rng = random.Random(1), torch.Generator().manual_seed(1)
    vocab = catalog_artifact.max_token_id + 1
    processor = TrieVllmProcessorV1(None, torch.device("cpu"), False)
    assert not processor.is_argmax_invariant()
    rows: list[dict[str, Any] | None] = []  # batch index -> {"k", "answer", "outputs"} (None k: plain)
    added = []
    for k in (1, 2, None, 3):
        outputs: list[int] = []
        added.append((len(rows), params(artifact_path, k) if k else SamplingParams(), [1, 2], outputs))
        rows.append({"k": k, "answer": walk(catalog_artifact, k, rng) if k else None, "outputs": outputs})
    processor.update_state(BatchUpdate(batch_size=len(rows), removed=[], added=added, moved=[]))
    for step in range(40):
        if step == 2:  # vLLM swaps rows 0 and 3 in its persistent batch
            processor.update_state(BatchUpdate(batch_size=len(rows), removed=[], added=[],
                                               moved=[(0, 3, MoveDirectionality.SWAP)]))
            rows[0], rows[3] = rows[3], rows[0]
        elif step == 4:  # and moves row 1's request to a new row 4 (row 1 is left empty)
            rows.append(None)
            processor.update_state(BatchUpdate(batch_size=len(rows), removed=[], added=[],
                                               moved=[(1, 4, MoveDirectionality.UNIDIRECTIONAL)]))
            rows[1], rows[4] = None, rows[1]
        else:
            processor.update_state(None)
        logits = torch.randn((len(rows), vocab), generator=torch_rng)
        before = logits.clone()
        after = processor.apply(logits)
        finished = []
        for index, row in enumerate(rows):
            if row is None:
                continue
            if row["k"] is None:
                assert torch.equal(after[index], before[index])
                continue
            assert finite(after[index]) == expected_allowed(catalog_artifact, row["k"], row["outputs"])
            token = row["answer"][len(row["outputs"])]
            row["outputs"].append(token)  # vLLM appends to the very list it handed over
            if token == catalog_artifact.eos_id:
                finished.append(index)
        if finished:
            processor.update_state(BatchUpdate(batch_size=len(rows), removed=finished, added=[], moved=[]))
            for index in finished:
                rows[index] = None
        if all(row is None or row["k"] is None for row in rows):
            break
    assert set(processor.rows) == set()  # every constrained request finished and was removed


# --- the vLLM arms, with a stand-in LLM ----------------------------------------------------------------------------


class StandInLLM:
    """``LLM.generate``'s signature and output shape; decodes greedily over random logits through the V1 adapter when
    a request carries our arguments, so the arm's requests really drive the processor."""

    def __init__(self, artifact: Artifact) -> None:
        self.artifact, self.calls = artifact, []
        self.processor = TrieVllmProcessorV1(None, torch.device("cpu"), False)

    def generate(self, prompts: list[dict[str, list[int]]], sampling: SamplingParams, use_tqdm: bool = True) -> Any:
        self.calls.append((prompts, sampling))
        outputs: list[list[int]] = [[] for _ in prompts]
        self.processor.update_state(BatchUpdate(batch_size=len(prompts), removed=[], moved=[], added=[
            (i, sampling, p["prompt_token_ids"], outputs[i]) for i, p in enumerate(prompts)]))
        generator = torch.Generator().manual_seed(0)
        for _ in range(sampling.max_tokens):
            logits = self.processor.apply(torch.randn((len(prompts), self.artifact.max_token_id + 1),
                                                      generator=generator))
            for i, out in enumerate(outputs):
                if not out or out[-1] != self.artifact.eos_id:
                    out.append(int(torch.argmax(logits[i])))
        self.processor.update_state(BatchUpdate(batch_size=0, removed=list(range(len(prompts))), added=[], moved=[]))
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=out, finish_reason="stop")]) for out in outputs]


def test_vllm_arms_build_the_requests_each_arm_means(catalog_artifact: Artifact, smollm: TokenizerInfo,
                                                     artifact_path: str) -> None:
    setup = EvalSetup(model=None, tokenizer=smollm, artifact=catalog_artifact, prompt=Prompt.style("short"),
                      artifact_path=Path(artifact_path))
    queries = [LabelledQuery("stocks and news", ("FinanceTool", "NewsTool")), LabelledQuery("weather", ("A", "B"))]
    llm = StandInLLM(catalog_artifact)
    trie = VllmArm(setup, mode="trie", llm=llm)
    predictions = trie.predict(queries)
    prompts, sampling = llm.calls[-1]
    assert [p["prompt_token_ids"] for p in prompts] == [setup.prompt_ids(q) for q in queries]
    assert sampling.extra_args == request_args(artifact_path, 2) and sampling.temperature == 0.0
    assert sampling.stop_token_ids == [catalog_artifact.eos_id] and sampling.structured_outputs is None
    for prediction in predictions:  # random logits, but every answer is two distinct catalog tools
        names = prediction.text.split(", ")
        assert prediction.finish_reason == "stop" and len(set(names)) == 2
        assert set(names) <= set(catalog_artifact.registry.names)

    grammar = VllmArm(setup, mode="grammar", llm=llm).sampling_params(2)
    assert isinstance(grammar.structured_outputs, StructuredOutputsParams)
    assert grammar.structured_outputs.grammar == exactly_k_ebnf(catalog_artifact.registry.names, 2,
                                                                catalog_artifact.contract)
    assert not grammar.extra_args
    plain = VllmArm(setup, mode="none", llm=llm).sampling_params(2)
    assert not plain.extra_args and plain.structured_outputs is None and plain.max_tokens == setup.max_new_tokens
