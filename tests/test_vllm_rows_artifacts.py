"""vLLM's rows on tooltrie's batch state (``integrations/vllm_rows.ArtifactRows``), without vLLM: the artifact states
a long-running vLLM holds stay bounded however many artifact names it is asked for, a step visits only the artifacts
that have rows, a request's subset (``tools``) is its row's mask, and a prior that follows the answer
(``tooltrie_follow``) answers as in process."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tooltrie.compiler import Artifact
from tooltrie.integrations import vllm_rows
from tooltrie.integrations.vllm_rows import (
    IDLE_ARTIFACT_STATES,
    ArtifactRows,
    RequestArgs,
    parse_request_args,
    publish_artifact,
    request_args,
)
from tooltrie.kernels import TrieMatcher
from tooltrie.kernels.batch import TrieBatch


def legal(artifact: Artifact, k: int, tokens: list[int], subset: tuple[int, ...] | None = None) -> list[int]:
    matcher = TrieMatcher(artifact, k, allowed=subset, backend="reference")
    for token in tokens:
        assert matcher.accept_token(token)
    allowed = [artifact.eos_id] if matcher.is_terminated() else matcher.legal_tokens()
    assert allowed is not None
    return sorted(allowed)


def finite(row: torch.Tensor) -> list[int]:
    return torch.isfinite(row).nonzero().flatten().tolist()


def test_a_thousand_artifact_names_keep_the_states_bounded(catalog_artifact: Artifact,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_rows, "load_artifact", lambda name, **_: catalog_artifact)  # one file, many names
    rows, n_rows = ArtifactRows("cpu"), 4
    logits = torch.zeros(n_rows, catalog_artifact.max_token_id + 1)
    most = 0
    for i in range(1000):  # each step, one row takes a request for a name not seen before
        rows.add(i % n_rows, RequestArgs(f"registry-{i}.trie.safetensors", 1))
        visited = rows.visited
        rows.apply(logits.clone(), list(range(n_rows)), [[]] * n_rows)
        assert rows.visited - visited == len(rows.live) == min(i + 1, n_rows)  # only artifacts with rows
        most = max(most, len(rows.batches))
        assert set(rows.batches) == set(rows.owners) == set(rows.live) | set(rows.idle)
    assert most == len(rows.batches) == n_rows + IDLE_ARTIFACT_STATES
    for row in range(n_rows):
        rows.remove(row)
    assert not rows.live and len(rows.batches) == IDLE_ARTIFACT_STATES


def test_an_idle_state_is_taken_again(catalog_artifact: Artifact, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_rows, "load_artifact", lambda name, **_: catalog_artifact)
    rows = ArtifactRows("cpu")
    rows.add(0, RequestArgs("a", 1))
    state = rows.batches["a"]
    rows.remove(0)
    assert rows.idle == {"a": None} and not rows.live
    rows.add(3, RequestArgs("a", 2))
    assert rows.batches["a"] is state and rows.live == {"a": 1} and not rows.idle


@pytest.mark.parametrize(("k", "subset"), [(1, (5,)), (2, (0, 9, 17, 30)), (3, (2, 3, 4, 40, 46))])
def test_a_subset_is_the_rows_mask(catalog_artifact: Artifact, monkeypatch: pytest.MonkeyPatch, k: int,
                                   subset: tuple[int, ...]) -> None:
    """Random legal walks under a subset: every mask equals the reference matcher's with that subset, beside a row
    of the same artifact without one; the answer is k distinct tools of the subset."""
    monkeypatch.setattr(vllm_rows, "load_artifact", lambda name, **_: catalog_artifact)
    rows, rng = ArtifactRows("cpu"), random.Random(k)
    rows.add(0, RequestArgs("catalog", k, tools=subset))
    rows.add(1, RequestArgs("catalog", k))
    outputs: list[list[int]] = [[], []]
    vocab = catalog_artifact.max_token_id + 1
    eos = catalog_artifact.eos_id
    while outputs[0][-1:] != [eos]:
        masked = rows.apply(torch.zeros(2, vocab), [0, 1], rows.unfed(outputs))
        for row in (0, 1):
            if row in rows:
                allowed = finite(masked[row])
                assert allowed == legal(catalog_artifact, k, outputs[row], subset if row == 0 else None)
                outputs[row].append(rng.choice(allowed))
                if outputs[row][-1] == eos and row == 1:
                    rows.remove(1)  # a finished request leaves the batch
    rows.apply(torch.zeros(2, vocab), [0, 1], rows.unfed(outputs))  # the stop token
    assert rows.batches["catalog"].is_done(0)
    tools = rows.batches["catalog"].tools(0)
    assert len(set(tools)) == k and set(tools) <= set(subset)


def test_ranked_rows_get_the_same_fused_values_in_the_buffer_as_in_place(catalog_artifact: Artifact,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose rows are all constrained writes into the buffer of legal logits (``LegalLogits``), one with many
    plain rows masks in place: a ranked row's fused values are the same either way, and greedy over them answers as
    ``choose`` with the prior does."""
    monkeypatch.setattr(vllm_rows, "load_artifact", lambda name, **_: catalog_artifact)
    n_tools, vocab, eos = catalog_artifact.trie.n_tools, catalog_artifact.max_token_id + 1, catalog_artifact.eos_id
    prior = (np.random.default_rng(7).integers(-4, 5, n_tools) / 2).tolist()  # ties between tools
    buffered, in_place = ArtifactRows("cpu"), ArtifactRows("cpu")
    for rows in (buffered, in_place):
        rows.add(0, RequestArgs("catalog", 3, prior=tuple(prior), model_weight=0.5))
        rows.add(1, RequestArgs("catalog", 2))
    oracle = TrieBatch(catalog_artifact, capacity=1, backend="reference")
    oracle.add(0, 3, prior=prior, model_weight=0.5)
    generator = torch.Generator().manual_seed(3)
    outputs: list[list[int]] = [[], []]
    plain = 40  # rows that are not ours: the step masks in place
    forced: list[int] = []
    while outputs[0][-1:] != [eos]:
        logits = torch.randn(2 + plain, vocab, generator=generator)
        unfed = buffered.unfed(outputs)
        a = buffered.apply(logits[:2].clone(), [0, 1], unfed)
        b = in_place.apply(logits.clone(), [0, 1] + [-1] * plain, in_place.unfed(outputs) + [[]] * plain)[:2]
        assert a.data_ptr() != b.data_ptr()
        assert torch.equal(a[0], b[0]) and torch.equal(torch.isfinite(a[1]), torch.isfinite(b[1]))
        if forced:  # the oracle took the run the trie forced; vLLM's row takes it a token a step
            expected = forced.pop(0)
        else:
            choice = oracle.choose(logits[:1].numpy(), [0])
            expected, forced = int(choice.chosen[0]), list(choice.forced[0])
        assert int(torch.argmax(a[0])) == expected
        outputs[0].append(expected)
        if outputs[1][-1:] != [eos]:
            outputs[1].append(int(torch.argmax(a[1])))


# --- the prior that follows the answer ------------------------------------------------------------------------------

FOLLOWED = ("what is the weather in Paris and the news about flights there",
            "convert dollars to euros, then find a cheap hotel and a restaurant",
            "I want to buy a house and need a mortgage calculator and a moving company")


def through_rows(rows: ArtifactRows, args: RequestArgs, artifact: Artifact, *, plain: int, seed: int,
                 oracle: TrieBatch) -> list[int]:
    """``args``' request in row 0 of ``rows`` beside ``plain`` rows that are not ours (many: the step masks in place;
    none: it fills the buffer of legal logits), vLLM's greedy argmax taking each token; at every step the token is the
    one ``oracle`` (row 0, the in-process batch) chooses from the same logits, its forced runs a token a step. The
    answer's tools."""
    vocab, eos = artifact.max_token_id + 1, artifact.eos_id
    rows.add(0, args)
    generator = torch.Generator().manual_seed(seed)
    outputs: list[int] = []
    forced: list[int] = []
    while outputs[-1:] != [eos]:
        logits = torch.randn(1 + plain, vocab, generator=generator)
        masked = rows.apply(logits.clone(), [0] + [-1] * plain, rows.unfed([outputs]) + [[]] * plain)
        if forced:
            expected = forced.pop(0)
        else:
            choice = oracle.choose(logits[:1].numpy().copy(), [0])
            expected, forced = int(choice.chosen[0]), list(choice.forced[0])
        assert int(torch.argmax(masked[0])) == expected
        outputs.append(expected)
    rows.apply(torch.zeros(1, vocab), [0], rows.unfed([outputs]))  # the stop token
    batch = rows.batches[args.artifact]
    assert batch.is_done(0) and oracle.is_done(0)
    return batch.tools(0)


@pytest.mark.parametrize("prior", ["lexical", "hybrid"])
def test_a_prior_that_follows_the_answer_answers_as_in_process(saved_catalog_artifact: Path, prior: str) -> None:
    """A request that sends its prior and how it follows the answer (``request_args(follow=Prior.follow)``, parsed as
    vLLM hands it over) gets the in-process answer, token for token: ``TrieBatch.add(follow=Prior.follow)`` on the
    same logits, with the model's weight and with the prior alone; and the follow-up does change answers (without
    it, some differ)."""
    from support.encoders import MadeUpEncoder

    from tooltrie.ranker import FollowUp, Ranker, Weights

    name = publish_artifact(saved_catalog_artifact)
    artifact = vllm_rows.load_artifact(name)
    moved = 0
    for weights in (Weights(model=1.0, retrieval=10.0), Weights(model=0.0, retrieval=1.0)):
        ranker = Ranker(artifact.registry, prior=prior, fused=weights, encoder=MadeUpEncoder(), asks=False)
        for i, query in enumerate(FOLLOWED):
            made = ranker.row(query, "fused")
            assert isinstance(made.follow, FollowUp) and made.scores is not None
            # the chosen tools' words counting a quarter: the shipped FOLLOW discounts none, and a lexical prior
            # keeps its weight, so it would not move
            made = replace(made, follow=replace(made.follow, covered=0.25))
            for k in (2, 3):
                sent = request_args(name, k, prior=made.scores, model_weight=made.model_weight, follow=made.follow,
                                    flat=True)
                args = parse_request_args(SimpleNamespace(extra_args=json.loads(json.dumps(sent))))
                assert args is not None and args.follow is not None
                answers = []
                for follow in (made.follow, None):
                    oracle = TrieBatch(artifact, capacity=1)
                    oracle.add(0, k, prior=made.scores, model_weight=made.model_weight, follow=follow)
                    sending = args if follow is not None else replace(args, query=None, follow=None)
                    answers.append(through_rows(ArtifactRows("cpu"), sending, artifact, plain=40 * (i % 2),
                                                seed=k + i, oracle=oracle))
                moved += answers[0] != answers[1]
    assert moved > 0  # the follow-up changed some answers: without it they are not the same


ASKED = ("What's the weather in Paris? Also find me a hotel there",
         "convert dollars to euros, then find a cheap hotel and book a table at a restaurant",
         "1) translate this letter into French 2) check my stock portfolio 3) play some jazz")


@pytest.mark.parametrize("prior", ["dense", "hybrid"])
def test_a_request_of_several_asks_answers_as_in_process(saved_catalog_artifact: Path, prior: str) -> None:
    """A request that asks several things sends each ask's prior beside the whole request's (``asks``) and gets the
    in-process answer, token for token (``TrieBatch.add(follow=PerAsk)``), with the model's weight and with the
    prior alone, at k below, at and above its asks; with a dense prior (which does not follow the answer once every
    ask has its tool) too; and the asks do change answers."""
    from support.encoders import MadeUpEncoder

    from tooltrie.ranker import PerAsk, Ranker, Weights

    name = publish_artifact(saved_catalog_artifact)
    artifact = vllm_rows.load_artifact(name)
    moved = 0
    for weights in (Weights(model=1.0, retrieval=10.0), Weights(model=0.0, retrieval=1.0)):
        rankers = [Ranker(artifact.registry, prior=prior, fused=weights, encoder=MadeUpEncoder(), asks=asks)
                   for asks in (True, False)]
        for i, query in enumerate(ASKED):
            made, whole = (ranker.row(query, "fused") for ranker in rankers)
            assert isinstance(made.follow, PerAsk) and made.scores is not None
            for k in (1, len(made.follow.asks), len(made.follow.asks) + 1):
                sent = request_args(name, k, prior=made.scores, model_weight=made.model_weight, follow=made.follow,
                                    flat=True)
                args = parse_request_args(SimpleNamespace(extra_args=json.loads(json.dumps(sent))))
                assert args is not None and args.asks is not None and len(args.asks) == len(made.follow.asks)
                oracle = TrieBatch(artifact, capacity=1)
                oracle.add(0, k, prior=made.scores, model_weight=made.model_weight, follow=made.follow)
                answer = through_rows(ArtifactRows("cpu"), args, artifact, plain=40 * (i % 2), seed=k + i,
                                      oracle=oracle)
                if weights.model == 0:
                    assert answer == made.follow.top(k)
                    static = [int(t) for t in np.argsort(-whole.scores, kind="stable")[:k]]
                    moved += answer != (whole.follow.top(k) if whole.follow is not None else static)
    assert moved > 0  # one tool per ask is not the whole request's answer


def test_the_lexical_index_is_the_in_process_one_made_once_per_artifact(saved_catalog_artifact: Path,
                                                                        artifact_root: Path) -> None:
    """The processor's lexical index of an artifact's registry reads each request's words and scores them exactly as
    the in-process ranker's (``Ranker.lexical``, built from the registry with the same defaults); it is made on the
    first request that asks, once, and kept with the loaded artifact; a follow-up made from it is the in-process
    one, value for value."""
    from tooltrie.ranker import Ranker

    names = vllm_rows.ArtifactNames()
    name = publish_artifact(saved_catalog_artifact)
    artifact = names.load(name)
    assert names.indexed == 0  # loading alone builds nothing
    index = names.lexical(name, artifact)
    assert names.lexical(name, names.load(name)) is index and names.indexed == 1
    assert (artifact_root / name.replace(".safetensors", ".lexical.safetensors")).is_file()  # beside it, in the root
    ranker = Ranker(artifact.registry, prior="lexical")
    for query in (*FOLLOWED, "", "the of and", "WeatherTool getNews currency_convert"):
        assert index.words(query) == ranker.lexical.words(query)
        np.testing.assert_array_equal(index.scores(query), ranker.lexical.scores(query))
    fresh = vllm_rows.ArtifactNames()  # another process: the index read from its file is the same
    again = fresh.lexical(name, fresh.load(name))
    for query in FOLLOWED:
        np.testing.assert_array_equal(again.scores(query), index.scores(query))
    made = ranker.row(FOLLOWED[0], "fused")
    assert made.follow is not None and made.scores is not None
    sent = request_args(name, 3, prior=made.scores, model_weight=made.model_weight, follow=made.follow)
    args = parse_request_args(SimpleNamespace(extra_args=sent))
    assert args is not None
    follow = vllm_rows.follow_up(args, vllm_rows.load_artifact(name))
    assert follow is not None and follow.first.dtype == np.float32
    np.testing.assert_array_equal(follow.first, made.scores)  # the prior sent, to the bit
    for tools in ((), (32,), (32, 2), (5, 40)):
        np.testing.assert_array_equal(follow(tools), made.follow(tools))
    assert vllm_rows.follow_up(replace(args, query=None, follow=None), artifact) is None


def test_a_root_that_cannot_be_written_still_follows(saved_catalog_artifact: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """The index's file cannot be written beside the artifact (a read-only root; here, as the tests may run as root,
    a directory where the file would go): logged, and the index answers all the same."""
    root = tmp_path / "read-only"
    root.mkdir()
    name = publish_artifact(saved_catalog_artifact, root=root)
    (root / name.replace(".safetensors", ".lexical.safetensors")).mkdir()
    root.chmod(0o555)
    monkeypatch.setenv(vllm_rows.ROOT_ENV, str(root))
    try:
        names = vllm_rows.ArtifactNames()
        artifact = names.load(name)
        with caplog.at_level("WARNING"):
            index = names.lexical(name, artifact)
        assert "lexical index was not cached" in caplog.text
        assert index.words(FOLLOWED[0]) and names.lexical(name, artifact) is index and names.indexed == 1
    finally:
        root.chmod(0o755)
