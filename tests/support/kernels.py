"""Helpers shared by the ``test_kernels_*`` files: tokenizers, small artifacts, brute-force answer sets, and
a decode loop that records every chosen token.

Everything is built from the repository itself (bundled tokenizers and registries) or made on the spot (tiny
hand-made BPE tokenizers); no network.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from tooltrie.compiler import Artifact, Contract, TokenizerInfo, compile_registry
from tooltrie.compiler.tokenizer_info import BUNDLED_TOKENIZERS_DIR
from tooltrie.errors import CompileError, RegistryError
from tooltrie.kernels import BatchState, step
from tooltrie.kernels.rules import Slot, legal_moves
from tooltrie.registry import make_registry

BUNDLED = ("gpt2", "smollm2-135m")
SEPARATORS = (", ", "\n", " | ")
BACKENDS = ("reference", "cpu")

# Names chosen to make trouble: shared prefixes, names that are token-prefixes of others (in both directions),
# case variants, a space inside a name, punctuation next to the separator, digits that BPE merges, non-ASCII.
NAME_ALPHABET = (
    "get", "get_user", "getUser", "get_users", "get user", "ge", "a", "ab", "abc", "b", "A", "x1", "x12",
    "search", "search_web", "Search", "météo", "mé", "météo_v2", "a.b", "a:", "_a", "fn()", "{x}", "naïve",
)


@cache
def bundled(name: str) -> TokenizerInfo:
    return TokenizerInfo.load(name)


def bundled_tokenizer_json(name: str) -> Path:
    return BUNDLED_TOKENIZERS_DIR / name / "tokenizer.json"


def compile_names(names: Sequence[str], tokenizer: TokenizerInfo, separator: str = ", ") -> Artifact:
    registry = make_registry([{"name": name} for name in names], name="x")
    return compile_registry(registry, tokenizer, Contract(separator=separator))


def try_compile(names: Sequence[str], tokenizer: TokenizerInfo, separator: str) -> Artifact | None:
    """The artifact, or None when the registry is refused for this tokenizer (a documented outcome)."""
    try:
        return compile_names(names, tokenizer, separator)
    except (CompileError, RegistryError):
        return None


# --------------------------------------------------------------------------------------------------------------
# Tiny hand-made tokenizers


TINY_EOS = "<eos>"


def tiny_bpe_json(chars: Iterable[str], merge_picks: Sequence[tuple[int, int]] = ()) -> str:
    """A character BPE ``tokenizer.json`` with no pre-tokenizer, so merges may cross the name/separator boundary.

    ``merge_picks`` are pairs of indices into the growing vocabulary (taken modulo its size): each adds the
    merge of those two tokens, unless it makes a token that exists already. Id 0 is the special ``<eos>``.
    """
    from tokenizers import Tokenizer, decoders, models

    vocab: dict[str, int] = {TINY_EOS: 0}
    for char in chars:
        vocab.setdefault(char, len(vocab))
    pieces = [token for token in vocab if token != TINY_EOS]
    merges: list[tuple[str, str]] = []
    for i, j in merge_picks:
        left, right = pieces[i % len(pieces)], pieces[j % len(pieces)]
        if left + right in vocab:
            continue
        merges.append((left, right))
        vocab[left + right] = len(vocab)
        pieces.append(left + right)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([TINY_EOS])
    return str(tokenizer.to_str())


@lru_cache(maxsize=256)
def tiny_tokenizer(spec: str, directory: str) -> TokenizerInfo:
    """Load a tokenizer.json text through the real loader (written once per distinct spec)."""
    import hashlib

    path = Path(directory) / f"tiny-{hashlib.sha256(spec.encode()).hexdigest()[:16]}.json"
    if not path.exists():
        path.write_text(spec, encoding="utf-8")
    return TokenizerInfo.load(path, eos_token=TINY_EOS)


# --------------------------------------------------------------------------------------------------------------
# Brute force: every answer and its canonical token ids


def all_answers(names: Sequence[str], k: int) -> list[tuple[int, ...]]:
    """Every answer of k distinct tools (ordered): the permutations."""
    return list(itertools.permutations(range(len(names)), k))


def answer_sequences(tokenizer: TokenizerInfo, contract: Contract, names: Sequence[str],
                     answers: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    texts = [contract.render([names[t] for t in answer]) for answer in answers]
    return [(*ids, tokenizer.eos_id) for ids in tokenizer.encode_batch(texts)]


class SequenceSet:
    """Sorted token sequences with prefix queries (bisect on tuples)."""

    def __init__(self, sequences: Iterable[tuple[int, ...]]) -> None:
        self.items = sorted(set(sequences))

    def _range(self, prefix: tuple[int, ...]) -> tuple[int, int]:
        lo = bisect.bisect_left(self.items, prefix)
        hi = bisect.bisect_left(self.items, (*prefix, 1 << 62))
        return lo, hi

    def has_prefix(self, prefix: tuple[int, ...]) -> bool:
        lo, hi = self._range(prefix)
        return hi > lo  # every item in [lo, hi) starts with prefix

    def next_tokens(self, prefix: tuple[int, ...]) -> set[int]:
        """{x : prefix + (x,) is a prefix of some sequence}."""
        lo, hi = self._range(prefix)
        return {self.items[i][len(prefix)] for i in range(lo, hi) if len(self.items[i]) > len(prefix)}


# --------------------------------------------------------------------------------------------------------------
# What a batched backend can choose from a slot


def one_row_state(artifact: Artifact, slot: Slot, *, width: int | None = None) -> BatchState:
    state = BatchState.start(artifact, [slot.k], k_max=max(width or slot.k, slot.k))
    state.set_slot(0, slot)
    return state


def backend_choices(artifact: Artifact, slot: Slot, backend: str, vocab_size: int,
                    rng: np.random.Generator) -> list[int]:
    """Every token ``backend`` can choose from ``slot``, found by elimination, in the order found.

    Random distinct logits over the whole vocabulary (illegal tokens too, so an illegal token would often win
    if it could); each query pushes the tokens found so far to -inf. A backend that obeys the rules chooses
    the legal token of highest logit among those left, and once every legal token is at -inf it chooses the
    lowest legal id again (ties), which ends the search.
    """
    values = rng.permutation(vocab_size).astype(np.float64)
    found: list[int] = []
    for _ in range(vocab_size + 1):
        logits = values.copy()
        logits[found] = -np.inf
        state = one_row_state(artifact, slot)
        chosen = int(step(artifact, state, logits[None, :].astype(np.float32), backend=backend)[0])
        if chosen < 0 or chosen in found:
            if found:
                assert chosen == min(found), f"{backend}: all legal tokens tied at -inf, chose {chosen}"
            return found
        if found:
            assert values[chosen] < values[found[-1]], f"{backend}: choices not in descending logit order"
        found.append(chosen)
    raise AssertionError("elimination did not end")


# --------------------------------------------------------------------------------------------------------------
# The rules, restated: what a step must choose


def nan_low(value: float) -> float:
    return -np.inf if np.isnan(value) else float(value)


def expected_choice(legal: Iterable[int], row_logits: np.ndarray[Any, Any],
                    full_to_output: np.ndarray[Any, Any] | None = None) -> int:
    """Argmax over legal tokens (those not pruned), ties toward the lower id, NaN lowest; -1 when none."""
    best: tuple[float, int] | None = None
    for token in legal:
        column = token if full_to_output is None else int(full_to_output[token])
        if column < 0:
            continue
        key = (-nan_low(float(row_logits[column])), token)
        if best is None or key < best:
            best = key
    return -1 if best is None else best[1]


def legal_tokens(artifact: Artifact, slot: Slot) -> set[int]:
    return set(legal_moves(artifact.trie, slot, artifact.eos_id))
