"""The training losses and validation scores against brute force on the tiny model.

- the batched pass with a shared prefix gives the full model's own logits at every answer position (no cache, every
  example fed whole: ``support.serve.teacher_forced``);
- the plain loss is the cross-entropy of those logits; the trie loss the cross-entropy of their legal entries, one
  position at a time;
- ``constrained_exact`` says whether the reference decoder, step by step, answers exactly the gold tools; and
  ``unconstrained_exact`` whether plain greedy decoding does.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.serve import greedy_decode, reference_decode, small_artifact, teacher_forced, tiny_model
from support.train import SMALL_LABELLED, write_training_data

from tooltrie.compiler import TokenizerInfo
from tooltrie.train.batches import make_batch
from tooltrie.train.data import Example, load_training_data
from tooltrie.train.loss import LOSSES, ValidationTotals, answer_hidden, plain_loss, trie_loss
from tooltrie.train.settings import LOSS_NAMES


@pytest.fixture(scope="module")
def examples(tmp_path_factory: pytest.TempPathFactory, smollm: TokenizerInfo) -> list[Example]:
    directory = write_training_data(tmp_path_factory.mktemp("data"), small_artifact(smollm), smollm)
    return load_training_data(directory, small_artifact(smollm)).train


def _full_logits(model: Any, examples: list[Example]) -> torch.Tensor:
    """[P, V]: each example fed whole, without a cache, through the model's own head."""
    rows = [teacher_forced(model, e.prompt_ids, e.completion_ids)[0] for e in examples]
    return torch.cat(rows)


@pytest.mark.parametrize("share_prefix", [True, False])
def test_answer_hidden_gives_the_full_models_logits(examples: list[Example], share_prefix: bool) -> None:
    model = tiny_model()
    batch = make_batch(examples, pad_id=2, share_prefix=share_prefix)
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        logits = answer_hidden(model.get_decoder(), batch) @ head.T
    torch.testing.assert_close(logits, _full_logits(model, examples), rtol=1e-4, atol=1e-4)


def test_the_losses_are_cross_entropies_of_the_full_logits(examples: list[Example]) -> None:
    model = tiny_model()
    batch = make_batch(examples, pad_id=2)
    head = model.get_output_embeddings().weight
    full = _full_logits(model, examples).double()
    with torch.no_grad():
        hidden = answer_hidden(model.get_decoder(), batch)
        plain, trie = float(plain_loss(hidden, head, batch)), float(trie_loss(hidden, head, batch))
        assert float(LOSSES["both"](hidden, head, batch)) == pytest.approx(plain + trie, rel=1e-6)
    assert plain == pytest.approx(float(F.cross_entropy(full, batch.targets)), rel=1e-4)
    legal = [lg for e in examples for lg in e.legal]
    targets = batch.targets.tolist()
    per_choice = [float(torch.logsumexp(full[i, list(lg)], 0) - full[i, targets[i]])
                  for i, lg in enumerate(legal) if len(lg) > 1]
    assert trie == pytest.approx(sum(per_choice) / len(per_choice), rel=1e-4)
    assert set(LOSSES) == set(LOSS_NAMES)


def test_losses_carry_gradients_to_the_model(examples: list[Example]) -> None:
    model = tiny_model()
    layer = model.model.layers[0].self_attn.q_proj.weight
    batch = make_batch(examples, pad_id=2)
    for loss_fn in (plain_loss, trie_loss):
        layer.requires_grad_(True)
        try:
            loss = loss_fn(answer_hidden(model.get_decoder(), batch), model.get_output_embeddings().weight, batch)
            (grad,) = torch.autograd.grad(loss, [layer])
        finally:
            layer.requires_grad_(False)
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0


def _with_gold(example: Example, tokens: list[int], smollm: TokenizerInfo) -> Example:
    """``example`` relabelled with the answer ``tokens`` read off the trie."""
    from tooltrie.kernels.matcher import TrieMatcher

    artifact = small_artifact(smollm)
    matcher = TrieMatcher(artifact, k=example.k)
    legal = []
    for token in tokens:
        legal.append(tuple(matcher.legal_tokens() or ()))
        assert matcher.accept_token(token)
    return Example(example.query, tuple(matcher.tool_names()), example.prompt_ids, tuple(tokens), tuple(legal))


def test_validation_accuracies_are_what_decoding_answers(examples: list[Example], smollm: TokenizerInfo) -> None:
    """Half the examples relabelled with the reference decoder's own answer (so they are right), half as given."""
    model, artifact = tiny_model(), small_artifact(smollm)
    head = model.get_output_embeddings().weight
    checked = {"constrained": 0, "unconstrained": 0}
    for i, example in enumerate(examples):
        decoded = reference_decode(model, artifact, example.prompt_ids, example.k)
        if i % 2 == 0:
            example = _with_gold(example, decoded, smollm)
        batch = make_batch([example], pad_id=artifact.eos_id)
        totals = ValidationTotals()
        with torch.no_grad():
            totals.add(answer_hidden(model.get_decoder(), batch), head, batch)
        summary = totals.summary()
        gold = list(example.completion_ids)
        assert summary["constrained_exact"] == float(decoded == gold), (example.query, decoded, gold)
        greedy = greedy_decode(model, example.prompt_ids, len(gold), artifact.eos_id)
        assert summary["unconstrained_exact"] == float(greedy == gold)
        checked["constrained"] += decoded == gold
        checked["unconstrained"] += greedy == gold
        assert summary["by_k"][str(example.k)]["examples"] == 1
    assert checked["constrained"] >= len(examples) // 2  # the relabelled ones


def test_validation_totals_average_over_batches(examples: list[Example]) -> None:
    model = tiny_model()
    head = model.get_output_embeddings().weight
    together, apart = ValidationTotals(), ValidationTotals()
    with torch.no_grad():
        batch = make_batch(examples, pad_id=2)
        together.add(answer_hidden(model.get_decoder(), batch), head, batch)
        for chunk in (examples[:3], examples[3:]):
            part = make_batch(chunk, pad_id=2)
            apart.add(answer_hidden(model.get_decoder(), part), head, part)
    first, second = together.summary(), apart.summary()
    assert first["examples"] == second["examples"] == len(SMALL_LABELLED)
    for key in ("loss", "trie_loss", "constrained_exact", "unconstrained_exact"):
        assert first[key] == pytest.approx(second[key], abs=2e-4)
    assert set(first["by_k"]) == {"1", "2"}
    assert math.isnan(ValidationTotals().summary()["loss"])
