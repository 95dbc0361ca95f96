"""The tools' embeddings made a chunk at a time (``tooltrie/embeddings.py``): against one pass over every text, a run
that stops continues where it stopped (only the texts not yet kept are embedded again), a damaged chunk or one made
for another registry version is made again and never used, progress is told after each chunk, and the ranker's
embeddings resume the same way."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.encoders import MadeUpEncoder

from tooltrie.embeddings import embed_texts
from tooltrie.kept import read_kept
from tooltrie.ranker import Ranker
from tooltrie.registry import make_registry

TEXTS = [f"tool number {i}: does thing {i % 3}" for i in range(10)]
KEY = {"registry_sha256": "abc", "encoder": "made-up", "text": "1"}


class Stopping(MadeUpEncoder):
    """Stops (raises) when asked for its ``calls``-th batch, like a run killed midway."""

    def __init__(self, calls: int) -> None:
        super().__init__()
        self.calls = calls

    def encode(self, texts: list[str]):  # type: ignore[no-untyped-def]
        self.calls -= 1
        if self.calls == 0:
            raise KeyboardInterrupt
        return super().encode(texts)


def test_chunks_make_what_one_pass_makes(tmp_path: Path) -> None:
    path = tmp_path / "tools.embeddings.safetensors"
    told: list[tuple[int, int]] = []
    made = embed_texts(MadeUpEncoder().encode, TEXTS, path, KEY, progress=lambda *a: told.append(a), chunk=4)
    np.testing.assert_array_equal(made, MadeUpEncoder().encode(TEXTS).numpy())
    assert told == [(4, 10), (8, 10), (10, 10)]
    kept = read_kept(path, KEY, lambda arrays, meta: arrays["embeddings"], what="embeddings")
    assert kept is not None and np.array_equal(kept, made)
    assert not (tmp_path / "tools.embeddings.safetensors.partial").exists()  # the chunks go once the whole is kept


def test_a_run_that_stops_continues_where_it_stopped(tmp_path: Path) -> None:
    path = tmp_path / "tools.embeddings.safetensors"
    with pytest.raises(KeyboardInterrupt):
        embed_texts(Stopping(calls=3).encode, TEXTS, path, KEY, chunk=4)  # two chunks made, the third stops
    assert not path.exists() and len(list((tmp_path / "tools.embeddings.safetensors.partial").iterdir())) == 2
    again = MadeUpEncoder()
    made = embed_texts(again.encode, TEXTS, path, KEY, chunk=4)
    assert again.encoded == TEXTS[8:]  # only what was not kept
    np.testing.assert_array_equal(made, MadeUpEncoder().encode(TEXTS).numpy())


@pytest.mark.parametrize("damage", ["cut short", "another registry", "another chunk size"])
def test_a_chunk_that_does_not_read_back_is_made_again(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "tools.embeddings.safetensors"
    with pytest.raises(KeyboardInterrupt):
        embed_texts(Stopping(calls=3).encode, TEXTS, path, KEY, chunk=4)
    first = tmp_path / "tools.embeddings.safetensors.partial" / "000000000.safetensors"
    key, chunk = KEY, 4
    if damage == "cut short":
        first.write_bytes(first.read_bytes()[:100])
    elif damage == "another registry":
        key = {**KEY, "registry_sha256": "def"}
    else:
        chunk = 5
    again = MadeUpEncoder()
    made = embed_texts(again.encode, TEXTS, path, key, chunk=chunk)
    expected_encoded = TEXTS[:4] + TEXTS[8:] if damage == "cut short" else TEXTS
    assert again.encoded == expected_encoded
    np.testing.assert_array_equal(made, MadeUpEncoder().encode(TEXTS).numpy())


def test_the_rankers_embeddings_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tooltrie.embeddings as embeddings

    registry = make_registry([{"name": f"tool_{i}", "description": f"does thing {i}"} for i in range(7)], name="r")
    path = tmp_path / "r.embeddings.safetensors"
    monkeypatch.setattr(embeddings, "CHUNK", 3)
    with pytest.raises(KeyboardInterrupt):
        Ranker(registry, encoder=Stopping(calls=2), embeddings_path=path).tool_embeddings  # noqa: B018
    again = MadeUpEncoder()
    ranker = Ranker(registry, encoder=again, embeddings_path=path)
    told: list[tuple[int, int]] = []
    ranker.progress = lambda *a: told.append(a)
    made = ranker.tool_embeddings
    assert len(again.encoded) == 4 and told == [(3, 7), (6, 7), (7, 7)]  # the first chunk was kept
    fresh = Ranker(registry, encoder=MadeUpEncoder()).tool_embeddings
    np.testing.assert_array_equal(made, fresh)
