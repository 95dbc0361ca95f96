"""Reading the regenerated training data (``tooltrie gen-data``) and checking it against the artifact trained for.

A data directory holds ``train.jsonl``, ``validation.jsonl`` and ``meta.json``. Each record is
``{"query", "tools", "k", "kind", "prompt", "completion", "prompt_ids", "completion_ids"}`` (``kind``, "need" for a
request that describes a situation, may be absent): ``prompt_ids`` is the whole prompt as the engine tokenizes it,
``completion_ids`` the tokens the engine emits for the answer (each tool's trie path, separators included, then the
stop token). ``meta.json`` names the registry (name, sha256), the tokenizer fingerprint, the contract sha256 and the
prompt style the records were made with.

Loading walks every completion through a ``TrieMatcher`` of the artifact: a token the trie refuses, or an answer that
does not end where the trie does, is a ``TrainingDataError`` naming the file and line. The walk also yields, for every
answer position, the legal tokens there: the candidates of the trie loss, and of the validation's constrained
accuracy.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tooltrie.compiler import provenance
from tooltrie.compiler.artifact import Artifact
from tooltrie.errors import TooltrieError
from tooltrie.kernels.matcher import TrieMatcher

__all__ = ["DataMeta", "Example", "TrainingData", "TrainingDataError", "check_alike", "example_from_record",
           "load_training_data", "read_meta"]

SPLIT_FILES = {"train": "train.jsonl", "validation": "validation.jsonl"}
META_FILE = "meta.json"
# Where meta.json keeps each hash; the first path present wins (nested, as gen-data writes it, or flat).
_META_PATHS: dict[str, tuple[tuple[str, ...], ...]] = {
    "registry_name": (("registry", "name"), ("registry_name",)),
    "registry_sha256": (("registry", "sha256"), ("registry_sha256",)),
    "tokenizer_fingerprint": (("tokenizer", "fingerprint"), ("tokenizer_fingerprint",)),
    "contract_sha256": (("contract_sha256",), ("contract", "sha256")),
    "prompt_style": (("prompt_style",), ("prompt", "style")),
}


class TrainingDataError(TooltrieError, ValueError):
    """Training data is missing, malformed, or was made for another registry, tokenizer or contract."""


@dataclass(frozen=True)
class Example:
    """One training record, checked against the trie."""

    query: str
    tools: tuple[str, ...]
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]  # the answer's tokens, ending with the stop token
    legal: tuple[tuple[int, ...], ...]  # the legal tokens (ascending) before each completion token
    # What the fused ranker adds to each legal token where there is a choice (``train.priors``); None: nothing.
    bonus: tuple[tuple[float, ...], ...] | None = None
    kind: str = ""  # "need": the request describes a situation, not the tool (``eval.datasets.LabelledQuery.kind``)

    @property
    def k(self) -> int:
        return len(self.tools)


@dataclass(frozen=True)
class DataMeta:
    """What ``meta.json`` says the data was made from."""

    registry_name: str
    registry_sha256: str
    tokenizer_fingerprint: str
    contract_sha256: str
    prompt_style: str
    raw: Mapping[str, Any] = field(repr=False)


@dataclass(frozen=True)
class TrainingData:
    directory: Path
    meta: DataMeta
    train: list[Example]
    validation: list[Example]


def read_meta(directory: str | Path) -> DataMeta:
    """Read ``meta.json``; raises ``TrainingDataError`` when it is missing or lacks a hash."""
    path = Path(directory) / META_FILE
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise TrainingDataError(f"{path}: no such file; make the training data with `tooltrie gen-data` "
                                "(or `make training-data`)") from exc
    except (OSError, ValueError) as exc:
        raise TrainingDataError(f"{path}: unreadable: {exc}") from exc
    if not isinstance(raw, dict):
        raise TrainingDataError(f"{path}: expected a JSON object")
    values = {}
    for name, paths in _META_PATHS.items():
        value = next((v for v in (_get(raw, p) for p in paths) if isinstance(v, str)), None)
        if value is None:
            raise TrainingDataError(f"{path}: no {name} (looked for {' or '.join('.'.join(p) for p in paths)})")
        values[name] = value
    return DataMeta(**values, raw=raw)


def check_meta(meta: DataMeta, artifact: Artifact, *, where: str) -> None:
    """The data must have been made for ``artifact``'s registry, tokenizer and contract."""
    problems = provenance.differences(meta, artifact, made="made for")
    if problems:
        raise TrainingDataError(f"{where}: the data does not fit this artifact: {'; '.join(problems)}; regenerate "
                                "it for this registry (`make training-data REGISTRY=...`)")


def check_alike(data: TrainingData, other: TrainingData) -> None:
    """Data made for another registry trains the same adapter only when its records were made alike: the same
    tokenizer (the ids mean the same), contract (answers end alike) and prompt style (the adapter records one)."""
    for name in ("tokenizer_fingerprint", "contract_sha256", "prompt_style"):
        mine, theirs = getattr(data.meta, name), getattr(other.meta, name)
        if mine != theirs:
            raise TrainingDataError(f"{other.directory / META_FILE}: {name} is {theirs!r}, but {mine!r} in "
                                    f"{data.directory / META_FILE}; data trained together must be made alike")


def load_training_data(directory: str | Path, artifact: Artifact) -> TrainingData:
    """Read and check a data directory made for ``artifact``."""
    root = Path(directory)
    meta = read_meta(root)
    check_meta(meta, artifact, where=str(root / META_FILE))
    splits = {split: [example_from_record(record, artifact, where=where)
                      for where, record in _records(root / name)]
              for split, name in SPLIT_FILES.items()}
    if not splits["train"]:
        raise TrainingDataError(f"{root / SPLIT_FILES['train']}: no training records")
    return TrainingData(directory=root, meta=meta, train=splits["train"], validation=splits["validation"])


def example_from_record(record: Mapping[str, Any], artifact: Artifact, *, where: str) -> Example:
    """Check one record and walk its completion through the trie."""
    try:
        query, tools = str(record["query"]), tuple(str(t) for t in record["tools"])
        prompt_ids = _ids(record["prompt_ids"])
        completion_ids = _ids(record["completion_ids"])
    except (KeyError, TypeError, ValueError) as exc:
        raise TrainingDataError(f"{where}: expected query, tools, prompt_ids and completion_ids "
                                f"(lists of token ids): {type(exc).__name__}: {exc}") from exc
    if "k" in record and record["k"] != len(tools):
        raise TrainingDataError(f"{where}: k is {record['k']} but {len(tools)} tools are given")
    if not prompt_ids:
        raise TrainingDataError(f"{where}: empty prompt_ids")
    return Example(query=query, tools=tools, prompt_ids=prompt_ids, completion_ids=completion_ids,
                   legal=_walk(artifact, tools, completion_ids, where=where), kind=str(record.get("kind", "")))


def _walk(artifact: Artifact, tools: Sequence[str], completion: Sequence[int],
          *, where: str) -> tuple[tuple[int, ...], ...]:
    if not 1 <= len(tools) <= artifact.trie.n_tools:
        raise TrainingDataError(f"{where}: {len(tools)} tools; the registry has {artifact.trie.n_tools}")
    matcher = TrieMatcher(artifact, k=len(tools))
    legal = []
    for position, token in enumerate(completion):
        allowed = matcher.legal_tokens()
        if matcher.is_terminated() or allowed is None or not matcher.accept_token(token):
            raise TrainingDataError(f"{where}: completion token {position} ({token}) does not follow the trie of "
                                    f"registry {artifact.registry.name!r} after {matcher.tool_names()}")
        legal.append(tuple(allowed))
    if not matcher.is_terminated():
        raise TrainingDataError(f"{where}: the completion ends before the answer does (after "
                                f"{matcher.tool_names()}, no stop token)")
    if matcher.tool_names() != list(tools):
        raise TrainingDataError(f"{where}: the completion names {matcher.tool_names()}, the record {list(tools)}")
    return tuple(legal)


def _records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise TrainingDataError(f"{path}: unreadable: {exc}") from exc
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise TrainingDataError(f"{where}: not JSON: {exc}") from exc
        if not isinstance(record, dict):
            raise TrainingDataError(f"{where}: expected a JSON object")
        yield where, record


def _ids(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise TypeError("not a list of integers")
    return tuple(value)


def _get(raw: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = raw
    for key in path:
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return value
