"""The training losses on a batch's answer positions, and the validation scores.

Only the answer (completion) tokens are scored: the prompt is given, not learnt. Two losses:

- ``plain``: cross-entropy over the whole vocabulary at every answer position (``hidden @ W.T``, [P, V]);
- ``trie``: cross-entropy over the trie's legal tokens only, at the positions where there is a choice
  (``hidden @ W[legal].T``): the same mask as serving, so the model learns the choice it will face; trained
  through the fused ranker (``train.priors``), each legal token's score is the model's plus the prior's.
  Positions with a single legal token (the rest of a name the trie forces, the stop token after the k-th tool)
  carry no loss. The model then never learns to write an answer without the mask (its unconstrained answers are
  not tool lists);
- ``both``: their sum.

A step's batch may run in several passes (``batches.passes``); each pass's loss is then its sum over the whole
batch's positions (``Scale``), so the passes' gradients add up to the batch's.

Validation scores both, plus two answer accuracies under teacher forcing, which equal what greedy decoding would
answer: ``constrained_exact`` (the argmax over the legal tokens is the target at every position: the engine would
answer exactly the gold tools, in the gold order; for k = 1, top-1 accuracy; through the fused ranker's sums when
trained so, which for k > 1 ranks the hops to the next tool by the finished tool's prior, where the decode then
picks the hop by the next tool's) and ``unconstrained_exact`` (the argmax over the whole vocabulary is the target at
every position, stop token included).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from tooltrie.train.batches import Batch
from tooltrie.train.data import Example

__all__ = ["LOSSES", "Scale", "ValidationTotals", "answer_hidden", "both_losses", "plain_loss", "trie_loss"]


@dataclass(frozen=True)
class Scale:
    """What the losses average over: the answer positions and the positions with a choice of a step's whole batch."""

    positions: int
    choices: int

    @classmethod
    def of(cls, examples: Sequence[Example]) -> Scale:
        return cls(positions=sum(len(e.completion_ids) for e in examples),
                   choices=sum(len(tokens) > 1 for e in examples for tokens in e.legal))


def answer_hidden(decoder: Any, batch: Batch) -> torch.Tensor:
    """The decoder's last hidden states [P, H] at the batch's answer positions (what the output layer reads).

    The shared prefix runs once with batch 1; its keys and values are broadcast to every row (gradients flow back
    through the broadcast), then the rows' rests run after it.
    """
    from transformers import DynamicCache

    shared, (rows, width) = batch.prefix_ids.numel(), batch.input_ids.shape
    cache = None
    if shared:
        prefix = decoder(input_ids=batch.prefix_ids[None], use_cache=True).past_key_values
        cache = DynamicCache([(layer.keys.expand(rows, -1, -1, -1), layer.values.expand(rows, -1, -1, -1))
                              for layer in prefix.layers])
    positions = (shared + torch.arange(width))[None].expand(rows, -1)
    out = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions,
                  past_key_values=cache, use_cache=cache is not None)
    hidden: torch.Tensor = out.last_hidden_state
    return hidden[batch.answer_row, batch.answer_col]


def plain_loss(hidden: torch.Tensor, head: torch.Tensor, batch: Batch, scale: Scale | None = None) -> torch.Tensor:
    """Mean cross-entropy over the whole vocabulary at every answer position (of ``scale``'s, default the batch's)."""
    positions = batch.targets.numel() if scale is None else scale.positions
    return F.cross_entropy((hidden @ head.T).float(), batch.targets, reduction="sum") / positions


def trie_loss(hidden: torch.Tensor, head: torch.Tensor, batch: Batch, scale: Scale | None = None) -> torch.Tensor:
    """Mean cross-entropy over the legal tokens at the answer positions with a choice (``scale``'s, default the
    batch's)."""
    if batch.choice.numel() == 0:  # every answer forced (one-tool registry): nothing to learn, but a graph to keep
        return hidden.sum() * 0.0
    choices = batch.choice.numel() if scale is None else scale.choices
    logits = _fused((hidden[batch.choice] @ head[batch.candidates].T).float(), batch)
    return F.cross_entropy(logits.masked_fill(~batch.candidate_legal, float("-inf")), batch.choice_target,
                           reduction="sum") / choices


def _fused(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The choices' scores as the decode ranks them: the model's, plus the fused ranker's prior when trained so."""
    return logits if batch.candidate_bonus is None else logits + batch.candidate_bonus


def both_losses(hidden: torch.Tensor, head: torch.Tensor, batch: Batch, scale: Scale | None = None) -> torch.Tensor:
    """``plain + trie``: the choice as served, sharpened, while the model still learns to spell the answer alone."""
    return plain_loss(hidden, head, batch, scale) + trie_loss(hidden, head, batch, scale)


LOSSES = {"plain": plain_loss, "trie": trie_loss, "both": both_losses}


@dataclass
class ValidationTotals:
    """Sums over validation batches; ``summary()`` gives the means and accuracies (overall and per k)."""

    nll: float = 0.0
    positions: int = 0
    trie_nll: float = 0.0
    choices: int = 0
    examples: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    constrained: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    unconstrained: dict[int, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, hidden: torch.Tensor, head: torch.Tensor, batch: Batch) -> None:
        logits = hidden.float() @ head.float().T
        nll = F.cross_entropy(logits, batch.targets, reduction="none")
        self.nll += float(nll.sum())
        self.positions += nll.numel()
        unconstrained_ok = logits.argmax(dim=1) == batch.targets
        constrained_ok = torch.ones_like(unconstrained_ok)  # a forced position is right by construction
        if batch.choice.numel():
            legal_logits = _fused(logits[batch.choice][:, batch.candidates], batch).masked_fill(
                ~batch.candidate_legal, float("-inf"))
            self.trie_nll += float(F.cross_entropy(legal_logits, batch.choice_target, reduction="sum"))
            self.choices += batch.choice.numel()
            # candidates ascend, so the first maximum is the lower token id: the decoders' tie rule
            constrained_ok[batch.choice] = legal_logits.argmax(dim=1) == batch.choice_target
        for ok, totals in ((constrained_ok, self.constrained), (unconstrained_ok, self.unconstrained)):
            wrong = torch.zeros(batch.size, dtype=torch.long).index_add_(0, batch.answer_row, (~ok).long())
            for example, misses in zip(batch.examples, wrong.tolist(), strict=True):
                totals[example.k] += misses == 0
        for example in batch.examples:
            self.examples[example.k] += 1

    def summary(self) -> dict[str, Any]:
        def share(part: dict[int, int], ks: list[int]) -> float:
            total = sum(self.examples[k] for k in ks)
            return round(sum(part[k] for k in ks) / total, 4) if total else float("nan")

        ks = sorted(self.examples)
        return {
            "examples": sum(self.examples.values()),
            "loss": round(self.nll / self.positions, 4) if self.positions else float("nan"),
            "trie_loss": round(self.trie_nll / self.choices, 4) if self.choices else float("nan"),
            "constrained_exact": share(self.constrained, ks),
            "unconstrained_exact": share(self.unconstrained, ks),
            "by_k": {str(k): {"examples": self.examples[k], "constrained_exact": share(self.constrained, [k]),
                              "unconstrained_exact": share(self.unconstrained, [k])} for k in ks},
        }
