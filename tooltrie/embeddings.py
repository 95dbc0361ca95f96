"""The tools' embeddings, made a chunk at a time and kept as they are made, so that a run that stops (interrupted,
killed, out of memory) continues where it stopped instead of starting again: 100,000 tools take minutes.

While they are made, each chunk of ``CHUNK`` tools is written beside the final file, in ``<file>.partial/`` (one
``tooltrie/kept.py`` file per chunk, atomic, keyed like the final file plus the chunk's place); a later run reads
every chunk that holds what it expects and makes the others. A chunk that does not read back (damaged, cut short,
made for another registry version, encoder or chunk size) is made again, never used. Once every chunk is there the
embeddings are kept in the final file and the chunks removed.

Progress (``progress``, called after each chunk with the tools done and the total) is what a command shows
(``tooltrie/progress.py``).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tooltrie.kept import keep, read_kept
from tooltrie.progress import OnProgress

CHUNK = 2048  # tools a chunk: what a stopped run may lose (about 20 s of all-MiniLM-L6-v2 on 2 cores)
logger = logging.getLogger(__name__)


def embed_texts(encode: Callable[[list[str]], Any], texts: Sequence[str], path: Path | None,
                key: Mapping[str, str], *, progress: OnProgress | None = None,
                chunk: int | None = None) -> npt.NDArray[np.float32]:
    """[len(texts), dim] the texts' embeddings by ``encode`` (a list of texts to a tensor or array of unit vectors),
    made ``chunk`` (default ``CHUNK``) at a time; with ``path``, each chunk kept as made and read back by a run that
    continues, then the whole kept at ``path`` under ``key`` (the chunks removed)."""
    chunk = CHUNK if chunk is None else chunk
    partial = None if path is None else path.with_name(path.name + ".partial")
    parts: list[npt.NDArray[np.float32]] = []
    for start in range(0, len(texts), chunk):
        count = min(chunk, len(texts) - start)
        chunk_key = {**key, "start": str(start), "count": str(count), "chunk": str(chunk)}
        file = None if partial is None else partial / f"{start:09d}.safetensors"
        made = None if file is None else read_kept(file, chunk_key, _reader(count), what="embeddings chunk")
        if made is None:
            made = np.asarray(_array(encode(list(texts[start : start + count]))), dtype=np.float32)
            if file is not None:
                keep(file, {"embeddings": made}, chunk_key, what="embeddings chunk")
        parts.append(made)
        if progress is not None:
            progress(start + count, len(texts))
    embeddings = np.concatenate(parts) if parts else np.zeros((0, 0), np.float32)
    if path is not None:
        keep(path, {"embeddings": embeddings}, key, what="embeddings")
        if partial is not None and partial.is_dir() and path.is_file():
            shutil.rmtree(partial, ignore_errors=True)
    return embeddings


def _reader(count: int) -> Callable[[dict[str, npt.NDArray[Any]], dict[str, str]], npt.NDArray[np.float32]]:
    """How a kept chunk of ``count`` embeddings is read back: ``count`` finite unit vectors, or ValueError (the
    chunk is made again)."""
    return lambda arrays, meta: _checked(arrays["embeddings"], count)


def _checked(values: npt.NDArray[Any], count: int) -> npt.NDArray[np.float32]:
    array = np.asarray(values, dtype=np.float32)
    if array.ndim != 2 or len(array) != count or not np.isfinite(array).all() or (
            len(array) and not np.allclose(np.linalg.norm(array, axis=1), 1.0, atol=1e-3)):
        raise ValueError(f"a chunk of {count} embeddings holds {array.shape}")
    return array


def _array(vectors: Any) -> npt.NDArray[np.float32]:
    return np.asarray(vectors.numpy() if hasattr(vectors, "numpy") else vectors, dtype=np.float32)


__all__ = ["CHUNK", "embed_texts"]
