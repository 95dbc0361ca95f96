"""vLLM's rows on tooltrie's batch state, without vLLM: the per-request arguments and the row bookkeeping both vLLM
adapters (``integrations/vllm.py``) share. Importable (and tested) where vLLM is not installed.

Nothing here imports ``tooltrie.kernels`` (and with it Numba and llvmlite) until rows are made: vLLM's CPU worker
unpickles its config, which imports the processor's module, then scans every loaded module to rebind its Triton
kernel overrides, and llvmlite's ffi wrappers break that scan. The kernels are imported where they are first used.
"""

from __future__ import annotations

import functools
import itertools
import operator
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from tooltrie.compiler.artifact import Artifact

if TYPE_CHECKING:
    from tooltrie.kernels.batch import TrieBatch

EXTRA_ARGS_KEY = "tooltrie"
# The flat form, for callers that cannot nest: vLLM's OpenAI server passes ``vllm_xargs`` (str, int, float or lists of
# them, no dicts) into ``extra_args`` as they are.
FLAT_ARTIFACT_KEY = "tooltrie_artifact"
FLAT_K_KEY = "tooltrie_k"
FLAT_PREFIX = "tooltrie_"  # any other key with it is a typo, refused rather than silently unconstrained


@dataclass(frozen=True)
class RequestArgs:
    artifact: str
    k: int
    thinking_budget: bool = False  # vLLM forces the end of its thinking: it writes into the logits after us


def request_args(artifact_path: str | os.PathLike[str], k: int, *, flat: bool = False) -> dict[str, Any]:
    """``SamplingParams.extra_args`` that ask for an answer of exactly ``k`` tools under the artifact at the path;
    ``flat``: as two top-level keys, the form vLLM's OpenAI server can carry in a request's ``vllm_xargs``.

    >>> request_args("catalog.trie.safetensors", 2)
    {'tooltrie': {'artifact': 'catalog.trie.safetensors', 'k': 2}}
    >>> request_args("catalog.trie.safetensors", 2, flat=True)
    {'tooltrie_artifact': 'catalog.trie.safetensors', 'tooltrie_k': 2}
    """
    if flat:
        return {FLAT_ARTIFACT_KEY: os.fspath(artifact_path), FLAT_K_KEY: int(k)}
    return {EXTRA_ARGS_KEY: {"artifact": os.fspath(artifact_path), "k": int(k)}}


def parse_request_args(params: Any) -> RequestArgs | None:
    """The request's tooltrie arguments, nested (``{"tooltrie": {"artifact", "k"}}``) or flat (``tooltrie_artifact``
    and ``tooltrie_k``), or None if it did not ask for the constraint; ``ValueError`` (which vLLM turns into a refused
    request) when they are malformed or do not fit the artifact."""
    extra = params.extra_args or {}
    flat_keys = sorted(key for key in extra if isinstance(key, str) and key.startswith(FLAT_PREFIX))
    if EXTRA_ARGS_KEY in extra:
        if flat_keys:
            raise ValueError(f"extra_args: give either {EXTRA_ARGS_KEY!r} or {FLAT_ARTIFACT_KEY!r} and "
                             f"{FLAT_K_KEY!r}, not both (got {EXTRA_ARGS_KEY!r} and {', '.join(flat_keys)})")
        where, args = f"extra_args[{EXTRA_ARGS_KEY!r}]", extra[EXTRA_ARGS_KEY]
        form = "{'artifact': path, 'k': int}"
        if not isinstance(args, dict):
            raise ValueError(f"{where} must be {form}, got {args!r}")
        artifact, k = args.get("artifact"), args.get("k")
    elif flat_keys:
        unknown = [key for key in flat_keys if key not in (FLAT_ARTIFACT_KEY, FLAT_K_KEY)]
        if unknown:
            raise ValueError(f"extra_args: unknown key {unknown[0]!r} (the flat form is {FLAT_ARTIFACT_KEY!r} and "
                             f"{FLAT_K_KEY!r})")
        where, form = "extra_args", f"{{{FLAT_ARTIFACT_KEY!r}: path, {FLAT_K_KEY!r}: int}}"
        args = {key: extra[key] for key in flat_keys}
        artifact, k = extra.get(FLAT_ARTIFACT_KEY), extra.get(FLAT_K_KEY)
    else:
        return None
    if not isinstance(artifact, str) or type(k) is not int:
        raise ValueError(f"{where} must be {form}, got {args!r}")
    from tooltrie.kernels.state import check_k  # not at import: see the module's docstring

    check_k(k, load_artifact(artifact).trie.n_tools, where=where)
    budgeted = getattr(params, "thinking_token_budget", None) is not None
    return RequestArgs(artifact=artifact, k=k, thinking_budget=budgeted)


@functools.lru_cache(maxsize=8)
def load_artifact(path: str) -> Artifact:
    return Artifact.load(path)


# Async scheduling (vLLM on GPUs) appends this to a request's output list for a token sampled but not yet copied
# back to the host; vLLM writes the real id over it before the next sampling step.
PLACEHOLDER = -1

# A CPU step either masks the constrained rows in place (writing -inf over every illegal logit) or returns a buffer
# that gets only their legal logits but every other row copied whole (``kernels.cpu.LegalLogits``). Measured on a
# shared 2-core AMD EPYC VM with a 49,152-token vocabulary: copying a plain row costs about what the buffer saves on
# 16 constrained rows, so the buffer is used only where plain rows are at most 1/16 of the constrained ones.
PLAIN_ROW_COST = 16


class ArtifactRows:
    """The rows of vLLM's batch that carry our arguments: one ``TrieBatch`` per artifact, whose rows keep vLLM's
    row numbers (V1 batch indices, V2 slots). ``fed[row]`` counts the output tokens the row has accepted (0 for rows
    that are not ours)."""

    def __init__(self, device: torch.device | str | None) -> None:
        from tooltrie.kernels.cpu import LegalLogits  # not at import: see the module's docstring

        self.backend = "cuda" if torch.device(device or "cpu").type == "cuda" else "cpu"
        self.batches: dict[str, TrieBatch] = {}
        self.args: dict[int, RequestArgs] = {}
        self.fed = np.zeros(16, dtype=np.int64)
        self.budgeted = np.zeros(16, dtype=bool)  # rows whose request has a thinking budget
        # Which request holds each row (a number new for each request added; 0: none of ours), and which one each
        # row of the buffer last served: a row of the buffer is reset whole when it serves another request, so that
        # whatever a later stage wrote into it (a finite value in an illegal column) cannot reach the next request.
        self.serial = np.zeros(16, dtype=np.int64)
        self.served = np.zeros(0, dtype=np.int64)
        self.next_serial = 1
        self.legal = LegalLogits()  # on a CPU, what ``apply`` returns (see PLAIN_ROW_COST)
        # Per artifact, vLLM row -> its batch row (the same number; -1: not this artifact's), with one more entry,
        # -1, at the end, so that row -1 (NumPy's last entry) maps to -1: a step maps its rows with one gather.
        self.owners: dict[str, npt.NDArray[np.int32]] = {}

    def __contains__(self, row: int) -> bool:
        return row in self.args

    def add(self, row: int, args: RequestArgs) -> None:
        """A request joins in ``row`` (or starts over there: a preempted request recomputed)."""
        from tooltrie.kernels.batch import TrieBatch

        self.remove(row)
        batch = self.batches.get(args.artifact)
        if batch is None:
            batch = self.batches[args.artifact] = TrieBatch(load_artifact(args.artifact), backend=self.backend,
                                                            capacity=max(16, row + 1))
            self.owners[args.artifact] = np.full(len(self.fed) + 1, -1, dtype=np.int32)
        batch.add(row, args.k)
        self._set(row, args, 0, self.next_serial)
        self.next_serial += 1

    def remove(self, row: int) -> None:
        args = self.args.get(row)
        self._set(row, None, 0, 0)
        if args is not None:
            self.batches[args.artifact].remove(row)

    def move(self, source: int, target: int, *, swap: bool) -> None:
        """vLLM moved ``source``'s request to ``target`` (and, with ``swap``, ``target``'s to ``source``)."""
        if source == target:
            return
        moving, displaced = self._row(source), self._row(target)
        if swap and moving[0] is not None and displaced[0] is not None and (
                moving[0].artifact == displaced[0].artifact):
            self.batches[moving[0].artifact].swap(source, target)
        else:
            if displaced[0] is not None:  # first, so that a move within one batch is not undone
                batch = self.batches[displaced[0].artifact]
                batch.move(target, source) if swap else batch.remove(target)
            if moving[0] is not None:
                self.batches[moving[0].artifact].move(source, target)
        self._set(target, *moving)
        self._set(source, *(displaced if swap else (None, 0, 0)))

    def apply(self, logits: torch.Tensor, rows: Sequence[int] | npt.NDArray[np.integer],
              new_tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """Logits row i belongs to vLLM row ``rows[i]`` (-1 or a row that is not ours: left alone) and brings it
        ``new_tokens[i]``: accept them, then mask, one call each per artifact, with no Python loop over rows.

        The masked logits are returned: on a GPU they are ``logits``, masked in place; on a CPU either ``logits``
        masked in place or a buffer that gets only the legal logits (``kernels.cpu.LegalLogits``), whichever costs
        less for the step's mix of rows (``PLAIN_ROW_COST``); in place, too, in a step with a thinking budget among
        its rows (vLLM writes finite values into the logits after us)."""
        from tooltrie.kernels.batch import ragged_ids
        from tooltrie.kernels.bitmask import get_bitmask_shape

        tokens, lengths = ragged_ids(new_tokens)
        vllm_rows = np.asarray(rows, dtype=np.int32).reshape(-1)
        self._grow(int(vllm_rows.max(initial=-1)) + 1)
        requests = np.where(vllm_rows >= 0, self.serial[vllm_rows], 0)
        constrained = requests > 0
        n_constrained = int(np.count_nonzero(constrained))
        if not n_constrained:
            return logits
        in_place = (self.backend != "cpu" or (len(vllm_rows) - n_constrained) * PLAIN_ROW_COST > n_constrained
                    or bool(self.budgeted[vllm_rows[constrained]].any()))
        bitmask = None if in_place else np.empty(get_bitmask_shape(*logits.shape), dtype=np.int32)
        for path, owner in self.owners.items():
            mine = owner[vllm_rows]  # -1 stays -1: an owner table ends with -1
            ours = mine >= 0
            if ours.any():
                self.fed[mine[ours]] += lengths[ours]
                self.batches[path].accept(tokens, mine, lengths=lengths)
                if bitmask is None:
                    self.batches[path].mask_logits_(logits, mine)
                else:
                    self.batches[path].fill_bitmask(bitmask, mine)
        if bitmask is None:
            return logits
        if len(self.served) < len(requests):
            self.served = np.concatenate([self.served, np.zeros(len(requests) - len(self.served), np.int64)])
        changed = np.flatnonzero(self.served[: len(requests)] != requests)
        self.legal.reset(changed)
        self.served[changed] = requests[changed]
        masked: torch.Tensor = self.legal(logits, bitmask, constrained)
        return masked

    def unfed(self, outputs: Sequence[Sequence[int]]) -> list[Sequence[int]]:
        """Row i's output tokens past those it has accepted, from its whole output list ``outputs[i]``, up to the
        first ``PLACEHOLDER`` (async scheduling: its token is not known yet; it is accepted once vLLM writes it)."""
        self._grow(len(outputs))
        starts = self.fed[: len(outputs)].tolist()
        new = map(operator.getitem, outputs, map(slice, starts, itertools.repeat(None)))
        return [tokens[: tokens.index(PLACEHOLDER)] if PLACEHOLDER in tokens else tokens for tokens in new]

    def _row(self, row: int) -> tuple[RequestArgs | None, int, int]:
        if row >= len(self.fed):
            return None, 0, 0
        return self.args.get(row), int(self.fed[row]), int(self.serial[row])

    def _set(self, row: int, args: RequestArgs | None, fed: int, serial: int) -> None:
        """Row ``row`` holds request ``serial`` (``args``' request; None and 0: none of ours), which has accepted
        ``fed`` tokens."""
        if args is None:
            self.args.pop(row, None)
        else:
            self.args[row] = args
        self._grow(row + 1)
        self.fed[row] = fed
        self.serial[row] = serial
        self.budgeted[row] = args is not None and args.thinking_budget
        for path, owner in self.owners.items():
            owner[row] = row if args is not None and args.artifact == path else -1

    def _grow(self, size: int) -> None:
        if size > len(self.fed):
            extra = max(size, 2 * len(self.fed)) - len(self.fed)
            self.fed = np.concatenate([self.fed, np.zeros(extra, np.int64)])
            self.serial = np.concatenate([self.serial, np.zeros(extra, np.int64)])
            self.budgeted = np.concatenate([self.budgeted, np.zeros(extra, bool)])
            for path, owner in self.owners.items():
                self.owners[path] = np.concatenate([owner, np.full(extra, -1, np.int32)])
