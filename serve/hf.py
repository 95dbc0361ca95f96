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
from tooltrie.kernels.state import check_k


class TrieLogitsProcessor(LogitsProcessor):
    """Constrain ``generate`` to answers of exactly ``k`` distinct registry tools."""

    def __init__(self, artifact: Artifact, k: int, *, reasoning_end_id: int | None = None) -> None:
        check_k(k, artifact.trie.n_tools)
        self.artifact, self.k, self.reasoning_end_id = artifact, k, reasoning_end_id
        self._matchers: list[TrieMatcher] = []
        self._prompt = torch.zeros((0, 0), dtype=torch.long)
        self._prompt_length = self._seen_length = -1

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._continues(input_ids):
            self._feed(input_ids)
        else:
            self._start(input_ids)
        self._seen_length = input_ids.shape[1]
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

    def tools(self, sequences: torch.Tensor | None = None) -> list[list[str]]:
        """The tools each row's answer names. Pass ``generate``'s output to include what the last step chose
        (``generate`` does not call the processor again after a row's final token)."""
        if sequences is not None:
            self._feed(sequences)
        return [matcher.tool_names() for matcher in self._matchers]

    def reset(self) -> None:
        """Forget the rows (a new ``generate`` call is also recognised by itself)."""
        self._matchers, self._prompt_length, self._seen_length = [], -1, -1

    def _continues(self, input_ids: torch.Tensor) -> bool:
        """Whether this call continues the last ``generate`` (one more token, the same prompts), or starts one."""
        return (input_ids.shape[1] == self._seen_length + 1 and input_ids.shape[0] == len(self._matchers)
                and torch.equal(input_ids[:, : self._prompt_length], self._prompt))

    def _start(self, input_ids: torch.Tensor) -> None:
        self._prompt_length = input_ids.shape[1]
        self._prompt = input_ids.clone()
        self._matchers = [TrieMatcher(self.artifact, self.k, reasoning_end_id=self.reasoning_end_id)
                          for _ in range(input_ids.shape[0])]

    def _feed(self, sequences: torch.Tensor) -> None:
        """Accept every generated token the matchers have not seen; a refused one is an error, never dropped."""
        for row, (matcher, tokens) in enumerate(zip(self._matchers, sequences.tolist(), strict=True)):
            generated = tokens[self._prompt_length :]
            for token in generated[matcher.accepted :]:
                if matcher.is_terminated():
                    break  # generate pads finished rows with the stop token
                if not matcher.accept_token(int(token)):
                    raise DecodeError(f"row {row}: token {token} is not legal after {matcher.tool_names()} "
                                      "(was this processor used for another generate without reset()?)")
