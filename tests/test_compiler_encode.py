"""The compiler's batched encoding (texts as the words of one pre-tokenized input, split at stop tokens) against
encoding each text on its own: the same ids for any texts, on both bundled tokenizers, and on tokenizers where the
batching cannot be trusted (truncation configured, a Metaspace/SentencePiece-style pre-tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tooltrie.compiler import TokenizerInfo, tokenizer_info
from tooltrie.compiler.tokenizer_info import BUNDLED_TOKENIZERS_DIR
from tooltrie.compiler.trie import FlatPaths

TEXTS = st.lists(st.one_of(
    st.text(max_size=12),
    st.text(alphabet="ab_.,; \n\t-éΩ🙂<|>/", max_size=20),
    st.sampled_from(["", " ", ", ", "\n", "get_weather", ", get_user", "<|im_end|>", "<|endoftext|>", "a<|im_end|>b",
                     "}\n", "  x", "x  ", "\x04", "\u200b"]),
), max_size=70)  # past the 32 texts checked on their own in every call


def _one_by_one(tokenizer: TokenizerInfo, texts: list[str]) -> list[list[int]]:
    return [tokenizer.encode(text) for text in texts]


@pytest.mark.parametrize("name", ["smollm2-135m", "gpt2"])
@settings(max_examples=150, deadline=None)
@given(texts=TEXTS)
def test_batched_encoding_equals_encoding_each_text(tokenizers: dict[str, TokenizerInfo], name: str,
                                                    texts: list[str]) -> None:
    tokenizer = tokenizers[name]
    flat = tokenizer.encode_flat(texts)
    assert [flat.path(i) for i in range(len(flat))] == _one_by_one(tokenizer, texts)


def test_many_texts_across_batches(smollm: TokenizerInfo) -> None:
    texts = [f"tool_{i}{', ' if i % 3 else ''}x{i % 7}" for i in range(5_000)]
    flat = smollm.encode_flat(texts)
    assert [flat.path(i) for i in range(len(flat))] == _one_by_one(smollm, texts)


def _variant(tmp_path: Path, change: dict[str, object]) -> TokenizerInfo:
    spec = json.loads((BUNDLED_TOKENIZERS_DIR / "gpt2" / "tokenizer.json").read_text(encoding="utf-8"))
    spec.update(change)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    return TokenizerInfo.load(path, eos_token="<|endoftext|>")


@pytest.mark.parametrize("change", [
    {"truncation": {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}},
    {"pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True}},
    {"normalizer": {"type": "Lowercase"}},
], ids=["truncation", "metaspace-first", "lowercase"])
def test_tokenizer_variants(tmp_path: Path, change: dict[str, object]) -> None:
    tokenizer = _variant(tmp_path, change)
    texts = ["Get_Weather", "a, b", ", x", " lead", "trail ", "one two three four five six", "<|endoftext|>"] * 10
    flat = tokenizer.encode_flat(texts)
    assert [flat.path(i) for i in range(len(flat))] == _one_by_one(tokenizer, texts)


@pytest.mark.parametrize("name", ["smollm2-135m", "gpt2"])
def test_the_recorded_fingerprint_is_the_computed_one(name: str, tmp_path: Path) -> None:
    from tooltrie.compiler.tokenizer_info import FINGERPRINT_RECORD, fingerprint

    folder = BUNDLED_TOKENIZERS_DIR / name
    assert (folder / FINGERPRINT_RECORD).is_file()
    info = TokenizerInfo.load(name)
    text = (folder / "tokenizer.json").read_text(encoding="utf-8")
    assert info.fingerprint == fingerprint(text, info.eos_token, info.eos_id)
    spec = json.loads(text)
    assert info.special_tokens == {t["content"] for t in spec["added_tokens"] if t.get("special")}
    # A changed file beside the same record: the record is not for these bytes, the fingerprint is computed.
    spec["model"]["vocab"]["zzzz-new-token"] = len(spec["model"]["vocab"]) + 1000
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    (tmp_path / FINGERPRINT_RECORD).write_bytes((folder / FINGERPRINT_RECORD).read_bytes())
    changed = TokenizerInfo.load(tmp_path, eos_token=info.eos_token)
    assert changed.fingerprint != info.fingerprint
    assert changed.fingerprint == fingerprint(json.dumps(spec), info.eos_token, info.eos_id)


@pytest.mark.parametrize("name", ["smollm2-135m", "gpt2"])
@settings(max_examples=150, deadline=None)
@given(data=st.data(), texts=TEXTS)
def test_decode_mismatches_equal_decoding_each_path(tokenizers: dict[str, TokenizerInfo], name: str,
                                                   data: st.DataObject, texts: list[str]) -> None:
    """The byte-level comparison finds exactly the paths that do not decode to their text: paths from the texts'
    own encodings, changed (an id replaced or dropped) or random (added tokens and halves of characters too)."""
    tokenizer = tokenizers[name]
    added = sorted(tokenizer.tokenizer.get_added_tokens_decoder())
    ids = st.one_of(st.integers(0, tokenizer.vocab_size - 1), st.sampled_from(added))
    paths = []
    for ids_of_text in _one_by_one(tokenizer, texts):
        kind = data.draw(st.sampled_from(["own", "replaced", "dropped", "random"]))
        if kind == "random" or (kind != "own" and not ids_of_text):
            ids_of_text = data.draw(st.lists(ids, max_size=6))
        elif kind != "own":
            at = data.draw(st.integers(0, len(ids_of_text) - 1))
            ids_of_text = [*ids_of_text[:at], *([data.draw(ids)] if kind == "replaced" else []), *ids_of_text[at + 1:]]
        paths.append(ids_of_text)
    decoded = tokenizer.decode_batch(paths)
    expected = {i: text for i, text in enumerate(decoded) if text != texts[i]}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tokenizer_info, "_BYTE_COMPARE_MIN_TEXTS", 0)
        assert tokenizer.decode_mismatches(FlatPaths.of(paths), texts) == expected


def test_decode_mismatches_with_another_decoder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoder that is not byte-level (here: none) decodes every path."""
    tokenizer = _variant(tmp_path, {"decoder": None})
    monkeypatch.setattr(tokenizer_info, "_BYTE_COMPARE_MIN_TEXTS", 0)
    texts = ["get_weather", "a b", "é"]
    paths = [tokenizer.encode(text) for text in texts]
    decoded = tokenizer.decode_batch(paths)
    assert tokenizer.decode_mismatches(FlatPaths.of(paths), texts) == {
        i: text for i, text in enumerate(decoded) if text != texts[i]}
    assert decoded != texts  # without a decoder the byte-level characters come back as they are
