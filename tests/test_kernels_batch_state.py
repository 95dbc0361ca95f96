"""The persistent batch state against per-row oracles, as a hypothesis state machine.

Random interleavings of what engines do between and during steps — add a request (k, subset, thinking, no
grammar), remove it, move or swap rows, accept tokens chosen elsewhere (legal ones, illegal ones, the stop token,
reasoning markers), fill a bitmask, mask logits in place, choose (random and tied logits, forced runs after),
checkpoint and roll back a row — on random registries whose names are token-prefixes of each other. After every
operation each backend's state must equal the readable oracle's (``kernels/rules.py`` slots, advanced here by the
rules written out), and every output (chosen tokens, statistics, decision counts, forced runs, bitmasks, masked
logits) must equal what the oracle says. The CPU and reference backends run in one machine; the CUDA backend (under
``NUMBA_ENABLE_CUDASIM=1``, or on a GPU) in a smaller one: the simulator costs ~0.1 s per block.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from numba import config, cuda

from tooltrie.compiler import Artifact, Contract, TokenizerInfo, compile_registry
from tooltrie.errors import DecodeError
from tooltrie.kernels import TrieBatch
from tooltrie.kernels.bitmask import allocate_token_bitmask, allowed_tokens
from tooltrie.kernels.cpu import logits_bits
from tooltrie.kernels.reference import ReferenceBackend
from tooltrie.kernels.rules import Slot, Status, advance, committed, fail, legal_moves
from tooltrie.kernels.state import DONE, ERROR, RUNNING
from tooltrie.kernels.walk import mask_rows
from tooltrie.ranker import PerAsk
from tooltrie.registry import make_registry

POOL = ["get", "get_user", "get_user_id", "set", "setup", "a", "ab", "abc", "météo", "search", "search_web", "x"]
MARKER = 0  # the reasoning-end marker of these tests ("!" in GPT-2), a token no trie starts with
ROWS = 6


@dataclass
class Row:
    """The oracle's row: a trie slot (constrained rows), or the plain status of a row without a grammar."""

    slot: Slot | None
    thinking: bool
    plain_status: Status = Status.RUNNING
    ranker: np.ndarray | None = None  # the model's weight, then each tool's prior
    follow: Any = None  # how the prior follows the answer, and the committed tools the ranker holds it for
    followed: tuple[int, ...] = ()

    @property
    def status(self) -> Status:
        return self.slot.status if self.slot is not None else self.plain_status


def _registries(tokenizer: TokenizerInfo) -> list[Artifact]:
    rng = random.Random(19)
    artifacts = []
    # " ": the next name's first token absorbs the separator, so a hop's edges are the names' own (a used tool can
    # close one); with the others a hop's edge is the separator's token, shared by every name.
    for i, separator in enumerate([", ", "\n", " | ", " "]):
        names = rng.sample(POOL, rng.randint(4, len(POOL)))
        artifacts.append(compile_registry(make_registry([{"name": n} for n in names], name=f"random{i}"), tokenizer,
                                          Contract(separator=separator)))
    return artifacts


@pytest.fixture(scope="module")
def artifacts() -> list[Artifact]:
    return _registries(TokenizerInfo.load("gpt2"))


class BatchMachine(RuleBasedStateMachine):
    backends: tuple[str, ...] = ()
    artifacts: ClassVar[list[Artifact]] = []

    @initialize(which=st.integers(0, 3))
    def start(self, which: int) -> None:
        self.artifact = self.artifacts[which]
        self.eos = self.artifact.eos_id
        self.vocab = self.artifact.max_token_id + 1
        self.trie_tokens = sorted(set(self.artifact.trie.edge_token.tolist()))
        # "cpu, every node cached": every node's mask precomputed (walk.mark_node), not only the wide ones
        options = {"cpu, every node cached": ("cpu", {"cached_min_edges": 1})}
        self.batches = {name: TrieBatch(self.artifact, backend=options.get(name, (name, {}))[0], capacity=2,
                                        reasoning_end_id=MARKER, **options.get(name, (name, {}))[1])
                        for name in self.backends}
        self.rows: dict[int, Row] = {}
        self.saved: dict[int, tuple[Row, dict[str, Any]]] = {}
        self.oracle = ReferenceBackend(self.artifact)

    # -- the oracle ----------------------------------------------------------------------------------------------

    def _legal(self, row: Row) -> list[int] | None:
        """The oracle's legal next tokens (None: anything; for a thinking row, anything but stop)."""
        if row.status is not Status.RUNNING:
            return [self.eos]
        if row.slot is None or row.thinking:
            return None
        return sorted(legal_moves(self.artifact.trie, row.slot, self.eos))

    def _accept(self, row: Row, token: int) -> Row:
        if row.status is not Status.RUNNING:
            return row
        if row.slot is None or row.thinking:
            if token < 0 or (row.thinking and token == self.eos):
                return replace(row, slot=fail(row.slot) if row.slot else None, plain_status=Status.ERROR)
            if row.thinking and token == MARKER:
                return replace(row, thinking=False)
            if row.slot is None and token == self.eos:
                return replace(row, plain_status=Status.DONE)
            return row
        move = legal_moves(self.artifact.trie, row.slot, self.eos).get(token)
        return replace(row, slot=fail(row.slot) if move is None else advance(self.artifact.trie, row.slot, move))

    def _forced(self, row: Row) -> tuple[Row, list[int]]:
        forced: list[int] = []
        while row.slot is not None and not row.thinking and row.status is Status.RUNNING:
            moves = legal_moves(self.artifact.trie, row.slot, self.eos)
            if len(moves) != 1:
                break
            (move,) = moves.values()
            forced.append(move.token)
            row = replace(row, slot=advance(self.artifact.trie, row.slot, move))
        return row, forced

    def _expected_row(self, row: Row) -> list[int]:
        legal = self._legal(row)
        if legal is None:
            return [t for t in range(self.vocab) if not (row.slot is not None and t == self.eos)]
        return legal

    # -- rows come and go ------------------------------------------------------------------------------------------

    @rule(row=st.integers(0, ROWS - 1), k=st.integers(1, 3),
          kind=st.sampled_from(["trie", "trie", "thinking", "plain"]), subset_seed=st.none() | st.integers(0, 1000),
          ranker=st.none() | st.tuples(st.sampled_from([0.0, 0.5, 1.0]), st.integers(0, 1000),
                                       st.sampled_from(["static", "follows", "asks"])))
    def add(self, row: int, k: int, kind: str, subset_seed: int | None,
            ranker: tuple[float, int, str] | None) -> None:
        n_tools = self.artifact.trie.n_tools
        subset = None
        if subset_seed is not None and kind != "plain":
            rng = random.Random(subset_seed)
            subset = frozenset(rng.sample(range(n_tools), rng.randint(k, n_tools)))
        constrained = kind != "plain"
        prior, weight, follow = None, 1.0, None
        if ranker is not None:  # priors in quarters: ties between tools happen
            rng = np.random.default_rng(ranker[1])
            weight, prior = ranker[0], rng.integers(-4, 5, n_tools) / 4
            if ranker[2] != "static":  # each committed tool moves every tool's prior by its row of quarters
                moves = rng.integers(-4, 5, (n_tools, n_tools)) / 4
                follow = lambda tools, prior=prior, moves=moves: prior + moves[list(tools)].sum(axis=0)  # noqa: E731
            if ranker[2] == "asks":  # a request of 2 or 3 asks: one tool per ask, then the request's follow-up
                asks = (rng.integers(-4, 5, (int(rng.integers(2, 4)), n_tools)) / 4).astype(np.float32)
                follow = PerAsk(asks, prior.astype(np.float32), follow)
                prior = follow(())
        for batch in self.batches.values():
            batch.add(row, k, constrained=constrained, thinking=kind == "thinking", subset=subset, prior=prior,
                      model_weight=weight, follow=follow if constrained else None)
        slot = Slot.start(self.artifact.trie, k, subset) if constrained else None
        self.rows[row] = Row(slot, thinking=kind == "thinking",
                             ranker=None if prior is None else np.array([weight, *prior], np.float32),
                             follow=follow if constrained else None)
        self.saved.pop(row, None)

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        row = data.draw(st.sampled_from(sorted(self.rows)))
        for batch in self.batches.values():
            batch.remove(row)
        del self.rows[row]
        self.saved.pop(row, None)

    @precondition(lambda self: self.rows)
    @rule(data=st.data(), destination=st.integers(0, ROWS + 1), swap=st.booleans())
    def move(self, data: st.DataObject, destination: int, swap: bool) -> None:
        source, target = data.draw(st.sampled_from(sorted(self.rows))), destination
        for batch in self.batches.values():
            batch.swap(source, target) if swap else batch.move(source, target)
        moving, displaced = self.rows.pop(source), self.rows.pop(target, None)
        self.rows[target] = moving
        if swap and displaced is not None:
            self.rows[source] = displaced
        if source == target:
            self.rows[target] = moving
        self.saved.pop(source, None)
        self.saved.pop(target, None)

    # -- a step ----------------------------------------------------------------------------------------------------

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def accept(self, data: st.DataObject) -> None:
        rows = data.draw(st.lists(st.sampled_from(sorted(self.rows)), min_size=1, max_size=4, unique=True))
        tokens = []
        for row in rows:
            legal = self._legal(self.rows[row])
            choices = st.sampled_from(legal) if legal else st.integers(0, self.vocab - 1)
            how = data.draw(st.sampled_from(["legal", "legal", "legal", "trie", "any", "stop", "marker"]))
            token = {"legal": choices, "trie": st.sampled_from(self.trie_tokens),  # often legal elsewhere, not here
                     "any": st.integers(-1, self.vocab + 5), "stop": st.just(self.eos), "marker": st.just(MARKER)}[how]
            run = data.draw(st.lists(token, min_size=0, max_size=2))
            tokens.append(run)
            for t in run:
                self.rows[row] = self._accept(self.rows[row], t)
        layout = [*rows, -1]  # a row of the engine's batch that is not ours
        for batch in self.batches.values():
            batch.accept([*tokens, [self.eos, 5]], layout)
        self._follow_answers()

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def fill(self, data: st.DataObject) -> None:
        rows = data.draw(st.permutations(sorted(self.rows)))
        layout = [*rows, -1]
        for name, batch in self.batches.items():
            bitmask = allocate_token_bitmask(len(layout), self.vocab)
            batch.fill_bitmask(bitmask, layout)
            for i, row in enumerate(rows):
                assert allowed_tokens(bitmask[i], self.vocab).tolist() == self._expected_row(self.rows[row]), name
            assert (bitmask[-1] == -1).all(), name  # untouched

    @precondition(lambda self: self.rows)
    @rule(data=st.data(), dtype=st.sampled_from(["float32", "float16"]))
    def mask(self, data: st.DataObject, dtype: str) -> None:
        rows = data.draw(st.permutations(sorted(self.rows)))
        logits = np.random.default_rng(data.draw(st.integers(0, 99))).standard_normal(
            (len(rows) + 1, self.vocab)).astype(dtype)
        for name, batch in self.batches.items():
            masked = logits.copy()
            batch.mask_logits_(masked, [*rows, -1])
            for i, row in enumerate(rows):
                kept = np.flatnonzero(masked[i] > -np.inf).tolist()
                assert kept == self._expected_row(self.rows[row]), name
                np.testing.assert_array_equal(masked[i, kept], logits[i, kept])
                assert np.isneginf(np.delete(masked[i], kept)).all()
            np.testing.assert_array_equal(masked[-1], logits[-1])

    @precondition(lambda self: self.rows)
    @rule(data=st.data(), tied=st.booleans())
    def choose(self, data: st.DataObject, tied: bool) -> None:
        rows = data.draw(st.permutations(sorted(self.rows)))
        layout = [*rows, -1]
        rng = np.random.default_rng(data.draw(st.integers(0, 99)))
        logits = (rng.integers(0, 3, (len(layout), self.vocab)) if tied
                  else rng.standard_normal((len(layout), self.vocab))).astype(np.float32)
        expected = [self._choose(row, logits[i]) for i, row in enumerate(rows)]
        self._follow_answers()
        for name, batch in self.batches.items():
            choice = batch.choose(logits, layout)
            for i, (chosen, stats, decision, forced) in enumerate(expected):
                assert choice.chosen[i] == chosen, name
                assert choice.forced[i] == forced, name
                if decision is not None:
                    assert choice.decision[i].tolist() == decision, name
                if stats is None:
                    assert np.isnan(choice.stats[i]).all(), name
                else:
                    np.testing.assert_allclose(choice.stats[i], stats, rtol=1e-9, atol=1e-9, err_msg=name)
            assert choice.chosen[-1] == -1 and choice.forced[-1] == []

    def _choose(self, row_index: int, logits: np.ndarray) -> tuple[int, Any, Any, list[int]]:
        row = self.rows[row_index]
        if row.status is not Status.RUNNING:
            return -1, None, None, []
        decision = None
        if row.slot is None or row.thinking:
            candidates = [(float(logits[t]), t) for t in range(self.vocab) if not (row.slot and t == self.eos)]
        else:
            moves = legal_moves(self.artifact.trie, row.slot, self.eos)
            candidates = [(float(logits[t]), t) for t in moves]
            continuing = sum(m.kind != "hop" for m in moves.values())
            decision = [len(moves), continuing, row.slot.emitted + (continuing == 0)]
        token = max(candidates, key=lambda c: (c[0], -c[1]))[1]
        if row.ranker is not None and decision is not None:  # the fused ranker, as the reference writes it out
            candidates, token = self.oracle._ranked(row.slot, moves, candidates, row.ranker)
        values = sorted((v for v, _ in candidates), reverse=True)
        top = values[0]
        total = top + math.log(sum(math.exp(v - top) for v in values if v > -math.inf))
        stats = [top, values[1] if len(values) > 1 else -math.inf, total]
        row = self._accept(row, token)
        row, forced = self._forced(row)
        self.rows[row_index] = row
        return token, stats, decision, forced

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def checkpoint(self, data: st.DataObject) -> None:
        row = data.draw(st.sampled_from(sorted(self.rows)))
        self.saved[row] = (self.rows[row], {name: batch.checkpoint(row) for name, batch in self.batches.items()})

    @precondition(lambda self: self.saved)
    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        row = data.draw(st.sampled_from(sorted(self.saved)))
        self.rows[row], saved = self.saved[row]
        for name, batch in self.batches.items():
            batch.restore(row, saved[name])
        self._follow_answers()

    def _follow_answers(self) -> None:
        """A running row whose prior follows its answer gets the prior of its committed tools (``rules.committed``)."""
        for index, row in self.rows.items():
            if row.follow is None or row.status is not Status.RUNNING:
                continue
            tools = committed(self.artifact.trie, row.slot)
            if tools != row.followed:
                self.rows[index] = replace(row, ranker=np.array([row.ranker[0], *row.follow(tools)], np.float32),
                                           followed=tools)

    # -- after every operation -------------------------------------------------------------------------------------

    @invariant()
    def every_backend_holds_the_oracles_rows(self) -> None:
        if not hasattr(self, "batches"):
            return
        for name, batch in self.batches.items():
            state = batch.fetch()
            for row, expected in self.rows.items():
                assert int(state.status[row]) == int(expected.status), (name, row)
                assert bool(state.thinking[row]) == expected.thinking, (name, row)
                if expected.slot is not None:
                    got = state.slot(row)
                    assert (got.node, got.depth, got.used) == (expected.slot.node, expected.slot.depth,
                                                                expected.slot.used), (name, row)
                    whole = frozenset(range(self.artifact.trie.n_tools))  # no subset: every tool
                    assert (got.allowed or whole) == (expected.slot.allowed or whole), (name, row)
                if expected.ranker is not None:  # the prior the row's next choice reads
                    np.testing.assert_array_equal(state.ranker[row], expected.ranker, err_msg=f"{name} {row}")


@pytest.mark.parametrize("backends", [("reference", "cpu", "cpu, every node cached")])
def test_batch_state_machine_host_backends(artifacts: list[Artifact], backends: tuple[str, ...]) -> None:
    machine = type("HostBatchMachine", (BatchMachine,), {"backends": backends, "artifacts": artifacts})
    run_state_machine_as_test(machine, settings=settings(max_examples=40, stateful_step_count=25, deadline=None,
                                                         suppress_health_check=[HealthCheck.too_slow]))


@pytest.mark.skipif(not (config.ENABLE_CUDASIM or cuda.is_available()),
                    reason="no GPU here and NUMBA_ENABLE_CUDASIM is not set: the CUDA kernels cannot run")
def test_batch_state_machine_cuda_backend(artifacts: list[Artifact]) -> None:
    machine = type("CudaBatchMachine", (BatchMachine,), {"backends": ("cuda", "cpu"), "artifacts": artifacts})
    run_state_machine_as_test(machine, settings=settings(max_examples=12, stateful_step_count=10, deadline=None,
                                                         suppress_health_check=[HealthCheck.too_slow]))


def test_the_status_values_are_the_oracles() -> None:
    assert (RUNNING, DONE, ERROR) == (Status.RUNNING, Status.DONE, Status.ERROR)


def test_every_pair_is_accepted_once_and_refused_as_a_repeat_where_the_rules_refuse_it(
        artifacts: list[Artifact]) -> None:
    """Accepting the canonical tokens of every answer [a, b], side by side in one batch, one accept call per token
    position: the compiled walk's rows fail at the very token where the readable rules (the reference backend) fail
    them, and end done when a != b, in the error state when a == b."""
    for artifact in artifacts:
        names = artifact.registry.names
        pairs = [(a, b) for a in names for b in names]
        streams = [[*artifact.token_path([a, b]), artifact.eos_id] for a, b in pairs]
        batches = {name: TrieBatch(artifact, backend=name, capacity=len(pairs)) for name in ("reference", "cpu")}
        for batch in batches.values():
            for row in range(len(pairs)):
                batch.add(row, 2)
        for position in range(max(map(len, streams))):
            for batch in batches.values():
                batch.accept([stream[position : position + 1] for stream in streams])
            np.testing.assert_array_equal(batches["cpu"].fetch().table, batches["reference"].fetch().table)
        status = batches["cpu"].fetch().status
        for row, (a, b) in enumerate(pairs):
            assert int(status[row]) == (ERROR if a == b else DONE), (artifact.registry.name, a, b)


def test_accept_takes_ragged_lists_and_arrays_with_lengths_alike(artifacts: list[Artifact]) -> None:
    """The two forms of ``accept``'s tokens give the same states; bad lengths are refused before any row moves."""
    artifact = artifacts[0]
    rng = random.Random(3)
    streams = []
    for _ in range(5):
        names = rng.sample(artifact.registry.names, 2)
        streams.append([*artifact.token_path(names), artifact.eos_id])
    ragged = [stream[: rng.randint(0, 4)] for stream in streams]
    lists, arrays = TrieBatch(artifact, capacity=5), TrieBatch(artifact, capacity=5)
    for batch in (lists, arrays):
        for row in range(5):
            batch.add(row, 2)
    array = np.full((5, 4), 7, dtype=np.int32)  # 7: padding past each row's length, never read
    for i, tokens in enumerate(ragged):
        array[i, : len(tokens)] = tokens
    lists.accept(ragged)
    arrays.accept(array, lengths=np.array([len(t) for t in ragged]))
    np.testing.assert_array_equal(lists.state.table, arrays.state.table)
    with pytest.raises(DecodeError, match="lengths"):
        arrays.accept(array, lengths=np.array([5, 0, 0, 0, 0]))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
       n_words=st.integers(1, 5), extra_cols=st.integers(-31, 40))
def test_the_compiled_mask_writes_minus_inf_exactly_where_the_bitmask_is_clear(
        data: st.DataObject, dtype: str, n_words: int, extra_cols: int) -> None:
    """``walk.mask_rows`` (word by word: fills, selects, skips) against the bitmask read bit by bit, for every float
    width, rows left alone (-1), a last partial word and columns past the bitmask."""
    import torch

    n_cols = max(1, 32 * n_words + extra_cols)
    words = st.sampled_from([0, -1]) | st.integers(-(2**31), 2**31 - 1)
    bitmask = np.array(data.draw(st.lists(st.lists(words, min_size=n_words, max_size=n_words), min_size=1,
                                          max_size=4)), dtype=np.int32)
    rows = np.array(data.draw(st.lists(st.sampled_from([-1, 0]), min_size=len(bitmask), max_size=len(bitmask))),
                    dtype=np.int32)
    logits = torch.arange(1, len(bitmask) * n_cols + 1, dtype=torch.float32).reshape(len(bitmask), n_cols)
    logits = logits.to(getattr(torch, dtype))
    masked = logits.clone()
    view, minus_inf = logits_bits(masked)
    mask_rows(bitmask, rows, view, minus_inf)
    allowed = np.zeros((len(bitmask), n_cols), dtype=bool)
    width = min(n_cols, 32 * n_words)
    allowed[:, :width] = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :width]
    allowed[rows < 0] = True
    expected = torch.where(torch.from_numpy(allowed), logits, torch.tensor(-math.inf, dtype=logits.dtype))
    assert torch.equal(masked, expected)


def test_the_public_step_keeps_its_backend(artifacts: list[Artifact], monkeypatch: pytest.MonkeyPatch) -> None:
    """``kernels.step`` makes its CPU backend once per artifact, not at every step, and a backend that only chooses
    never builds the node masks a fill reads; the steps still choose what the reference chooses."""
    from tooltrie.kernels import BatchState, cpu, step

    made: list[Artifact] = []
    init = cpu.CpuBackend.__init__

    def counting(self: cpu.CpuBackend, artifact: Artifact, **options: Any) -> None:
        made.append(artifact)
        init(self, artifact, **options)

    monkeypatch.setattr(cpu.CpuBackend, "__init__", counting)
    cpu._step_backend.cache_clear()
    rng = np.random.default_rng(4)
    for artifact in artifacts[:2]:
        state, oracle = BatchState.start(artifact, [2, 1]), BatchState.start(artifact, [2, 1])
        for _ in range(6):
            logits = rng.standard_normal((2, artifact.max_token_id + 1)).astype(np.float32)
            np.testing.assert_array_equal(step(artifact, state, logits),
                                          step(artifact, oracle, logits, backend="reference"))
    assert made == artifacts[:2]
    assert all("node_masks" not in vars(cpu._step_backend(a, None)) for a in artifacts[:2])
