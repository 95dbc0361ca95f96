"""vLLM's rows on tooltrie's batch state (``integrations/vllm_rows.ArtifactRows``), without vLLM: the artifact states
a long-running vLLM holds stay bounded however many artifact names it is asked for, a step visits only the artifacts
that have rows, and a request's subset (``tools``) is its row's mask, as in process."""

from __future__ import annotations

import random

import pytest
import torch

from tooltrie.compiler import Artifact
from tooltrie.integrations import vllm_rows
from tooltrie.integrations.vllm_rows import IDLE_ARTIFACT_STATES, ArtifactRows, RequestArgs
from tooltrie.kernels import TrieMatcher


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
    import numpy as np

    from tooltrie.kernels.batch import TrieBatch

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
