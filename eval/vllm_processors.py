"""vLLM 0.33 logits processors: thin adapters that route rows and token ids to ``RequestConstraint``.

Two interfaces, one per model runner (see ``docs/vllm.md``):

- ``TrieLogitsProcessor`` for the V2 model runner (vLLM 0.33's default on GPUs):
  ``vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor``. Per-request state is keyed by the request's slot;
  at each step a row's new output tokens are read from ``req_states.all_token_ids`` (one gather for the batch);
  how many there are comes from host-side lengths, so nothing waits on the device but that gather.
- ``TrieLogitsProcessorV1`` for the V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``):
  ``vllm.v1.sample.logits_processor.LogitsProcessor`` with ``update_state(BatchUpdate)``; vLLM hands over a live
  reference to each request's output token list.

A request opts in with ``SamplingParams(extra_args=request_args(artifact_path, k))``; the artifact is loaded once per
path and process. Requests without it are left alone, so one ``LLM`` serves constrained, grammar
(``structured_outputs``) and plain requests side by side. Register with
``LLM(model, logits_processors=[processor_class()])``.

This module imports vLLM; import it only where vLLM is installed (``pip install tooltrie[vllm]``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate
from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates
from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcRequestState
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor

from tooltrie.compiler.artifact import Artifact
from tooltrie.eval.constraint import RequestConstraint, mask_rows_
from tooltrie.kernels.state import check_k

EXTRA_ARGS_KEY = "tooltrie"


@dataclass(frozen=True)
class RequestArgs:
    artifact: str
    k: int


def request_args(artifact_path: str | os.PathLike[str], k: int) -> dict[str, Any]:
    """``SamplingParams.extra_args`` that ask for an answer of exactly ``k`` tools under the artifact at the path."""
    return {EXTRA_ARGS_KEY: {"artifact": os.fspath(artifact_path), "k": int(k)}}


def parse_request_args(params: SamplingParams) -> RequestArgs | None:
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


def processor_class() -> type[TrieLogitsProcessor] | type[TrieLogitsProcessorV1]:
    """The adapter for the model runner vLLM will use: V1 when ``VLLM_USE_V2_MODEL_RUNNER=0``, else V2."""
    return TrieLogitsProcessorV1 if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0" else TrieLogitsProcessor


def _constraint(args: RequestArgs) -> RequestConstraint:
    return RequestConstraint(load_artifact(args.artifact), args.k)


class TrieLogitsProcessor(V2LogitsProcessor):  # type: ignore[misc,unused-ignore]  # Any without vLLM
    """The V2 model runner's interface."""

    def __init__(self, vllm_config: Any, req_states: LogitsProcRequestState) -> None:
        self.req_states = req_states
        self.constraints: dict[int, RequestConstraint] = {}  # request slot -> its constraint

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        parse_request_args(sampling_params)

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        args = parse_request_args(sampling_params)
        if args is None:
            self.constraints.pop(req_idx, None)  # the slot's previous occupant may have been ours
            return False
        self.constraints[req_idx] = _constraint(args)
        return True

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        slots = [int(slot) for slot in ctx.idx_mapping_np]
        if logits.shape[0] != len(slots):
            raise RuntimeError("tooltrie's logits processor needs one logits row per request "
                               "(vLLM refuses custom logits processors with speculative decoding)")
        rows = [row for row, slot in enumerate(slots) if slot in self.constraints]
        if not rows:
            return logits
        outputs = self._output_tokens(rows, slots, ctx)
        constraints = [self.constraints[slots[row]] for row in rows]
        for constraint, tokens in zip(constraints, outputs, strict=True):
            constraint.update(tokens)
        return mask_rows_(logits, rows, constraints)

    def _output_tokens(self, rows: list[int], slots: list[int], ctx: LogitsContext) -> list[list[int]]:
        """Each row's output tokens so far: what its constraint has seen plus the new ones, fetched in one gather.

        Without speculative decoding the row's sequence length is exact on the host (``seq_lens_upper_bound_np``):
        the request has ``length - prompt_len`` committed output tokens (none yet, or fewer, mid-prefill)."""
        prompt_len = self.req_states.prompt_len.np
        gather_slots: list[int] = []
        gather_positions: list[int] = []
        wanted: list[tuple[list[int], int]] = []
        for row in rows:
            slot = slots[row]
            constraint = self.constraints[slot]
            outputs = max(0, int(ctx.seq_lens_upper_bound_np[row]) - int(prompt_len[slot]))
            known = constraint.fed[:outputs]
            start = int(prompt_len[slot]) + len(known)
            new = outputs - len(known)
            gather_slots += [slot] * new
            gather_positions += range(start, start + new)
            wanted.append((known, new))
        fetched: list[int] = []
        if gather_slots:
            table = self.req_states.all_token_ids.gpu
            index = (torch.as_tensor(gather_slots, device=table.device), torch.as_tensor(gather_positions,
                                                                                          device=table.device))
            fetched = [int(t) for t in table[index].tolist()]
        result, offset = [], 0
        for known, new in wanted:
            result.append(known + fetched[offset : offset + new])
            offset += new
        return result


class TrieLogitsProcessorV1(V1LogitsProcessor):  # type: ignore[misc,unused-ignore]
    """The V1 model runner's interface (``VLLM_USE_V2_MODEL_RUNNER=0``)."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        # batch index -> (constraint, vLLM's live list of the request's output tokens)
        self.rows: dict[int, tuple[RequestConstraint, list[int]]] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        parse_request_args(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax: that is the point

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, self._new_row)

    @staticmethod
    def _new_row(params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
                 ) -> tuple[RequestConstraint, list[int]] | None:
        args = parse_request_args(params)
        return None if args is None else (_constraint(args), output_ids)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        rows = sorted(self.rows)
        constraints: Sequence[RequestConstraint] = [self.rows[row][0] for row in rows]
        for row, constraint in zip(rows, constraints, strict=True):
            constraint.update(self.rows[row][1])
        return mask_rows_(logits, rows, constraints)
