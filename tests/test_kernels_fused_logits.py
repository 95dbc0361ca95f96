"""The fused ranker written into the logits (``TrieBatch.fuse_logits_``, ``walk.fuse_row``), for engines that can
only edit logits: on every backend, from states reached by random walks over random registries, subsets and
priors (ties included),

- the written row's only maximum is the token ``choose`` takes (so any argmax, whatever its ties, takes it);
- its log-softmax is the choice's score, ``best - log_total`` of the stats;
- illegal tokens are -inf, and rows without a ranker are written as ``mask_logits_`` writes them;
- the compiled backends write exactly what the reference writes.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import config, cuda

from tooltrie.compiler import Artifact, Contract, TokenizerInfo, compile_registry
from tooltrie.errors import DecodeError
from tooltrie.kernels import TrieBatch
from tooltrie.kernels.state import RUNNING
from tooltrie.registry import make_registry

POOL = ["get", "get_user", "get_user_id", "set", "setup", "a", "ab", "abc", "météo", "search", "search_web", "x",
        "send", "send_mail", "sum"]
CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not (config.ENABLE_CUDASIM or cuda.is_available()),
                                                     reason="no GPU and NUMBA_ENABLE_CUDASIM is not set"))
N_ROWS = 4  # three ranked rows and one without a ranker


@pytest.fixture(scope="module")
def artifacts() -> list[Artifact]:
    tokenizer, rng = TokenizerInfo.load("gpt2"), random.Random(34)
    return [compile_registry(make_registry([{"name": n} for n in rng.sample(POOL, rng.randint(5, len(POOL)))],
                                           name=f"random{i}"), tokenizer, Contract(separator=separator))
            for i, separator in enumerate([", ", "\n", " "])]


def _rows(artifact: Artifact, rng: np.random.Generator) -> list[dict]:
    """Each row's ``add`` arguments: k, maybe a subset, a prior with ties and a model weight (the last: none)."""
    n_tools, rows = artifact.trie.n_tools, []
    for r in range(N_ROWS):
        k = int(rng.integers(1, min(3, n_tools) + 1))
        row: dict = {"k": k}
        if rng.random() < 0.4:
            row["subset"] = sorted(rng.permutation(n_tools)[: rng.integers(k, n_tools + 1)].tolist())
        if r < N_ROWS - 1:
            row["prior"] = rng.integers(-2, 3, n_tools) / 2  # few values: ties between tools
            row["model_weight"] = float(rng.choice([0.0, 0.3, 1.0, 2.0]))
        rows.append(row)
    return rows


def _logits(artifact: Artifact, rng: np.random.Generator) -> np.ndarray:
    """Wider than the vocabulary (as vLLM pads it); integer-valued half the time (ties), else spread out."""
    shape = (N_ROWS, artifact.max_token_id + 4)
    if rng.random() < 0.5:
        return rng.integers(-1, 2, shape).astype(np.float32)
    return (rng.standard_normal(shape) * 3).astype(np.float32)


def _batch(artifact: Artifact, backend: str, rows: list[dict]) -> TrieBatch:
    batch = TrieBatch(artifact, backend=backend, capacity=N_ROWS)
    for r, row in enumerate(rows):
        batch.add(r, **row)
    return batch


def _check_walk(artifact: Artifact, backend: str, seed: int, max_steps: int = 40) -> None:
    """Walk a batch by ``choose`` and a twin by the argmax of its fused logits; at every step both agree, and the
    reference twin writes the same logits."""
    rng = np.random.default_rng(seed)
    rows = _rows(artifact, rng)
    chooser, writer = _batch(artifact, backend, rows), _batch(artifact, backend, rows)
    oracle = _batch(artifact, "reference", rows) if backend != "reference" else None
    for _ in range(max_steps):
        running = chooser.fetch().status[:N_ROWS] == RUNNING
        if not running.any():
            break
        logits = _logits(artifact, rng)
        written, masked = logits.copy(), logits.copy()
        writer.mask_logits_(masked)
        writer.fuse_logits_(written)
        if oracle is not None:
            expected = logits.copy()
            oracle.fuse_logits_(expected)
            np.testing.assert_array_equal(written, expected)
        choice = chooser.choose(logits)
        for r in np.flatnonzero(running).tolist():
            legal = masked[r] > -np.inf
            assert (written[r][~legal] == -np.inf).all()
            if "prior" not in rows[r]:
                np.testing.assert_array_equal(written[r], masked[r])
            if "prior" in rows[r]:  # the chosen token is the only maximum
                assert np.flatnonzero(written[r] == written[r].max()).tolist() == [choice.chosen[r]], (r, rows[r])
            assert int(np.argmax(written[r])) == choice.chosen[r], (r, rows[r])  # ties to the lower id
            best, _, log_total = choice.stats[r]
            row = written[r].astype(np.float64)
            finite = row[row > -np.inf]
            top = finite.max()
            logprob = row[choice.chosen[r]] - (top + np.log(np.exp(finite - top).sum()))
            assert logprob == pytest.approx(best - log_total, abs=1e-4), (r, rows[r])
        writer.accept(choice.chosen[:, None], lengths=(choice.chosen >= 0).astype(np.int32))
        if oracle is not None:
            oracle.accept(choice.chosen[:, None], lengths=(choice.chosen >= 0).astype(np.int32))
        for r in range(N_ROWS):
            for forced in choice.forced[r]:
                for twin in (writer, oracle):
                    if twin is not None:
                        twin.accept([[forced]], [r])
    assert (writer.fetch().table == chooser.fetch().table).all()


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@settings(max_examples=40, deadline=None)
@given(which=st.integers(0, 2), seed=st.integers(0, 10**6))
def test_the_argmax_of_the_fused_logits_is_the_choice_and_its_logprob_the_score(artifacts: list[Artifact],
                                                                                backend: str, which: int,
                                                                                seed: int) -> None:
    _check_walk(artifacts[which], backend, seed)


@pytest.mark.parametrize("backend", [CUDA])
def test_the_cuda_kernel_writes_what_the_reference_writes(artifacts: list[Artifact], backend: str) -> None:
    for seed in range(2 if config.ENABLE_CUDASIM else 20):
        _check_walk(artifacts[seed % 3], backend, seed, max_steps=8 if config.ENABLE_CUDASIM else 40)


def test_a_tie_with_the_chosen_hop_is_moved_one_float_step_down(artifacts: list[Artifact]) -> None:
    """"get" may end or go on ("get_user"): every hop is valued by get's prior, and the hop that starts the
    best next tool (by prior) must win the argmax even though lower-id hops hold the same value."""
    tokenizer = TokenizerInfo.load("gpt2")
    artifact = compile_registry(make_registry([{"name": n} for n in ("get", "get_user", "set", "sum", "x")],
                                              name="ties"), tokenizer, Contract(separator=" "))
    names = [tool.name for tool in artifact.registry.tools]
    prior = np.zeros(len(names))
    prior[names.index("get")], prior[names.index("x")] = 1.0, 0.5  # next tool: "x", whose first token is not lowest
    for backend in ("reference", "cpu"):
        batch = TrieBatch(artifact, backend=backend, capacity=1)
        batch.add(0, k=2, prior=prior, model_weight=0.0)
        logits = np.zeros((1, artifact.max_token_id + 1), np.float32)
        batch.accept([tokenizer.encode("get")])
        written = logits.copy()
        batch.fuse_logits_(written)
        top = written[0].max()
        assert (written[0] == top).sum() == 1, backend
        assert tokenizer.decode([int(np.argmax(written[0]))]).strip() == "x", backend
        assert ((written[0] < top) & (written[0] == np.nextafter(top, np.float32(-np.inf)))).any(), backend


def test_ranked_rows_need_float32_logits(artifacts: list[Artifact]) -> None:
    batch = TrieBatch(artifacts[0], capacity=1)
    batch.add(0, k=1, prior=np.zeros(artifacts[0].trie.n_tools), model_weight=1.0)
    with pytest.raises(DecodeError, match="float32"):
        batch.fuse_logits_(np.zeros((1, artifacts[0].max_token_id + 1), np.float16))
