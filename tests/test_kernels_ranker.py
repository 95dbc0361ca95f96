"""The fused ranker inside the constrained decode (``kernels/walk.py``): a legal token's value is the model's
weighted score plus the best prior among the unused allowed tools below its edge.

- the per-edge aggregate equals brute force over the tools whose path crosses the edge (random registries, used
  tools, subsets, a hop's own tool left out);
- with the model's weight at zero, every backend answers exactly the prior's top k among the allowed tools, in
  order, whatever the logits;
- with every prior equal, the fused choice is the model's own.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import config, cuda

from tooltrie.compiler import Artifact, Contract, TokenizerInfo, compile_registry
from tooltrie.kernels import TrieBatch, walk
from tooltrie.kernels.state import USED
from tooltrie.registry import make_registry

POOL = ["get", "get_user", "get_user_id", "set", "setup", "a", "ab", "abc", "météo", "search", "search_web", "x",
        "send", "send_mail", "sum"]
HOST_BACKENDS = ["reference", "cpu"]
CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not (config.ENABLE_CUDASIM or cuda.is_available()),
                                                     reason="no GPU and NUMBA_ENABLE_CUDASIM is not set"))


@pytest.fixture(scope="module")
def artifacts() -> list[Artifact]:
    tokenizer, rng = TokenizerInfo.load("gpt2"), random.Random(21)
    return [compile_registry(make_registry([{"name": n} for n in rng.sample(POOL, rng.randint(5, len(POOL)))],
                                           name=f"random{i}"), tokenizer, Contract(separator=separator))
            for i, separator in enumerate([", ", "\n", " "])]


def _crossing(artifact: Artifact, edge: int) -> set[int]:
    """Brute force: the tools whose path, in any trie, crosses ``edge``."""
    trie = artifact.trie
    return {t for r in range(trie.n_tries) for t in range(trie.n_tools) if edge in trie.tool_path(r, t).tolist()}


@settings(max_examples=60, deadline=None)
@given(which=st.integers(0, 2), seed=st.integers(0, 10**6))
def test_the_per_edge_prior_is_the_best_open_tool_below_the_edge(artifacts: list[Artifact], which: int,
                                                                 seed: int) -> None:
    artifact = artifacts[which]
    trie, rng = artifact.trie, np.random.default_rng(seed)
    n_tools = trie.n_tools
    used = rng.permutation(n_tools)[: rng.integers(0, min(3, n_tools))].tolist()
    allowed = (rng.random(n_tools) < 0.7).astype(np.uint8)
    prior = rng.integers(-8, 9, n_tools) / 4
    table = np.full((1, USED + 3), -1, np.int32)
    table[0, USED : USED + len(used)] = used
    table[0, 3] = len(used)  # EMITTED
    ranked = (np.array([[1.0, *prior]], np.float32), *trie.tools_below())
    for edge in range(trie.n_edges):
        crossing = _crossing(artifact, edge)
        for extra in (-1, *sorted(crossing)[:2]):
            open_tools = [t for t in crossing if t != extra and t not in used and allowed[t]]
            expected = max((prior[t] for t in open_tools), default=-np.inf)
            assert walk.edge_prior(0, edge, extra, table, allowed[None], ranked) == expected, (edge, extra)


def _answer(artifact: Artifact, backend: str, k: int, logits: np.ndarray, **row: object) -> list[int]:
    batch = TrieBatch(artifact, backend=backend, capacity=1)
    batch.add(0, k, **row)  # type: ignore[arg-type]
    for _ in range(200):
        if not batch.is_running(0):
            break
        batch.choose(logits)
    assert batch.is_done(0)
    return batch.tools(0)


@pytest.mark.parametrize("backend", [*HOST_BACKENDS, CUDA])
def test_with_the_model_weight_at_zero_the_answer_is_the_priors_top_k_in_order(artifacts: list[Artifact],
                                                                               backend: str) -> None:
    rng = np.random.default_rng(5)
    for artifact in artifacts:
        n_tools = artifact.trie.n_tools
        for _ in range(4 if backend == "cuda" else 12):
            k = int(rng.integers(1, 4))
            prior = rng.permutation(n_tools) / n_tools  # distinct: one right answer
            subset = None
            if rng.random() < 0.5:
                subset = sorted(rng.permutation(n_tools)[: rng.integers(k, n_tools + 1)].tolist())
            logits = rng.standard_normal((1, artifact.max_token_id + 1)).astype(np.float32) * 10
            candidates = range(n_tools) if subset is None else subset
            expected = sorted(candidates, key=lambda t: -prior[t])[:k]
            got = _answer(artifact, backend, k, logits, prior=prior, model_weight=0.0, subset=subset)
            assert got == expected, (artifact.registry.name, backend, k, subset)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_with_equal_priors_the_fused_choice_is_the_models(artifacts: list[Artifact], backend: str) -> None:
    rng = np.random.default_rng(8)
    for artifact in artifacts:
        for _ in range(10):
            k = int(rng.integers(1, 4))
            logits = rng.integers(0, 3, (1, artifact.max_token_id + 1)).astype(np.float32)  # ties too
            plain = _answer(artifact, backend, k, logits)
            fused = _answer(artifact, backend, k, logits, prior=np.full(artifact.trie.n_tools, 0.25),
                            model_weight=2.0)
            assert fused == plain, (artifact.registry.name, k)
