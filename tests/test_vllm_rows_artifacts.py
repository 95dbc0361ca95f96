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
