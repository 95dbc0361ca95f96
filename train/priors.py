"""Training through the fused ranker: each choice's legal tokens carry the retrieval prior the decode adds to them.

Served with ``--ranker fused``, a legal token is ranked by the model's score plus the retrieval prior below its
edge (``kernels/walk.py``; ``kernels.reference.fused_values`` writes it out). Trained alone, the model also spends
itself on what retrieval already gets right, and its scores meet the prior only when served. With
``TrainSettings.prior_weight`` the trie loss is taken over the same sums: every training example carries, for each
answer position, what the fused ranker adds to each legal token (``Example.bonus``), so the model learns what the
prior misses. The prior of an example is the one serving makes for its query over its own registry's tools
(``Ranker.row``): ``TrainSettings.prior`` (dense, lexical or hybrid; z-scores per query, ``tooltrie.ranker``), weighted
as served (the model's weight 1, retrieval's ``prior_weight``), and following the answer as served: each position's
prior is the one the decode holds there, made from the tools the answer has committed to (``Prior.follow``: one tool
per ask of a request that asks several things, then the request's follow-up). Adapters trained before the priors were
z-scored (docs/training.md's measurements) were trained through the raw all-MiniLM-L6-v2 cosine similarity instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from tooltrie.compiler.artifact import Artifact
from tooltrie.compiler.trie import CompiledTrie
from tooltrie.kernels.reference import fused_values
from tooltrie.kernels.rules import Slot, advance, committed, legal_moves
from tooltrie.ranker import DEFAULT_PRIOR
from tooltrie.train.data import Example, TrainingData

if TYPE_CHECKING:
    from tooltrie.kernels.state import FollowUp
    from tooltrie.ranker import Ranker

__all__ = ["EdgeTools", "choice_bonuses", "ranker_priors", "retrieval_priors", "with_priors"]


class EdgeTools:
    """The tools whose path crosses each edge (``CompiledTrie.tools_below``), as ``fused_values`` asks for them."""

    def __init__(self, trie: CompiledTrie) -> None:
        self._start, self._tools = trie.tools_below()

    def __call__(self, edge: int) -> Sequence[int]:
        result: list[int] = self._tools[self._start[edge] : self._start[edge + 1]].tolist()
        return result


def choice_bonuses(artifact: Artifact, example: Example, prior: npt.NDArray[np.float32], crossing: EdgeTools,
                   follow: FollowUp | None = None) -> tuple[tuple[float, ...], ...]:
    """For each answer position of ``example``, what the fused ranker adds to each of its legal tokens (in the
    order of ``example.legal``) given each tool's ``prior`` (already weighted), which ``follow`` (None: it does not)
    makes follow the answer as the decode does (``TrieBatch.add(follow=...)``: once the answer commits to a tool);
    positions with one legal token get ``()``: they carry no loss."""
    trie, eos_id = artifact.trie, artifact.eos_id
    ranker = np.concatenate([[1.0], prior]).astype(np.float32)
    slot, bonuses = Slot.start(trie, example.k), []
    followed: tuple[int, ...] = ()
    for token, legal in zip(example.completion_ids, example.legal, strict=True):
        tools = committed(trie, slot)
        if follow is not None and tools != followed:
            ranker[1:], followed = np.asarray(follow(tools), dtype=np.float32), tools
        moves = legal_moves(trie, slot, eos_id)
        if len(legal) > 1:
            values, _ = fused_values(trie, slot, moves, [(0.0, t) for t in legal], ranker, crossing)
            bonuses.append(tuple(value for value, _ in values))
        else:
            bonuses.append(())
        slot = advance(trie, slot, moves[token])
    return tuple(bonuses)


def with_priors(data: TrainingData, artifact: Artifact, priors: npt.NDArray[np.float32],
                follows: Sequence[FollowUp | None] | None = None) -> TrainingData:
    """``data`` (made for ``artifact``) with every example's bonuses; ``priors`` holds a row per example, train then
    validation, of its query's prior for each tool, already weighted (``Prior.scores``, the model's weight being 1),
    and ``follows`` (None: none) how each follows the answer (``Prior.follow``)."""
    examples = [*data.train, *data.validation]
    if priors.shape != (len(examples), artifact.trie.n_tools):
        raise ValueError(f"{data.directory}: priors of shape {priors.shape}, expected "
                         f"{(len(examples), artifact.trie.n_tools)} (examples, tools)")
    if follows is not None and len(follows) != len(examples):
        raise ValueError(f"{data.directory}: {len(follows)} follow-ups for {len(examples)} examples")
    crossing = EdgeTools(artifact.trie)
    done = [replace(e, bonus=choice_bonuses(artifact, e, priors[i], crossing,
                                            None if follows is None else follows[i]))
            for i, e in enumerate(examples)]
    return replace(data, train=done[: len(data.train)], validation=done[len(data.train) :])


def ranker_priors(data: TrainingData, artifact: Artifact, ranker: Ranker) -> TrainingData:
    """``with_priors`` by ``ranker`` (over ``artifact``'s registry): each query's prior as the service makes a fused
    request's (``Ranker.row``, its prior kind and fused weights, following the answer as it does), the queries'
    scores made in one batch."""
    if ranker.fused.model != 1.0:
        raise ValueError(f"training through the prior takes the model's weight as 1, not {ranker.fused.model:g}")
    examples = [*data.train, *data.validation]
    queries = [example.query for example in examples]
    rows = [ranker.row(example.query, "fused", k=example.k, scores=scores)
            for example, scores in zip(examples, ranker.prior_scores(queries), strict=True)]
    priors = np.zeros((len(queries), artifact.trie.n_tools), dtype=np.float32)
    for i, row in enumerate(rows):
        if row.scores is not None:  # None: a retrieval weight of 0, nothing added
            priors[i] = row.scores
    return with_priors(data, artifact, priors, [row.follow for row in rows])


def retrieval_priors(data: TrainingData, artifact: Artifact, source: str | Path | None, weight: float, *,
                     prior: str = DEFAULT_PRIOR) -> TrainingData:
    """``ranker_priors`` by the ranker serving gives ``artifact`` (``ranker_for``) with the fused weights (1,
    ``weight``) and ``prior``; the tools' embeddings and lexical index kept beside ``source`` as serving keeps them."""
    from tooltrie.ranker import Weights, ranker_for

    return ranker_priors(data, artifact, ranker_for(artifact, source, Weights(model=1.0, retrieval=weight),
                                                    prior=prior))
