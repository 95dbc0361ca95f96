"""The CUDA kernels against the NumPy reference, step by step (device state included).

Runs on a GPU when there is one, else under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, which ``make test``
sets on machines without a GPU), else is skipped with the reason. The simulator costs ~0.1-0.4 s per block,
so the cases are small: a few slots, a few steps.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import numpy as np
import pytest
from numba import config, cuda

from tooltrie.compiler import Contract, TokenizerInfo, compile_registry
from tooltrie.kernels import BatchState, VocabMap, step
from tooltrie.kernels.state import DONE, ERROR, RUNNING
from tooltrie.registry import make_registry

if not (config.ENABLE_CUDASIM or cuda.is_available()):
    pytest.skip("no GPU here and NUMBA_ENABLE_CUDASIM is not set: the CUDA kernels cannot run",
                allow_module_level=True)

from tooltrie.kernels.cuda import CudaStepper

VARIANTS = [("constant", "warp"), ("constant", "thread"), ("global", "warp"), ("global", "thread")]


@pytest.fixture(scope="module")
def gpt2() -> TokenizerInfo:
    return TokenizerInfo.load("gpt2")


@pytest.fixture(scope="module")
def tools_artifact(gpt2: TokenizerInfo):
    names = ["get", "get_user", "set", "setup", "a", "ab", "météo"]
    return compile_registry(make_registry([{"name": n} for n in names], name="tools"), gpt2)


@pytest.fixture(scope="module")
def probe_artifact(gpt2: TokenizerInfo):
    """A different grammar (the health probe's), with its own separator."""
    return compile_registry(make_registry([{"name": n} for n in ["ping", "pong"]], name="probe"), gpt2,
                            Contract(separator=" | "))


def _tied_logits(rng: np.random.Generator, batch: int, vocab: int) -> np.ndarray:
    return rng.integers(0, 3, size=(batch, vocab)).astype(np.float32)


def _run_both(artifact, stepper, state_ref, state_dev, logits, **options):
    expected = step(artifact, state_ref, logits, backend="reference", **options)
    chosen = np.full(len(state_dev), -7, dtype=np.int32)
    stepper.step(state_dev.table, logits, chosen, **options)
    np.testing.assert_array_equal(chosen, expected)
    np.testing.assert_array_equal(state_dev.table, state_ref.table)


@pytest.mark.parametrize(("placement", "layout"), VARIANTS)
def test_kernel_equals_reference_on_mixed_batch(tools_artifact, placement, layout):
    stepper = CudaStepper(tools_artifact, placement=placement, layout=layout)
    assert stepper.placement == placement
    ks, constrained = [3, 1, 2], [True, True, False]  # the last row has no grammar: plain argmax
    state_ref = BatchState.start(tools_artifact, ks, constrained=constrained)
    state_dev = BatchState.start(tools_artifact, ks, constrained=constrained)
    rng = np.random.default_rng(7)
    for _ in range(14):
        _run_both(tools_artifact, stepper, state_ref, state_dev, _tied_logits(rng, 3, 50257))
        if (state_ref.status[:2] != RUNNING).all():
            break
    assert (state_ref.status[:2] == DONE).all()


def test_auto_placement_is_constant_for_a_small_trie(tools_artifact):
    assert CudaStepper(tools_artifact).placement == "constant"
    assert CudaStepper(tools_artifact, constant_budget=64).placement == "global"


def test_error_when_every_legal_token_is_pruned(tools_artifact):
    # An output vocabulary without the trie's first tokens: nothing is legal, so the slot fails loudly.
    first_tokens = set(tools_artifact.trie.edge_token.tolist())
    kept = [t for t in range(50257) if t not in first_tokens]
    vocab = VocabMap.from_output_ids(kept, 50257)
    stepper = CudaStepper(tools_artifact, layout="thread")
    state_ref, state_dev = BatchState.start(tools_artifact, [2]), BatchState.start(tools_artifact, [2])
    logits = np.random.default_rng(0).standard_normal((1, len(kept))).astype(np.float32)
    _run_both(tools_artifact, stepper, state_ref, state_dev, logits, vocab=vocab)
    assert state_dev.status[0] == ERROR


def test_two_grammars_alternating_never_mix(tools_artifact, probe_artifact):
    """Constant memory is per compiled kernel: launching the probe grammar between catalog steps must not
    change what the catalog kernel decides, and vice versa."""
    steppers = {name: CudaStepper(artifact, placement="constant", layout="thread")
                for name, artifact in (("tools", tools_artifact), ("probe", probe_artifact))}
    artifacts = {"tools": tools_artifact, "probe": probe_artifact}
    states = {name: (BatchState.start(a, [2]), BatchState.start(a, [2])) for name, a in artifacts.items()}
    rng = np.random.default_rng(3)
    for _ in range(12):
        for name in ("tools", "probe"):
            state_ref, state_dev = states[name]
            if state_ref.status[0] == RUNNING:
                _run_both(artifacts[name], steppers[name], state_ref, state_dev, _tied_logits(rng, 1, 50257))
    for name, (state_ref, _) in states.items():
        assert state_ref.status[0] == DONE, name
    probe_tools = {probe_artifact.registry.names[t] for t in states["probe"][1].tools(0)}
    assert probe_tools == {"ping", "pong"}


def test_sparse_head_picks_what_full_head_with_mask_picks(tools_artifact):
    """Integer-valued hidden states and weights make every dot product exact in float32 and float64, so the
    sparse head must equal the masked argmax of the full head exactly, ties included (tolerance: none)."""
    rng = np.random.default_rng(11)
    vocab, hidden_size, batch = 50257, 4, 2
    weights = rng.integers(-2, 3, size=(vocab, hidden_size)).astype(np.float32)
    stepper = CudaStepper(tools_artifact, layout="warp")
    state_ref = BatchState.start(tools_artifact, [2, 3])
    state_dev = BatchState.start(tools_artifact, [2, 3])
    for _ in range(12):
        hidden = rng.integers(-2, 3, size=(batch, hidden_size)).astype(np.float32)
        expected = step(tools_artifact, state_ref, hidden @ weights.T, backend="reference")
        chosen = np.full(batch, -7, dtype=np.int32)
        stepper.sparse_step(state_dev.table, hidden, weights, chosen)
        np.testing.assert_array_equal(chosen, expected)
        np.testing.assert_array_equal(state_dev.table, state_ref.table)
        if (state_ref.status != RUNNING).all():
            break
    assert (state_ref.status == DONE).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16-bits"])
def test_half_precision_logits(tools_artifact, dtype):
    rng = np.random.default_rng(5)
    stepper = CudaStepper(tools_artifact, layout="thread")
    state_ref, state_dev = BatchState.start(tools_artifact, [3]), BatchState.start(tools_artifact, [3])
    for _ in range(12):
        values = rng.integers(-4, 4, size=(1, 50257)).astype(np.float32) / 4  # exact in both half formats
        if dtype == "float16":
            device_logits = values.astype(np.float16)
        else:  # bfloat16 is the top half of float32's bits
            device_logits = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)
        expected = step(tools_artifact, state_ref, values, backend="reference")
        chosen = np.full(1, -7, dtype=np.int32)
        stepper.step(state_dev.table, device_logits, chosen)
        np.testing.assert_array_equal(chosen, expected)
        if state_ref.status[0] != RUNNING:
            break
    assert state_dev.status[0] == DONE


def _device_library(name: str) -> Any:
    """An array library whose CUDA arrays the kernel must take as they are: torch or CuPy, each its own case, skipped
    with the reason where its arrays cannot be made (the simulator, no such library, no GPU it sees)."""
    reason = "needs a real GPU (not the simulator)" if config.ENABLE_CUDASIM else None
    if reason is None:
        try:
            module = importlib.import_module(name)
        except ImportError:
            reason = f"{name} is not installed"
        else:
            if not (module.cuda.is_available() if name == "torch" else module.is_available()):
                reason = f"{name} sees no GPU"
    return name if reason is None else pytest.param(name, marks=pytest.mark.skip(reason=reason))


@pytest.mark.parametrize("library", [_device_library("torch"), _device_library("cupy")])
def test_device_arrays_zero_copy(tools_artifact, library):
    """torch CUDA tensors (on torch's current stream, bfloat16 included) and CuPy arrays go in as they are."""
    rng = np.random.default_rng(2)
    stepper = CudaStepper(tools_artifact)
    state_ref = BatchState.start(tools_artifact, [3, 2])
    if library == "torch":
        import torch

        table = torch.from_numpy(state_ref.table.copy()).cuda()
        chosen = torch.empty(2, dtype=torch.int32, device="cuda")
        to_device, to_host = (lambda a: torch.from_numpy(a).cuda()), (lambda a: a.cpu().numpy())
    else:
        import cupy

        table, chosen = cupy.asarray(state_ref.table), cupy.empty(2, dtype=cupy.int32)
        to_device, to_host = cupy.asarray, cupy.asnumpy
    for _ in range(14):
        values = (rng.integers(-4, 4, size=(2, 50257)) / 4).astype(np.float32)
        expected = step(tools_artifact, state_ref, values, backend="reference")
        logits = to_device(values)
        if library == "torch":
            logits = logits.to(torch.bfloat16)  # exact for these values
        stepper.step(table, logits, chosen)
        np.testing.assert_array_equal(to_host(chosen), expected)
        np.testing.assert_array_equal(to_host(table), state_ref.table)
        if (state_ref.status != RUNNING).all():
            break
    assert (state_ref.status == DONE).all()


@pytest.mark.skipif(bool(config.ENABLE_CUDASIM), reason="needs a real GPU: the simulator has no streams to follow")
def test_launches_follow_torch_streams_and_small_grids_do_not_warn(tools_artifact):
    """A launch is configured once per grid and torch stream: a step on another stream runs there, and a grid of
    one block (one slot: the usual case) raises no Numba performance warning."""
    torch = pytest.importorskip("torch")
    stepper = CudaStepper(tools_artifact)
    state_ref = BatchState.start(tools_artifact, [2])
    table = torch.from_numpy(state_ref.table.copy()).cuda()
    chosen = torch.empty(1, dtype=torch.int32, device="cuda")
    rng = np.random.default_rng(5)
    side = torch.cuda.Stream()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for stream in (torch.cuda.current_stream(), side, torch.cuda.current_stream()):
            values = rng.standard_normal((1, 50257)).astype(np.float32)
            expected = step(tools_artifact, state_ref, values, backend="reference")
            with torch.cuda.stream(stream):
                stepper.step(table, torch.from_numpy(values).cuda(), chosen)
            stream.synchronize()
            np.testing.assert_array_equal(chosen.cpu().numpy(), expected)
    assert len(stepper._launches) == 2


@pytest.mark.parametrize(("placement", "layout"), [("constant", "warp"), ("global", "thread")])
def test_subsets_counted_on_the_device_decode_as_the_reference(tools_artifact, placement, layout):
    """Rows limited to subsets: the device computes their edge counts from a bitmap (equal to the host's), and
    the kernel then chooses what the reference chooses, only ever tools of each row's subset."""
    stepper = CudaStepper(tools_artifact, placement=placement, layout=layout)
    subsets = [frozenset({0, 1, 4}), None, frozenset({6})]
    ks = [2, 2, 1]
    state_ref = BatchState.start(tools_artifact, ks, subsets=subsets)
    state_dev = BatchState.start(tools_artifact, ks)
    counts, allowed = stepper.subsets(state_ref.allowed)
    np.testing.assert_array_equal(counts.copy_to_host(), state_ref.counts)
    rng = np.random.default_rng(11)
    for _ in range(12):
        logits = _tied_logits(rng, 3, 50257)
        expected = step(tools_artifact, state_ref, logits, backend="reference")
        chosen = np.full(3, -7, dtype=np.int32)
        stepper.step(state_dev.table, logits, chosen, subsets=(counts, allowed))
        np.testing.assert_array_equal(chosen, expected)
        np.testing.assert_array_equal(state_dev.table, state_ref.table)
        if (state_ref.status != RUNNING).all():
            break
    assert (state_ref.status == DONE).all()
    assert set(state_ref.tools(0)) <= subsets[0] and state_ref.tools(2) == [6]


@pytest.mark.skipif(not cuda.is_available() or config.ENABLE_CUDASIM, reason="CuPy arrays need a real GPU")
def test_cupy_arrays_go_where_torch_tensors_do(tools_artifact):
    """A CuPy pipeline: logits and hidden states as CuPy arrays (``__cuda_array_interface__``, zero-copy) are masked
    and chosen on the device exactly as the CPU backend does on the host."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed (pip install 'tooltrie[cuda]')")
    from tooltrie.kernels import TrieBatch

    rng = np.random.default_rng(5)
    batches = {name: TrieBatch(tools_artifact, backend=name, capacity=3) for name in ("cuda", "cpu")}
    for batch in batches.values():
        for row, k in enumerate((1, 2, 3)):
            batch.add(row, k)
    for _ in range(8):
        logits = rng.standard_normal((3, 50257)).astype(np.float32)
        masked_gpu, masked_cpu = cupy.asarray(logits), logits.copy()
        batches["cuda"].mask_logits_(masked_gpu)
        batches["cpu"].mask_logits_(masked_cpu)
        np.testing.assert_array_equal(cupy.asnumpy(masked_gpu), masked_cpu)
        on_gpu, on_cpu = batches["cuda"].choose(cupy.asarray(logits)), batches["cpu"].choose(logits)
        np.testing.assert_array_equal(on_gpu.chosen, on_cpu.chosen)
        assert on_gpu.forced == on_cpu.forced
    np.testing.assert_array_equal(batches["cuda"].fetch().table, batches["cpu"].fetch().table)


@pytest.mark.skipif(not config.ENABLE_CUDASIM, reason="stands a handle in for torch's stream: the simulator's kernels")
def test_every_launch_goes_on_torch_s_current_stream(tools_artifact, monkeypatch):
    """Accepted tokens, forced runs, fill, mask, choose (dense and sparse) and subset counts each launch on torch's
    current stream, not Numba's default one: the model's work and the kernels then run in order on whichever stream
    the model is on. torch's stream is a stand-in handle here; each kernel configuration records the stream it got."""
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    import tooltrie.kernels.cuda as device
    from tooltrie.kernels.batch import TrieBatch

    class Stream:  # what ``cuda.external_stream`` gives, as far as the backend uses it
        def __init__(self, handle: int) -> None:
            self.handle = handle

        def synchronize(self) -> None:
            pass

    torch_stream = 0x7E57
    monkeypatch.setattr(device, "_torch_current_stream", lambda device=None: torch_stream)
    monkeypatch.setattr(device.cuda, "external_stream", Stream)
    launches: list[tuple[str, int | None]] = []
    configure = FakeCUDAKernel.__getitem__

    def spy(kernel, configuration):
        stream = configuration[2] if len(configuration) > 2 else None
        launches.append((kernel.fn.__name__, getattr(stream, "handle", stream)))
        return configure(kernel, configuration)

    monkeypatch.setattr(FakeCUDAKernel, "__getitem__", spy)
    batch = TrieBatch(tools_artifact, backend="cuda", capacity=2)
    batch.add(0, 2, subset={0, 1, 4})
    batch.add(1, 1)
    vocab = tools_artifact.max_token_id + 1
    batch.accept([[tools_artifact.trie.edge_token[0]], []])
    batch.follow_forced()
    batch.fill_bitmask(np.zeros((2, (vocab + 31) // 32), np.int32))
    batch.mask_logits_(np.zeros((2, vocab), np.float32))
    batch.choose(np.zeros((2, vocab), np.float32))
    batch.choose_sparse(np.ones((2, 4), np.float32), np.ones((vocab, 4), np.float32))
    batch.backend.subsets(np.ones((2, tools_artifact.trie.n_tools), np.uint8))  # a device pipeline's subsets
    assert {name for name, _ in launches} == {"_zero_counts", "_count_subset_paths", "accept", "forced", "fill",
                                              "_mask_kernel", "choose"}
    assert [launch for launch in launches if launch[1] != torch_stream] == []
