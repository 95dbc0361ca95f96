"""The trie constraint for engines that hand a logits processor each request's generated tokens (vLLM).

``RequestConstraint`` is plain Python: one request's state, fed the request's output token ids so far (the whole
list, as vLLM keeps it), answering with the legal next tokens as a mask or an additive bias over the vocabulary.
It is the engine's rule (``kernels/rules.py``, through ``TrieMatcher``), so the same token stream gives the same
legal sets as the engine and ``TrieLogitsProcessor``; ``tests/test_vllm_constraint.py`` checks exactly that.
The vLLM adapters (``tooltrie.eval.vllm_processors``) only route rows and token ids to it.

>>> from tooltrie.compiler import TokenizerInfo, compile_registry
>>> from tooltrie.registry import make_registry
>>> tok = TokenizerInfo.load("gpt2")
>>> artifact = compile_registry(make_registry([{"name": "get"}, {"name": "get_user"}], name="demo"), tok)
>>> constraint = RequestConstraint(artifact, k=1)
>>> constraint.allowed_tokens()  # "get"
[1136]
>>> constraint.update(tok.encode("get"))
>>> constraint.allowed_tokens() == sorted([62, tok.eos_id])  # "_" or stop
True
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from tooltrie.compiler.artifact import Artifact
from tooltrie.kernels.matcher import TrieMatcher


class RequestConstraint:
    """One request's answer of exactly ``k`` distinct tools, fed its output tokens as they grow.

    A token the trie refuses (another stage overrode the mask, e.g. a forced end of thinking) puts the request in
    an error state it never leaves: only the stop token is allowed, so the request ends with an answer ``parse``
    will score as invalid, and ``error`` says what happened. An engine loop must not raise for one bad row.
    """

    def __init__(self, artifact: Artifact, k: int, *, reasoning_end_id: int | None = None) -> None:
        self.artifact = artifact
        self.matcher = TrieMatcher(artifact, k, reasoning_end_id=reasoning_end_id)
        self.fed: list[int] = []
        self.error: str | None = None

    @property
    def k(self) -> int:
        return self.matcher.k

    def update(self, output_ids: Sequence[int]) -> None:
        """Catch up with the request's output tokens (all of them so far). If they no longer extend what was fed
        (a preempted request recomputed differently), start over from the beginning."""
        if len(output_ids) < len(self.fed) or list(output_ids[: len(self.fed)]) != self.fed:
            self.matcher.reset()
            self.fed, self.error = [], None
        for token in output_ids[len(self.fed):]:
            token = int(token)
            self.fed.append(token)
            if self.error is not None or self.matcher.is_terminated():
                continue  # past the stop token (an engine ignoring it) or already failed: nothing more to check
            if not self.matcher.accept_token(token):
                self.error = f"token {token} is not legal after {self.matcher.tool_names()}"

    def allowed_tokens(self) -> list[int] | None:
        """The legal next tokens, ascending; after the answer (or an error) only the stop token; None while a
        reasoning model thinks (then anything but the stop token)."""
        if self.error is not None or self.matcher.is_terminated():
            return [self.artifact.eos_id]
        legal = self.matcher.legal_tokens()
        if legal == []:  # cannot happen for a valid artifact; fail loudly, never hand back a row of -inf
            self.error = f"no legal token after {self.matcher.tool_names()}"
            return [self.artifact.eos_id]
        return legal

    def mask(self, vocab_size: int) -> npt.NDArray[np.bool_]:
        """``True`` where a token is allowed, over ``vocab_size`` entries (the model's logit width)."""
        allowed = self.allowed_tokens()
        if allowed is None:
            mask = np.ones(vocab_size, dtype=bool)
            mask[self.artifact.eos_id] = False
            return mask
        mask = np.zeros(vocab_size, dtype=bool)
        mask[allowed] = True
        return mask

    def bias(self, vocab_size: int) -> npt.NDArray[np.float32]:
        """The additive form of ``mask``: 0 where allowed, -inf elsewhere."""
        return np.where(self.mask(vocab_size), np.float32(0), np.float32(-np.inf)).astype(np.float32)


def mask_rows_(logits: torch.Tensor, rows: Sequence[int], constraints: Sequence[RequestConstraint]) -> torch.Tensor:
    """Set every disallowed logit of the given rows to -inf, in place; other rows are left alone.

    One host-built index list and one masked fill on ``logits``' device, whatever the batch size.
    """
    if not rows:
        return logits
    vocab = logits.shape[-1]
    keep = torch.zeros((len(rows), vocab), dtype=torch.bool)
    for i, constraint in enumerate(constraints):
        allowed = constraint.allowed_tokens()
        if allowed is None:
            keep[i] = True
            keep[i, constraint.artifact.eos_id] = False
        else:
            keep[i, allowed] = True
    index = torch.as_tensor(list(rows), dtype=torch.long, device=logits.device)
    selected = logits.index_select(0, index)
    logits.index_copy_(0, index, selected.masked_fill(~keep.to(logits.device), float("-inf")))
    return logits
