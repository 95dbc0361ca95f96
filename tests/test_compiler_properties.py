"""Property tests of the compiler on random registries.

For any registry (unicode names, shared prefixes, names that are token-prefixes of others, 1..2000 tools) and
separator, compiling either succeeds or raises CompileError/RegistryError with a message, never anything else;
on success the trie validates and every sampled answer's trie path is the tokenizer's encoding of its rendering.
"""

from __future__ import annotations

import itertools
import os
import random
import string

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.trie import trie_ids, walk

from tooltrie.compiler import Artifact, Contract, TokenizerInfo, compile_registry
from tooltrie.compiler.trie import DuplicatePathError, build_trie, phase_of
from tooltrie.errors import CompileError, RegistryError
from tooltrie.registry import make_registry

SEPARATORS = [", ", "\n", " | ", ";"]
# Reproducible by default (the same examples every run); TOOLTRIE_HYPOTHESIS_EXPLORE=1 draws fresh ones.
DERANDOMIZE = not os.environ.get("TOOLTRIE_HYPOTHESIS_EXPLORE")
_SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large]
TOKENIZER_NAMES = ["smollm2-135m", "gpt2"]
WORDS = ["get", "set", "user", "users", "weather", "list", "create", "delete", "search", "file", "send", "email",
         "calc", "BMI", "bmi", "roi", "parcel", "state", "api", "v2", "id", "x", "Get", "USER", "météo", "日本",
         "données", "math", "sqrt", "to", "from", "by"]
JOINERS = ["_", "", ".", "-", " ", "/", ":"]
SUFFIXES = ["_user", "s", "_id", "2", ".v2", " now", "er", "_", "!", "()", "é", "日"]

# Characters for free-form names: letters of several scripts, digits, punctuation (including the separators'
# characters), combining marks, emoji, and the occasional space, tab or control character.
_odd = st.sampled_from([*"_.,;|!?()[]{}<>'\"-+*/\\@#$%^&~`= \t\u00a0\u0301\u200b",
                        "😀", "\U0001f1eb", "\U0001f1f7", "中", "ß", "İ"])
_chars = st.one_of(st.characters(exclude_categories=("Cs",)), _odd, st.sampled_from(string.ascii_letters))

word_names = st.lists(st.sampled_from(WORDS), min_size=1, max_size=4).flatmap(
    lambda words: st.sampled_from(JOINERS).map(lambda joiner: joiner.join(words)))
free_names = st.text(_chars, min_size=1, max_size=10)
# Mostly valid identifiers, sometimes free text (which may be refused: whitespace at the ends, separators...).
any_name = st.one_of(word_names, word_names, free_names)
identifier_names = st.from_regex(r"[A-Za-z][A-Za-z0-9_.]{0,14}[A-Za-z0-9]", fullmatch=True)


def _large_names(n: int, seed: int) -> list[str]:
    """``n`` distinct names built from the word list (BFCL-like identifiers with shared prefixes), some the
    token-prefix of others, some with case variants and non-ASCII parts."""
    rng = random.Random(seed)
    names: dict[str, None] = {}
    while len(names) < n:
        roll = rng.random()
        if roll < 0.15 and names:
            base = rng.choice(list(names))
            name = base + rng.choice(SUFFIXES)  # an extension of an existing name
        elif roll < 0.2 and names:
            name = rng.choice(list(names)).swapcase()
        else:
            parts = [rng.choice(WORDS) for _ in range(rng.randint(1, 4))]
            name = rng.choice(["_", "_", ".", ""]).join(parts) + (str(rng.randint(0, 99)) if rng.random() < 0.2
                                                                  else "")
        if name == name.strip():
            names[name] = None
    order = list(names)
    rng.shuffle(order)
    return order


@st.composite
def registries(draw: st.DrawFn, names: st.SearchStrategy[str] = any_name) -> list[str]:
    """Tool names: usually 1..12 drawn names plus extensions of them; about one in eight a large registry."""
    if draw(st.integers(0, 7).map(lambda x: x == 7)):
        return _large_names(draw(st.integers(100, 2000)), draw(st.integers(0, 2**32 - 1)))
    base = draw(st.lists(names, min_size=1, max_size=12, unique=True))
    extensions = draw(st.lists(st.tuples(st.sampled_from(base), st.sampled_from(SUFFIXES)), max_size=4))
    out = list(dict.fromkeys(base + [stem + suffix for stem, suffix in extensions]))
    return draw(st.permutations(out))


def _sample_answers(n: int, rng: np.random.Generator, per_tool_limit: int = 250) -> list[list[int]]:
    """Each (sampled) tool in every phase with random distinct neighbours, plus random k-answers, k <= 6."""
    tools = range(n) if n <= per_tool_limit else rng.choice(n, size=per_tool_limit, replace=False).tolist()
    answers: list[list[int]] = []
    for t in tools:
        answers.append([t])
        if n >= 2:
            other = int(rng.choice([x for x in range(min(n, 64)) if x != t] or [(t + 1) % n]))
            answers += [[t, other], [other, t]]
        if n >= 3:
            a, b = rng.choice([x for x in range(n) if x != t][:200], size=2, replace=False).tolist()
            answers.append([a, t, b])
    for _ in range(60):
        k = int(rng.integers(1, min(n, 6) + 1))
        answers.append(rng.choice(n, size=k, replace=False).tolist())
    return answers


def _check_artifact(artifact: Artifact, names: list[str], tokenizer: TokenizerInfo, contract: Contract,
                    seed: int) -> None:
    trie = artifact.trie
    trie.validate()
    assert trie.n_tools == len(names)
    assert artifact.split.left + artifact.split.right == contract.separator
    rng = np.random.default_rng(seed)
    answers = _sample_answers(len(names), rng)
    rendered = [contract.render([names[t] for t in answer]) for answer in answers]
    lossless = {t: tokenizer.decode(tokenizer.encode(names[t])) == names[t] for answer in answers for t in answer}
    expected = tokenizer.encode_batch(rendered)
    for answer, text, ids in zip(answers, rendered, expected, strict=True):
        answer_names = [names[t] for t in answer]
        assert trie_ids(artifact, answer) == ids, answer_names
        assert contract.parse(text) == answer_names
        if all(lossless[t] for t in answer):  # SmolLM2 drops a few byte values (e.g. 0x04) when encoding
            assert contract.parse(tokenizer.decode(ids)) == answer_names
    # Artifact.token_path (by name) on a few, and each tool's single-tool path walks to its terminal.
    for answer, ids in list(zip(answers, expected, strict=True))[:40]:
        assert artifact.token_path([names[t] for t in answer]) == ids
    for t in {answer[0] for answer in answers if len(answer) == 1}:
        node = walk(artifact, phase_of(0, 1), tokenizer.encode(names[t]))
        assert node >= 0 and int(trie.node_tool[node]) == t


def _compile_or_refuse(names: list[str], tokenizer: TokenizerInfo, contract: Contract) -> Artifact | None:
    """Compile, or return None after checking the refusal is a RegistryError/CompileError with a message."""
    try:
        registry = make_registry([{"name": name} for name in names], name="prop")
    except RegistryError as exc:
        assert str(exc).strip()
        # Only the loader's rules refuse a name at load time.
        assert any(not n.strip() or n != n.strip() or len((n + "x").splitlines()) > 1 for n in names), str(exc)
        return None
    try:
        return compile_registry(registry, tokenizer, contract)
    except (RegistryError, CompileError) as exc:
        assert str(exc).strip()
        if isinstance(exc, RegistryError):
            reasons = ("separator", "special token", "no tokens", "round trip", "tokenizes exactly like")
            assert any(reason in str(exc) for reason in reasons), str(exc)
        return None


@settings(max_examples=70, deadline=None, derandomize=DERANDOMIZE, suppress_health_check=_SLOW)
@given(names=registries(), separator=st.sampled_from(SEPARATORS), tokenizer_name=st.sampled_from(TOKENIZER_NAMES),
       seed=st.integers(0, 2**32 - 1))
def test_compile_is_exact_or_refuses(tokenizers: dict[str, TokenizerInfo], names: list[str], separator: str,
                                     tokenizer_name: str, seed: int) -> None:
    tokenizer, contract = tokenizers[tokenizer_name], Contract(separator=separator)
    event("size", "1-12" if len(names) <= 12 else "13-99" if len(names) < 100 else "100-2000")
    artifact = _compile_or_refuse(names, tokenizer, contract)
    event("outcome", "compiled" if artifact is not None else "refused")
    if artifact is not None:
        _check_artifact(artifact, names, tokenizer, contract, seed)


@settings(max_examples=40, deadline=None, derandomize=DERANDOMIZE, suppress_health_check=_SLOW)
@given(names=registries(identifier_names), separator=st.sampled_from([", ", "\n", " | "]),
       tokenizer_name=st.sampled_from(TOKENIZER_NAMES), seed=st.integers(0, 2**32 - 1))
def test_identifier_registries_always_compile(tokenizers: dict[str, TokenizerInfo], names: list[str], separator: str,
                                             tokenizer_name: str, seed: int) -> None:
    """Registries of identifier-like names (letters, digits, "_" and "." inside; the shape of BFCL's names) with the
    usual separators must compile: a refusal here would be a false one."""
    tokenizer, contract = tokenizers[tokenizer_name], Contract(separator=separator)
    artifact = compile_registry(make_registry([{"name": n} for n in names], name="ids"), tokenizer, contract)
    _check_artifact(artifact, names, tokenizer, contract, seed)


@settings(max_examples=30, deadline=None, derandomize=DERANDOMIZE)
@given(names=st.lists(st.text(_chars, min_size=1, max_size=8).filter(lambda s: s == s.strip() and "\n" not in s
                                                                      and "\r" not in s), min_size=2, max_size=5,
                      unique=True),
       tokenizer_name=st.sampled_from(TOKENIZER_NAMES))
def test_small_registries_exhaustively(tokenizers: dict[str, TokenizerInfo], names: list[str],
                                       tokenizer_name: str) -> None:
    """On small registries check every answer (all orderings, every k), not a sample."""
    tokenizer, contract = tokenizers[tokenizer_name], Contract()
    artifact = _compile_or_refuse(names, tokenizer, contract)
    if artifact is None:
        return
    answers = [list(a) for k in range(1, len(names) + 1) for a in itertools.permutations(range(len(names)), k)]
    expected = tokenizer.encode_batch([contract.render([names[t] for t in a]) for a in answers])
    for answer, ids in zip(answers, expected, strict=True):
        assert trie_ids(artifact, answer) == ids, [names[t] for t in answer]


@settings(max_examples=150, deadline=None, derandomize=DERANDOMIZE)
@given(names=st.lists(st.text(_chars, max_size=8), max_size=6),
       separator=st.sampled_from([*SEPARATORS, " or ", "\t"]))
def test_contract_render_parse_roundtrip(names: list[str], separator: str) -> None:
    contract = Contract(separator=separator)
    text = contract.render(names)
    if any(separator in name for name in names) or names == [""]:
        return  # such names are refused by check_name (or render to the empty answer)
    assert contract.parse(text) == names
    assert contract.parse(text + "<|im_end|>", stop_text="<|im_end|>") == names


@settings(max_examples=120, deadline=None, derandomize=DERANDOMIZE)
@given(paths=st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=5), min_size=1, max_size=40, unique_by=tuple),
       data=st.data())
def test_build_trie_random_paths(paths: list[list[int]], data: st.DataObject) -> None:
    """The sort-built trie: every path is recorded exactly, counts match, and it validates."""
    second = data.draw(st.permutations(paths))
    trie = build_trie([paths, second], [0, 0, 1, 1])
    trie.validate()
    for r, tries_paths in enumerate([paths, second]):
        for tool, path in enumerate(tries_paths):
            edges = trie.tool_path(r, tool)
            assert trie.edge_token[edges].tolist() == path
            assert int(trie.node_tool[trie.edge_child[edges[-1]]]) == tool
    # Node count: one root per trie plus one node per distinct non-empty prefix.
    prefixes = {tuple(p[:i]) for p in paths for i in range(1, len(p) + 1)}
    assert trie.n_nodes == 2 * (len(prefixes) + 1)


@settings(max_examples=60, deadline=None, derandomize=DERANDOMIZE)
@given(paths=st.lists(st.lists(st.integers(0, 6), min_size=2, max_size=2), min_size=1, max_size=20, unique_by=tuple),
       data=st.data())
def test_build_trie_refuses_duplicate_paths_of_equal_length(paths: list[list[int]], data: st.DataObject) -> None:
    duplicate = data.draw(st.sampled_from(paths))
    with pytest.raises(DuplicatePathError) as info:
        build_trie([[*paths, duplicate]], [0, 0, 0, 0])
    assert (paths.index(duplicate), len(paths)) in info.value.pairs


def test_build_trie_refuses_a_duplicate_shorter_than_the_longest_path() -> None:
    try:
        trie = build_trie([[[0], [0, 0], [0]]], [0, 0, 0, 0])
    except DuplicatePathError as exc:
        assert exc.pairs == [(0, 2)]
    else:
        raise AssertionError(f"no DuplicatePathError; node_tool={trie.node_tool.tolist()}")
