"""Registry + tokenizer + contract -> a verified trie over canonical token ids.

A tool's path is the exact ids ``tokenizer.encode(render(answer))`` gives it in context, and that context matters:
with GPT-2-style BPE the space after ``","`` joins the next name (``", get"`` -> ``[",", " get"]``), and some
pre-tokenizers glue a newline to a name that ends in punctuation (``"}\\n"``). So the separator is split into a
left part ``L`` (ending a tool that is followed by another) and a right part ``R`` (starting the next tool), and
each phase of an answer gets its own trie over ``P + name + S`` with ``P`` in {"", R} and ``S`` in {"", L}. The
first split point for which every sampled answer decomposes exactly is kept; see ``docs/trie.md``.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

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
    FlatPaths,
    Split,
    build_trie,
    concat_ranges,
)
from tooltrie.errors import CompileError, RegistryError, TooltrieError
from tooltrie.registry.model import Registry, Tool
from tooltrie.registry.problems import Problem, RegistryProblems

PROGRESS_MIN_TOOLS = 10_000  # show a progress bar from this many tools on
_ENCODE_CHUNK = 8_192
_SCREEN_ANSWERS = 64  # answers tried on a split point before the full verification
_CHAIN_LENGTH = 32  # tools per verification chain
# Separators proposed when names contain the contract's: the first that no name contains and that compiles.
SEPARATOR_CANDIDATES = ("\n", "; ", " | ", ";", "|", "\t", " / ", ",")


def compile_registry(
    registry: Registry,
    tokenizer: TokenizerInfo,
    contract: Contract | None = None,
    *,
    sample: int = 1_000,
    seed: int = 0,
    progress: bool | None = None,
    problems: Sequence[Problem] = (),
    suggest: bool = True,
) -> Artifact:
    """Compile ``registry`` into an :class:`Artifact` whose trie paths equal the tokenizer's encodings.

    Every tool is verified in context in every position (see ``_verification_answers``), plus ``sample`` random
    pairs and triples. Raises :class:`RegistryProblems` listing every name the contract or tokenizer cannot
    carry (with ``problems`` found before, e.g. by the loader; when names contain the separator, it proposes one
    that no name contains and that compiles, unless ``suggest`` is False) and :class:`CompileError` when no split
    of the separator represents the registry.

    >>> from tooltrie.registry import CATALOG_PATH, load_registry
    >>> artifact = compile_registry(load_registry(CATALOG_PATH), TokenizerInfo.load("smollm2-135m"))
    >>> artifact.placement(), artifact.trie.n_tools, artifact.split
    ('constant', 47, Split(left='', right=', '))
    """
    contract = contract or Contract()
    held = [token for token in sorted(tokenizer.special_tokens) if token and token in contract.separator]
    if held:
        raise CompileError(f"the contract's separator {contract.separator!r} holds {tokenizer.source}'s special token "
                           f"{held[0]!r}: an answer would stop or change turns inside it; choose another separator")
    names = registry.names
    show = len(names) >= PROGRESS_MIN_TOOLS and sys.stderr.isatty() if progress is None else progress
    splits = _split_candidates(contract.separator)
    with _Encoder(tokenizer, names, show) as encoder:
        encoder.phase_paths(splits[0])  # queued: encoded while Python works on what follows
        first_answers = _verification_answers(names, splits[0], sample, np.random.default_rng(seed))
        registry.sha256  # noqa: B018  (the artifact's identity, hashed while the tokenizer works)
        bare = encoder.affixed("", "").result()
        found = [*problems, *name_problems(registry, tokenizer, contract, bare)]
        if found:
            raise _problems_error(found, registry, tokenizer, contract, suggest=suggest)
        if not names:
            raise RegistryError(f"{registry.source or registry.name}: the registry has no tools")

        failures: dict[Split, str] = {}
        for split in splits:
            answers = first_answers if split == splits[0] else _verification_answers(names, split, sample,
                                                                                    np.random.default_rng(seed))
            paths = {phase: job.result() for phase, job in encoder.phase_paths(split).items()}
            screen = answers[:_SCREEN_ANSWERS]
            bad = _mismatches(screen, _expected(screen, paths, len(names)),
                              encoder.encode(_answer_texts(screen, names, contract)))
            trie: CompiledTrie | RegistryProblems | None = None
            if not bad:
                verifying = encoder.start(_answer_texts(answers, names, contract), "verifying")
                expected = _expected(answers, paths, len(names))  # gathered while the tokenizer works,
                trie = _try_build(paths, registry)  # and the trie built (used only if every answer verifies)
                bad = _mismatches(answers, expected, verifying.result())
            if bad:
                failures[split] = _describe_mismatches(bad, names, contract)
                continue
            if isinstance(trie, RegistryProblems):
                raise trie
            assert trie is not None
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


def name_problems(registry: Registry, tokenizer: TokenizerInfo, contract: Contract, bare: FlatPaths) -> list[Problem]:
    """Every name the contract or the tokenizer cannot carry (``bare``: the names' encodings)."""
    tools = registry.tools
    found = [Problem.of(tool, "separator", f"tool name contains the contract's separator {contract.separator!r}")
             for tool in tools if contract.separator in tool.name]
    if not tools:
        return found
    lengths = bare.lengths
    special = {tokenizer.token_to_id(token) for token in tokenizer.special_tokens}
    special_ids = np.array(sorted({token for token in special if token is not None} | {tokenizer.eos_id}),
                           dtype=np.int64)
    tool_of_token = np.repeat(np.arange(len(tools)), lengths)
    has_special = np.bincount(tool_of_token[np.isin(bare.tokens, special_ids)], minlength=len(tools)) > 0
    decoded = tokenizer.decode_mismatches(bare, registry.names)
    twins = [(first, later) for first, later in bare.duplicates() if lengths[first]]
    twin_of = {later for _, later in twins}  # "tokenizes exactly like" says more than "does not survive decoding"
    for tool_id, tool in enumerate(tools):
        if not lengths[tool_id]:
            found.append(Problem.of(tool, "no_tokens", f"tool name renders to no tokens with {tokenizer.source}"))
        elif has_special[tool_id]:
            found.append(Problem.of(
                tool, "special_token", f"tool name contains a special token of {tokenizer.source} (e.g. the stop "
                f"token {tokenizer.eos_token!r}); it could end the answer early"))
        elif tool_id in decoded and tool_id not in twin_of:  # e.g. bytes the vocabulary lacks are silently dropped
            found.append(Problem.of(
                tool, "round_trip", f"tool name does not survive {tokenizer.source}'s round trip: its tokens decode "
                f"to {decoded[tool_id]!r}, so an answer naming it could not be parsed"))
    found += [_same_tokens_problem(tools[later], tools[first]) for first, later in twins]
    return found


def _problems_error(found: list[Problem], registry: Registry, tokenizer: TokenizerInfo, contract: Contract, *,
                    suggest: bool) -> RegistryProblems:
    source = registry.source or registry.name
    if not suggest or not any(problem.cause == "separator" for problem in found):
        return RegistryProblems(found, source=source)
    separator = suggest_separator(registry, tokenizer, contract, found)
    if separator is None:
        hint = (f"no separator among {[*SEPARATOR_CANDIDATES]} is absent from every name and compiles with "
                f"{tokenizer.source}; rename the tools that contain {contract.separator!r}")
    else:
        hint = (f"hint: no name contains {separator!r}, and the registry compiles with it for {tokenizer.source}: "
                f"compile with --separator {cli_quote(separator)}")
    return RegistryProblems(found, source=source, hint=hint, suggested_separator=separator)


def suggest_separator(registry: Registry, tokenizer: TokenizerInfo, contract: Contract,
                      found: Sequence[Problem]) -> str | None:
    """The first of ``SEPARATOR_CANDIDATES`` that no name contains and with which the tools whose only problem is
    the separator (plus those without problems) compile, or None."""
    other = {(problem.where, problem.tool) for problem in found if problem.cause != "separator"}
    usable = [tool for tool in registry.tools if (tool.where.removesuffix(f" {tool.name!r}"), tool.name) not in other]
    if not usable:
        return None
    candidate_registry = Registry(name=registry.name, tools=tuple(usable), source=registry.source)
    for separator in SEPARATOR_CANDIDATES:
        if separator == contract.separator or any(separator in tool.name for tool in registry.tools):
            continue
        try:
            compile_registry(candidate_registry, tokenizer, Contract(separator=separator), progress=False,
                             suggest=False)
        except TooltrieError:
            continue
        return separator
    return None


def cli_quote(separator: str) -> str:
    r"""The separator as ``--separator`` takes it (which reads ``\n``, ``\t`` and ``\\`` as escapes).

    >>> print(cli_quote("\n"), cli_quote("; "))
    '\n' '; '
    """
    escaped = separator.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")
    return "'" + escaped.replace("'", "'\"'\"'") + "'"


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
    if not n:
        return []
    by_length = sorted(range(n), key=lambda tool: len(names[tool]))
    shortest, runner_up = by_length[0], by_length[min(1, n - 1)]
    partner = [shortest] * n  # the shortest other name
    partner[shortest] = runner_up

    order = rng.permutation(n).tolist()
    answers: list[tuple[int, ...]] = [
        (int(rng.integers(n)), *order[start : start + _CHAIN_LENGTH], int(rng.integers(n)))
        for start in range(0, n, _CHAIN_LENGTH)
    ]
    answers += zip(range(n), partner, strict=True)
    if split.left:
        answers += zip(partner, range(n), strict=True)
    answers += [tuple(row) for row in rng.integers(0, n, size=(sample, 2)).tolist()]
    answers += [tuple(row) for row in rng.integers(0, n, size=(sample, 3)).tolist()]
    return [answers[i] for i in rng.permutation(len(answers))]


class _Encoder:
    """The registry's encodings, made on a thread of their own, in the order started: the Rust tokenizer releases
    the GIL, so the compiler's Python work (checking names, gathering expected encodings, hashing) runs meanwhile.
    Each affixed form of the names is encoded once and shared by the phases and splits that use it."""

    def __init__(self, tokenizer: TokenizerInfo, names: list[str], show_progress: bool) -> None:
        self.tokenizer = tokenizer
        self.names = names
        self.show_progress = show_progress and importlib.util.find_spec("tqdm") is not None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tooltrie-encode")
        self._affixed: dict[tuple[str, str], Future[FlatPaths]] = {}

    def __enter__(self) -> _Encoder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._thread.shutdown(cancel_futures=True)

    def start(self, texts: list[str], what: str = "tokenizing") -> Future[FlatPaths]:
        return self._thread.submit(self._encode, texts, what)

    def encode(self, texts: list[str], what: str = "tokenizing") -> FlatPaths:
        return self.start(texts, what).result()

    def affixed(self, prefix: str, suffix: str) -> Future[FlatPaths]:
        """Every name between ``prefix`` and ``suffix``, encoded."""
        if (prefix, suffix) not in self._affixed:
            texts = [prefix + name + suffix for name in self.names] if prefix or suffix else self.names
            self._affixed[prefix, suffix] = self.start(texts, f"tokenizing {prefix + '<name>' + suffix!r}")
        return self._affixed[prefix, suffix]

    def phase_paths(self, split: Split) -> dict[int, Future[FlatPaths]]:
        """Every tool's token path in each phase of ``split`` (phases with the same affixes share one object)."""
        return {phase: self.affixed(*split.affixes(phase)) for phase in range(N_PHASES)}

    def _encode(self, texts: list[str], what: str) -> FlatPaths:
        """The texts' ids concatenated, without a Python list or an encoding per text."""
        if not self.show_progress:
            return self.tokenizer.encode_flat(texts)
        from tqdm import tqdm

        parts = []
        with tqdm(total=len(texts), desc=what, unit="text", leave=False) as bar:
            for start in range(0, len(texts), _ENCODE_CHUNK):
                chunk = texts[start : start + _ENCODE_CHUNK]
                parts.append(self.tokenizer.encode_flat(chunk))
                bar.update(len(chunk))
        return FlatPaths.concatenate(parts)


def _same_tokens_problem(tool: Tool, twin: Tool) -> Problem:
    hint = " (they differ only in case: this tokenizer does not tell case apart)" if (
        tool.name.casefold() == twin.name.casefold()) else ""
    return Problem.of(tool, "duplicate_path", f"tool name tokenizes exactly like {twin.name!r} ({twin.where}){hint}")


def _answer_texts(answers: Sequence[tuple[int, ...]], names: list[str], contract: Contract) -> list[str]:
    """Each answer rendered as the model writes it."""
    tool_names = [names[tool] for answer in answers for tool in answer]
    bounds = np.cumsum([0, *map(len, answers)]).tolist()
    return [contract.separator.join(tool_names[a:b]) for a, b in itertools.pairwise(bounds)]


def _expected(answers: Sequence[tuple[int, ...]], paths: dict[int, FlatPaths], n_tools: int) -> FlatPaths:
    """Each answer's encoding as the concatenation of its tools' phase paths (one gather for all of them)."""
    if not answers:
        return FlatPaths(np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64))
    # The phase of every position: one table of paths, indexed by (distinct encoding, tool).
    tables, table_of_phase = _distinct(paths)
    table_tokens = np.concatenate([table.tokens for table in tables])
    table_starts = np.concatenate([table.starts[:-1] + offset for table, offset in
                                   zip(tables, np.cumsum([0] + [len(t.tokens) for t in tables]), strict=False)])
    table_lengths = np.concatenate([table.lengths for table in tables])
    answer = FlatPaths.of(answers)
    length = answer.lengths
    position = np.arange(len(answer.tokens)) - np.repeat(answer.starts[:-1], length)
    answer_size = np.repeat(length, length)
    position_phase = np.where(position == 0, np.where(answer_size == 1, PHASE_FIRST_LAST, PHASE_FIRST_MORE),
                              np.where(position == answer_size - 1, PHASE_NEXT_LAST, PHASE_NEXT_MORE))
    key = np.asarray(table_of_phase)[position_phase] * n_tools + answer.tokens
    seg_start, seg_length = table_starts[key], table_lengths[key]
    expected_length = np.add.reduceat(seg_length, answer.starts[:-1])
    return FlatPaths(table_tokens[concat_ranges(seg_start, seg_length)],
                     np.concatenate([[0], np.cumsum(expected_length)]))


def _mismatches(answers: Sequence[tuple[int, ...]], expected: FlatPaths, actual: FlatPaths) -> list[tuple[int, ...]]:
    """The answers whose canonical encoding (``actual``) is not the concatenation of their tools' phase paths
    (``expected``), compared as flat arrays."""
    if not answers:
        return []
    same_length = expected.lengths == actual.lengths
    # Compare the answers of equal length token by token (their tokens line up once the others are dropped).
    expected_owner = np.repeat(same_length, expected.lengths)
    actual_owner = np.repeat(same_length, actual.lengths)
    owner = np.repeat(np.arange(len(answers)), actual.lengths)[actual_owner]
    differs = np.zeros(len(answers), dtype=bool)
    differs[owner[expected.tokens[expected_owner] != actual.tokens[actual_owner]]] = True
    return [answers[int(i)] for i in np.nonzero(differs | ~same_length)[0]]


def _distinct(paths: dict[int, FlatPaths]) -> tuple[list[FlatPaths], list[int]]:
    """The phases' distinct path tables (phases with the same affixes share one object) and each phase's index."""
    distinct: list[FlatPaths] = []
    index = []
    for phase in range(N_PHASES):
        found = next((i for i, seen in enumerate(distinct) if seen is paths[phase]), None)
        if found is None:
            distinct.append(paths[phase])
            found = len(distinct) - 1
        index.append(found)
    return distinct, index


def _try_build(paths: dict[int, FlatPaths], registry: Registry) -> CompiledTrie | RegistryProblems:
    """The trie, or the problems that stop it (raised only once the split is known to verify)."""
    try:
        return _build(paths, registry)
    except RegistryProblems as problems:
        return problems


def _build(paths: dict[int, FlatPaths], registry: Registry) -> CompiledTrie:
    distinct, phase_trie = _distinct(paths)
    try:
        trie = build_trie(distinct, phase_trie)
    except DuplicatePathError as exc:
        tools = registry.tools
        raise RegistryProblems([_same_tokens_problem(tools[max(pair)], tools[min(pair)]) for pair in exc.pairs],
                               source=registry.source or registry.name) from None
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
