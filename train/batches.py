"""Batches for teacher-forced training: a shared prompt prefix, the rest of each example, and the answer positions.

Every prompt starts with the same chat-template system turn (about 40 of its ~60 tokens for the ``short`` style), so
a batch is fed as that shared prefix once (batch 1) and each example's rest after it: the model's keys and values of
the prefix are computed once and broadcast to every row. The result is the same as feeding every example whole, for
about a third of the tokens.

Layout, for examples ``prompt_ids + completion_ids``::

    prefix_ids   [L]      the longest common prefix of the batch's prompts (at least one prompt token left per row)
    input_ids    [B, R]   prompt_ids[L:] + completion_ids[:-1], right-padded
    attention    [B, L+R]
    answer_row, answer_col   [P]   where the hidden state predicting each completion token sits in ``input_ids``
    targets      [P]      the completion tokens

and, for the trie loss, the answer positions with a choice (more than one legal token): their legal tokens as a
boolean matrix over the union of those tokens, and what the fused ranker adds to each (``train.priors``) when the
examples carry it.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from tooltrie.train.data import Example

__all__ = ["Batch", "attention_cells", "balanced_batches", "make_batch", "passes", "shuffled_batches",
           "stratified_sample", "stratum"]


@dataclass(frozen=True)
class Batch:
    examples: tuple[Example, ...]
    prefix_ids: torch.Tensor  # [L] long
    input_ids: torch.Tensor  # [B, R] long
    attention_mask: torch.Tensor  # [B, L + R] long
    answer_row: torch.Tensor  # [P] long: the example of each answer position
    answer_col: torch.Tensor  # [P] long: the column of input_ids whose hidden state predicts it
    targets: torch.Tensor  # [P] long
    choice: torch.Tensor  # [C] long: indices into the P answer positions that have more than one legal token
    candidates: torch.Tensor  # [U] long: the union of the legal tokens at those positions, ascending
    candidate_legal: torch.Tensor  # [C, U] bool: which candidates are legal at each choice
    choice_target: torch.Tensor  # [C] long: the target's index in ``candidates``
    # [C, U] float: what the fused ranker adds to each legal candidate (``Example.bonus``); None when not trained so
    candidate_bonus: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return len(self.examples)


def make_batch(examples: Sequence[Example], *, pad_id: int, share_prefix: bool = True) -> Batch:
    """Lay out ``examples`` as described in the module docstring; ``pad_id`` fills the padding (never attended).
    Without ``share_prefix`` every row is fed whole (the prefix is empty)."""
    if not examples:
        raise ValueError("an empty batch")
    shared = _common_prefix([e.prompt_ids for e in examples]) if share_prefix else 0
    shared = min(shared, min(len(e.prompt_ids) for e in examples) - 1)  # each row keeps a token to predict from
    rests = [list(e.prompt_ids[shared:]) + list(e.completion_ids[:-1]) for e in examples]
    width = max(len(rest) for rest in rests)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), shared + width), dtype=torch.long)
    attention[:, :shared] = 1
    rows, cols, targets, legal, bonus = [], [], [], [], []
    for row, (example, rest) in enumerate(zip(examples, rests, strict=True)):
        input_ids[row, : len(rest)] = torch.tensor(rest, dtype=torch.long)
        attention[row, shared : shared + len(rest)] = 1
        first = len(example.prompt_ids) - shared - 1  # the last prompt token predicts the first answer token
        for j, token in enumerate(example.completion_ids):
            rows.append(row)
            cols.append(first + j)
            targets.append(token)
            legal.append(example.legal[j])
            bonus.append(example.bonus[j] if example.bonus is not None else ())
    choice = [i for i, tokens in enumerate(legal) if len(tokens) > 1]
    candidates = sorted({token for i in choice for token in legal[i]})
    column = {token: c for c, token in enumerate(candidates)}
    candidate_legal = torch.zeros((len(choice), len(candidates)), dtype=torch.bool)
    with_bonus = [e.bonus is not None for e in examples]
    if any(with_bonus) and not all(with_bonus):
        raise ValueError("a batch mixes examples with and without the fused ranker's bonuses")
    candidate_bonus = torch.zeros((len(choice), len(candidates))) if all(with_bonus) else None
    for c, i in enumerate(choice):
        columns = [column[token] for token in legal[i]]
        candidate_legal[c, columns] = True
        if candidate_bonus is not None:
            candidate_bonus[c, columns] = torch.tensor(bonus[i])
    return Batch(
        examples=tuple(examples),
        prefix_ids=torch.tensor(examples[0].prompt_ids[:shared], dtype=torch.long),
        input_ids=input_ids,
        attention_mask=attention,
        answer_row=torch.tensor(rows, dtype=torch.long),
        answer_col=torch.tensor(cols, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        choice=torch.tensor(choice, dtype=torch.long),
        candidates=torch.tensor(candidates, dtype=torch.long),
        candidate_legal=candidate_legal,
        choice_target=torch.tensor([column[targets[i]] for i in choice], dtype=torch.long),
        candidate_bonus=candidate_bonus,
    )


def attention_cells(examples: Sequence[Example]) -> int:
    """What ``make_batch(examples)`` costs the attention of one pass: rows x the rest's width x (prefix + width)
    scores per head and layer (the shared prefix runs once, in batch 1)."""
    shared = min(_common_prefix([e.prompt_ids for e in examples]), min(len(e.prompt_ids) for e in examples) - 1)
    width = max(_length(e) - 1 - shared for e in examples)
    return len(examples) * width * (shared + width)


def passes(examples: Sequence[Example], max_cells: int) -> list[list[Example]]:
    """``examples`` (one step's batch) cut, in order, into parts of at most ``max_cells`` ``attention_cells`` each
    (a part of one example however long), so a batch of a few long requests runs in several passes whose gradients
    add up instead of one pass that holds its whole attention in memory."""
    parts: list[list[Example]] = []
    for example in examples:
        if parts and attention_cells([*parts[-1], example]) <= max_cells:
            parts[-1].append(example)
        else:
            parts.append([example])
    return parts


def shuffled_batches(examples: Sequence[Example], batch_size: int, *, seed: int,
                     bucket: int = 32) -> Iterator[list[Example]]:
    """An endless stream of full batches of similar lengths, in a seeded random order.

    Each epoch is a fresh permutation; every window of ``bucket`` batches' worth of it is sorted by length and cut
    into batches, and the epoch's batches are shuffled. Sorting within windows cuts the padding (on the catalog
    data the mean batch width falls from 71 to 43 tokens) while the batches stay random draws. What does not fill a
    batch at the end of an epoch opens the next one.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if not examples:
        raise ValueError("no examples to draw batches from")
    rng = random.Random(seed)
    carried: list[Example] = []
    while True:
        order = list(examples)
        rng.shuffle(order)
        order = carried + order
        full = len(order) // batch_size * batch_size
        order, carried = order[:full], order[full:]
        batches = []
        for start in range(0, full, batch_size * bucket):
            window = sorted(order[start : start + batch_size * bucket], key=_length)
            batches += [window[i : i + batch_size] for i in range(0, len(window), batch_size)]
        rng.shuffle(batches)
        yield from batches


def balanced_batches(examples: Sequence[Example], batch_size: int, *, seed: int, bucket: int = 32,
                     also: Sequence[Sequence[Example]] = (),
                     partners: Mapping[str, str] | None = None) -> Iterator[list[Example]]:
    """An endless stream of full batches drawn (with replacement, seeded) so every answer set counts alike.

    The catalog's queries are far from even: FinanceTool has 1,022 training queries, ProductComparison 2, and the
    two-tool answers are 4 % of the data. The held-out test split takes the same number of queries from every tool
    (``eval.datasets``), so a model trained on the natural mix learns the mix's prior and misses the rare tools.
    Here each draw picks k with weight proportional to the square root of its number of examples (the rare k gets
    more than its share, not an equal one), then a stratum of that k (``stratum``: the unordered gold set)
    uniformly, then one of its examples uniformly; where a stratum holds requests of several kinds (plainly worded,
    and situations described: ``Example.kind``), the kind first, by the same square-root rule, so the few requests
    that describe a need are not drowned by a tool's hundreds of plain ones. Windows of ``bucket`` batches are sorted
    by length, as in ``shuffled_batches``.

    ``also``: other sets of examples (another registry's data), each balanced on its own; a draw first picks a set
    with weight proportional to its size, so a registry of many tools does not drown one of few.

    ``partners``: hard negatives, a tool of ``examples`` to the tool it is most easily taken for
    (``train.hard_negatives``). That set's draws then come in pairs, side by side in one batch (``_packed``): a
    balanced draw and a request for its tool's partner, so each step weighs the pair's differences.
    """
    if batch_size < (2 if partners is not None else 1):
        raise ValueError(f"batch_size must be at least {2 if partners is not None else 1}, got {batch_size}")
    sets = [_Balanced(members) for members in (examples, *also)]
    weights = [len(members) for members in (examples, *also)]
    rng, window = random.Random(seed), batch_size * bucket
    while True:
        if len(sets) == 1 and partners is None:  # no choice of set drawn: the stream one set drew before mixing
            units: list[tuple[Example, ...]] = [(example,) for example in sets[0].draw(rng, window)]
        else:
            counts = Counter(rng.choices(range(len(sets)), weights=weights, k=window))
            first = sets[0].draw_pairs(rng, counts[0], partners) if partners is not None else [
                (example,) for example in sets[0].draw(rng, counts[0])]
            units = [*first, *((example,) for i, one in enumerate(sets[1:], 1) for example in one.draw(rng, counts[i]))]
        units.sort(key=lambda unit: max(map(_length, unit)))
        batches = _packed(units, batch_size, bucket)
        rng.shuffle(batches)
        yield from batches


def _packed(units: Sequence[tuple[Example, ...]], batch_size: int, count: int) -> list[list[Example]]:
    """Up to ``count`` full batches of ``units`` in order, never splitting one (a hard-negative pair stays in one
    batch): a unit that does not fit a batch's last places waits, first in line for the next places."""
    batches: list[list[Example]] = []
    batch: list[Example] = []
    waiting: list[tuple[Example, ...]] = []
    for unit in units:
        waiting.append(unit)
        while (fits := next((i for i, one in enumerate(waiting) if len(batch) + len(one) <= batch_size), None)) \
                is not None:
            batch.extend(waiting.pop(fits))
            if len(batch) == batch_size:
                batches.append(batch)
                if len(batches) == count:
                    return batches
                batch = []
    return batches


class _Balanced:
    """One set's balanced draw: k by the square root of its count, then a stratum, then (where it holds several) a
    kind by the square root of its count, then an example."""

    def __init__(self, examples: Sequence[Example]) -> None:
        if not examples:
            raise ValueError("no examples to draw batches from")
        groups: dict[int, dict[frozenset[str], list[Example]]] = {}
        for example in examples:
            groups.setdefault(example.k, {}).setdefault(stratum(example), []).append(example)
        self.ks = sorted(groups)
        self.k_weights = [math.sqrt(sum(len(members) for members in groups[k].values())) for k in self.ks]
        self.strata = {k: [_Stratum(groups[k][key]) for key in sorted(groups[k], key=sorted)] for k in self.ks}
        self.single = {tool: members for (tool,), members in groups.get(1, {}).items()}  # one tool's requests

    def draw(self, rng: random.Random, count: int) -> list[Example]:
        return [rng.choice(self.strata[k]).draw(rng) for k in rng.choices(self.ks, weights=self.k_weights, k=count)]

    def draw_pairs(self, rng: random.Random, count: int, partners: Mapping[str, str]) -> list[tuple[Example, ...]]:
        """``count`` examples or one more, in pairs: a balanced draw, then a request for its tool's partner (another
        balanced draw where it has none)."""
        pairs: list[tuple[Example, ...]] = []
        for example in self.draw(rng, (count + 1) // 2):
            mates = self.single.get(partners.get(example.tools[0], ""), []) if example.k == 1 else []
            pairs.append((example, rng.choice(mates) if mates else self.draw(rng, 1)[0]))
        return pairs


class _Stratum:
    """One gold set's requests, by kind (in sorted order; plainly worded first)."""

    def __init__(self, examples: Sequence[Example]) -> None:
        kinds: dict[str, list[Example]] = {}
        for example in examples:
            kinds.setdefault(example.kind, []).append(example)
        self.kinds = [kinds[kind] for kind in sorted(kinds)]
        self.weights = [math.sqrt(len(members)) for members in self.kinds]

    def draw(self, rng: random.Random) -> Example:
        if len(self.kinds) == 1:  # one kind: no draw of it (a stream of plain data is what it was before kinds)
            return rng.choice(self.kinds[0])
        return rng.choice(rng.choices(self.kinds, weights=self.weights)[0])


def stratum(example: Example) -> frozenset[str]:
    """What the test split is stratified by: the unordered set of gold tools."""
    return frozenset(example.tools)


def stratified_sample(examples: Sequence[Example], count: int, *, seed: int) -> list[Example]:
    """``count`` examples (all when fewer), taken round-robin over the strata in a seeded order, so a rare tool
    weighs in a validation sample as it does in the test split."""
    rng = random.Random(seed)
    groups: dict[frozenset[str], list[Example]] = {}
    for example in examples:
        groups.setdefault(stratum(example), []).append(example)
    queues = [rng.sample(members, len(members)) for _, members in sorted(groups.items(), key=lambda kv: sorted(kv[0]))]
    rng.shuffle(queues)
    chosen: list[Example] = []
    while len(chosen) < min(count, len(examples)):
        for queue in queues:
            if queue and len(chosen) < count:
                chosen.append(queue.pop())
    return chosen


def _length(example: Example) -> int:
    return len(example.prompt_ids) + len(example.completion_ids)


def _common_prefix(sequences: Sequence[Sequence[int]]) -> int:
    first = sequences[0]
    length = min(len(s) for s in sequences)
    for i in range(length):
        token = first[i]
        if any(s[i] != token for s in sequences):
            return i
    return length
