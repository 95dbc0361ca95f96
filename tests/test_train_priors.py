"""Training through the fused ranker (``train.priors``) against the decoder it trains for.

- every example's bonuses are the values the reference backend's fused ranker gives its legal tokens, each tool's
  prior found by looking at every tool (``ReferenceBackend._tools_crossing``) where training uses the compiled
  inverse of the paths, and the prior is the one a served fused request gets (``Ranker.row``), for every prior kind;
- for one-tool answers, the validation's constrained accuracy through the prior is what fused decoding (the
  reference backend, ``TrieBatch.add(prior=)``) answers, step by step on the tiny model: right on the examples
  relabelled with the fused decoder's own answer, wrong elsewhere;
- the trie loss through the prior is the cross-entropy of the legal logits plus the bonuses, one position at a time,
  and with no prior it is the loss as before;
- a data set's bonuses need one prior row per example, and training refuses data whose bonuses do not match
  its ``prior_weight``; an adapter trained through the prior records its weight and kind.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support.encoders import MadeUpEncoder
from support.serve import last_logits, small_artifact, tiny_model
from support.train import write_training_data

from tooltrie.compiler import Artifact, TokenizerInfo
from tooltrie.kernels import TrieBatch
from tooltrie.kernels.reference import ReferenceBackend, fused_values
from tooltrie.kernels.rules import Slot, advance, legal_moves
from tooltrie.ranker import PRIORS, PerAsk, Ranker, Weights
from tooltrie.train.batches import make_batch
from tooltrie.train.data import Example, TrainingData, load_training_data
from tooltrie.train.loss import ValidationTotals, answer_hidden, trie_loss
from tooltrie.train.priors import ranker_priors, with_priors
from tooltrie.train.settings import TrainSettings
from tooltrie.train.trainer import train


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, smollm: TokenizerInfo) -> TrainingData:
    directory = write_training_data(tmp_path_factory.mktemp("data"), small_artifact(smollm), smollm)
    return load_training_data(directory, small_artifact(smollm))


def _similarities(data: TrainingData, artifact: Artifact, seed: int) -> np.ndarray:
    rows = len(data.train) + len(data.validation)
    return np.random.default_rng(seed).uniform(-1, 1, (rows, artifact.trie.n_tools)).astype(np.float32)


def _check_bonuses(artifact: Artifact, example: Example, prior: np.ndarray, follow: Any = None) -> None:
    """``example``'s bonuses are what the reference backend's fused ranker adds to its legal tokens at each choice,
    with the prior the reference decode holds there: ``prior`` (each tool's, weighted; the model's weight 1),
    following the answer by ``follow`` as the decode fed the example's tokens makes it follow."""
    looking = ReferenceBackend(artifact)._tools_crossing
    assert example.bonus is not None and len(example.bonus) == len(example.legal)
    decode = TrieBatch(artifact, backend="reference", capacity=1)
    decode.add(0, example.k, prior=prior, model_weight=1.0, follow=follow)
    slot = Slot.start(artifact.trie, example.k)
    for token, legal, bonus in zip(example.completion_ids, example.legal, example.bonus, strict=True):
        moves = legal_moves(artifact.trie, slot, artifact.eos_id)
        if len(legal) > 1:
            ranker = decode.fetch().ranker[0]
            values, _ = fused_values(artifact.trie, slot, moves, [(0.0, t) for t in legal], ranker, looking)
            assert bonus == pytest.approx([value for value, _ in values], rel=1e-6)
        else:
            assert bonus == ()
        slot = advance(artifact.trie, slot, moves[token])
        decode.accept([[token]], [0])


def test_the_bonuses_are_the_reference_rankers_values(data: TrainingData, smollm: TokenizerInfo) -> None:
    artifact = small_artifact(smollm)
    for seed in range(3):
        similarities = _similarities(data, artifact, seed)
        primed = with_priors(data, artifact, 3.0 * similarities)
        for i, example in enumerate([*primed.train, *primed.validation]):
            _check_bonuses(artifact, example, 3.0 * similarities[i])


@pytest.mark.parametrize("prior", PRIORS)
def test_the_bonuses_come_from_the_prior_a_served_fused_request_gets(data: TrainingData, smollm: TokenizerInfo,
                                                                     prior: str) -> None:
    """Training through the prior sees the prior serving decodes with: for each query, the reference ranker's
    values over ``Ranker.row(query, "fused")`` (the query's z-scored prior of that kind times the fused weight), made
    one request at a time as the service does, following the answer as the decode does (one tool per ask of "All
    users, then search", then the request's follow-up)."""
    artifact = small_artifact(smollm)
    weights = Weights(model=1.0, retrieval=3.0)
    few = dataclasses.replace(data, train=data.train[-6:], validation=data.validation[:2])
    primed = ranker_priors(few, artifact, Ranker(artifact.registry, fused=weights, prior=prior,
                                                 encoder=MadeUpEncoder()))
    serving = Ranker(artifact.registry, fused=weights, prior=prior, encoder=MadeUpEncoder())
    followed = 0
    for example in [*primed.train, *primed.validation]:
        row = serving.row(example.query, "fused")
        assert row.model_weight == 1.0 and row.scores is not None
        _check_bonuses(artifact, example, row.scores, row.follow)
        followed += isinstance(row.follow, PerAsk) and example.k > 1
    assert followed  # a request of two asks is among them
    with pytest.raises(ValueError, match="model's weight as 1"):
        ranker_priors(few, artifact, Ranker(artifact.registry, fused=Weights(2.0, 3.0), encoder=MadeUpEncoder()))


def _fused_decode(model: Any, artifact: Artifact, prompt: tuple[int, ...], k: int, prior: np.ndarray) -> list[int]:
    batch = TrieBatch(artifact, backend="reference", capacity=1)
    batch.add(0, k, prior=prior, model_weight=1.0)
    tokens: list[int] = []
    while batch.is_running(0) and len(tokens) < 64:
        choice = batch.choose(last_logits(model, [*prompt, *tokens]).numpy())
        tokens += [int(choice.chosen[0]), *choice.forced[0]]
    assert batch.is_done(0), tokens
    return tokens


def _relabelled(example: Example, tokens: list[int], artifact: Artifact) -> Example:
    slot, legal = Slot.start(artifact.trie, example.k), []
    for token in tokens:
        moves = legal_moves(artifact.trie, slot, artifact.eos_id)
        legal.append(tuple(sorted(moves)))
        slot = advance(artifact.trie, slot, moves[token])
    names = [artifact.registry.tools[t].name for t in slot.used]
    return dataclasses.replace(example, tools=tuple(names), completion_ids=tuple(tokens), legal=tuple(legal),
                               bonus=None)


def test_validation_through_the_prior_is_what_fused_decoding_answers(data: TrainingData,
                                                                     smollm: TokenizerInfo) -> None:
    model, artifact = tiny_model(), small_artifact(smollm)
    head = model.get_output_embeddings().weight
    singles = [e for e in data.train if e.k == 1]
    similarities = np.random.default_rng(7).uniform(-1, 1, (len(singles), artifact.trie.n_tools)).astype(np.float32)
    weight, checked = 4.0, {True: 0, False: 0}
    for i, example in enumerate(singles):
        prior = weight * similarities[i]
        decoded = _fused_decode(model, artifact, example.prompt_ids, 1, prior)
        if i % 2 == 0:
            example = _relabelled(example, decoded, artifact)
        one = dataclasses.replace(data, train=[example], validation=[])
        (primed,) = with_priors(one, artifact, weight * similarities[i : i + 1]).train
        totals = ValidationTotals()
        with torch.no_grad():
            totals.add(answer_hidden(model.get_decoder(), make_batch([primed], pad_id=2)), head,
                       make_batch([primed], pad_id=2))
        right = decoded == list(example.completion_ids)
        assert totals.summary()["constrained_exact"] == float(right), (example.query, decoded)
        checked[right] += 1
    assert checked[True] >= len(singles) // 2 and checked[False] > 0  # both outcomes are checked


def test_the_trie_loss_adds_the_bonuses_to_the_legal_logits(data: TrainingData, smollm: TokenizerInfo) -> None:
    model, artifact = tiny_model(), small_artifact(smollm)
    head = model.get_output_embeddings().weight
    primed = with_priors(data, artifact, 2.5 * _similarities(data, artifact, 3)).train
    batch, bare = make_batch(primed, pad_id=2), make_batch(data.train, pad_id=2)
    with torch.no_grad():
        hidden = answer_hidden(model.get_decoder(), batch)
        logits = (hidden @ head.T).double()
        expected, choices = 0.0, 0
        position = 0
        for example in primed:
            assert example.bonus is not None
            for token, legal, bonus in zip(example.completion_ids, example.legal, example.bonus, strict=True):
                if len(legal) > 1:
                    scores = logits[position, list(legal)] + torch.tensor(bonus, dtype=torch.float64)
                    expected += float(F.cross_entropy(scores[None], torch.tensor([legal.index(token)])))
                    choices += 1
                position += 1
        assert float(trie_loss(hidden, head, batch)) == pytest.approx(expected / choices, rel=1e-4)
        assert bare.candidate_bonus is None
        assert float(trie_loss(hidden, head, bare)) != pytest.approx(expected / choices, rel=1e-4)


def test_bonuses_need_a_row_per_example_and_training_matches_them(data: TrainingData, smollm: TokenizerInfo,
                                                                  tmp_path: Any) -> None:
    artifact = small_artifact(smollm)
    with pytest.raises(ValueError, match="priors of shape"):
        with_priors(data, artifact, _similarities(data, artifact, 0)[1:])
    primed = with_priors(data, artifact, _similarities(data, artifact, 0))
    with pytest.raises(ValueError, match="a batch mixes"):
        make_batch([primed.train[0], data.train[1]], pad_id=2)
    for settings, given in ((TrainSettings(steps=1, prior_weight=2.0), data), (TrainSettings(steps=1), primed)):
        with pytest.raises(ValueError, match="prior_weight"):
            train(given, artifact, copy.deepcopy(tiny_model()), base_name="tiny", output=tmp_path / "adapter",
                  settings=settings, progress=False)


def test_an_adapter_trained_through_the_prior_ranks_through_it(data: TrainingData, smollm: TokenizerInfo,
                                                               tmp_path: Any) -> None:
    """Its record says to rank its registry's answers fused, at the weight it was trained through, and names the
    prior it was trained through."""
    from tooltrie.ranker_policy import auto_ranker, fused_weights
    from tooltrie.serve.adapter import read_adapter

    artifact = small_artifact(smollm)
    primed = with_priors(data, artifact, 3.0 * _similarities(data, artifact, 0))
    train(primed, artifact, copy.deepcopy(tiny_model()), base_name="tiny", output=tmp_path / "adapter", progress=False,
          settings=TrainSettings(steps=1, batch_size=2, prior_weight=3.0, prior="lexical", eval_every=0,
                                 eval_examples=0))
    adapter = read_adapter(tmp_path / "adapter")
    assert fused_weights(adapter, artifact) == Weights(model=1.0, retrieval=3.0)
    assert adapter.record["ranker"]["prior"] == adapter.record["training"]["settings"]["prior"] == "lexical"
    assert auto_ranker(adapter, artifact, retrieval=True) == "fused"


def test_retrieval_priors_make_a_blank_model_answer_retrievals_top_tool(data: TrainingData, smollm: TokenizerInfo,
                                                                       tmp_path: Any) -> None:
    """With every model score equal, the choices follow the prior alone: a one-tool example is answered right
    exactly when its tool is the hybrid prior's best for its query (the real all-MiniLM-L6-v2 encoder)."""
    from tooltrie.train.priors import retrieval_priors

    artifact = small_artifact(smollm)
    singles = dataclasses.replace(data, train=[e for e in data.train if e.k == 1], validation=[])
    primed = retrieval_priors(singles, artifact, tmp_path / "small.safetensors", weight=10.0).train
    best = Ranker(artifact.registry).prior_scores([e.query for e in primed]).argmax(axis=1)
    head = torch.zeros((1 + max(t for e in primed for legal in e.legal for t in legal), 4))
    outcomes = set()
    for example, tool in zip(primed, best.tolist(), strict=True):
        batch = make_batch([example], pad_id=2)
        totals = ValidationTotals()
        totals.add(torch.zeros((batch.targets.numel(), 4)), head, batch)
        right = example.tools == (artifact.registry.tools[tool].name,)
        assert totals.summary()["constrained_exact"] == float(right), (example.query, example.tools, tool)
        outcomes.add(right)
    assert outcomes == {True, False}
    for kept in ("embeddings", "lexical"):  # beside the artifact, as serving keeps them
        assert (tmp_path / f"small.{kept}.safetensors").is_file()
