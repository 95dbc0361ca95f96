"""vLLM's rows on tooltrie's batch state, without vLLM: the per-request arguments and the row bookkeeping both vLLM
adapters (``integrations/vllm.py``) share. Importable (and tested) where vLLM is not installed."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tooltrie.compiler.artifact import Artifact
from tooltrie.kernels.batch import TrieBatch
from tooltrie.kernels.state import check_k

EXTRA_ARGS_KEY = "tooltrie"


@dataclass(frozen=True)
class RequestArgs:
    artifact: str
    k: int


def request_args(artifact_path: str | os.PathLike[str], k: int) -> dict[str, Any]:
    """``SamplingParams.extra_args`` that ask for an answer of exactly ``k`` tools under the artifact at the path."""
    return {EXTRA_ARGS_KEY: {"artifact": os.fspath(artifact_path), "k": int(k)}}


def parse_request_args(params: Any) -> RequestArgs | None:
    """The request's tooltrie arguments, or None if it did not ask for the constraint; ``ValueError`` (which vLLM
    turns into a refused request) when they are malformed or do not fit the artifact."""
    extra = params.extra_args or {}
    if EXTRA_ARGS_KEY not in extra:
        return None
    args = extra[EXTRA_ARGS_KEY]
    if not isinstance(args, dict) or not isinstance(args.get("artifact"), str) or type(args.get("k")) is not int:
        raise ValueError(f"extra_args[{EXTRA_ARGS_KEY!r}] must be {{'artifact': path, 'k': int}}, got {args!r}")
    artifact = load_artifact(args["artifact"])
    check_k(args["k"], artifact.trie.n_tools, where=f"extra_args[{EXTRA_ARGS_KEY!r}]")
    return RequestArgs(artifact=args["artifact"], k=args["k"])


@functools.lru_cache(maxsize=8)
def load_artifact(path: str) -> Artifact:
    return Artifact.load(path)


class ArtifactRows:
    """The rows of vLLM's batch that carry our arguments: one ``TrieBatch`` per artifact, whose rows keep vLLM's
    row numbers (V1 batch indices, V2 slots). ``fed[row]`` counts the output tokens the row has accepted."""

    def __init__(self, device: torch.device | str | None) -> None:
        self.backend = "cuda" if torch.device(device or "cpu").type == "cuda" else "cpu"
        self.batches: dict[str, TrieBatch] = {}
        self.args: dict[int, RequestArgs] = {}
        self.fed: dict[int, int] = {}

    def __contains__(self, row: int) -> bool:
        return row in self.args

    def add(self, row: int, args: RequestArgs) -> None:
        """A request joins in ``row`` (or starts over there: a preempted request recomputed)."""
        self.remove(row)
        batch = self.batches.get(args.artifact)
        if batch is None:
            batch = self.batches[args.artifact] = TrieBatch(load_artifact(args.artifact), backend=self.backend,
                                                            capacity=max(16, row + 1))
        batch.add(row, args.k)
        self.args[row], self.fed[row] = args, 0

    def remove(self, row: int) -> None:
        args = self.args.pop(row, None)
        self.fed.pop(row, None)
        if args is not None:
            self.batches[args.artifact].remove(row)

    def move(self, source: int, target: int, *, swap: bool) -> None:
        """vLLM moved ``source``'s request to ``target`` (and, with ``swap``, ``target``'s to ``source``)."""
        moving = self.args.pop(source, None), self.fed.pop(source, None)
        displaced = self.args.pop(target, None), self.fed.pop(target, None)
        if swap and moving[0] is not None and displaced[0] is not None and (
                moving[0].artifact == displaced[0].artifact):
            self.batches[moving[0].artifact].swap(source, target)
        else:
            if displaced[0] is not None:  # first, so that a move within one batch is not undone
                batch = self.batches[displaced[0].artifact]
                batch.move(target, source) if swap else batch.remove(target)
            if moving[0] is not None:
                self.batches[moving[0].artifact].move(source, target)
        if moving[0] is not None:
            self.args[target], self.fed[target] = moving  # type: ignore[assignment]
        if swap and displaced[0] is not None:
            self.args[source], self.fed[source] = displaced  # type: ignore[assignment]

    def apply(self, logits: torch.Tensor, rows: Sequence[int], new_tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """Logits row i belongs to vLLM row ``rows[i]`` (-1: none of ours) and brings it ``new_tokens[i]``: accept
        them, then mask, one call each per artifact."""
        for tokens, row in zip(new_tokens, rows, strict=True):
            if row >= 0:
                self.fed[row] += len(tokens)
        for path, batch in self.batches.items():
            mine = [row if row >= 0 and self.args[row].artifact == path else -1 for row in rows]
            if any(row >= 0 for row in mine):
                batch.accept(new_tokens, mine)
                batch.mask_logits_(logits, mine)
        return logits
