"""Property tests of the batched step (``tooltrie.kernels.step``, backends ``reference`` and ``cpu``).

Every finished constrained row holds exactly k distinct registry tools, its ids are the canonical ids of their
rendering plus the stop token, and parsing the decoded text gives the tools back. The two backends agree token
for token and table for table; each choice is checked against the rules restated in the test (argmax over the
legal tokens, ties toward the lower id, NaN lowest). Plus: logits dtypes (NumPy float16/32/64, torch incl.
bfloat16), vocabulary pruning, k at and past the bounds, eviction (``compact``), slot reuse (``reset``) and
reasoning rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.kernels import (
    BACKENDS,
    BUNDLED,
    NAME_ALPHABET,
    SEPARATORS,
    bundled,
    compile_names,
    expected_choice,
    legal_tokens,
)

from tooltrie.compiler import Artifact, TokenizerInfo
from tooltrie.errors import DecodeError
from tooltrie.kernels import BatchState, TrieMatcher, VocabMap, step
from tooltrie.kernels.state import DONE, ERROR, RUNNING

LogitsKind = str
KINDS: tuple[LogitsKind, ...] = ("normal", "few-values", "all-equal", "nan-sprinkled", "all-nan", "all-neg-inf")


def examples(n: int) -> settings:
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@cache
def artifact_for(names: tuple[str, ...], tokenizer_name: str, separator: str) -> Artifact:
    return compile_names(list(names), bundled(tokenizer_name), separator)


def width_of(artifact: Artifact) -> int:
    return max(bundled_vocab(artifact), int(artifact.trie.edge_token.max()) + 1, artifact.eos_id + 1)


def bundled_vocab(artifact: Artifact) -> int:
    return int(artifact.tokenizer_meta["vocab_size"])


def make_logits(kind: LogitsKind, rows: int, width: int, rng: np.random.Generator) -> np.ndarray[Any, Any]:
    if kind == "normal":
        return rng.standard_normal((rows, width)).astype(np.float32)
    if kind == "few-values":
        return rng.integers(0, 3, size=(rows, width)).astype(np.float32)
    if kind == "all-equal":
        return np.zeros((rows, width), np.float32)
    if kind == "nan-sprinkled":
        logits = rng.standard_normal((rows, width)).astype(np.float32)
        logits[rng.random((rows, width)) < 0.3] = np.nan
        return logits
    if kind == "all-nan":
        return np.full((rows, width), np.nan, np.float32)
    if kind == "all-neg-inf":
        return np.full((rows, width), -np.inf, np.float32)
    raise ValueError(kind)


def plain_expected(row_logits: np.ndarray[Any, Any], vocab: VocabMap | None, excluded: int = -1) -> int:
    """Plain argmax by the rules' order: NaN counts as -inf, ties go to the lowest full id, ``excluded`` (the
    stop token of a constrained row still thinking) is never taken."""
    values = np.where(np.isnan(row_logits), -np.inf, row_logits)
    full = np.arange(len(values)) if vocab is None else np.asarray(vocab.output_to_full)
    allowed = full != excluded
    best = values[allowed].max()
    return int(full[(values == best) & allowed].min())


def expected_step(artifact: Artifact, state: BatchState, logits: np.ndarray[Any, Any], *,
                  vocab: VocabMap | None = None, reasoning_end_id: int | None = None) -> list[int | None]:
    """What each row must choose, from the rules (None: not pinned down here, only agreement is checked)."""
    out: list[int | None] = []
    for row in range(len(state)):
        if int(state.status[row]) != RUNNING:
            out.append(-1)
        elif not state.constrained[row] or state.thinking[row]:
            excluded = artifact.eos_id if state.constrained[row] else -1
            out.append(plain_expected(np.asarray(logits[row], np.float64), vocab, excluded))
        else:
            f2o = None if vocab is None else vocab.full_to_output
            out.append(expected_choice(legal_tokens(artifact, state.slot(row)), np.asarray(logits[row], np.float64),
                                       f2o))
    return out


def lockstep(artifact: Artifact, states: dict[str, BatchState], logits: Any, **options: Any) -> list[int]:
    """One step on every backend with the same logits; checks the choices against the rules and each other."""
    expected = expected_step(artifact, states["reference"], np.asarray(logits), **options)
    chosen = {backend: step(artifact, state, logits, backend=backend, **options).tolist()
              for backend, state in states.items()}
    for backend, tokens in chosen.items():
        for row, (want, got) in enumerate(zip(expected, tokens, strict=True)):
            if want is not None:
                assert got == want, f"{backend}: row {row} chose {got}, the rules say {want}"
    assert chosen["cpu"] == chosen["reference"]
    np.testing.assert_array_equal(states["cpu"].table, states["reference"].table)
    return chosen["reference"]


def start_both(artifact: Artifact, ks: Sequence[int], **kwargs: Any) -> dict[str, BatchState]:
    return {backend: BatchState.start(artifact, ks, **kwargs) for backend in BACKENDS}


def max_steps(artifact: Artifact, k: int) -> int:
    return k * (artifact.trie.max_depth + 1) + 2


def check_answer(artifact: Artifact, tokenizer: TokenizerInfo, state: BatchState, row: int, ids: list[int],
                 k: int) -> None:
    names = artifact.registry.names
    assert int(state.status[row]) == DONE, f"row {row} did not finish"
    tools = state.tools(row)
    assert len(tools) == k and len(set(tools)) == k
    rendered = [names[t] for t in tools]
    assert ids == [*tokenizer.encode(artifact.contract.render(rendered)), tokenizer.eos_id]
    assert artifact.contract.parse(tokenizer.decode(ids[:-1])) == rendered


@st.composite
def registries(draw: st.DrawFn, min_size: int = 1) -> tuple[tuple[str, ...], str, str]:
    names = tuple(draw(st.lists(st.sampled_from(NAME_ALPHABET), min_size=min_size, max_size=7, unique=True)))
    return names, draw(st.sampled_from(BUNDLED)), draw(st.sampled_from(SEPARATORS))


# ----------------------------------------------------------------------------------------------------------------


@examples(40)
@given(registry=registries(), data=st.data())
def test_batched_decode_valid_and_backends_agree(registry: tuple[tuple[str, ...], str, str],
                                                 data: st.DataObject) -> None:
    names, tokenizer_name, separator = registry
    artifact, tokenizer = artifact_for(names, tokenizer_name, separator), bundled(tokenizer_name)
    n = len(names)
    rows = data.draw(st.lists(st.one_of(st.integers(1, n), st.none()), min_size=1, max_size=6), label="rows")
    kind = data.draw(st.sampled_from(KINDS), label="logits")
    dtype = data.draw(st.sampled_from([np.float32, np.float64]), label="dtype")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    ks = [k if k is not None else 1 for k in rows]
    constrained = [k is not None for k in rows]
    states = start_both(artifact, ks, constrained=constrained)
    width = width_of(artifact)
    ids: list[list[int]] = [[] for _ in rows]
    for _ in range(max_steps(artifact, max(ks))):
        if not (states["reference"].status[np.asarray(constrained)] == RUNNING).any():
            break
        logits = make_logits(kind, len(rows), width, rng)
        for row, has_grammar in enumerate(constrained):
            if not has_grammar and np.isnan(logits[row]).any():  # plain rows: NaN order has its own test
                logits[row] = rng.standard_normal(width)
        for row, token in enumerate(lockstep(artifact, states, logits.astype(dtype))):
            if token >= 0:
                ids[row].append(token)
    for row, k in enumerate(rows):
        if k is not None:
            check_answer(artifact, tokenizer, states["reference"], row, ids[row], k)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["all-equal", "all-nan", "all-neg-inf"])
def test_full_ties_pick_lowest_legal_id(backend: str, kind: LogitsKind) -> None:
    artifact = artifact_for(("get", "get_user", "getUser", "a", "ab", "search"), "gpt2", ", ")
    state = BatchState.start(artifact, [1, 2, 3, 6])
    rng = np.random.default_rng(0)
    while (state.status == RUNNING).any():
        lowest = [min(legal_tokens(artifact, state.slot(row))) if state.status[row] == RUNNING else -1
                  for row in range(len(state))]
        assert step(artifact, state, make_logits(kind, len(state), width_of(artifact), rng),
                    backend=backend).tolist() == lowest
    assert (state.status == DONE).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_ranks_lowest(backend: str) -> None:
    """A NaN logit loses to every finite number; among NaNs the lowest legal id wins."""
    artifact = artifact_for(("a", "b", "c"), "smollm2-135m", ", ")
    width = width_of(artifact)
    root = sorted(legal_tokens(artifact, BatchState.start(artifact, [1]).slot(0)))
    assert len(root) == 3
    for values, want in [([np.nan, np.nan, -1e30], root[2]), ([np.nan, -3.0, np.nan], root[1]),
                         ([np.nan, np.nan, np.nan], root[0]), ([np.nan, np.nan, np.inf], root[2])]:
        logits = np.full((1, width), 5.0, np.float32)  # illegal tokens: high, never chosen
        logits[0, root] = values
        state = BatchState.start(artifact, [1])
        assert step(artifact, state, logits, backend=backend).tolist() == [want], values


DTYPE_REGISTRIES = [
    (("get", "get_user", "getUser", "a", "ab", "search", "météo"), "gpt2", ", "),
    (("a", "ab", "abc", "b", "x1", "x12"), "smollm2-135m", " | "),
]


@pytest.mark.parametrize(("backend", "dtype"), [
    ("reference", "float16"), ("cpu", "float16"),
    ("reference", "float64"), ("cpu", "float64"),
])
@pytest.mark.parametrize("registry", DTYPE_REGISTRIES, ids=["gpt2", "smollm2"])
def test_float16_and_float64_logits_choose_like_float32(registry: tuple[tuple[str, ...], str, str], dtype: str,
                                                       backend: str) -> None:
    """Values that float16 holds exactly: every dtype must make the same choices as float32 (ties included)."""
    names, tokenizer_name, separator = registry
    artifact = artifact_for(names, tokenizer_name, separator)
    ks = [1, len(names), 2, 3]
    width = width_of(artifact)
    for seed, kind in enumerate(KINDS[:4]):
        runs = {}
        for run_dtype in ("float32", dtype):
            rng = np.random.default_rng(seed)
            state = BatchState.start(artifact, ks)
            tokens: list[list[int]] = []
            for _ in range(max_steps(artifact, max(ks))):
                logits = np.round(make_logits(kind, len(ks), width, rng) * 8) / 8  # exact in float16
                tokens.append(step(artifact, state, logits.astype(run_dtype), backend=backend).tolist())
            runs[run_dtype] = tokens
        assert runs[dtype] == runs["float32"], kind


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_torch_logits_on_cpu_backend(dtype: str) -> None:
    torch = pytest.importorskip("torch")
    artifact = artifact_for(("get", "get_user", "getUser", "a", "ab", "search", "météo"), "gpt2", " | ")
    tokenizer = bundled("gpt2")
    ks = [1, 3, 7, 2]
    state, reference = BatchState.start(artifact, ks), BatchState.start(artifact, ks)
    generator = torch.Generator().manual_seed(0)
    ids: list[list[int]] = [[] for _ in ks]
    for _ in range(max_steps(artifact, 7)):
        logits = torch.randint(0, 4, (len(ks), width_of(artifact)), generator=generator).to(getattr(torch, dtype))
        chosen = step(artifact, state, logits, backend="cpu").tolist()
        assert chosen == step(artifact, reference, logits.float().numpy(), backend="reference").tolist()
        for row, token in enumerate(chosen):
            if token >= 0:
                ids[row].append(token)
    for row, k in enumerate(ks):
        check_answer(artifact, tokenizer, state, row, ids[row], k)


# ---------------------------------------------------------------------------------------------------- pruning


@examples(30)
@given(registry=registries(min_size=2), data=st.data())
def test_vocab_pruning(registry: tuple[tuple[str, ...], str, str], data: st.DataObject) -> None:
    """Logits over a pruned, shuffled output vocabulary: a pruned token is never chosen; a slot whose legal
    tokens are all pruned fails (status ERROR, chosen -1) and stays failed."""
    names, tokenizer_name, separator = registry
    artifact = artifact_for(names, tokenizer_name, separator)
    width = width_of(artifact)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    trie_tokens = np.unique(np.append(artifact.trie.edge_token, artifact.eos_id))
    keep_share = data.draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]), label="share of the trie's tokens kept")
    kept = trie_tokens[rng.random(len(trie_tokens)) < keep_share]
    others = rng.choice(np.setdiff1d(np.arange(width), trie_tokens), size=200, replace=False)
    output_to_full = rng.permutation(np.concatenate([kept, others]))
    vocab = VocabMap.from_output_ids(output_to_full, width)
    n = len(names)
    ks = [1, n, data.draw(st.integers(1, n), label="k")]
    states = start_both(artifact, ks)
    kind = data.draw(st.sampled_from(KINDS[:4]), label="logits")
    failed: set[int] = set()
    ids: list[list[int]] = [[] for _ in ks]
    for _ in range(max_steps(artifact, n)):
        if not (states["reference"].status == RUNNING).any():
            break
        chosen = lockstep(artifact, states, make_logits(kind, len(ks), len(output_to_full), rng), vocab=vocab)
        for row, token in enumerate(chosen):
            assert token == -1 or vocab.full_to_output[token] >= 0, "a pruned token was chosen"
            if row in failed:
                assert token == -1
            if int(states["reference"].status[row]) == ERROR:
                assert token == -1
                failed.add(row)
            elif token >= 0:
                ids[row].append(token)
    for row, k in enumerate(ks):
        if row not in failed:
            check_answer(artifact, bundled(tokenizer_name), states["reference"], row, ids[row], k)
    if keep_share == 0.0:
        assert failed == set(range(len(ks)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_legal_tokens_pruned_is_an_error(backend: str) -> None:
    artifact = artifact_for(("get", "get_user", "set"), "gpt2", ", ")
    width = width_of(artifact)
    state = BatchState.start(artifact, [2, 2], constrained=[True, False])
    root = legal_tokens(artifact, state.slot(0))
    output_to_full = np.array([t for t in range(width) if t not in root])
    vocab = VocabMap.from_output_ids(output_to_full, width)
    logits = np.zeros((2, len(output_to_full)), np.float32)
    logits[1, 7] = 1.0
    assert step(artifact, state, logits, backend=backend, vocab=vocab).tolist() == [-1, int(output_to_full[7])]
    assert int(state.status[0]) == ERROR and int(state.status[1]) == RUNNING
    assert step(artifact, state, logits, backend=backend, vocab=vocab).tolist()[0] == -1
    assert int(state.status[0]) == ERROR


# ------------------------------------------------------------------------------------------------------ bounds


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(3))
def test_k_equals_number_of_tools(backend: str, seed: int) -> None:
    names = ("get", "get_user", "getUser", "a", "ab", "abc", "météo")
    artifact, tokenizer = artifact_for(names, "smollm2-135m", "\n"), bundled("smollm2-135m")
    rng = np.random.default_rng(seed)
    state = BatchState.start(artifact, [len(names)] * 3)
    ids: list[list[int]] = [[] for _ in range(3)]
    for index in range(max_steps(artifact, len(names))):
        logits = make_logits(KINDS[index % 3], 3, width_of(artifact), rng)
        for row, token in enumerate(step(artifact, state, logits, backend=backend).tolist()):
            if token >= 0:
                ids[row].append(token)
    for row in range(3):
        check_answer(artifact, tokenizer, state, row, ids[row], len(names))
        assert sorted(state.tools(row)) == list(range(len(names)))


@pytest.mark.parametrize("k", [0, -1, 4, 100])
def test_k_outside_bounds_refused_up_front(k: int) -> None:
    artifact = artifact_for(("a", "b", "c"), "gpt2", ", ")
    with pytest.raises(DecodeError):
        BatchState.start(artifact, [1, k])
    with pytest.raises(DecodeError):
        TrieMatcher(artifact, k)
    state = BatchState.start(artifact, [1, 1])
    before = state.table.copy()
    with pytest.raises(DecodeError):
        state.add(artifact, 1, k)
    np.testing.assert_array_equal(state.table, before)
    BatchState.start(artifact, [k if k >= 0 else 0], constrained=[False])  # no grammar, no bound


# ---------------------------------------------------------------------------------------------- compact, reset


@examples(25)
@given(registry=registries(min_size=2), data=st.data())
def test_compact_kept_slots_continue_unchanged(registry: tuple[tuple[str, ...], str, str],
                                               data: st.DataObject) -> None:
    names, tokenizer_name, separator = registry
    artifact = artifact_for(names, tokenizer_name, separator)
    n, width = len(names), width_of(artifact)
    rows = data.draw(st.lists(st.integers(1, n), min_size=1, max_size=6), label="ks")
    constrained = data.draw(st.lists(st.booleans(), min_size=len(rows), max_size=len(rows)), label="constrained")
    evict_after = data.draw(st.integers(0, 4), label="steps before eviction")
    kept = data.draw(st.lists(st.booleans(), min_size=len(rows), max_size=len(rows)), label="kept")
    order = data.draw(st.permutations(range(sum(kept))), label="new order")
    mapping = np.full(len(rows), -1)
    mapping[np.nonzero(kept)[0]] = order
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    for backend in BACKENDS:
        full = BatchState.start(artifact, rows, constrained=constrained)
        compacted = BatchState.start(artifact, rows, constrained=constrained)
        for index in range(max_steps(artifact, n)):
            logits = make_logits("few-values", len(rows), width, rng)
            chosen = step(artifact, full, logits, backend=backend)
            if index < evict_after:
                assert step(artifact, compacted, logits, backend=backend).tolist() == chosen.tolist()
                continue
            if index == evict_after:
                compacted.compact(mapping)
                assert len(compacted) == sum(kept)
            old = np.argsort(np.where(mapping >= 0, mapping, len(rows)))[: sum(kept)]  # new index -> old slot
            got = step(artifact, compacted, logits[old], backend=backend)
            assert got.tolist() == chosen[old].tolist()
            np.testing.assert_array_equal(compacted.table, full.table[old])


@pytest.mark.parametrize("mapping", [
    [0, 0, 1],  # two slots sent to one index
    [0, 2, -1],  # a gap: kept slots must fill 0..kept-1
    [1, 2, 3],  # past the end
    [0, 1],  # wrong length
    [[0, 1, 2]],  # wrong shape
])
def test_compact_refuses_invalid_mapping(mapping: list[Any]) -> None:
    artifact = artifact_for(("a", "b", "c"), "gpt2", ", ")
    state = BatchState.start(artifact, [1, 2, 3])
    before = state.table.copy()
    with pytest.raises(DecodeError):
        state.compact(mapping)
    np.testing.assert_array_equal(state.table, before)


def test_compact_refuses_negative_index_other_than_minus_one() -> None:
    artifact = artifact_for(("a", "b", "c"), "gpt2", ", ")
    state = BatchState.start(artifact, [1, 2, 3])
    with pytest.raises(DecodeError):
        state.compact([0, -2, 1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_reset_finished_row_starts_a_new_answer(backend: str) -> None:
    names = ("get", "get_user", "getUser", "a", "ab", "search")
    artifact, tokenizer = artifact_for(names, "gpt2", ", "), bundled("gpt2")
    rng = np.random.default_rng(1)
    width = width_of(artifact)
    state, control = BatchState.start(artifact, [1, 6]), BatchState.start(artifact, [1, 6])
    ids: list[list[int]] = [[], []]
    while int(state.status[0]) == RUNNING:
        logits = make_logits("normal", 2, width, rng)
        chosen = step(artifact, state, logits, backend=backend).tolist()
        assert chosen == step(artifact, control, logits, backend=backend).tolist()
        ids[0].append(chosen[0])
        ids[1].append(chosen[1])
    check_answer(artifact, tokenizer, state, 0, ids[0], 1)
    for new_k in (2, 6):  # 6 is wider than the table was: the table grows
        state.add(artifact, 0, new_k)
        assert int(state.status[0]) == RUNNING and state.tools(0) == [] and int(state.k[0]) == new_k
        ids[0] = []
        while int(state.status[0]) == RUNNING:
            logits = make_logits("few-values", 2, width, rng)
            chosen = step(artifact, state, logits, backend=backend).tolist()
            if int(control.status[1]) == RUNNING:  # the other row continues as if nothing happened
                assert chosen[1] == step(artifact, control, logits, backend=backend).tolist()[1]
                ids[1].append(chosen[1])
            ids[0].append(chosen[0])
        check_answer(artifact, tokenizer, state, 0, ids[0], new_k)
    # Reused as a row without a grammar: plain argmax, done at the stop token.
    state.add(artifact, 0, 0, constrained=False)
    logits = np.zeros((2, width), np.float32)
    logits[0, artifact.eos_id] = 1.0
    assert step(artifact, state, logits, backend=backend).tolist()[0] == artifact.eos_id
    assert int(state.status[0]) == DONE


# --------------------------------------------------------------------------------------------------- reasoning


@examples(20)
@given(registry=registries(min_size=2), data=st.data())
def test_reasoning_rows_unconstrained_until_marker(registry: tuple[tuple[str, ...], str, str],
                                                   data: st.DataObject) -> None:
    names, tokenizer_name, separator = registry
    artifact, tokenizer = artifact_for(names, tokenizer_name, separator), bundled(tokenizer_name)
    width, n = width_of(artifact), len(names)
    marker = data.draw(st.integers(0, width - 1).filter(lambda t: t != artifact.eos_id), label="marker")
    ks = data.draw(st.lists(st.integers(1, n), min_size=1, max_size=4), label="ks")
    thinking = data.draw(st.lists(st.booleans(), min_size=len(ks), max_size=len(ks)), label="thinking")
    think_steps = data.draw(st.lists(st.integers(0, 5), min_size=len(ks), max_size=len(ks)), label="think steps")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    states = start_both(artifact, ks, thinking=thinking)
    matchers = [TrieMatcher(artifact, k, reasoning_end_id=marker if think else None)
                for k, think in zip(ks, thinking, strict=True)]
    answer_ids: list[list[int]] = [[] for _ in ks]
    seen_marker = [not think for think in thinking]
    for index in range(max(think_steps) + 1 + max_steps(artifact, max(ks))):
        logits = make_logits("normal", len(ks), width, rng)
        for row in range(len(ks)):
            if not seen_marker[row]:
                # Before the marker the argmax is anything but the marker: often the stop token or a token
                # no answer could start with; at the chosen step it is the marker.
                decoys = [artifact.eos_id, (marker + 1) % width, 0]
                target = marker if index == think_steps[row] else int(rng.choice(decoys))
                if target == marker and index != think_steps[row]:
                    target = artifact.eos_id
                logits[row, target] = 50.0
        chosen = lockstep(artifact, states, logits, reasoning_end_id=marker)
        for row, token in enumerate(chosen):
            if token < 0:
                continue
            assert matchers[row].accept_token(token)
            if seen_marker[row]:
                answer_ids[row].append(token)
            else:
                assert token == plain_expected(np.asarray(logits[row], np.float64), None, artifact.eos_id), (
                    "a thinking row takes plain argmax, never the stop token")
                assert matchers[row].legal_tokens() is None or token == marker
                seen_marker[row] = token == marker
    for row, k in enumerate(ks):
        check_answer(artifact, tokenizer, states["reference"], row, answer_ids[row], k)
        assert matchers[row].is_terminated() and matchers[row].tools() == states["reference"].tools(row)


# ------------------------------------------------------------------------ plain rows: the two backends agree


def test_plain_rows_with_nan_backends_agree() -> None:
    artifact = artifact_for(("a", "b"), "gpt2", ", ")
    width = width_of(artifact)
    logits = np.zeros((2, width), np.float32)
    logits[:, 7] = 1.0
    logits[:, 5] = np.nan
    chosen = {backend: step(artifact, BatchState.start(artifact, [1, 1], constrained=[False, True]), logits,
                            backend=backend).tolist() for backend in BACKENDS}
    assert chosen["cpu"] == chosen["reference"]


def test_plain_rows_with_ties_under_vocab_map_backends_agree() -> None:
    artifact = artifact_for(("a", "b"), "gpt2", ", ")
    width = width_of(artifact)
    output_to_full = np.arange(width)[::-1].copy()  # output column 0 is the highest full id
    vocab = VocabMap.from_output_ids(output_to_full, width)
    logits = np.zeros((1, width), np.float32)
    chosen = {backend: step(artifact, BatchState.start(artifact, [1], constrained=[False]), logits,
                            backend=backend, vocab=vocab).tolist() for backend in BACKENDS}
    assert chosen["cpu"] == chosen["reference"]


def test_unconstrained_thinking_row_stop_backends_agree() -> None:
    artifact = artifact_for(("a", "b"), "gpt2", ", ")
    logits = np.zeros((1, width_of(artifact)), np.float32)
    logits[0, artifact.eos_id] = 1.0
    tables = {}
    for backend in BACKENDS:
        state = BatchState.start(artifact, [1], constrained=[False], thinking=[True])
        assert step(artifact, state, logits, backend=backend, reasoning_end_id=100).tolist() == [artifact.eos_id]
        tables[backend] = state.table
    np.testing.assert_array_equal(tables["cpu"], tables["reference"])


# --------------------------------------------------------------------------- inputs that do not fit the state


# Each case builds (state, logits, vocab) from an artifact. The arrays are views into larger ones the test owns,
# so a backend that reads past them reads memory it may read (except the identity map of narrow logits).
MISFIT_CASES = {
    "narrow-logits": """
backing = np.zeros((1, width), np.float32)
state, logits, vocab = BatchState.start(artifact, [1]), backing[:, :10], None
""",
    "too-few-rows": """
backing = np.zeros((3, width), np.float32)
state, logits, vocab = BatchState.start(artifact, [1, 1, 1]), backing[:1], None
""",
    "small-vocab-map": """
backing = np.full(width, -1, np.int32)
backing[:10] = np.arange(10)
vocab = VocabMap(output_to_full=np.arange(10, dtype=np.int32), full_to_output=backing[:10])
state, logits = BatchState.start(artifact, [1]), np.zeros((1, 10), np.float32)
""",
}
MISFIT_RUN = """
import numpy as np
from support.kernels import bundled, compile_names
from tooltrie.kernels import BatchState, VocabMap, step
artifact = compile_names(["get", "get_user", "set", "a"], bundled("gpt2"))
width = {width}
{case}
try:
    chosen = step(artifact, state, logits, backend={backend!r}, vocab=vocab)
except (ValueError, IndexError) as exc:
    print("RAISED", type(exc).__name__)
else:
    print("CHOSE", chosen.tolist(), "status", state.status.tolist())
"""


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(MISFIT_CASES))
def test_logits_that_do_not_fit_are_refused(backend: str, case: str) -> None:
    """Logits narrower than the trie's token ids, fewer rows than slots, or a vocabulary map that does not cover
    the trie: the step must raise, never choose from memory outside the arrays. The cpu backend runs in a
    subprocess, so a crash fails this test instead of the session."""
    import subprocess
    import sys
    from pathlib import Path

    artifact = artifact_for(("get", "get_user", "set", "a"), "gpt2", ", ")
    script = MISFIT_RUN.format(width=width_of(artifact), case=MISFIT_CASES[case], backend=backend)
    if backend == "reference":
        namespace: dict[str, Any] = {}
        exec(compile("import numpy as np\nfrom tooltrie.kernels import BatchState, VocabMap\n" + MISFIT_CASES[case],
                     case, "exec"), {"artifact": artifact, "width": width_of(artifact)}, namespace)
        with pytest.raises((ValueError, IndexError)):
            step(artifact, namespace["state"], namespace["logits"], backend=backend, vocab=namespace["vocab"])
        return
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parent)
    assert done.returncode == 0 and done.stdout.startswith("RAISED"), (done.returncode, done.stdout,
                                                                         done.stderr[-2000:])


def test_state_narrower_than_k_refused() -> None:
    artifact = artifact_for(("get", "get_user", "set", "a"), "gpt2", ", ")
    with pytest.raises((DecodeError, ValueError)):
        BatchState.start(artifact, [3, 3], k_max=1)
