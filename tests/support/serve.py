"""Helpers shared by ``test_serve_engine.py`` and ``test_serve_hf.py``: the tiny model, a small registry whose names
are token-prefixes of each other, and the oracles the engine is checked against.

The oracles never use a key/value cache, a prefix cache or the sparse head: every logit comes from the model's own
forward pass over the whole prompt (``model(ids).logits``, the full head), and every choice from the NumPy
reference decoder (``kernels.step(..., backend="reference")``) or a plain argmax.

Checking a given answer (``reference_trace``, ``greedy_check``) runs one forward pass over prompt + answer and reads
the logits at every answer position (teacher forcing). That is the same as decoding step by step from scratch, one
full forward pass per token: the model is causal, so the logits at a position depend on the tokens before it only,
and those are the answer's own tokens up to the first disagreement, where the check stops. ``reference_decode`` and
``greedy_decode`` are the literal step-by-step loops, for short prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np
import torch

from tooltrie.compiler import Artifact, TokenizerInfo, compile_registry
from tooltrie.kernels import BatchState, step
from tooltrie.kernels.rules import legal_moves
from tooltrie.kernels.state import DONE, RUNNING
from tooltrie.registry import make_registry
from tooltrie.testing import tiny_llama

# Token-prefixes of each other with the SmolLM2 tokenizer: "get" [726] < "get_user" [726, 79, 4093] and
# "get_users" [726, 79, 13044]; "search" [7916] < "search_web" [7916, 79, 12317]; "a" [81] vs "ab" [369].
# So an answer meets stop-vs-continue ("search" + eos or "_"), hop-vs-continue ("get" + "," or "_") and forced
# runs ("search_" -> "web").
SMALL_NAMES = ("get", "get_user", "get_users", "search", "search_web", "a", "ab")


@cache
def tiny_model() -> Any:
    """The tiny random Llama with SmolLM2's 49,152-token vocabulary, built once per test process (~5 s)."""
    return tiny_llama()


@cache
def small_artifact(tokenizer: TokenizerInfo) -> Artifact:
    registry = make_registry([{"name": name} for name in SMALL_NAMES], name="small")
    return compile_registry(registry, tokenizer)


def prompt_ids(engine: Any, query: str, k: int) -> list[int]:
    """The prompt the engine decodes for ``query``: the shared prefix, then the query and the suffix."""
    prefix, suffix = engine.prompt_parts(k)
    return list(engine.tokenizer.encode(prefix)) + list(engine.tokenizer.encode(query + suffix))


def whole_prompt_ids(engine: Any, query: str, k: int) -> list[int]:
    """The same prompt tokenized in one piece, as without a prefix cache."""
    prefix, suffix = engine.prompt_parts(k)
    return list(engine.tokenizer.encode(prefix + query + suffix))


# --------------------------------------------------------------------------------------------------------------
# Full forward passes (no cache of any kind)


def last_logits(model: Any, ids: Sequence[int]) -> torch.Tensor:
    """``model(ids).logits[:, -1]``: the full head's logits for the next token, float32, shape [1, V]."""
    with torch.no_grad():
        return model(torch.tensor([list(ids)]), logits_to_keep=1).logits[:, -1].float()  # type: ignore[no-any-return]


def teacher_forced(model: Any, prompt: Sequence[int], tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [n, V] and last hidden states [n, H] predicting each of ``tokens`` after ``prompt``, in one full
    forward pass of ``model`` over prompt + tokens[:-1]. The hidden states are what the model's own output layer
    received (captured with a hook), so ``logits[i] == lm_head(hidden[i])``."""
    n = len(tokens)
    ids = torch.tensor([[*prompt, *tokens[:-1]]])
    captured: list[torch.Tensor] = []
    head = model.get_output_embeddings()
    handle = head.register_forward_hook(lambda _module, inputs, _output: captured.append(inputs[0].detach()))
    try:
        with torch.no_grad():
            logits = model(ids, logits_to_keep=n).logits[0].float()
    finally:
        handle.remove()
    (hidden,) = captured
    assert logits.shape[0] == n and hidden.shape[1] == n
    return logits, hidden[0]


# --------------------------------------------------------------------------------------------------------------
# The reference decoder


@dataclass
class Decision:
    """A step of the reference decode with more than one legal token."""

    position: int  # index into the answer's tokens
    legal: list[int]  # ascending
    legal_logits: np.ndarray[Any, Any]  # the full head's float32 logits of ``legal``, in that order
    hidden: torch.Tensor  # what the output layer received at this position
    chosen: int  # the reference decoder's choice
    kind: str  # the move taken: "edge" | "hop" | "stop"
    tool: int  # index in the answer of the tool being spelled when the decision is made (before the move)

    @property
    def margin(self) -> float:
        values = np.sort(self.legal_logits.astype(np.float64))[::-1]
        return float(values[0] - values[1])

    @property
    def logprob(self) -> float:
        values = self.legal_logits.astype(np.float64)
        best = values[self.legal.index(self.chosen)]
        return float(best - np.logaddexp.reduce(values))


@dataclass
class Trace:
    """What the reference decoder chose along an answer, on the full head's logits."""

    tokens: list[int]  # its choices, up to and including the first one that differs from the answer checked
    done: bool  # whether it finished (chose the stop token) exactly at the end of ``tokens``
    decisions: list[Decision] = field(default_factory=list)
    forced: int = 0  # steps with a single legal token

    @property
    def min_margin(self) -> float:
        return min((d.margin for d in self.decisions), default=float("inf"))


def reference_trace(model: Any, artifact: Artifact, prompt: Sequence[int], answer: Sequence[int], k: int) -> Trace:
    """Run the reference decoder along ``answer`` (teacher-forced, see the module docstring)."""
    logits, hidden = teacher_forced(model, prompt, answer)
    state = BatchState.start(artifact, [k])
    trace = Trace(tokens=[], done=False)
    for position, token in enumerate(answer):
        if state.status[0] != RUNNING:
            break
        before = state.slot(0)
        moves = legal_moves(artifact.trie, before, artifact.eos_id)
        legal = sorted(moves)
        row = logits[position].numpy()
        chosen = int(step(artifact, state, row[None, :], backend="reference")[0])
        trace.tokens.append(chosen)
        if len(legal) > 1:
            trace.decisions.append(Decision(position=position, legal=legal, legal_logits=row[legal].copy(),
                                            hidden=hidden[position], chosen=chosen, kind=moves[chosen].kind,
                                            tool=before.emitted))
        else:
            trace.forced += 1
        if chosen != token:
            break
    trace.done = bool(state.status[0] == DONE)
    return trace


def reference_decode(model: Any, artifact: Artifact, prompt: Sequence[int], k: int, max_steps: int = 64) -> list[int]:
    """The literal loop: a full forward pass over prompt + tokens so far, then one reference step, until done."""
    state = BatchState.start(artifact, [k])
    tokens: list[int] = []
    while state.status[0] == RUNNING and len(tokens) < max_steps:
        logits = last_logits(model, [*prompt, *tokens]).numpy()
        tokens.append(int(step(artifact, state, logits, backend="reference")[0]))
    assert state.status[0] == DONE, f"the reference decoder did not finish: {tokens}"
    return tokens


# --------------------------------------------------------------------------------------------------------------
# Plain greedy decoding


def greedy_decode(model: Any, prompt: Sequence[int], max_new_tokens: int, eos_id: int) -> list[int]:
    """Plain greedy decoding, step by step on the full head, no cache."""
    tokens: list[int] = []
    while len(tokens) < max_new_tokens:
        tokens.append(int(torch.argmax(last_logits(model, [*prompt, *tokens])[0])))
        if tokens[-1] == eos_id:
            break
    return tokens


def greedy_check(model: Any, prompt: Sequence[int], tokens: Sequence[int]) -> tuple[list[int], float]:
    """The full head's argmax at every position of ``tokens`` (teacher-forced), which equals ``tokens`` exactly when
    ``tokens`` is the greedy continuation of ``prompt``; and the smallest lead of the best logit over the runner-up
    (to rule out near-ties)."""
    logits, _ = teacher_forced(model, prompt, tokens)
    top = torch.topk(logits.double(), 2, dim=1).values
    return [int(i) for i in torch.argmax(logits, dim=1)], float((top[:, 0] - top[:, 1]).min())
