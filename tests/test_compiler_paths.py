"""Differential test of the compiler: every tool's trie path, in every phase, is exactly what the tokenizer gives
the tool's name in context, for both bundled registries and both bundled tokenizers.

The invariant: for every answer (distinct names), ``artifact.token_path(names) == tokenizer.encode(render(names))``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
from support.trie import trie_ids, walk

from tooltrie.compiler import Artifact, Contract, TokenizerInfo, compile_registry
from tooltrie.compiler.trie import (
    N_PHASES,
    PHASE_FIRST_LAST,
    PHASE_FIRST_MORE,
    PHASE_NEXT_LAST,
    PHASE_NEXT_MORE,
    Split,
    phase_of,
)
from tooltrie.errors import CompileError
from tooltrie.registry import Registry, make_registry

CASES = [(r, t) for r in ("catalog", "bfcl") for t in ("smollm2-135m", "gpt2")]
CASE_IDS = [f"{r}-{t}" for r, t in CASES]


def _rotation_answers(n: int) -> list[list[int]]:
    """For every tool t: [t], [t, next], [prev, t, next] and [prev, t] over a rotation of the tool list, so each
    tool is written in every phase."""
    answers = []
    for t in range(n):
        prev, nxt = (t - 1) % n, (t + 1) % n
        answers += [[t], [t, nxt], [prev, t, nxt], [prev, t]]
    return answers


@pytest.mark.parametrize(("registry_name", "tokenizer_name"), CASES, ids=CASE_IDS)
def test_every_tool_in_every_phase_matches_the_tokenizer(
    compiled: Callable[[str, str], Artifact], registries: dict[str, Registry], tokenizers: dict[str, TokenizerInfo],
    registry_name: str, tokenizer_name: str,
) -> None:
    artifact, registry, tokenizer = compiled(registry_name, tokenizer_name), registries[registry_name], \
        tokenizers[tokenizer_name]
    contract = Contract()
    names = registry.names
    answers = _rotation_answers(len(names))
    expected = tokenizer.encode_batch([contract.render([names[t] for t in answer]) for answer in answers])
    bad_trie = [a for a, ids in zip(answers, expected, strict=True) if trie_ids(artifact, a) != ids]
    assert not bad_trie, [[names[t] for t in a] for a in bad_trie[:5]]
    # Artifact.token_path (by name) agrees too; on a sample for the large registry (it re-indexes names per call).
    step = max(1, len(answers) // 600)
    for answer, ids in list(zip(answers, expected, strict=True))[::step]:
        assert artifact.token_path([names[t] for t in answer]) == ids


@pytest.mark.parametrize(("registry_name", "tokenizer_name"), CASES, ids=CASE_IDS)
def test_phase_paths_equal_affixed_encodings_and_walk_to_the_tool(
    compiled: Callable[[str, str], Artifact], registries: dict[str, Registry], tokenizers: dict[str, TokenizerInfo],
    registry_name: str, tokenizer_name: str,
) -> None:
    artifact, registry, tokenizer = compiled(registry_name, tokenizer_name), registries[registry_name], \
        tokenizers[tokenizer_name]
    trie, split = artifact.trie, artifact.split
    assert split.left + split.right == Contract().separator
    names = registry.names
    n = len(names)
    assert trie.n_tools == n
    for phase in range(N_PHASES):
        prefix, suffix = split.affixes(phase)
        expected = tokenizer.encode_batch([prefix + name + suffix for name in names])
        r = int(trie.phase_trie[phase])
        for tool in range(n):
            path = trie.edge_token[trie.tool_path(r, tool)].tolist()
            assert path == expected[tool], (phase, names[tool])
            # Walking the tokens from the phase's root by the CSR arrays ends on this tool's terminal.
            node = walk(artifact, phase, path)
            assert node >= 0 and int(trie.node_tool[node]) == tool, (phase, names[tool])


@pytest.mark.parametrize(("registry_name", "tokenizer_name"), CASES, ids=CASE_IDS)
def test_random_k_answers_match(
    compiled: Callable[[str, str], Artifact], registries: dict[str, Registry], tokenizers: dict[str, TokenizerInfo],
    registry_name: str, tokenizer_name: str,
) -> None:
    artifact, registry, tokenizer = compiled(registry_name, tokenizer_name), registries[registry_name], \
        tokenizers[tokenizer_name]
    names = registry.names
    rng = np.random.default_rng(1234)
    answers = [rng.choice(len(names), size=k, replace=False).tolist() for k in range(1, 9) for _ in range(150)]
    expected = tokenizer.encode_batch([", ".join(names[t] for t in answer) for answer in answers])
    for answer, ids in zip(answers, expected, strict=True):
        assert trie_ids(artifact, answer) == ids, [names[t] for t in answer]


@pytest.mark.parametrize("tokenizer_name", ["smollm2-135m", "gpt2"])
def test_catalog_all_ordered_pairs(compiled: Callable[[str, str], Artifact], catalog: Registry,
                                   tokenizers: dict[str, TokenizerInfo], tokenizer_name: str) -> None:
    artifact, tokenizer = compiled("catalog", tokenizer_name), tokenizers[tokenizer_name]
    answers = [list(p) for p in itertools.permutations(range(len(catalog)), 2)]
    expected = tokenizer.encode_batch([", ".join(catalog.names[t] for t in answer) for answer in answers])
    assert [trie_ids(artifact, a) for a in answers] == expected


@pytest.mark.parametrize(("registry_name", "tokenizer_name"), CASES, ids=CASE_IDS)
def test_trie_structure(compiled: Callable[[str, str], Artifact], registry_name: str, tokenizer_name: str) -> None:
    artifact = compiled(registry_name, tokenizer_name)
    trie = artifact.trie
    trie.validate()
    # Phases with the same affixes share one trie; distinct affixes get distinct tries.
    affixes = [artifact.split.affixes(p) for p in range(N_PHASES)]
    for p, q in itertools.combinations(range(N_PHASES), 2):
        assert (trie.phase_trie[p] == trie.phase_trie[q]) == (affixes[p] == affixes[q])
    assert trie.n_tries == len(set(affixes))
    # The stop token is never on an edge: it is appended by the decoder, not part of any name.
    assert artifact.eos_id not in set(trie.edge_token.tolist())
    # A hop terminal's outgoing tokens never also start the next tool.
    next_first = set()
    for phase in (PHASE_NEXT_MORE, PHASE_NEXT_LAST):
        root = int(trie.trie_root[trie.phase_trie[phase]])
        next_first |= set(trie.edge_token[trie.node_edges(root).start:trie.node_edges(root).stop].tolist())
    for phase in (PHASE_FIRST_MORE, PHASE_NEXT_MORE):
        r = int(trie.phase_trie[phase])
        for tool in range(trie.n_tools):
            terminal = int(trie.edge_child[trie.tool_path(r, tool)[-1]])
            out = set(trie.edge_token[trie.node_edges(terminal).start:trie.node_edges(terminal).stop].tolist())
            assert not out & next_first


def test_default_split_for_comma_space(catalog_artifact: Artifact) -> None:
    # The documented result for the catalog with SmolLM2: the whole separator starts the next tool.
    assert catalog_artifact.split == Split(left="", right=", ")
    assert catalog_artifact.trie.n_tools == 47


def test_phase_of() -> None:
    assert phase_of(0, 1) == PHASE_FIRST_LAST
    assert [phase_of(i, 2) for i in range(2)] == [PHASE_FIRST_MORE, PHASE_NEXT_LAST]
    assert [phase_of(i, 4) for i in range(4)] == [PHASE_FIRST_MORE, PHASE_NEXT_MORE, PHASE_NEXT_MORE,
                                                  PHASE_NEXT_LAST]


def test_bfcl_case_pairs_have_distinct_paths(compiled: Callable[[str, str], Artifact], bfcl: Registry) -> None:
    for tokenizer_name in ("smollm2-135m", "gpt2"):
        artifact = compiled("bfcl", tokenizer_name)
        for a, b in [("GET_PARCEL_STATE", "get_parcel_state"), ("calculate_BMI", "calculate_bmi"),
                     ("calculate_ROI", "calculate_roi")]:
            assert artifact.token_path([a]) != artifact.token_path([b])
            assert artifact.token_path([a, b]) != artifact.token_path([b, a])


@pytest.mark.parametrize("separator", [", ", "\n", " | ", ";", " or ", ",\n"])
@pytest.mark.parametrize("tokenizer_name", ["smollm2-135m", "gpt2"])
def test_other_separators_on_the_catalog(catalog: Registry, tokenizers: dict[str, TokenizerInfo], separator: str,
                                         tokenizer_name: str) -> None:
    tokenizer, contract = tokenizers[tokenizer_name], Contract(separator=separator)
    artifact = compile_registry(catalog, tokenizer, contract)
    assert artifact.contract == contract
    names = catalog.names
    answers = _rotation_answers(len(names))
    expected = tokenizer.encode_batch([contract.render([names[t] for t in a]) for a in answers])
    for answer, ids in zip(answers, expected, strict=True):
        assert trie_ids(artifact, answer) == ids, [names[t] for t in answer]
        assert contract.parse(contract.render([names[t] for t in answer])) == [names[t] for t in answer]


@pytest.mark.parametrize("tokenizer_name", ["smollm2-135m", "gpt2"])
def test_prefix_names(tokenizers: dict[str, TokenizerInfo], tokenizer_name: str) -> None:
    # "get" is a token-prefix of the others: its terminal has children, in every phase.
    tokenizer = tokenizers[tokenizer_name]
    names = ["get", "get_user", "get_user_id", "getter", "get.x", "g", "user"]
    artifact = compile_registry(make_registry([{"name": n} for n in names], name="p"), tokenizer)
    for k in (1, 2, 3):
        for answer in itertools.permutations(names, k):
            assert artifact.token_path(list(answer)) == tokenizer.encode(", ".join(answer))
    trie = artifact.trie
    r = int(trie.phase_trie[PHASE_FIRST_LAST])
    terminal = int(trie.edge_child[trie.tool_path(r, 0)[-1]])
    assert int(trie.node_tool[terminal]) == 0 and len(trie.node_edges(terminal)) > 0


def test_unrepresentable_registry_is_refused_with_a_message(smollm: TokenizerInfo) -> None:
    # With ";" the punctuation on both sides of the separator merges into one pre-token ("!);)" ...), so no split
    # point makes every answer the concatenation of per-tool paths. The message lists each split tried.
    registry = make_registry([{"name": n} for n in ["!)", "'", ")\u00e9!"]], name="punct")
    with pytest.raises(CompileError, match=r"(?s)no split of the separator ';' lets smollm2-135m represent this "
                       r"registry.*split '' \| ';': \d+ answers do not decompose.*split ';' \| '': \d+ answers "
                       r"do not decompose"):
        compile_registry(registry, smollm, Contract(separator=";"))


@pytest.mark.parametrize(("names", "separator"), [(["get", "get,x", "c"], ", "), (["a", "a |b", "c"], " | ")],
                         ids=["comma", "pipe"])
def test_hop_clash_on_one_split_tries_the_next(gpt2: TokenizerInfo, names: list[str], separator: str) -> None:
    contract = Contract(separator=separator)
    artifact = compile_registry(make_registry([{"name": n} for n in names], name="clash"), gpt2, contract)
    for k in (1, 2, 3):
        for answer in itertools.permutations(names, k):
            assert artifact.token_path(list(answer)) == gpt2.encode(contract.render(list(answer)))
