"""Hugging Face integration: a ``LogitsProcessor`` driven by a compiled artifact.

>>> from transformers import LogitsProcessorList                                  # doctest: +SKIP
>>> processor = TrieLogitsProcessor(artifact, k=3)                                # doctest: +SKIP
>>> model.generate(**inputs, logits_processor=LogitsProcessorList([processor]),
...                do_sample=False, eos_token_id=artifact.eos_id)                 # doctest: +SKIP

The rows of ``generate``'s batch are rows of one batch state: each call accepts the tokens they just took and sets
every illegal token's score to -inf, in place. Greedy search then picks the highest legal score, the first (lowest
id) on ties, which is the trie decoder's own rule, so ``generate`` and the engine agree token for token. After a
row's answer is complete only the stop token is left (``generate`` pads finished rows with it).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import LogitsProcessor

from tooltrie.compiler.artifact import Artifact
from tooltrie.errors import DecodeError
from tooltrie.kernels.batch import TrieBatch
from tooltrie.kernels.state import ERROR, check_k


class TrieLogitsProcessor(LogitsProcessor):
    """Constrain ``generate`` to answers of exactly ``k`` distinct registry tools: each call accepts the token every
    row just took and masks the scores in place, one call each for the whole batch (``kernels/batch.py``), on the
    scores' device (``backend``: ``"cuda"`` for CUDA scores, else ``"cpu"``, unless named). Where rows change
    between calls (beam search, assisted decoding), each is replayed from its prompt."""

    def __init__(self, artifact: Artifact, k: int, *, reasoning_end_id: int | None = None,
                 backend: str | None = None) -> None:
        check_k(k, artifact.trie.n_tools)
        self.artifact, self.k, self.reasoning_end_id, self.backend = artifact, k, reasoning_end_id, backend
        self._batch: TrieBatch | None = None
        self._prompt = self._seen = torch.zeros((0, 0), dtype=torch.long)
        self._prompt_length = self._seen_length = -1

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._continues(input_ids):
            self._feed(input_ids)
        elif self._same_prompts(input_ids):  # beams reordered, or drafted tokens rolled back: replay each row
            self._start(input_ids[:, : self._prompt_length], scores)
            self._feed(input_ids)
        else:
            self._start(input_ids, scores)
        self._seen = input_ids.clone()
        self._seen_length = input_ids.shape[1]
        assert self._batch is not None  # started above
        self._batch.mask_logits_(scores)
        self._raise_on_error("no legal token after")
        return scores

    def tools(self, sequences: torch.Tensor | None = None) -> list[list[str]]:
        """The tools each row's answer names. Pass ``generate``'s output to include what the last step chose
        (``generate`` does not call the processor again after a row's final token)."""
        if sequences is not None:
            self._feed(sequences)
        if self._batch is None:
            return []
        names = self.artifact.registry.names
        return [[names[t] for t in self._batch.tools(row)] for row in range(self._prompt.shape[0])]

    def reset(self) -> None:
        """Forget the rows (a new ``generate`` call is also recognised by itself)."""
        self._batch, self._prompt_length, self._seen_length = None, -1, -1
        self._prompt = self._seen = torch.zeros((0, 0), dtype=torch.long)

    def _continues(self, input_ids: torch.Tensor) -> bool:
        """Whether this call extends what the last one saw, row for row (greedy or sampled decoding: one more
        token; a draft verified: a few more)."""
        return (self._batch is not None and input_ids.shape[0] == self._seen.shape[0]
                and input_ids.shape[1] > self._seen_length
                and torch.equal(input_ids[:, : self._seen_length], self._seen))

    def _same_prompts(self, input_ids: torch.Tensor) -> bool:
        """Whether this call is the same ``generate`` with rows that changed after their prompts (beam search
        reorders beams; assisted decoding rolls back rejected draft tokens)."""
        return (self._batch is not None and input_ids.shape[0] == self._prompt.shape[0]
                and input_ids.shape[1] >= self._prompt_length
                and torch.equal(input_ids[:, : self._prompt_length], self._prompt))

    def _start(self, input_ids: torch.Tensor, scores: torch.Tensor) -> None:
        self._prompt_length = input_ids.shape[1]
        self._prompt = input_ids.clone()
        backend = self.backend or ("cuda" if scores.is_cuda else "cpu")
        self._batch = TrieBatch(self.artifact, backend=backend, capacity=input_ids.shape[0],
                                reasoning_end_id=self.reasoning_end_id)
        for row in range(input_ids.shape[0]):
            self._batch.add(row, self.k, thinking=self.reasoning_end_id is not None)
        self._fed = 0

    def _feed(self, sequences: torch.Tensor) -> None:
        """Accept every generated token the rows have not seen (one call for the batch); a refused one is an
        error, never dropped. A finished row ignores what follows (``generate`` pads it with the stop token)."""
        if self._batch is None:
            return
        generated = sequences[:, self._prompt_length + self._fed :]
        if generated.shape[1]:
            self._batch.accept(np.ascontiguousarray(generated.cpu().numpy()))
            self._fed += generated.shape[1]
            self._raise_on_error("a token that is not legal after")

    def _raise_on_error(self, what: str) -> None:
        assert self._batch is not None
        state = self._batch.fetch()
        failed = np.flatnonzero(state.status[: self._prompt.shape[0]] == ERROR)
        if len(failed):
            row = int(failed[0])
            names = [self.artifact.registry.names[t] for t in state.tools(row)]
            raise DecodeError(f"row {row}: {what} {names} (was this processor used for another generate without "
                              "reset()?)")
