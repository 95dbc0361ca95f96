"""The training losses and validation scores against brute force on the tiny model.

- the batched pass with a shared prefix gives the full model's own logits at every answer position (no cache, every
  example fed whole: ``support.serve.teacher_forced``);
- the plain loss is the cross-entropy of those logits; the trie loss the cross-entropy of their legal entries, one
  position at a time;
- a batch run in several passes (its losses scaled by the whole batch) learns what it learns in one pass;
- ``constrained_exact`` says whether the reference decoder, step by step, answers exactly the gold tools; and
  ``unconstrained_exact`` whether plain greedy decoding does.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.serve import greedy_decode, reference_decode, small_artifact, teacher_forced, tiny_model
from support.train import SMALL_LABELLED, write_training_data

from tooltrie.compiler import TokenizerInfo
from tooltrie.train.batches import attention_cells, make_batch, passes
from tooltrie.train.data import Example, load_training_data
from tooltrie.train.loss import LOSSES, Scale, ValidationTotals, answer_hidden, plain_loss, trie_loss
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


def test_a_batch_run_in_passes_learns_what_it_learns_in_one(examples: list[Example]) -> None:
    """Each pass's loss is scaled by the whole batch's positions: the passes' losses and gradients add up to the
    batch's own, however it is cut (one example a pass here, the attention cells of one example at most)."""
    model = tiny_model()
    layers = [model.model.layers[0].self_attn.q_proj.weight, model.model.layers[-1].mlp.down_proj.weight]
    head, decoder = model.get_output_embeddings().weight, model.get_decoder()
    whole_batch = make_batch(examples, pad_id=2)
    parts = passes(examples, max_cells=max(attention_cells([e]) for e in examples))
    assert len(parts) > 1 and [e for part in parts for e in part] == examples
    for layer in layers:
        layer.requires_grad_(True)
    try:
        for name, loss_fn in LOSSES.items():
            whole = loss_fn(answer_hidden(decoder, whole_batch), head, whole_batch)
            expected = torch.autograd.grad(whole, layers)
            scale, total, got = Scale.of(examples), 0.0, [torch.zeros_like(layer) for layer in layers]
            for part in parts:
                batch = make_batch(part, pad_id=2)
                loss = loss_fn(answer_hidden(decoder, batch), head, batch, scale)
                total += float(loss.detach())
                got = [g + d for g, d in zip(got, torch.autograd.grad(loss, layers), strict=True)]
            assert total == pytest.approx(float(whole.detach()), rel=1e-5), name
            for g, e in zip(got, expected, strict=True):
                torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
    finally:
        for layer in layers:
            layer.requires_grad_(False)


def test_passes_hold_at_most_their_attention_cells(examples: list[Example]) -> None:
    """``attention_cells`` is the batch ``make_batch`` lays out (rows x width x (prefix + width)), and ``passes``
    cuts a batch, in order, into the fewest consecutive parts that each fit (or hold a single example)."""
    for count in range(1, len(examples) + 1):
        batch = make_batch(examples[:count], pad_id=2)
        rows, width = batch.input_ids.shape
        assert attention_cells(examples[:count]) == rows * width * (batch.prefix_ids.numel() + width)
    for max_cells in (1, 2_000, 20_000, attention_cells(examples) - 1, attention_cells(examples)):
        parts = passes(examples, max_cells)
        assert [e for part in parts for e in part] == examples
        assert all(len(part) == 1 or attention_cells(part) <= max_cells for part in parts)
        assert all(attention_cells([*part, following[0]]) > max_cells
                   for part, following in itertools.pairwise(parts))
    assert passes(examples, attention_cells(examples)) == [examples]


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
