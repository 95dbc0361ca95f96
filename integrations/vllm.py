"""vLLM logits processors (0.33, and 0.32's CPU build): vLLM's persistent batch mapped onto tooltrie's batch state
(``kernels/batch.py``).

Two interfaces, one per model runner (see ``docs/vllm.md``):

- ``TrieVllmProcessor`` for the V2 model runner (vLLM 0.33's default on GPUs):
  ``vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor``. State rows are the requests' slots; at each step a
  row's new output tokens are read from ``req_states.all_token_ids`` (one gather for the batch); how many there are
  comes from host-side lengths, so nothing waits on the device but that gather.
- ``TrieVllmProcessorV1`` for the V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``):
  ``vllm.v1.sample.logits_processor.LogitsProcessor`` with ``update_state(BatchUpdate)``: removed, added and moved
  rows (in that order, vLLM's) map to the batch state's remove, add and move; vLLM hands over a live reference to
  each request's output token list. vLLM's CPU build runs this runner.

Either way ``apply()`` is one ``accept`` of every row's new tokens and one mask per artifact in the batch, with no
per-row Python on the mask (``ArtifactRows.apply``): on a GPU the CUDA backend writes it in place on the logits'
device; on a CPU it is written in place or into a buffer of legal logits, whichever costs less for the step's mix of
constrained and plain rows. A token the mask did not allow (another stage overrode it) puts its row in the error
state: from then on only the stop token is allowed, so the request ends with an answer ``parse`` scores as invalid,
never an exception in vLLM's loop.

A request opts in with ``SamplingParams(extra_args=request_args(artifact, k, tools=...))`` (or the flat form,
``request_args(..., flat=True)``, which vLLM's OpenAI server carries in ``vllm_xargs``). The processor reads artifacts
only from one directory set where vLLM starts (``$TOOLTRIE_ARTIFACT_ROOT``; default: the compile cache's ``vllm/``)
and a request names one by its file name there (``request_args`` given a path copies the file in); ``tools``, tool
ids, is the subset the answer may use, enforced in the mask; ``prior`` and ``model_weight`` rank it by the fused
ranker, and ``follow`` (``Prior.follow``) makes that prior follow the answer as in process. Requests without
tooltrie's arguments are left alone, so one ``LLM`` serves constrained, grammar (``structured_outputs``) and plain
requests side by side. Register with
``LLM(model, logits_processors=[processor_class()])`` or by name (``"tooltrie.integrations.vllm:TrieVllmProcessorV1"``).
Importing this module does not import Numba (``vllm_rows``' docstring says why).

This module imports vLLM; import it only where vLLM is installed (``pip install tooltrie[vllm]``).
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import numpy as np
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality
from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcRequestState
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor

from tooltrie.integrations.vllm_rows import (
    EXTRA_ARGS_KEY,
    ArtifactRows,
    RequestArgs,
    ServedModel,
    load_artifact,
    parse_request_args,
    record_served,
    request_args,
    validate_request,
)


def served(vllm_config: Any) -> ServedModel | None:
    """The model this vLLM serves, recorded in the artifact root for admission's checks (``record_served``)."""
    model = ServedModel.of(vllm_config)
    if model is not None:
        record_served(model)
    return model


def processor_class() -> type[TrieVllmProcessor] | type[TrieVllmProcessorV1]:
    """The adapter for the model runner vLLM will use: what ``VLLM_USE_V2_MODEL_RUNNER`` says (0: V1, 1: V2), else
    V1 on vLLM's CPU build (its only runner) and V2 elsewhere."""
    choice = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if choice is None:
        from vllm.platforms import current_platform

        choice = "0" if current_platform.is_cpu() else "1"
    return TrieVllmProcessorV1 if choice == "0" else TrieVllmProcessor


class TrieVllmProcessor(V2LogitsProcessor):  # type: ignore[misc,unused-ignore]  # Any without vLLM
    """The V2 model runner's interface."""

    def __init__(self, vllm_config: Any, req_states: LogitsProcRequestState) -> None:
        self.req_states = req_states
        self.rows = ArtifactRows(getattr(req_states, "device", None), served(vllm_config))

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        validate_request(sampling_params)

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        return self.rows.admit(req_idx, sampling_params)  # a row it cannot add fails alone, never the step

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        slots = [int(slot) for slot in ctx.idx_mapping_np]
        if logits.shape[0] != len(slots):
            raise RuntimeError("tooltrie's logits processor needs one logits row per request "
                               "(vLLM refuses custom logits processors with speculative decoding)")
        rows = [slot if slot in self.rows else -1 for slot in slots]
        if all(row < 0 for row in rows):
            return logits
        return self.rows.apply(logits, rows, self._new_tokens(rows, ctx))

    def _new_tokens(self, rows: list[int], ctx: LogitsContext) -> list[list[int]]:
        """Each row's output tokens since the last step, fetched in one gather.

        Without speculative decoding the row's sequence length is exact on the host (``seq_lens_upper_bound_np``):
        the request has ``length - prompt_len`` committed output tokens (none yet, or fewer, mid-prefill). A request
        with fewer than its row has accepted was recomputed (preempted): its row starts again."""
        prompt_len = self.req_states.prompt_len.np
        gather_slots: list[int] = []
        gather_positions: list[int] = []
        counts: list[int] = []
        for i, slot in enumerate(rows):
            if slot < 0:
                counts.append(0)
                continue
            outputs = max(0, int(ctx.seq_lens_upper_bound_np[i]) - int(prompt_len[slot]))
            if slot in self.rows.failed:  # ends with its stop token whatever it was fed
                counts.append(0)
                continue
            if outputs < self.rows.fed[slot]:
                self.rows.add(slot, self.rows.args[slot])
            start = int(prompt_len[slot]) + self.rows.fed[slot]
            new = outputs - self.rows.fed[slot]
            gather_slots += [slot] * new
            gather_positions += range(start, start + new)
            counts.append(new)
        fetched: list[int] = []
        if gather_slots:
            table = self.req_states.all_token_ids.gpu
            index = (torch.as_tensor(gather_slots, device=table.device), torch.as_tensor(gather_positions,
                                                                                          device=table.device))
            fetched = [int(t) for t in table[index].tolist()]
        result, offset = [], 0
        for new in counts:
            result.append(fetched[offset : offset + new])
            offset += new
        return result


class TrieVllmProcessorV1(V1LogitsProcessor):  # type: ignore[misc,unused-ignore]
    """The V1 model runner's interface (``VLLM_USE_V2_MODEL_RUNNER=0``)."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.state = ArtifactRows(device, served(vllm_config))
        self.rows: dict[int, list[int]] = {}  # batch index -> vLLM's live list of the request's output tokens

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        validate_request(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax: that is the point

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """In vLLM's order (``BatchUpdate``'s contract): removed, then added, then moved; a row removed and added
        in one update holds the added request."""
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.state.remove(index)
            self.rows.pop(index, None)
        for index, params, _, output_ids in batch_update.added:
            if self.state.admit(index, params):  # a row it cannot add fails alone, never the step
                self.rows[index] = output_ids
            else:
                self.rows.pop(index, None)
        for source, target, direction in batch_update.moved:
            swap = direction == MoveDirectionality.SWAP
            self.state.move(source, target, swap=swap)
            moved, displaced = self.rows.pop(source, None), self.rows.pop(target, None)
            if moved is not None:
                self.rows[target] = moved
            if swap and displaced is not None:
                self.rows[source] = displaced

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        n_rows = logits.shape[0]
        outputs = list(map(self.rows.get, range(n_rows), itertools.repeat((), n_rows)))  # (): not ours, nothing new
        return self.state.apply(logits, np.arange(n_rows), self.state.unfed(outputs))


__all__ = ["EXTRA_ARGS_KEY", "ArtifactRows", "RequestArgs", "TrieVllmProcessor", "TrieVllmProcessorV1", "load_artifact",
           "parse_request_args", "processor_class", "request_args"]
