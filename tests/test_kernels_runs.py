"""``runs_to_next_choice``: the runs the engine feeds speculatively, checked against ``legal_moves`` along random walks
through the catalog and through a registry whose names are token-prefixes of each other."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.serve import small_artifact

from tooltrie.compiler import Artifact, TokenizerInfo
from tooltrie.kernels import TrieBatch
from tooltrie.kernels.rules import Slot, advance, legal_moves, runs_to_next_choice

UNLIMITED = 10_000


@pytest.fixture(scope="module")
def artifacts(catalog_artifact: Artifact, smollm: TokenizerInfo) -> dict[str, Artifact]:
    return {"catalog": catalog_artifact, "small": small_artifact(smollm)}


def follow(artifact: Artifact, slot: Slot, run: tuple[int, ...]) -> tuple[Slot, list[str]]:
    """The slot at the end of ``run`` and the kinds of its moves; every token after the first must be forced."""
    kinds = []
    for i, token in enumerate(run):
        moves = legal_moves(artifact.trie, slot, artifact.eos_id)
        assert token in moves and (i == 0 or len(moves) == 1), (run, i)
        kinds.append(moves[token].kind)
        slot = advance(artifact.trie, slot, moves[token])
    return slot, kinds


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), registry=st.sampled_from(["catalog", "small"]), k=st.integers(1, 3),
       budget=st.sampled_from([0, 1, 2, 5, 16]))
def test_runs_lead_inside_a_name_to_the_next_choice(artifacts: dict[str, Artifact], seed: int, registry: str,
                                                    k: int, budget: int) -> None:
    artifact, rng = artifacts[registry], random.Random(seed)
    slot = Slot.start(artifact.trie, k)
    while (moves := legal_moves(artifact.trie, slot, artifact.eos_id)):
        if len(moves) > 1:  # a choice: check its runs
            every = runs_to_next_choice(artifact.trie, slot, artifact.eos_id, UNLIMITED)
            for run in every:
                end, kinds = follow(artifact, slot, run)
                assert all(kind == "edge" for kind in kinds[1:]), run  # the name goes on after the first token
                assert len(legal_moves(artifact.trie, end, artifact.eos_id)) > 1, run  # and ends at a choice
            missing = {token for token, move in moves.items() if move.kind != "stop"} - {run[0] for run in every}
            for token in missing:  # a first token left out leads to no choice inside its name
                end, _ = follow(artifact, slot, (token,))
                forced = legal_moves(artifact.trie, end, artifact.eos_id)
                while len(forced) == 1 and next(iter(forced.values())).kind == "edge":
                    end = advance(artifact.trie, end, next(iter(forced.values())))
                    forced = legal_moves(artifact.trie, end, artifact.eos_id)
                assert len(forced) <= 1, token
            # a budget takes, in token order, each run that still fits
            fitting, left = [], budget
            for run in every:
                if len(run) <= left:
                    fitting.append(run)
                    left -= len(run)
            assert runs_to_next_choice(artifact.trie, slot, artifact.eos_id, budget) == fitting
        slot = advance(artifact.trie, slot, moves[rng.choice(sorted(moves))])


def test_the_catalogs_first_choice_has_runs_for_its_shared_name_starts(artifacts: dict[str, Artifact],
                                                                       smollm: TokenizerInfo) -> None:
    artifact = artifacts["catalog"]
    runs = runs_to_next_choice(artifact.trie, Slot.start(artifact.trie, 1), artifact.eos_id, UNLIMITED)
    assert sorted(smollm.decode(list(run)) for run in runs) == ["House", "Media", "Product", "Research", "Trip"]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), registry=st.sampled_from(["catalog", "small"]), k=st.integers(1, 3),
       budget=st.sampled_from([1, 2, 5, 16]), limited=st.booleans())
def test_the_compiled_runs_equal_the_readable_ones(artifacts: dict[str, Artifact], seed: int, registry: str, k: int,
                                                   budget: int, limited: bool) -> None:
    """``TrieBatch.runs`` (the compiled walk the engine uses) against ``runs_to_next_choice`` at every state of a
    random walk, on the whole registry and on a random subset."""
    artifact, rng = artifacts[registry], random.Random(seed)
    n_tools = artifact.trie.n_tools
    subset = frozenset(rng.sample(range(n_tools), rng.randint(k, n_tools))) if limited else None
    batch = TrieBatch(artifact, capacity=2)
    batch.add(1, k, subset=subset)
    slot = Slot.start(artifact.trie, k, subset)
    while batch.is_running(1):
        assert batch.runs(1, budget) == runs_to_next_choice(artifact.trie, slot, artifact.eos_id, budget)
        moves = legal_moves(artifact.trie, slot, artifact.eos_id)
        token = rng.choice(sorted(moves))
        slot = advance(artifact.trie, slot, moves[token])
        batch.accept([[token]], rows=[1])
    assert batch.tools(1) == list(slot.used)
