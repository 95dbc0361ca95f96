"""Hugging Face integration: a ``LogitsProcessor`` driven by a compiled artifact.

>>> from transformers import LogitsProcessorList                                  # doctest: +SKIP
>>> processor = TrieLogitsProcessor(artifact, k=3)                                # doctest: +SKIP
>>> model.generate(**inputs, logits_processor=LogitsProcessorList([processor]),
...                do_sample=False, eos_token_id=artifact.eos_id)                 # doctest: +SKIP

Every row of the batch gets its own matcher; tokens generated so far are fed to it at each call, and every
illegal token's score becomes -inf. Greedy search then picks the highest legal score, the first (lowest id) on
ties, which is the trie decoder's own rule, so ``generate`` and the engine agree token for token. After a row's
answer is complete only the stop token is left (``generate`` pads finished rows with it).
"""

from __future__ import annotations

from typing import cast

import torch
from transformers import LogitsProcessor

from tooltrie.compiler.artifact import Artifact
from tooltrie.errors import DecodeError
from tooltrie.kernels.matcher import TrieMatcher


class TrieLogitsProcessor(LogitsProcessor):
    """Constrain ``generate`` to answers of exactly ``k`` distinct registry tools."""

    def __init__(self, artifact: Artifact, k: int, *, reasoning_end_id: int | None = None) -> None:
        self.artifact, self.k, self.reasoning_end_id = artifact, k, reasoning_end_id
        self._matchers: list[TrieMatcher] = []
        self._prompt_length = -1

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self._matchers:  # the first call: nothing generated yet
            self._prompt_length = input_ids.shape[1]
            self._matchers = [TrieMatcher(self.artifact, self.k, reasoning_end_id=self.reasoning_end_id)
                              for _ in range(input_ids.shape[0])]
        elif input_ids.shape[1] > self._prompt_length:
            for matcher, token in zip(self._matchers, input_ids[:, -1].tolist(), strict=True):
                if not matcher.is_terminated():
                    matcher.accept_token(int(token))
        allowed = torch.zeros_like(scores, dtype=torch.bool)
        for row, matcher in enumerate(self._matchers):
            legal = [self.artifact.eos_id] if matcher.is_terminated() else matcher.legal_tokens()
            if legal is None:  # thinking: anything but the stop token
                allowed[row] = True
                allowed[row, self.artifact.eos_id] = False
            elif not legal:  # fail loudly rather than let generate pick from a row of -inf
                raise DecodeError(f"row {row}: no legal token after {matcher.tool_names()}")
            else:
                allowed[row, legal] = True
        return cast(torch.FloatTensor, scores.masked_fill(~allowed, float("-inf")))

    def tools(self) -> list[list[str]]:
        """The tools each row's answer named so far."""
        return [matcher.tool_names() for matcher in self._matchers]

    def reset(self) -> None:
        """Forget the rows, for the next ``generate`` call."""
        self._matchers, self._prompt_length = [], -1

