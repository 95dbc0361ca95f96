"""Reading training data: records walk the trie (their legal sets are the matcher's), and bad data is refused with
the file, line and what to do. Also: batches (shared prefix, answer positions, candidates) and the batch stream."""

from __future__ import annotations

import itertools
import json
import math
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.serve import small_artifact
from support.train import SMALL_LABELLED, make_record, write_training_data

from tooltrie.compiler import TokenizerInfo, compile_registry
from tooltrie.kernels.matcher import TrieMatcher
from tooltrie.registry import make_registry
from tooltrie.train.batches import balanced_batches, make_batch, shuffled_batches, stratified_sample, stratum
from tooltrie.train.data import Example, TrainingDataError, load_training_data


@pytest.fixture
def data_dir(tmp_path: Path, smollm: TokenizerInfo) -> Path:
    return write_training_data(tmp_path / "data", small_artifact(smollm), smollm)


def test_records_load_with_the_legal_tokens_of_each_answer_position(data_dir: Path, smollm: TokenizerInfo) -> None:
    artifact = small_artifact(smollm)
    data = load_training_data(data_dir, artifact)
    assert (len(data.train), len(data.validation)) == (len(SMALL_LABELLED), 4)
    assert data.meta.prompt_style == "short" and data.meta.registry_sha256 == artifact.registry.sha256
    for example, (query, tools) in zip(data.train, SMALL_LABELLED, strict=True):
        assert (example.query, example.tools, example.k) == (query, tools, len(tools))
        assert example.completion_ids[-1] == artifact.eos_id
        matcher = TrieMatcher(artifact, k=example.k)
        for token, legal in zip(example.completion_ids, example.legal, strict=True):
            assert legal == tuple(matcher.legal_tokens() or ()) and token in legal
            assert matcher.accept_token(token)
        assert matcher.is_terminated()
    assert any(len(legal) > 1 for e in data.train for legal in e.legal)  # there are choices to learn
    assert any(len(legal) == 1 for e in data.train for legal in e.legal)  # and forced tokens


def _rewrite(path: Path, line: int, change: dict[str, object]) -> None:
    lines = path.read_text(encoding="utf-8").splitlines()
    record = json.loads(lines[line - 1])
    record.update(change)
    lines[line - 1] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.mark.parametrize(("change", "expected"), [
    ({"completion_ids": [726, 999, 2]}, r"train.jsonl:2: completion token 1 \(999\) does not follow the trie"),
    ({"completion_ids": [726, 79]}, r"train.jsonl:2: the completion ends before the answer does"),
    ({"k": 2}, r"train.jsonl:2: k is 2 but 1 tools are given"),
    ({"prompt_ids": "not ids"}, r"train.jsonl:2: expected query, tools, prompt_ids and completion_ids"),
    ({"tools": ["get_user"]}, r"train.jsonl:2: the completion names \['get_users'\], the record \['get_user'\]"),
])
def test_a_bad_record_is_refused_with_its_line(data_dir: Path, smollm: TokenizerInfo, change: dict[str, object],
                                               expected: str) -> None:
    _rewrite(data_dir / "train.jsonl", 2, change)
    with pytest.raises(TrainingDataError, match=expected):
        load_training_data(data_dir, small_artifact(smollm))


def test_data_made_for_another_registry_is_refused(data_dir: Path, smollm: TokenizerInfo) -> None:
    other = compile_registry(make_registry([{"name": "get"}, {"name": "put"}], name="other"), smollm)
    with pytest.raises(TrainingDataError, match=r"'other' .* is not the 'small' it was made for .*training-data"):
        load_training_data(data_dir, other)


@pytest.mark.parametrize("problem", ["missing", "not json", "no hash"])
def test_a_bad_meta_file_is_refused(data_dir: Path, smollm: TokenizerInfo, problem: str) -> None:
    meta = data_dir / "meta.json"
    if problem == "missing":
        meta.unlink()
    elif problem == "not json":
        meta.write_text("{", encoding="utf-8")
    else:
        raw = json.loads(meta.read_text(encoding="utf-8"))
        del raw["contract_sha256"]
        meta.write_text(json.dumps(raw), encoding="utf-8")
    message = {"missing": "no such file; make the training data", "not json": "unreadable",
               "no hash": "no contract_sha256"}[problem]
    with pytest.raises(TrainingDataError, match=message):
        load_training_data(data_dir, small_artifact(smollm))


def test_gen_data_output_loads(tmp_path: Path, smollm: TokenizerInfo) -> None:
    """What ``tooltrie gen-data`` writes is what the trainer reads (a user query file, for the small registry)."""
    training_data = pytest.importorskip("tooltrie.train.training_data")
    artifact = small_artifact(smollm)
    queries = tmp_path / "queries.jsonl"
    queries.write_text("".join(json.dumps({"query": q, "tools": list(t)}) + "\n" for q, t in SMALL_LABELLED * 3),
                       encoding="utf-8")
    training_data.generate_training_data(tmp_path / "gen", artifact=artifact, tokenizer=smollm,
                                         queries=[str(queries)], descriptions=False, validation_fraction=0.25)
    data = load_training_data(tmp_path / "gen", artifact)
    assert data.meta.prompt_style == "short" and len(data.train) + len(data.validation) == 3 * len(SMALL_LABELLED)
    ours = make_record(artifact, smollm, data.train[0].query, data.train[0].tools)
    assert (list(data.train[0].prompt_ids), list(data.train[0].completion_ids)) == (ours["prompt_ids"],
                                                                                    ours["completion_ids"])


# --- batches ---------------------------------------------------------------------------------------------------


def test_a_batch_shares_the_prompt_prefix_and_points_at_every_answer_token(data_dir: Path,
                                                                           smollm: TokenizerInfo) -> None:
    artifact = small_artifact(smollm)
    examples = load_training_data(data_dir, artifact).train[:5]
    batch = make_batch(examples, pad_id=artifact.eos_id)
    shared = batch.prefix_ids.numel()
    assert shared > 10 and all(list(e.prompt_ids[:shared]) == batch.prefix_ids.tolist() for e in examples)
    assert len({e.prompt_ids[shared] for e in examples}) > 1  # the longest common prefix, no longer
    assert batch.attention_mask.shape == (5, shared + batch.input_ids.shape[1])
    position = 0
    for row, example in enumerate(examples):
        fed = [*example.prompt_ids, *example.completion_ids[:-1]]
        assert batch.attention_mask[row].sum() == len(fed)
        assert batch.input_ids[row, : len(fed) - shared].tolist() == fed[shared:]
        for j, token in enumerate(example.completion_ids):
            col = int(batch.answer_col[position])
            assert int(batch.answer_row[position]) == row and int(batch.targets[position]) == token
            # the hidden state at that column has seen exactly the prompt and the answer's first j tokens
            assert shared + col + 1 == len(example.prompt_ids) + j
            position += 1
    assert position == batch.targets.numel()
    legal = [lg for e in examples for lg in e.legal]
    assert batch.choice.tolist() == [i for i, lg in enumerate(legal) if len(lg) > 1]
    for c, i in enumerate(batch.choice.tolist()):
        allowed = batch.candidates[batch.candidate_legal[c]].tolist()
        assert allowed == list(legal[i])
        assert int(batch.candidates[batch.choice_target[c]]) == int(batch.targets[i])

    whole = make_batch(examples, pad_id=artifact.eos_id, share_prefix=False)
    assert whole.prefix_ids.numel() == 0 and whole.targets.tolist() == batch.targets.tolist()
    alone = make_batch(examples[:1], pad_id=artifact.eos_id)  # one row: all but the last prompt token is shared
    assert alone.prefix_ids.numel() == len(examples[0].prompt_ids) - 1


def test_the_batch_stream_is_seeded_full_and_covers_each_epoch(data_dir: Path, smollm: TokenizerInfo) -> None:
    examples = load_training_data(data_dir, small_artifact(smollm)).train  # 8 examples

    def take(seed: int, count: int) -> list[list[str]]:
        stream = shuffled_batches(examples, 4, seed=seed, bucket=1)
        return [[e.query for e in next(stream)] for _ in range(count)]

    first = take(0, 6)
    assert first == take(0, 6) and first != take(1, 6)
    assert all(len(batch) == 4 for batch in first)
    for epoch in range(3):
        assert sorted(q for batch in first[2 * epoch : 2 * epoch + 2] for q in batch) == sorted(
            e.query for e in examples)
    odd = shuffled_batches(examples[:3], 2, seed=0)  # fewer examples than fit evenly: still full batches
    assert [len(next(odd)) for _ in range(5)] == [2] * 5
    with pytest.raises(ValueError, match="no examples"):
        next(shuffled_batches([], 2, seed=0))


def _example(query: str, *tools: str) -> Example:
    return Example(query=query, tools=tools, prompt_ids=(1,) * (1 + len(query) % 5), completion_ids=(2,), legal=((2,),))


def test_balanced_batches_weigh_every_gold_set_alike_and_the_rare_k_by_its_square_root() -> None:
    # 90 queries for A, 10 for B (k = 1); 4 for the pair {A, B}, 1 for {A, C} (k = 2)
    examples = ([_example(f"a{i}", "A") for i in range(90)] + [_example(f"b{i}", "B") for i in range(10)]
                + [_example(f"ab{i}", *("AB" if i % 2 else "BA")) for i in range(4)] + [_example("ac", "A", "C")])
    stream = balanced_batches(examples, 8, seed=3, bucket=4)
    batches = [next(stream) for _ in range(1000)]
    assert all(len(batch) == 8 for batch in batches)
    assert [[e.query for e in b] for b in batches[:20]] == [
        [e.query for e in b] for b in itertools.islice(balanced_batches(examples, 8, seed=3, bucket=4), 20)]
    drawn = Counter(stratum(e) for batch in batches for e in batch)
    total = sum(drawn.values())
    k2_share = (drawn[frozenset("AB")] + drawn[frozenset("AC")]) / total
    assert k2_share == pytest.approx(math.sqrt(5) / (math.sqrt(100) + math.sqrt(5)), abs=0.02)
    assert drawn[frozenset("A")] / drawn[frozenset("B")] == pytest.approx(1, abs=0.1)  # not 9:1 as in the data
    assert drawn[frozenset("AB")] / drawn[frozenset("AC")] == pytest.approx(1, abs=0.2)
    b_queries = Counter(e.query for batch in batches for e in batch if e.tools == ("B",))
    assert len(b_queries) == 10  # within a gold set every example is drawn
    with pytest.raises(ValueError, match="no examples"):
        next(balanced_batches([], 2, seed=0))


def _one_set_reference(examples: list[Example], batch_size: int, seed: int, bucket: int) -> Iterator[list[Example]]:
    """The balanced stream as written for a single set: every shipped adapter was trained on this stream."""
    groups: dict[int, dict[frozenset[str], list[Example]]] = {}
    for example in examples:
        groups.setdefault(example.k, {}).setdefault(stratum(example), []).append(example)
    ks = sorted(groups)
    k_weights = [math.sqrt(sum(len(members) for members in groups[k].values())) for k in ks]
    strata = {k: [groups[k][key] for key in sorted(groups[k], key=sorted)] for k in ks}
    rng = random.Random(seed)
    while True:
        draws = [rng.choice(rng.choice(strata[k])) for k in rng.choices(ks, weights=k_weights, k=batch_size * bucket)]
        draws.sort(key=lambda e: len(e.prompt_ids) + len(e.completion_ids))
        batches = [draws[i : i + batch_size] for i in range(0, len(draws), batch_size)]
        rng.shuffle(batches)
        yield from batches


def test_balanced_batches_of_several_sets_draw_each_by_its_size_and_balance_it_alone() -> None:
    catalog = [_example(f"a{i}", "A") for i in range(90)] + [_example(f"b{i}", "B") for i in range(10)]
    other = [_example(f"t{i}", f"T{i}") for i in range(50)]  # 50 tools, one example each
    one = list(itertools.islice(balanced_batches(catalog, 8, seed=5, bucket=4), 30))
    assert one == list(itertools.islice(_one_set_reference(catalog, 8, 5, 4), 30))  # one set: the stream as it was
    batches = list(itertools.islice(balanced_batches(catalog, 8, seed=5, bucket=4, also=[other]), 2000))
    drawn = [e for batch in batches for e in batch]
    from_other = sum(e.tools[0].startswith("T") for e in drawn)
    assert from_other / len(drawn) == pytest.approx(50 / 150, abs=0.02)  # by size, not by the 52 gold sets
    in_catalog = Counter(e.tools for e in drawn if not e.tools[0].startswith("T"))
    assert in_catalog[("A",)] / in_catalog[("B",)] == pytest.approx(1, abs=0.1)  # each set balanced alone
    with pytest.raises(ValueError, match="no examples"):
        next(balanced_batches(catalog, 2, seed=0, also=[[]]))


def test_balanced_batches_draw_a_gold_sets_kinds_by_their_square_roots() -> None:
    """Within a gold set, requests that describe a need count by the square root of their number beside the plain
    ones (4 against 100: 2 / 12 of A's draws), every one of them drawn; a gold set of needs alone is one more set."""
    def need(query: str, *tools: str) -> Example:
        return replace(_example(query, *tools), kind="need")

    examples = ([_example(f"a{i}", "A") for i in range(100)] + [need(f"n{i}", "A") for i in range(4)]
                + [_example(f"b{i}", "B") for i in range(30)] + [need("c0", "C")])
    drawn = [e for batch in itertools.islice(balanced_batches(examples, 8, seed=4, bucket=4), 3000) for e in batch]
    of_a = [e for e in drawn if e.tools == ("A",)]
    assert sum(e.kind == "need" for e in of_a) / len(of_a) == pytest.approx(2 / 12, abs=0.02)
    assert len({e.query for e in of_a if e.kind == "need"}) == 4
    by_set = Counter(e.tools for e in drawn)
    assert by_set[("C",)] / by_set[("B",)] == pytest.approx(1, abs=0.1)  # each gold set alike, whatever its kinds


def test_hard_negatives_are_drawn_beside_their_tool_in_one_batch() -> None:
    """Each pair of the set's draws: a balanced draw, then a request for its tool's partner (a k = 2 draw, or a tool
    without a partner's requests, gets another balanced draw); the other set's draws come alone."""
    catalog = ([_example(f"a{i}", "A") for i in range(30)] + [_example(f"b{i}", "B") for i in range(3)]
               + [_example(f"c{i}", "C") for i in range(5)] + [_example("ab", "A", "B")])
    partners = {"A": "B", "B": "A", "C": "Z"}  # Z has no requests
    batches = list(itertools.islice(balanced_batches(catalog, 8, seed=2, bucket=4, partners=partners), 500))
    assert all(len(batch) == 8 for batch in batches)
    pairs = [(batch[i], batch[i + 1]) for batch in batches for i in range(0, 8, 2)]
    for first, second in pairs:
        if first.k == 1 and first.tools[0] in "AB":
            assert second.tools == (partners[first.tools[0]],)
    drawn = Counter(e.tools for batch in batches for e in batch)
    assert drawn[("B",)] / drawn[("A",)] == pytest.approx(1, abs=0.1)  # a pair's tools alike, not 10:1
    other = [_example(f"t{i}", f"T{i}") for i in range(20)]
    mixed = list(itertools.islice(balanced_batches(catalog, 8, seed=2, bucket=4, also=[other], partners=partners),
                                  500))
    assert all(len(batch) == 8 for batch in mixed)
    assert all(sum(not e.tools[0].startswith("T") for e in batch) % 2 == 0 for batch in mixed)  # pairs never cut
    flat = [e for batch in mixed for e in batch]
    assert sum(e.tools[0].startswith("T") for e in flat) / len(flat) == pytest.approx(20 / 59, abs=0.03)
    together = [b for a, b in itertools.pairwise(flat) if a.k == 1 and a.tools[0] == "A" and b.tools == ("B",)]
    assert len(together) > 0.3 * sum(e.tools == ("A",) for e in flat)


@settings(deadline=None)  # a loaded CI machine must not fail a test on time
@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=8), count=st.integers(0, 30), seed=st.integers(0, 9))
def test_a_stratified_sample_takes_round_robin_over_the_gold_sets(sizes: list[int], count: int, seed: int) -> None:
    examples = [_example(f"{tool}{i}", f"T{tool}") for tool, size in enumerate(sizes) for i in range(size)]
    sample = stratified_sample(examples, count, seed=seed)
    assert len(sample) == min(count, len(examples)) and len({e.query for e in sample}) == len(sample)
    taken = Counter(e.tools for e in sample)
    for tools, size in Counter(e.tools for e in examples).items():  # no set is short while another has extra
        assert taken[tools] == size or taken[tools] >= max(taken.values(), default=0) - 1
    assert sample == stratified_sample(examples, count, seed=seed)
