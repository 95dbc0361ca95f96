"""Per-tokenizer information, built once: the Rust tokenizer, its stop token and a fingerprint.

The fingerprint hashes what decides token ids (vocabulary, merges, normalizer, pre-tokenizer, special tokens,
the stop token), so an artifact compiled for one tokenizer is refused with another.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
from tokenizers import Encoding, Tokenizer, decoders

from tooltrie.compiler.trie import FlatPaths, concat_ranges
from tooltrie.errors import TokenizerError

BUNDLED_TOKENIZERS_DIR = Path(__file__).with_name("tokenizers")
DEFAULT_TOKENIZER = "smollm2-135m"

# Markers after which a reasoning model's answer starts; the constraint begins on the token after one.
REASONING_END_MARKERS = ("</think>", "</thinking>", "<|end_of_thought|>", "</reasoning>")
FINGERPRINT_RECORD = "fingerprint.json"  # beside tokenizer.json: its fingerprint, for the file's exact bytes
_WORDS_PER_BATCH = 1_024  # texts per pre-tokenized input in encode_flat (batches run in parallel)
_BYTE_COMPARE_MIN_TEXTS = 10_000  # below this, decoding every text costs less than making the bytes table once
_PROBE_TEXTS = 32  # texts of each encode_flat call also encoded on their own, as a check
# Parts of tokenizer.json that decide which ids a text encodes to (the decoder and padding do not).
_FINGERPRINT_KEYS = ("model", "normalizer", "pre_tokenizer", "added_tokens")


@dataclass(frozen=True, eq=False)
class TokenizerInfo:
    """A loaded tokenizer plus what the contract needs from it.

    >>> info = TokenizerInfo.load("gpt2")
    >>> info.encode("get_weather, get_user")
    [1136, 62, 23563, 11, 651, 62, 7220]
    >>> info.eos_token, info.eos_id
    ('<|endoftext|>', 50256)
    """

    tokenizer: Tokenizer = field(repr=False)
    source: str  # a bundled tokenizer's name, or the path it was loaded from
    eos_token: str
    eos_id: int
    fingerprint: str
    special_tokens: frozenset[str] = field(repr=False)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    @classmethod
    def load(cls, source: str | Path | None = None, *, eos_token: str | None = None) -> TokenizerInfo:
        """Load a Hugging Face fast tokenizer.

        ``source`` is a directory holding ``tokenizer.json`` (and optionally ``tokenizer_config.json``, which
        names the stop token), a ``tokenizer.json`` file, or the name of a bundled tokenizer
        (``smollm2-135m``, the default, or ``gpt2``).
        """
        path, name = _resolve(source)
        json_path = path / "tokenizer.json" if path.is_dir() else path
        try:
            text = json_path.read_text(encoding="utf-8")
            tokenizer = Tokenizer.from_str(text)
        except FileNotFoundError:
            raise TokenizerError(f"{json_path}: no tokenizer.json there") from None
        except Exception as exc:  # the Rust side raises plain Exceptions for malformed files
            raise TokenizerError(f"{json_path}: not a Hugging Face tokenizer.json: {exc}") from None
        special = frozenset(added.content for added in tokenizer.get_added_tokens_decoder().values() if added.special)
        eos = eos_token or _configured_eos(json_path.parent) or _guess_eos(special)
        if eos is None:
            raise TokenizerError(
                f"{json_path}: cannot tell the stop token: no tokenizer_config.json with 'eos_token' beside it "
                f"and none of the usual names among the special tokens; pass eos_token=..."
            )
        eos_id = tokenizer.token_to_id(eos)
        if eos_id is None:
            raise TokenizerError(f"{json_path}: stop token {eos!r} is not in the vocabulary")
        return cls(
            tokenizer=tokenizer,
            source=name,
            eos_token=eos,
            eos_id=int(eos_id),
            fingerprint=_recorded_fingerprint(json_path, text, eos, int(eos_id)) or fingerprint(text, eos, int(eos_id)),
            special_tokens=special,
        )

    @property
    def reasoning_end_id(self) -> int | None:
        """The id of a reasoning-end marker (``</think>`` and the like) if the vocabulary has one."""
        for marker in REASONING_END_MARKERS:
            found = self.tokenizer.token_to_id(marker)
            if found is not None:
                return int(found)
        return None

    def encode(self, text: str) -> list[int]:
        """Canonical token ids of ``text``, without special tokens added around it."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_prompt(self, before: str, text: str, after: str) -> list[int]:
        """``before + text + after`` tokenized whole, with the special tokens of ``before`` and ``after`` (a chat
        template's) parsed and those spelled inside ``text`` (a user's query) kept as text: a query holding
        ``<|im_end|>`` cannot close its turn. Everything between two template special tokens is encoded in one
        piece, as ``encode`` does, so a query without special-token strings gets exactly ``encode``'s ids."""
        ids: list[int] = []
        plain = ""
        for piece in (*self._split_specials(before), text, *self._split_specials(after)):
            if isinstance(piece, int):
                ids += self._text_tokenizer.encode(plain, add_special_tokens=False).ids if plain else []
                ids.append(piece)
                plain = ""
            else:
                plain += piece
        return ids + (self._text_tokenizer.encode(plain, add_special_tokens=False).ids if plain else [])

    def _split_specials(self, template: str) -> list[str | int]:
        """``template`` as its text and the ids of its special tokens, in order."""
        if self._special_pattern is None:
            return [template]
        pieces: list[str | int] = []
        for i, part in enumerate(self._special_pattern.split(template)):
            if i % 2:
                token = self.tokenizer.token_to_id(part)
                assert token is not None  # the pattern holds the tokenizer's own special tokens only
                pieces.append(token)
            elif part:
                pieces.append(part)
        return pieces

    @functools.cached_property
    def _special_pattern(self) -> re.Pattern[str] | None:
        specials = sorted(self.special_tokens, key=len, reverse=True)
        return re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None

    @functools.cached_property
    def _text_tokenizer(self) -> Tokenizer:
        """A copy of the tokenizer that reads special-token strings as text (the shared one is left as it is)."""
        copy = Tokenizer.from_str(self.tokenizer.to_str())
        copy.encode_special_tokens = True
        return copy

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` for many texts at once (parallel in Rust)."""
        return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def encodings(self, texts: list[str]) -> list[Encoding]:
        """The Rust encodings of ``texts`` (parallel; no offsets)."""
        return list(self.tokenizer.encode_batch_fast(texts, add_special_tokens=False))

    def encode_flat(self, texts: list[str]) -> FlatPaths:
        """``encode`` of every text, as one array with boundaries, in batches of texts.

        The Rust tokenizer encodes each word of a pre-tokenized input as a sequence of its own (normalized,
        pre-tokenized and tokenized alone, then concatenated), so a batch of texts given as the words of one input,
        each followed by the stop token as a word of its own, yields every text's canonical ids between stop
        tokens, without an encoding object per text (most of the cost of many short texts). Where that cannot be
        trusted, each text is encoded on its own: a tokenizer with truncation or padding configured, a stop token
        that is not one added token, or a text whose ids contain the stop token; and the first texts of each call
        are checked against encoding them on their own.
        """
        if not texts:
            return FlatPaths(np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64))
        if self.tokenizer.truncation is None and self.tokenizer.padding is None and self._stop_is_one_word:
            flat = self._encode_as_words(texts)
            if flat is not None:
                return flat
        return FlatPaths.of([encoding.ids for encoding in self.encodings(texts)])

    @functools.cached_property
    def _stop_is_one_word(self) -> bool:
        return self.tokenizer.encode_batch_fast([[self.eos_token]], is_pretokenized=True,
                                                add_special_tokens=False)[0].ids == [self.eos_id]

    def _encode_as_words(self, texts: list[str]) -> FlatPaths | None:
        batches = [_with_stops(texts[start : start + _WORDS_PER_BATCH], self.eos_token)
                   for start in range(0, len(texts), _WORDS_PER_BATCH)]
        encodings = self.tokenizer.encode_batch_fast(batches, is_pretokenized=True, add_special_tokens=False)
        ids = np.concatenate([np.array(encoding.ids, dtype=np.int64) for encoding in encodings])
        ends = np.flatnonzero(ids == self.eos_id)
        if len(ends) != len(texts):  # a text that encodes to the stop token: the boundaries are unknown
            return None
        lengths = ends - np.concatenate([[-1], ends[:-1]]) - 1
        flat = FlatPaths(np.delete(ids, ends), np.concatenate([[0], np.cumsum(lengths)]))
        probe = texts[:_PROBE_TEXTS]
        if [flat.path(i) for i in range(len(probe))] != [e.ids for e in self.encodings(probe)]:
            return None
        return flat

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def decode_batch(self, batches: list[list[int]]) -> list[str]:
        return [str(text) for text in self.tokenizer.decode_batch(batches, skip_special_tokens=False)]

    def decode_mismatches(self, paths: FlatPaths, texts: list[str]) -> dict[int, str]:
        """The texts that ``paths`` (their ids) do not decode back to, by index, with what they decode to.

        A byte-level decoder turns each token into fixed bytes, so there the ids' bytes are compared with the
        texts' UTF-8 in a few array operations, and only the texts that differ, or hold an added token (which
        decodes as its content), are decoded. Other decoders decode every text.
        """
        table = self._token_bytes if len(texts) >= _BYTE_COMPARE_MIN_TEXTS else None
        suspects = _byte_mismatches(paths, texts, table).tolist() if table is not None else range(len(texts))
        decoded = self.decode_batch([paths.path(i) for i in suspects])  # the judge: every suspect decoded
        return {i: text for i, text in zip(suspects, decoded, strict=True) if text != texts[i]}

    @functools.cached_property
    def _token_bytes(self) -> _TokenBytes | None:
        """Each vocabulary token's bytes under a byte-level decoder; None for any other decoder."""
        if not isinstance(self.tokenizer.decoder, decoders.ByteLevel):
            return None
        byte_of = {char: byte for byte, char in _byte_level_chars().items()}
        tokens = [""] * self.vocab_size
        for token, token_id in self.tokenizer.get_vocab(with_added_tokens=False).items():
            tokens[token_id] = token
        added = [int(token_id) for token_id in self.tokenizer.get_added_tokens_decoder()]
        pieces = [_byte_level_bytes(token, byte_of) for token in tokens]
        lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        lengths[added] = -1  # an added token decodes as its content, not as bytes
        return _TokenBytes(np.frombuffer(b"".join(pieces), dtype=np.uint8), starts, lengths)

    def token_to_id(self, token: str) -> int | None:
        found = self.tokenizer.token_to_id(token)
        return None if found is None else int(found)


class _TokenBytes(NamedTuple):
    """The bytes a byte-level decoder gives each token id: ``data[starts[i] : starts[i] + lengths[i]]``
    (length -1: an added token)."""

    data: npt.NDArray[np.uint8]
    starts: npt.NDArray[np.int64]
    lengths: npt.NDArray[np.int64]


@functools.cache
def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    return {**{byte: chr(byte) for byte in printable}, **{byte: chr(256 + i) for i, byte in enumerate(others)}}


def _byte_level_bytes(token: str, byte_of: dict[str, int]) -> bytes:
    """A token's bytes as the byte-level decoder gives them (a token outside the alphabet: its own UTF-8)."""
    try:
        return bytes(byte_of[char] for char in token)
    except KeyError:
        return token.encode("utf-8")


def _byte_mismatches(paths: FlatPaths, texts: list[str], table: _TokenBytes) -> npt.NDArray[np.int64]:
    """The indices of the texts whose paths' bytes differ from their UTF-8, or that hold an added token."""
    encoded = [text.encode("utf-8", "surrogatepass") for text in texts]
    text_lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    token_lengths = table.lengths[paths.tokens]
    owner = np.repeat(np.arange(len(texts)), paths.lengths)
    has_added = np.bincount(owner[token_lengths < 0], minlength=len(texts)) > 0
    path_lengths = np.bincount(owner, weights=token_lengths, minlength=len(texts)).astype(np.int64)
    comparable = (path_lengths == text_lengths) & ~has_added
    kept = paths.tokens[comparable[owner]]
    produced = table.data[concat_ranges(table.starts[kept], table.lengths[kept])]
    expected = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    if not comparable.all():
        text_starts = np.concatenate([[0], np.cumsum(text_lengths)[:-1]])
        expected = expected[concat_ranges(text_starts[comparable], text_lengths[comparable])]
    differs = np.zeros(len(texts), dtype=bool)
    differs[np.repeat(np.nonzero(comparable)[0], text_lengths[comparable])[produced != expected]] = True
    return np.nonzero(differs | ~comparable)[0]


def _with_stops(texts: list[str], stop: str) -> list[str]:
    """Each text followed by ``stop`` (filled by slice assignment: no Python loop per text)."""
    words = [stop] * (2 * len(texts))
    words[::2] = texts
    return words


def fingerprint(text: str, eos: str, eos_id: int) -> str:
    """The sha256 of what decides token ids in a ``tokenizer.json`` text (canonical JSON), and the stop token."""
    spec = json.loads(text)
    parts: dict[str, Any] = {key: spec.get(key) for key in _FINGERPRINT_KEYS}
    parts["eos"] = [eos, eos_id]
    canonical = json.dumps(parts, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _recorded_fingerprint(json_path: Path, text: str, eos: str, eos_id: int) -> str | None:
    """The fingerprint recorded beside a tokenizer file (``fingerprint.json``, as the bundled tokenizers have), if
    it was recorded for exactly this file's bytes and stop token: a process then skips the canonical JSON of the
    whole vocabulary (a third of a second for SmolLM2's)."""
    record_path = json_path.with_name(FINGERPRINT_RECORD)
    if not record_path.is_file():
        return None
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(record, dict) or record.get("eos") != [eos, eos_id] or record.get(
            "tokenizer_json_sha256") != hashlib.sha256(text.encode("utf-8")).hexdigest():
        return None
    found = record.get("fingerprint")
    return found if isinstance(found, str) else None


def write_fingerprint_record(source: str | Path) -> Path:
    """Record a tokenizer's fingerprint beside its file (for the bundled ones: ``python -c 'from
    tooltrie.compiler.tokenizer_info import write_fingerprint_record as w; w("gpt2"); w("smollm2-135m")'``)."""
    info = TokenizerInfo.load(source)
    path, _ = _resolve(source)
    json_path = path / "tokenizer.json" if path.is_dir() else path
    text = json_path.read_text(encoding="utf-8")
    record = {"tokenizer_json_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
              "eos": [info.eos_token, info.eos_id], "fingerprint": fingerprint(text, info.eos_token, info.eos_id)}
    out = json_path.with_name(FINGERPRINT_RECORD)
    out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return out


def _resolve(source: str | Path | None) -> tuple[Path, str]:
    """The tokenizer's path, and the name to record: a bundled tokenizer's name, else the path given."""
    if source is None:
        source = DEFAULT_TOKENIZER
    path = Path(source)
    if not path.exists() and (BUNDLED_TOKENIZERS_DIR / str(source)).is_dir():
        return BUNDLED_TOKENIZERS_DIR / str(source), str(source)
    if not path.exists():
        bundled = sorted(p.name for p in BUNDLED_TOKENIZERS_DIR.iterdir() if p.is_dir())
        raise TokenizerError(f"{source}: no such tokenizer file or directory (bundled: {', '.join(bundled)})")
    return path, str(path)


def _configured_eos(directory: Path) -> str | None:
    config_path = directory / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    try:
        eos = json.loads(config_path.read_text(encoding="utf-8")).get("eos_token")
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{config_path}: unreadable tokenizer config: {exc}") from None
    if isinstance(eos, dict):  # older configs store {"content": "...", ...}
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def _guess_eos(special: frozenset[str]) -> str | None:
    for candidate in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>", "<eos>", "<|end|>"):
        if candidate in special:
            return candidate
    return None
