"""Every consumer of the batch state gives the same legal sets for the same token streams, without vLLM: vLLM's
rows (``integrations/vllm_rows.ArtifactRows``, fed as vLLM feeds them: one token per step, then a mask written on
the logits) against the readable rules (``kernels/rules.py``), ``TrieMatcher``'s bitmask and the Hugging Face
processor's mask, token for token. The streams are the engine's own answers with the tiny model, and random legal
walks."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from support.serve import small_artifact, tiny_model

from tooltrie.compiler import Artifact, TokenizerInfo
from tooltrie.integrations.hf import TrieLogitsProcessor
from tooltrie.integrations.vllm_rows import ArtifactRows, RequestArgs, publish_artifact
from tooltrie.kernels import TrieMatcher, allocate_token_bitmask
from tooltrie.kernels.bitmask import allowed_tokens
from tooltrie.kernels.rules import Slot, advance, legal_moves
from tooltrie.serve.engine import Engine, Request

QUERIES = ("What is the weather in Paris?", "stock price of ACME", "book a table and a flight, then convert euros")


def engine_rule(artifact: Artifact, k: int, stream: list[int]) -> list[list[int]]:
    """The engine's legal set before each token of ``stream`` (and after the last), from ``kernels/rules.py``."""
    slot, sets = Slot.start(artifact.trie, k), []
    for token in stream:
        moves = legal_moves(artifact.trie, slot, artifact.eos_id)
        sets.append(sorted(moves))
        slot = advance(artifact.trie, slot, moves[token])
    sets.append([artifact.eos_id])  # after the answer: only the stop token
    return sets


def finite(row: torch.Tensor) -> list[int]:
    return torch.isfinite(row).nonzero().flatten().tolist()


def rows_sets(path: str, artifact: Artifact, k: int, stream: list[int]) -> list[list[int]]:
    """What vLLM's rows allow before each token: one row, fed one new token per step, masking fresh logits."""
    rows, sets = ArtifactRows("cpu"), []
    rows.add(3, RequestArgs(path, k))
    for end in range(len(stream) + 1):
        logits = torch.zeros((1, artifact.max_token_id + 1))
        sets.append(finite(rows.apply(logits, [3], [stream[end - 1 : end]])[0]))
    assert rows.fed[3] == len(stream)
    return sets


def matcher_sets(artifact: Artifact, k: int, stream: list[int]) -> list[list[int]]:
    matcher, sets = TrieMatcher(artifact, k), []
    bitmask = allocate_token_bitmask(1, artifact.max_token_id + 1)
    for token in [*stream, None]:
        if matcher.is_terminated():
            sets.append([artifact.eos_id])
            break
        matcher.fill_next_token_bitmask(bitmask)
        sets.append(allowed_tokens(bitmask[0], artifact.max_token_id + 1).tolist())
        assert token is not None and matcher.accept_token(token)
    return sets


def processor_sets(artifact: Artifact, k: int, stream: list[int]) -> list[list[int]]:
    """``TrieLogitsProcessor`` under a generate-like loop over one row."""
    processor, sets = TrieLogitsProcessor(artifact, k), []
    prompt = [5, 6, 7]
    for end in range(len(stream) + 1):
        scores = torch.zeros((1, artifact.max_token_id + 1))
        masked = processor(torch.tensor([prompt + stream[:end]]), scores)
        sets.append(torch.nonzero(masked[0] == 0).flatten().tolist())
    return sets


def random_walk(artifact: Artifact, k: int, rng: random.Random) -> list[int]:
    matcher, stream = TrieMatcher(artifact, k), []
    while not matcher.is_terminated():
        token = rng.choice(matcher.legal_tokens() or [])
        assert matcher.accept_token(token)
        stream.append(token)
    return stream


@pytest.fixture(scope="module")
def artifacts(smollm: TokenizerInfo, catalog_artifact: Artifact) -> dict[str, Artifact]:
    return {"small": small_artifact(smollm), "catalog": catalog_artifact}


@pytest.fixture(scope="module")
def paths(artifacts: dict[str, Artifact], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each artifact's name in the processor's root ($TOOLTRIE_ARTIFACT_ROOT, conftest's)."""
    folder = tmp_path_factory.mktemp("rows")
    return {name: publish_artifact(artifact.save(folder / f"{name}.trie.safetensors"))
            for name, artifact in artifacts.items()}


@pytest.fixture(scope="module")
def engine_streams(artifacts: dict[str, Artifact], smollm: TokenizerInfo) -> list[tuple[str, int, list[int]]]:
    """The engine's own answers (token ids, stop included) with the tiny model, for k = 1..3 on both registries."""
    streams = []
    for name, artifact in artifacts.items():
        engine = Engine(tiny_model(), smollm, artifact, max_batch=4)
        requests = [Request(query, k) for k in (1, 2, 3) for query in QUERIES]
        for request, answer in zip(requests, engine.run(requests), strict=True):
            assert answer.finish_reason == "stop"
            streams.append((name, request.k, answer.token_ids))
    return streams


def all_streams(artifacts: dict[str, Artifact], engine_streams: list[tuple[str, int, list[int]]], walks: int
                ) -> list[tuple[str, int, list[int]]]:
    rng = random.Random(7)
    return engine_streams + [(name, k, random_walk(artifacts[name], k, rng)) for name in artifacts
                             for k in (1, 2, 3, 5) for _ in range(walks)]


# oracle -> (its legal sets, random walks per registry and k besides the engine's answers; the processor is slower)
ORACLES: dict[str, tuple[Callable[[Artifact, int, list[int]], list[list[int]]], int]] = {
    "engine rules": (engine_rule, 6),
    "TrieMatcher bitmask": (matcher_sets, 6),
    "TrieLogitsProcessor": (processor_sets, 1),
}


@pytest.mark.parametrize("oracle", list(ORACLES))
def test_same_streams_give_identical_masks(oracle: str, artifacts: dict[str, Artifact], paths: dict[str, str],
                                           engine_streams: list[tuple[str, int, list[int]]]) -> None:
    legal_sets, walks = ORACLES[oracle]
    for name, k, stream in all_streams(artifacts, engine_streams, walks):
        artifact = artifacts[name]
        assert rows_sets(paths[name], artifact, k, stream) == legal_sets(artifact, k, stream), (name, k, stream)


def test_an_illegal_token_is_an_error_state_that_only_allows_stop(artifacts: dict[str, Artifact],
                                                                  paths: dict[str, str]) -> None:
    artifact = artifacts["catalog"]
    rows, vocab = ArtifactRows("cpu"), artifact.max_token_id + 1
    rows.add(0, RequestArgs(paths["catalog"], 1))
    first = finite(rows.apply(torch.zeros((1, vocab)), [0], [[]])[0])
    illegal = next(t for t in range(vocab) if t not in first)
    for tokens in ([illegal], [5, 6]):  # it never leaves the state
        assert finite(rows.apply(torch.zeros((1, vocab)), [0], [tokens])[0]) == [artifact.eos_id]


def test_rows_mask_only_their_own_logits_rows_across_two_artifacts(artifacts: dict[str, Artifact],
                                                                   paths: dict[str, str]) -> None:
    """Rows of two artifacts in one batch, moved and swapped as vLLM's persistent batch does, keep their own
    states; a row that is not ours is left untouched."""
    small, catalog = artifacts["small"], artifacts["catalog"]
    vocab = max(small.max_token_id, catalog.max_token_id) + 1
    streams = {"small": random_walk(small, 2, random.Random(5)), "catalog": random_walk(catalog, 3, random.Random(6))}
    rows = ArtifactRows("cpu")
    rows.add(0, RequestArgs(paths["small"], 2))
    rows.add(1, RequestArgs(paths["catalog"], 3))
    where = {"small": 0, "catalog": 1}  # which vLLM row each request is in
    fed = {"small": 0, "catalog": 0}
    rng = random.Random(0)
    for step in range(max(map(len, streams.values())) + 1):
        if step % 3 == 1:  # swap the two requests
            rows.move(where["small"], where["catalog"], swap=True)
            where = {"small": where["catalog"], "catalog": where["small"]}
        elif step % 3 == 2:  # move one request to a free row
            name = rng.choice(list(where))
            free = next(r for r in range(2, 6) if r not in where.values())
            rows.move(where[name], free, swap=False)
            where[name] = free
        layout = [*where.values(), 7]  # logits rows: ours, then one that is not
        rng.shuffle(layout)
        logits = torch.randn((len(layout), vocab))
        original = logits.clone()
        owner = {row: name for name, row in where.items()}
        new = [streams[owner[row]][fed[owner[row]] - 1 : fed[owner[row]]] if row in owner and fed[owner[row]] else []
               for row in layout]
        masked = rows.apply(logits, [row if row in owner else -1 for row in layout], new)
        for i, row in enumerate(layout):
            if row not in owner:
                assert torch.equal(masked[i], original[i])
                continue
            name = owner[row]
            artifact, stream = (small, streams["small"]) if name == "small" else (catalog, streams["catalog"])
            expected = engine_rule(artifact, 2 if name == "small" else 3, stream)[min(fed[name], len(stream))]
            assert finite(masked[i]) == expected, (step, name)
            assert torch.equal(masked[i, expected], original[i, expected])
            fed[name] = min(fed[name] + 1, len(stream))


def test_a_recomputed_request_starts_over(artifacts: dict[str, Artifact], paths: dict[str, str]) -> None:
    artifact = artifacts["catalog"]
    stream, other = random_walk(artifact, 2, random.Random(1)), random_walk(artifact, 2, random.Random(2))
    rows, vocab = ArtifactRows("cpu"), artifact.max_token_id + 1
    rows.add(0, RequestArgs(paths["catalog"], 2))
    rows.apply(torch.zeros((1, vocab)), [0], [stream[:-1]])
    rows.add(0, RequestArgs(paths["catalog"], 2))  # preempted, recomputed: added again
    assert finite(rows.apply(torch.zeros((1, vocab)), [0], [other[:2]])[0]) == engine_rule(artifact, 2, other)[2]


def test_many_rows_of_two_artifacts_keep_their_own_states_as_the_tables_grow(artifacts: dict[str, Artifact],
                                                                             paths: dict[str, str]) -> None:
    """Forty requests of two artifacts in rows 0..39 (past the row tables' first sizes), each fed its walk one
    token a step in a shuffled layout, beside rows that are not ours (one given tokens it must ignore)."""
    rng = random.Random(11)
    names = ["small", "catalog"]
    streams = {row: (names[row % 2], random_walk(artifacts[names[row % 2]], 2, rng)) for row in range(40)}
    vocab = max(artifact.max_token_id for artifact in artifacts.values()) + 1
    rows = ArtifactRows("cpu")
    for row, (name, _) in streams.items():
        rows.add(row, RequestArgs(paths[name], 2))
    for step in range(max(len(stream) for _, stream in streams.values()) + 1):
        layout = [*streams, 45, -1]
        rng.shuffle(layout)
        logits = torch.randn((len(layout), vocab))
        original = logits.clone()
        new = [streams[row][1][step - 1 : step] if row in streams else ([7] if row == 45 else []) for row in layout]
        masked = rows.apply(logits, layout, new)
        for i, row in enumerate(layout):
            if row not in streams:
                assert torch.equal(masked[i], original[i])
                continue
            name, stream = streams[row]
            assert finite(masked[i]) == engine_rule(artifacts[name], 2, stream)[min(step, len(stream))], (step, row)
    assert rows.fed[45] == 0 and 45 not in rows


def test_the_cpu_mask_writes_only_legal_logits_into_a_buffer_that_outlives_what_samplers_do_to_it(
        artifacts: dict[str, Artifact], paths: dict[str, str]) -> None:
    """On a CPU ``apply`` returns a buffer that gets only the legal logits, reused from step to step; each step's
    result equals masking that step's logits in place (what a step with a thinking budget does), although the
    sampler divided the last result by a temperature and wrote -inf over all but its top 2 of each row, and the
    batch grows, shrinks and reorders, with rows that are not ours among them."""
    rng = random.Random(3)
    names = ["small", "catalog"]
    streams = {row: (names[row % 2], random_walk(artifacts[names[row % 2]], 1 + row % 3, rng)) for row in range(12)}
    vocab = max(artifact.max_token_id for artifact in artifacts.values()) + 1
    buffered, in_place = ArtifactRows("cpu"), ArtifactRows("cpu")
    for row, (name, _) in streams.items():
        buffered.add(row, RequestArgs(paths[name], 1 + row % 3))
        in_place.add(row, RequestArgs(paths[name], 1 + row % 3, thinking_budget=True))
    fed = dict.fromkeys(streams, 0)
    for step in range(max(len(stream) for _, stream in streams.values()) + 1):
        layout = rng.sample(list(streams), rng.randint(1, len(streams))) + [20, -1][: rng.randint(0, 2)]
        rng.shuffle(layout)
        new = []
        for row in layout:  # a row in the layout takes its next token; one left out this step catches up later
            stream = streams[row][1] if row in streams else []
            new.append(stream[fed[row] - 1 : fed[row]] if row in streams and fed[row] else [])
        logits = torch.randn((len(layout), vocab))
        expected = in_place.apply(logits.clone(), layout, new)
        masked = buffered.apply(logits.clone(), layout, new)
        assert torch.equal(masked, expected), step
        masked.div_(0.7)  # what vLLM's sampler then does to the result, in place
        top = masked.topk(2, dim=1).indices
        keep = torch.zeros_like(masked, dtype=torch.bool).scatter_(1, top, True)
        masked.masked_fill_(~keep, float("-inf"))
        for row in layout:
            if row in streams:
                fed[row] = min(fed[row] + 1, len(streams[row][1]))
