"""Differential against XGrammar (CPU) on the string-level exactly-k grammar (``compiler/ebnf.py``).

The walk follows random legal tokens of our matcher and feeds each to an XGrammar matcher over
``exactly_k_ebnf(names, k)``. At every step:

- our legal set is a subset of XGrammar's mask, and equals the canonical next tokens (read off the canonical
  ids of every answer of k distinct tools);
- every token XGrammar allows and we do not is explained, and the test computes which way:

  * ``repeat``: ``prefix + [x]`` is a prefix of the canonical ids of some answer, but every such answer uses a
    tool twice (the string grammar cannot say "no repeats");
  * ``non-canonical``: the text of ``prefix + [x]`` is a prefix of some rendering, but no answer's canonical
    ids start with ``prefix + [x]`` (another tokenization of the same text).

Anything else (a canonical token we refuse, or a token whose text no rendering starts with) fails the test.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections import Counter
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import pytest
from support.kernels import SequenceSet, bundled, bundled_tokenizer_json, compile_names

from tooltrie.compiler import Artifact, Contract, TokenizerInfo
from tooltrie.compiler.ebnf import exactly_k_ebnf
from tooltrie.kernels import TrieMatcher
from tooltrie.kernels.bitmask import allowed_tokens
from tooltrie.registry import BFCL_PATH, CATALOG_PATH, load_registry

xgr = pytest.importorskip("xgrammar")


@dataclass(frozen=True)
class XG:
    info: Any
    compiler: Any
    token_bytes: list[bytes]


@cache
def xg_for(tokenizer_name: str) -> XG:
    from transformers import PreTrainedTokenizerFast

    tokenizer = bundled(tokenizer_name)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(bundled_tokenizer_json(tokenizer_name)))
    info = xgr.TokenizerInfo.from_huggingface(hf, stop_token_ids=[tokenizer.eos_id],
                                              vocab_size=tokenizer.vocab_size)
    return XG(info=info, compiler=xgr.GrammarCompiler(info), token_bytes=list(info.decoded_vocab))


@cache
def registry_names(which: str) -> tuple[str, ...]:
    if which == "catalog":
        return tuple(load_registry(CATALOG_PATH).names)
    bfcl = load_registry(BFCL_PATH).names
    if which == "bfcl-get":  # 100 names, most of them starting with "get_"
        return tuple(bfcl[900:1000])
    if which == "bfcl-look":  # 40 names with token-prefix pairs ("look", "look_at", "math.roots.*")
        return tuple(bfcl[1190:1230])
    raise KeyError(which)


@cache
def artifact_for(which: str, tokenizer_name: str) -> Artifact:
    return compile_names(list(registry_names(which)), bundled(tokenizer_name))


@dataclass(frozen=True)
class Answers:
    distinct: SequenceSet  # canonical ids (+ eos) of answers of k distinct tools
    repeats: SequenceSet  # ... of answers that use some tool more than once
    renderings: list[bytes]  # sorted UTF-8 renderings of every answer, repeats included


def enumerate_answers(tokenizer: TokenizerInfo, names: tuple[str, ...], k: int) -> Answers:
    contract = Contract()
    answers = list(itertools.product(range(len(names)), repeat=k))
    texts = [contract.render([names[t] for t in answer]) for answer in answers]
    distinct, repeats = [], []
    for answer, ids in zip(answers, tokenizer.encode_batch(texts), strict=True):
        (distinct if len(set(answer)) == k else repeats).append((*ids, tokenizer.eos_id))
    return Answers(SequenceSet(distinct), SequenceSet(repeats), sorted({text.encode() for text in texts}))


def is_text_prefix(renderings: list[bytes], text: bytes) -> bool:
    i = bisect.bisect_left(renderings, text)
    return i < len(renderings) and renderings[i].startswith(text)


def classify(x: int, prefix: tuple[int, ...], text: bytes, answers: Answers, xg: XG, eos: int) -> str:
    extended = (*prefix, x)
    if answers.distinct.has_prefix(extended):
        return "UNEXPLAINED: canonical for an answer of distinct tools, yet refused by the trie"
    if answers.repeats.has_prefix(extended):
        return "repeat"
    if x == eos:
        complete = bisect.bisect_left(answers.renderings, text)
        if complete < len(answers.renderings) and answers.renderings[complete] == text:
            return "non-canonical"  # the text is a whole answer, but these ids are not its canonical ids
        return "UNEXPLAINED: stop allowed where the text is no whole answer"
    if is_text_prefix(answers.renderings, text + xg.token_bytes[x]):
        return "non-canonical"
    return "UNEXPLAINED: the token's text leaves every rendering"


# k = 3 enumerates n**3 answers (about 100k for the catalog), so each k = 3 case runs with one tokenizer.
CASES = [
    *[("catalog", tokenizer, k) for tokenizer in ("smollm2-135m", "gpt2") for k in (1, 2)],
    ("catalog", "smollm2-135m", 3),
    *[("bfcl-get", tokenizer, k) for tokenizer in ("smollm2-135m", "gpt2") for k in (1, 2)],
    ("bfcl-look", "gpt2", 3),
]


@pytest.mark.parametrize(("which", "tokenizer_name", "k"), CASES)
def test_trie_mask_within_xgrammar_and_differences_explained(which: str, tokenizer_name: str, k: int) -> None:
    tokenizer, xg = bundled(tokenizer_name), xg_for(tokenizer_name)
    names = registry_names(which)
    artifact = artifact_for(which, tokenizer_name)
    eos, vocab = tokenizer.eos_id, xg.info.vocab_size
    grammar = xg.compiler.compile_grammar(exactly_k_ebnf(list(names), k, Contract()))
    answers = enumerate_answers(tokenizer, names, k)
    rng = random.Random(f"{which}-{tokenizer_name}-{k}")
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    kinds: Counter[str] = Counter()
    walks = 12 if k < 3 else 6
    for _ in range(walks):
        ours, theirs = TrieMatcher(artifact, k), xgr.GrammarMatcher(grammar)
        prefix: tuple[int, ...] = ()
        text = b""
        while not ours.is_terminated():
            legal = ours.legal_tokens()
            assert legal is not None
            theirs.fill_next_token_bitmask(bitmask)
            allowed = set(allowed_tokens(np.ascontiguousarray(bitmask[0].numpy()), vocab).tolist())
            where = f"{which}/{tokenizer_name} k={k} at {tokenizer.decode(list(prefix))!r}"
            assert set(legal) <= allowed, f"{where}: ours allows {sorted(set(legal) - allowed)}, XGrammar does not"
            assert set(legal) == answers.distinct.next_tokens(prefix), where
            for x in sorted(allowed - set(legal)):
                kind = classify(x, prefix, text, answers, xg, eos)
                assert not kind.startswith("UNEXPLAINED"), f"{where}: token {x} {xg.token_bytes[x]!r}: {kind}"
                kinds[kind] += 1
            token = rng.choice(legal)
            assert ours.accept_token(token)
            assert theirs.accept_token(token), f"{where}: XGrammar refuses our token {token}"
            prefix, text = (*prefix, token), text + (b"" if token == eos else xg.token_bytes[token])
        assert theirs.is_terminated()
        tools = [names[t] for t in ours.tools()]
        assert len(set(tools)) == k
        assert list(prefix) == [*tokenizer.encode(", ".join(tools)), eos]
    # The classification is exercised: XGrammar always offers other tokenizations of a name's first letters,
    # and with k >= 2 the tools already used.
    assert kinds["non-canonical"] > 0
    if k >= 2:
        assert kinds["repeat"] > 0


def test_repeat_classification_example() -> None:
    """A worked example of the kinds: after ``get,`` the string grammar offers `` get`` again."""
    tokenizer, xg = bundled("gpt2"), xg_for("gpt2")
    names = ("get", "set")
    answers = enumerate_answers(tokenizer, names, 2)
    get, comma, space_get = tokenizer.encode("get, get")
    assert classify(space_get, (get, comma), b"get,", answers, xg, tokenizer.eos_id) == "repeat"
    g = tokenizer.encode("g")[0]
    assert classify(g, (), b"", answers, xg, tokenizer.eos_id) == "non-canonical"
    assert classify(tokenizer.encode("set")[0], (), b"", answers, xg, tokenizer.eos_id).startswith("UNEXPLAINED")
