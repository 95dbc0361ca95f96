"""Decision statistics from the walk (``stats [B, 3]``: best, runner-up, log-sum-exp over a row's candidates)
against a direct NumPy computation over the legal tokens of ``kernels/rules.py``, and the chosen tokens against
the NumPy reference step (unchanged by asking for statistics).

The CPU backend always runs; the CUDA kernels run on a GPU or under ``NUMBA_ENABLE_CUDASIM=1`` (else skipped with
the reason). Integer-valued hidden states and weights make every dot product exact in float32 and float64, so
ties are real ties: the runner-up must equal the best there.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from numba import config, cuda

from tooltrie.compiler import TokenizerInfo, compile_registry
from tooltrie.compiler.artifact import Artifact
from tooltrie.errors import DecodeError
from tooltrie.kernels import BatchState, VocabMap, step
from tooltrie.kernels import cpu as cpu_backend
from tooltrie.kernels.rules import legal_moves
from tooltrie.kernels.state import RUNNING
from tooltrie.registry import make_registry

NAMES = ["get", "get_user", "set", "setup", "a", "ab", "météo"]
HAS_CUDA = bool(config.ENABLE_CUDASIM or cuda.is_available())
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no GPU here and NUMBA_ENABLE_CUDASIM is not set")


@pytest.fixture(scope="module")
def artifact() -> Artifact:
    return compile_registry(make_registry([{"name": n} for n in NAMES], name="tools"), TokenizerInfo.load("gpt2"))


def expected_stats(artifact: Artifact, state: BatchState, logits: np.ndarray, vocab: VocabMap) -> np.ndarray:
    """(best, runner-up, log-sum-exp) per row over its candidates, from ``state`` before the step: the legal
    tokens (``rules.legal_moves``) that the output vocabulary keeps, or every column but the excluded stop token
    for a plain row; NaN rows for slots that are not running."""
    out = np.full((len(state), 3), np.nan)
    for row in range(len(state)):
        if state.status[row] != RUNNING:
            continue
        if not state.constrained[row] or state.thinking[row]:
            excluded = artifact.eos_id if state.constrained[row] else -1
            columns = np.flatnonzero(vocab.output_to_full != excluded)
        else:
            legal = legal_moves(artifact.trie, state.slot(row), artifact.eos_id)
            columns = np.array([vocab.full_to_output[t] for t in legal if vocab.full_to_output[t] >= 0], dtype=int)
        values = logits[row, columns].astype(np.float64)
        values = np.sort(np.where(np.isnan(values), -np.inf, values))[::-1]
        finite = values[values > -np.inf]
        out[row] = (values[0] if len(values) else -np.inf, values[1] if len(values) > 1 else -np.inf,
                    np.logaddexp.reduce(finite) if len(finite) else -np.inf)
    return out


def _integer_case(rng: np.random.Generator, batch: int, n_cols: int, hidden_size: int = 4
                  ) -> tuple[np.ndarray, np.ndarray]:
    weights = rng.integers(-2, 3, size=(n_cols, hidden_size)).astype(np.float32)
    hidden = rng.integers(-2, 3, size=(batch, hidden_size)).astype(np.float32)
    return hidden, weights


def _pruned_vocab(artifact: Artifact, extra: int = 40) -> VocabMap:
    """The trie's tokens, the stop token and a few others: a small output vocabulary (plain rows stay cheap
    under the simulator), with one trie token pruned so a legal token can be missing from the scores."""
    trie_tokens = sorted(set(artifact.trie.edge_token.tolist()))
    kept = sorted(set(trie_tokens[1:]) | {artifact.eos_id} | set(range(100, 100 + extra)))
    return VocabMap.from_output_ids(kept, 50257)


# The batch: rows of different k, one limited to a subset, one without a grammar (plain argmax), one thinking.
KS = [3, 1, 2, 2, 2]
CONSTRAINED = [True, True, True, False, True]
THINKING = [False, False, False, False, True]
SUBSETS = [None, None, frozenset({0, 1, 4}), None, None]


def _start(artifact: Artifact) -> BatchState:
    return BatchState.start(artifact, KS, constrained=CONSTRAINED, thinking=THINKING, subsets=SUBSETS)


@pytest.mark.parametrize("pruned", [False, True], ids=["full-vocab", "pruned-vocab"])
def test_cpu_sparse_step_stats_equal_direct_computation(artifact: Artifact, pruned: bool) -> None:
    vocab = _pruned_vocab(artifact) if pruned else VocabMap.identity(50257)
    rng = np.random.default_rng(5)
    state_ref, state_cpu = _start(artifact), _start(artifact)
    for _ in range(16):
        hidden, weights = _integer_case(rng, len(KS), len(vocab.output_to_full))
        logits = hidden @ weights.T
        wanted = expected_stats(artifact, state_ref, logits, vocab)
        expected = step(artifact, state_ref, logits, backend="reference", vocab=vocab, reasoning_end_id=13)
        stats = np.full((len(KS), 3), 7.0)
        chosen = cpu_backend.sparse_step(artifact, state_cpu, hidden, weights, vocab=vocab, stats=stats,
                                         reasoning_end_id=13)
        np.testing.assert_array_equal(chosen, expected)
        np.testing.assert_array_equal(state_cpu.table, state_ref.table)
        np.testing.assert_allclose(stats, wanted, rtol=1e-12, atol=1e-12)
        if (state_ref.status[:3] != RUNNING).all():
            break
    assert (state_ref.status[:3] != RUNNING).all()


def test_a_bfloat16_head_decides_as_its_float32_widening(artifact: Artifact) -> None:
    """The sparse head read as bfloat16 bits (no float32 copy of the model's head) gives the choices, states and
    statistics of the same head widened to float32, bit for bit; non-integer weights of both signs, -0 and NaN."""
    import torch

    from tooltrie.kernels import walk

    rng = np.random.default_rng(11)
    state_wide, state_bits = _start(artifact), _start(artifact)
    for _ in range(16):
        head = torch.from_numpy(rng.standard_normal((50257, 6)).astype(np.float32) * 3).to(torch.bfloat16)
        head[artifact.trie.edge_token[:2], 1] = float("nan")
        head[artifact.trie.edge_token[2:4]] = -0.0
        hidden = rng.standard_normal((len(KS), 6)).astype(np.float32)
        wide_stats, bits_stats = np.empty((len(KS), 3)), np.empty((len(KS), 3))
        wide = cpu_backend.sparse_step(artifact, state_wide, hidden, head.float().numpy(), stats=wide_stats)
        bits = cpu_backend.sparse_step(artifact, state_bits, hidden, head, stats=bits_stats)
        np.testing.assert_array_equal(bits, wide)
        np.testing.assert_array_equal(state_bits.table, state_wide.table)
        np.testing.assert_array_equal(bits_stats, wide_stats)
        if (state_wide.status[:3] != RUNNING).all():
            break
    assert (state_wide.status[:3] != RUNNING).all()
    head = torch.from_numpy(rng.standard_normal((40, 6)).astype(np.float32)).to(torch.bfloat16)
    as_bits, widened = cpu_backend.as_numpy_head(head), head.float().numpy()
    assert as_bits.dtype == np.int16 and np.shares_memory(as_bits, head.view(torch.int16).numpy())
    for col in range(40):
        assert walk.score(as_bits, hidden, 1, col) == walk.score(widened, hidden, 1, col)  # the Python twin's


def test_cpu_dense_step_stats_count_nan_as_minus_infinity(artifact: Artifact) -> None:
    rng = np.random.default_rng(9)
    state_ref, state_cpu = _start(artifact), _start(artifact)
    vocab = VocabMap.identity(50257)
    for _ in range(16):
        logits = rng.integers(-3, 3, size=(len(KS), 50257)).astype(np.float32) / 2
        logits[rng.random(logits.shape) < 0.3] = np.nan
        logits[:, artifact.trie.edge_token[:3]] = np.nan  # some legal tokens are NaN for sure
        wanted = expected_stats(artifact, state_ref, logits, vocab)
        expected = step(artifact, state_ref, logits, backend="reference")
        stats = np.empty((len(KS), 3))
        np.testing.assert_array_equal(cpu_backend.step(artifact, state_cpu, logits, stats=stats), expected)
        np.testing.assert_allclose(stats, wanted, rtol=1e-12, atol=1e-12)
        if (state_ref.status[:3] != RUNNING).all():
            break


def test_single_candidate_has_no_runner_up_and_no_candidate_is_minus_infinity(artifact: Artifact) -> None:
    # Only "a"'s first token kept among the trie's: one legal token at the root, then none after it.
    a_token = int(TokenizerInfo.load("gpt2").encode("a")[0])
    vocab = VocabMap.from_output_ids([a_token, 5, 6], 50257)
    state = BatchState.start(artifact, [2])
    stats = np.empty((1, 3))
    logits = np.array([[1.5, 9.0, 9.0]], dtype=np.float32)
    assert cpu_backend.step(artifact, state, logits, vocab=vocab, stats=stats).tolist() == [a_token]
    np.testing.assert_array_equal(stats, [[1.5, -np.inf, 1.5]])


def test_stats_of_the_wrong_shape_are_refused(artifact: Artifact) -> None:
    state = BatchState.start(artifact, [1, 1])
    logits = np.zeros((2, 50257), dtype=np.float32)
    for bad in (np.empty((1, 3)), np.empty((2, 2)), np.empty((2, 3), np.float32)):
        with pytest.raises(DecodeError, match="stats must be float64"):
            cpu_backend.step(artifact, state, logits, stats=bad)


def _cuda_run(stepper: Any, state: BatchState, hidden: np.ndarray, weights: np.ndarray, vocab: VocabMap,
              subsets: Any) -> tuple[np.ndarray, np.ndarray]:
    chosen = np.full(len(state), -7, dtype=np.int32)
    stats = np.full((len(state), 3), 7.0)
    stepper.sparse_step(state.table, hidden, weights, chosen, subsets=subsets, vocab=vocab, stats=stats,
                        reasoning_end_id=13)
    return chosen, stats


@needs_cuda
@pytest.mark.parametrize(("placement", "layout"), [("constant", "warp"), ("global", "thread")])
def test_cuda_sparse_step_stats_equal_direct_computation(artifact: Artifact, placement: str, layout: str) -> None:
    """Few rows, pruned vocabulary: the simulator costs ~0.1-0.4 s per block."""
    from tooltrie.kernels.cuda import CudaStepper

    stepper = CudaStepper(artifact, placement=placement, layout=layout)
    vocab = _pruned_vocab(artifact, extra=8)
    rng = np.random.default_rng(21)
    state_ref, state_dev = _start(artifact), _start(artifact)
    subsets = stepper.subsets(state_ref.allowed)
    for _ in range(10):
        hidden, weights = _integer_case(rng, len(KS), len(vocab.output_to_full))
        logits = hidden @ weights.T
        wanted = expected_stats(artifact, state_ref, logits, vocab)
        expected = step(artifact, state_ref, logits, backend="reference", vocab=vocab, reasoning_end_id=13)
        chosen, stats = _cuda_run(stepper, state_dev, hidden, weights, vocab, subsets)
        np.testing.assert_array_equal(chosen, expected)
        np.testing.assert_array_equal(state_dev.table, state_ref.table)
        np.testing.assert_allclose(stats, wanted, rtol=1e-12, atol=1e-12)
        if (state_ref.status[:3] != RUNNING).all():
            break
    assert (state_ref.status[:3] != RUNNING).all()


@needs_cuda
def test_cuda_dense_step_stats_and_bfloat16_refused(artifact: Artifact) -> None:
    from tooltrie.kernels.cuda import CudaStepper

    stepper = CudaStepper(artifact, layout="warp")
    vocab = _pruned_vocab(artifact, extra=8)
    state_ref, state_dev = BatchState.start(artifact, [2, 1]), BatchState.start(artifact, [2, 1])
    rng = np.random.default_rng(4)
    logits = rng.integers(-3, 3, size=(2, len(vocab.output_to_full))).astype(np.float32)
    logits[0, :4] = np.nan
    wanted = expected_stats(artifact, state_ref, logits, vocab)
    expected = step(artifact, state_ref, logits, backend="reference", vocab=vocab)
    chosen, stats = np.full(2, -7, dtype=np.int32), np.empty((2, 3))
    stepper.step(state_dev.table, logits, chosen, vocab=vocab, stats=stats)
    np.testing.assert_array_equal(chosen, expected)
    np.testing.assert_allclose(stats, wanted, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="bfloat16"):
        stepper.step(state_dev.table, logits.view(np.int16)[:, ::2].copy(), chosen, vocab=vocab, stats=stats)
