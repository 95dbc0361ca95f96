"""The shared-prefix decoder against Hugging Face's own forward pass over each row's whole sequence.

Rows start on a shared prefix (or on the first part of it), are fed one or several tokens per pass, leave and are
replaced, and outgrow the tail cache; some passes also feed speculative runs after a row's tokens, of which the row
may adopt one. After every pass each row's hidden state (and each run's) must equal the model's last hidden state
over that row's prefix share plus everything fed to it and adopted so far (plus the run), with no cache of any kind.
On a machine with a CUDA GPU the model is checked there too (other kernels, other rounding: a looser tolerance).
"""

from __future__ import annotations

import random
import weakref
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tooltrie.errors import ModelError
from tooltrie.serve import decoder as decoder_module
from tooltrie.serve.decoder import SharedPrefixDecoder
from tooltrie.serve.model import _native_bf16
from tooltrie.testing import tiny_llama

VOCAB = 500
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
TOLERANCE = {"cpu": {"atol": 2e-5, "rtol": 1e-4}, "cuda": {"atol": 1e-4, "rtol": 1e-3}}


@pytest.fixture(scope="module", params=DEVICES)
def model(request: pytest.FixtureRequest) -> Any:
    return tiny_llama(VOCAB, seed=3).to(request.param)


def full_forward(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        ids_tensor = torch.tensor([ids], device=model.device)
        return model.get_decoder()(input_ids=ids_tensor).last_hidden_state[0, -1]  # type: ignore[no-any-return]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), slots=st.integers(1, 4), prefix_count=st.integers(1, 2))
def test_rows_on_shared_prefixes_match_the_full_forward_pass(model: Any, seed: int, slots: int,
                                                             prefix_count: int) -> None:
    rng = random.Random(seed)
    tolerance = TOLERANCE[model.device.type]
    # capacity 2 is tiny: the tail cache must grow on the way
    decoder = SharedPrefixDecoder(model, slots, capacity=2)
    prefixes = [decoder.prefix([rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))])
                for _ in range(prefix_count)]
    sequences: dict[int, list[int]] = {}

    def start(slot: int) -> None:
        prefix = rng.choice(prefixes)
        used = rng.randint(1, len(prefix))  # some rows part from the prefix before it ends
        decoder.start(slot, prefix, used)
        sequences[slot] = list(prefix.ids[:used])

    for slot in range(slots):
        start(slot)
    with torch.no_grad():
        for _ in range(6):
            active = rng.sample(range(slots), rng.randint(1, slots))
            feeds = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))] for _ in active]
            runs = [[[rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))] for _ in range(rng.choice([0, 0, 1, 3]))]
                    for _ in active]
            hidden = decoder.forward(active, feeds, runs)
            assert hidden.shape[0] == len(active) + sum(map(len, runs))
            run_hidden = iter(hidden[len(active) :])
            for i, slot in enumerate(active):
                sequences[slot] += feeds[i]
                torch.testing.assert_close(hidden[i], full_forward(model, sequences[slot]), **tolerance)
            for i, slot in enumerate(active):
                for run in runs[i]:  # each run as if fed alone after the row's feed
                    torch.testing.assert_close(next(run_hidden), full_forward(model, sequences[slot] + run),
                                               **tolerance)
                if runs[i] and rng.random() < 0.7:  # the row goes on with one of its runs (or none)
                    chosen = rng.randrange(len(runs[i]))
                    decoder.adopt(slot, chosen)
                    sequences[slot] += runs[i][chosen]
            leaving = rng.choice(range(slots))  # a row leaves; a new one takes its slot
            decoder.release(leaving)
            start(leaving)


def test_a_slot_that_was_not_started_is_refused(model: Any) -> None:
    decoder = SharedPrefixDecoder(model, 2)
    with pytest.raises(ValueError, match="slot 1 was not started"):
        decoder.forward([1], [[5]])


def test_models_other_than_llama_style_are_refused() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50))
    with pytest.raises(ModelError, match=r"Llama-style.*'gpt2'"):
        SharedPrefixDecoder(gpt2, 1)


def test_decoders_on_one_model_share_its_blocks_until_its_weights_change() -> None:
    model = tiny_llama(VOCAB, seed=5)
    first, second = SharedPrefixDecoder(model, 1), SharedPrefixDecoder(model, 2)
    assert first.blocks is second.blocks  # one copy of the stacked weights per model, not per engine
    with torch.no_grad():
        model.get_decoder().layers[1].mlp.up_proj.weight.mul_(2.0)
    changed = SharedPrefixDecoder(model, 1)
    assert changed.blocks is not first.blocks
    ids = [5, 17, 301, 42]
    changed.start(0, changed.prefix(ids[:2]), 2)
    with torch.no_grad():
        hidden = changed.forward([0], [ids[2:]])
    torch.testing.assert_close(hidden[0], full_forward(model, ids), atol=2e-5, rtol=1e-4)


def test_prepacked_bfloat16_projections_match_plain_linear_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_llama(VOCAB, seed=7, dtype=torch.bfloat16)
    packed = SharedPrefixDecoder(model, 2)
    if packed.blocks[0].qkv.packed is None:
        pytest.skip("this torch build has no oneDNN prepacking for bfloat16 linear layers")
    monkeypatch.setattr(decoder_module, "_prepacked", lambda weight: None)
    monkeypatch.setattr(decoder_module, "_BLOCKS", weakref.WeakKeyDictionary())
    plain = SharedPrefixDecoder(model, 2)
    assert plain.blocks[0].qkv.packed is None
    rng = random.Random(0)
    outputs = []
    for decoder in (packed, plain):
        prefix = decoder.prefix([rng.randrange(VOCAB) for _ in range(9)])
        for slot in range(2):
            decoder.start(slot, prefix, 9)
        with torch.no_grad():
            outputs.append([decoder.forward([0, 1], [[rng.randrange(VOCAB) for _ in range(n)] for n in (33, 20)]),
                            decoder.forward([0, 1], [[rng.randrange(VOCAB)], [rng.randrange(VOCAB)]])])
        rng = random.Random(0)  # the same tokens for both
    for got, want in zip(*outputs, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_projection_biases_follow_the_paired_query_and_key_rows() -> None:
    """Qwen2-style q/k/v biases: reordered with their rows for the rotary pairing, the result is unchanged."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.2, use_sliding_window=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        model = Qwen2ForCausalLM(config).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    projection.bias.normal_(0, 0.5)  # nonzero: a misplaced bias shows
    decoder = SharedPrefixDecoder(model, 1)
    assert decoder.blocks[0].qkv.bias is not None
    ids = [7, 99, 250, 3, 41, 18]
    decoder.start(0, decoder.prefix(ids[:3]), 3)
    with torch.no_grad():
        hidden = decoder.forward([0], [ids[3:]])
    torch.testing.assert_close(hidden[0], full_forward(model, ids), atol=2e-5, rtol=1e-4)


# A row's hidden states must not depend on what shares its passes: the same bits alone as beside other rows (on other
# prefixes, fed other widths, with and without runs), in bfloat16 as served where the CPU has bfloat16 units, whose
# products give each row the same result whatever the number of rows. (Not in float32: MKL's float32 products take
# other kernels for a few rows than for many, e.g. 5 rows against 40, and round differently.)
@pytest.mark.skipif(not _native_bf16(), reason="the CPU has no bfloat16 units: the model is served in float32")
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), others=st.integers(1, 5))
def test_a_rows_hidden_states_do_not_depend_on_the_other_rows_of_its_passes(seed: int, others: int) -> None:
    rng = random.Random(seed)
    model = tiny_llama(VOCAB, seed=5, dtype=torch.bfloat16)
    prefixes_ids = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))] for _ in range(2)]
    passes = [([rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))],
               [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))] for _ in range(rng.choice([0, 1, 3]))])
              for _ in range(4)]

    def row_hidden(batch: int) -> list[torch.Tensor]:
        decoder = SharedPrefixDecoder(model, batch, capacity=4)
        prefixes = [decoder.prefix(ids) for ids in prefixes_ids]
        decoder.start(0, prefixes[0], len(prefixes[0]))
        for slot in range(1, batch):
            prefix = rng.choice(prefixes)
            decoder.start(slot, prefix, rng.randint(1, len(prefix)))
        seen = []
        for feed, runs in passes:
            slots = [0, *(s for s in range(1, batch) if rng.random() < 0.8)]
            feeds = [feed, *([rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))] for _ in slots[1:])]
            all_runs = [runs, *([[rng.randrange(VOCAB)]] * rng.randint(0, 2) for _ in slots[1:])]
            hidden = decoder.forward(slots, feeds, all_runs)
            seen += [hidden[0], *hidden[len(slots) : len(slots) + len(runs)]]  # the row's, then its runs'
            if runs:
                decoder.adopt(0, 0)
        return seen

    with torch.no_grad():
        alone, beside = row_hidden(1), row_hidden(1 + others)
    for a, b in zip(alone, beside, strict=True):
        assert torch.equal(a, b)
