"""Registry + tokenizer + contract -> a verified trie over canonical token ids.

A tool's path is the exact ids ``tokenizer.encode(render(answer))`` gives it in context, and that context matters:
with GPT-2-style BPE the space after ``","`` joins the next name (``", get"`` -> ``[",", " get"]``), and some
pre-tokenizers glue a newline to a name that ends in punctuation (``"}\\n"``). So the separator is split into a
left part ``L`` (ending a tool that is followed by another) and a right part ``R`` (starting the next tool), and
each phase of an answer gets its own trie over ``P + name + S`` with ``P`` in {"", R} and ``S`` in {"", L}. The
first split point for which every sampled answer decomposes exactly is kept; see ``docs/trie.md``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tooltrie.compiler.artifact import Artifact, CompileStats
from tooltrie.compiler.contract import Contract
from tooltrie.compiler.tokenizer_info import TokenizerInfo
from tooltrie.compiler.trie import (
    N_PHASES,
    PHASE_FIRST_LAST,
    PHASE_FIRST_MORE,
    PHASE_NEXT_LAST,
    PHASE_NEXT_MORE,
    CompiledTrie,
    DuplicatePathError,
    Split,
    build_trie,
)
from tooltrie.errors import CompileError, RegistryError
from tooltrie.registry.model import Registry, Tool

PROGRESS_MIN_TOOLS = 10_000  # show a progress bar from this many tools on
_ENCODE_CHUNK = 8_192
_SCREEN_ANSWERS = 64  # answers tried on a split point before the full verification
_CHAIN_LENGTH = 32  # tools per verification chain


def compile_registry(
    registry: Registry,
    tokenizer: TokenizerInfo,
    contract: Contract | None = None,
    *,
    sample: int = 1_000,
    seed: int = 0,
    progress: bool | None = None,
) -> Artifact:
    """Compile ``registry`` into an :class:`Artifact` whose trie paths equal the tokenizer's encodings.

    Every tool is verified in context in every position (see ``_verification_answers``), plus ``sample`` random
    pairs and triples. Raises :class:`RegistryError` for names the
    contract or tokenizer cannot carry and :class:`CompileError` when no split of the separator represents
    the registry.

    >>> from tooltrie.registry import CATALOG_PATH, load_registry
    >>> artifact = compile_registry(load_registry(CATALOG_PATH), TokenizerInfo.load("smollm2-135m"))
    >>> artifact.placement(), artifact.trie.n_tools, artifact.split
    ('constant', 47, Split(left='', right=', '))
    """
    contract = contract or Contract()
    names = registry.names
    for tool in registry.tools:
        contract.check_name(tool.name, tool.where)
    show = len(names) >= PROGRESS_MIN_TOOLS if progress is None else progress
    encoder = _Encoder(tokenizer, show)
    bare_paths = encoder.encode(names)
    _check_names_encode(registry, bare_paths, tokenizer)

    failures: dict[Split, str] = {}
    for split in _split_candidates(contract.separator):
        answers = _verification_answers(names, split, sample, np.random.default_rng(seed))
        paths = _phase_paths(names, split, encoder, bare_paths)
        bad = _mismatches(answers[:_SCREEN_ANSWERS], names, paths, contract, encoder)
        if not bad:
            bad = _mismatches(answers, names, paths, contract, encoder)
        if bad:
            failures[split] = _describe_mismatches(bad, names, contract)
            continue
        trie = _build(paths, registry)
        clash = _hop_clash(trie, registry)
        if clash:
            failures[split] = clash
            continue
        stats = CompileStats(verified_answers=len(answers), verified_tools=len(names))
        return Artifact.create(registry=registry, tokenizer=tokenizer, contract=contract, split=split,
                               trie=trie, stats=stats)
    lines = [f"no split of the separator {contract.separator!r} lets {tokenizer.source} represent this registry:"]
    lines += [f"  split {split.left!r} | {split.right!r}: {why}" for split, why in failures.items()]
    raise CompileError("\n".join(lines))


def _split_candidates(separator: str) -> list[Split]:
    return [Split(separator[:i], separator[i:]) for i in range(len(separator) + 1)]


def _verification_answers(names: list[str], split: Split, sample: int,
                          rng: np.random.Generator) -> list[tuple[int, ...]]:
    """The answers whose encodings must equal the concatenation of their tools' paths.

    - Chains: a random order of all tools cut into runs of ``_CHAIN_LENGTH``, each run between two more tools,
      so every tool sits once in a middle position, a separator on either side, for about one name of text.
    - Every tool first, before the shortest other name: the first position's right-hand context.
    - Every tool last, after the shortest other name, when the separator's left part is not empty (with an
      empty left part a last tool's path is the text that ends the answer, encoded as it stands).
    - ``sample`` random pairs and as many random triples, for variety.

    The order is shuffled, so a screen of the first few answers sees a spread of tools.
    """
    n = len(names)
    by_length = sorted(range(n), key=lambda tool: len(names[tool]))
    shortest, runner_up = by_length[0], by_length[min(1, n - 1)]

    def partner(tool: int) -> int:
        return runner_up if tool == shortest else shortest

    order = rng.permutation(n).tolist()
    answers: list[tuple[int, ...]] = [
        (int(rng.integers(n)), *order[start : start + _CHAIN_LENGTH], int(rng.integers(n)))
        for start in range(0, n, _CHAIN_LENGTH)
    ]
    answers += [(tool, partner(tool)) for tool in range(n)]
    if split.left:
        answers += [(partner(tool), tool) for tool in range(n)]
    answers += [tuple(row) for row in rng.integers(0, n, size=(sample, 2)).tolist()]
    answers += [tuple(row) for row in rng.integers(0, n, size=(sample, 3)).tolist()]
    return [answers[i] for i in rng.permutation(len(answers))]


class _Encoder:
    """Batched, chunked encoding with an optional progress bar."""

    def __init__(self, tokenizer: TokenizerInfo, show_progress: bool) -> None:
        self.tokenizer = tokenizer
        self.show_progress = show_progress

    def encode(self, texts: list[str], what: str = "tokenizing") -> list[list[int]]:
        if not self.show_progress:
            return list(self.tokenizer.encode_batch(texts))
        from tqdm import tqdm

        out: list[list[int]] = []
        with tqdm(total=len(texts), desc=what, unit="text", leave=False) as bar:
            for start in range(0, len(texts), _ENCODE_CHUNK):
                chunk = texts[start : start + _ENCODE_CHUNK]
                out += self.tokenizer.encode_batch(chunk)
                bar.update(len(chunk))
        return out


def _check_names_encode(registry: Registry, encodings: list[list[int]], tokenizer: TokenizerInfo) -> None:
    special_ids = {tokenizer.token_to_id(token) for token in tokenizer.special_tokens} | {tokenizer.eos_id}
    decoded = tokenizer.decode_batch(encodings)
    first_with: dict[tuple[int, ...], Tool] = {}
    for tool, ids, text in zip(registry.tools, encodings, decoded, strict=True):
        twin = first_with.setdefault(tuple(ids), tool)
        if twin is not tool:
            raise _same_tokens_error(tool, twin)
        if not ids:
            raise RegistryError(f"{tool.where}: tool name renders to no tokens with {tokenizer.source}")
        if special_ids.intersection(ids):
            raise RegistryError(
                f"{tool.where}: tool name contains a special token of {tokenizer.source} "
                f"(e.g. the stop token {tokenizer.eos_token!r}); it could end the answer early"
            )
        if text != tool.name:  # e.g. characters the vocabulary has no bytes for are silently dropped
            raise RegistryError(f"{tool.where}: tool name does not survive {tokenizer.source}'s round trip: "
                                f"its tokens decode to {text!r}, so an answer naming it could not be parsed")


def _same_tokens_error(tool: Tool, twin: Tool) -> RegistryError:
    hint = " (they differ only in case: this tokenizer does not tell case apart)" if (
        tool.name.casefold() == twin.name.casefold()) else ""
    return RegistryError(f"{tool.where}: tool name tokenizes exactly like {twin.name!r} ({twin.where}){hint}")


def _phase_paths(names: list[str], split: Split, encoder: _Encoder,
                 bare_paths: list[list[int]]) -> dict[int, list[list[int]]]:
    """Token paths of every tool in each phase (phases with the same affixes share one encoding; the bare names
    are encoded already)."""
    by_affix: dict[tuple[str, str], list[list[int]]] = {("", ""): bare_paths}
    paths = {}
    for phase in range(N_PHASES):
        prefix, suffix = split.affixes(phase)
        if (prefix, suffix) not in by_affix:
            by_affix[prefix, suffix] = encoder.encode([prefix + name + suffix for name in names],
                                                      what=f"tokenizing {prefix + '<name>' + suffix!r}")
        paths[phase] = by_affix[prefix, suffix]
    return paths


def _mismatches(
    answers: Sequence[tuple[int, ...]],
    names: list[str],
    paths: dict[int, list[list[int]]],
    contract: Contract,
    encoder: _Encoder,
) -> list[tuple[int, ...]]:
    """The answers whose canonical encoding is not the concatenation of their tools' phase paths."""
    actual = encoder.encode([contract.render([names[t] for t in answer]) for answer in answers], what="verifying")
    first_last, first_more, next_last, next_more = (paths[phase] for phase in (
        PHASE_FIRST_LAST, PHASE_FIRST_MORE, PHASE_NEXT_LAST, PHASE_NEXT_MORE))
    bad = []
    for answer, ids in zip(answers, actual, strict=True):
        if len(answer) == 1:
            expected = first_last[answer[0]]
        else:
            expected = first_more[answer[0]] + [token for tool in answer[1:-1] for token in next_more[tool]]
            expected += next_last[answer[-1]]
        if expected != ids:
            bad.append(answer)
    return bad


def _build(paths: dict[int, list[list[int]]], registry: Registry) -> CompiledTrie:
    distinct: list[list[list[int]]] = []
    phase_trie = []
    for phase in range(N_PHASES):
        found = next((i for i, seen in enumerate(distinct) if seen is paths[phase]), None)
        if found is None:
            distinct.append(paths[phase])
            found = len(distinct) - 1
        phase_trie.append(found)
    try:
        trie = build_trie(distinct, phase_trie)
    except DuplicatePathError as exc:
        first, second = sorted(exc.pairs[0])
        raise _same_tokens_error(registry.tools[second], registry.tools[first]) from None
    trie.validate()
    return trie


def _hop_clash(trie: CompiledTrie, registry: Registry) -> str | None:
    """A terminal that hops to the next tool must not share a token with the next tries' roots: the token
    would mean both "a longer name" and "the next tool", and the trie could not tell which."""
    next_roots = [int(trie.trie_root[trie.phase_trie[p]]) for p in (PHASE_NEXT_MORE, PHASE_NEXT_LAST)]
    hop_tokens = np.concatenate([trie.edge_token[trie.node_edges(root).start : trie.node_edges(root).stop]
                                 for root in next_roots])
    hop_tries = [int(trie.phase_trie[p]) for p in (PHASE_FIRST_MORE, PHASE_NEXT_MORE)]
    parent = trie.edge_parent()
    hop_terminal = (trie.node_tool >= 0) & np.isin(trie.node_trie(), hop_tries)
    clashes = np.nonzero(hop_terminal[parent] & np.isin(trie.edge_token, hop_tokens))[0]
    if not clashes.size:
        return None
    edge = int(clashes[0])
    tool = registry.tools[int(trie.node_tool[parent[edge]])]
    return (f"after {tool.name!r} ({tool.where}) the token {int(trie.edge_token[edge])} both continues a longer "
            f"tool name and starts the next tool; rename the tools that extend {tool.name!r} or change the separator")


def _describe_mismatches(bad: list[tuple[int, ...]], names: list[str], contract: Contract) -> str:
    example = contract.render([names[t] for t in bad[0]])
    culprits = sorted({names[t] for answer in bad[:5] for t in answer})
    return f"{len(bad)} answers do not decompose, e.g. {example!r} (tools {culprits})"
