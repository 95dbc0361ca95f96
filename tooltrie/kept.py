"""What the retrieval prior keeps beside an artifact, so that work done once per registry version is not done again:
the tools' embeddings (``ranker.py``) and their lexical index (``lexical.py``). One pattern for both: safetensors
arrays and string metadata; read back only when the metadata holds what the reader expects (another registry
version, encoder or kind of index is made afresh) and the reader accepts the arrays (a damaged file, or one whose
arrays do not fit, is made afresh too, with a warning: never trusted); written atomically, and a write that fails is
logged: a cache, so the caller answers from what it holds.

>>> import tempfile, numpy as np
>>> path = Path(tempfile.mkdtemp()) / "tools.kept.safetensors"
>>> keep(path, {"scores": np.arange(3, dtype=np.float32)}, {"registry_sha256": "abc"}, what="scores")
>>> read_kept(path, {"registry_sha256": "abc"}, lambda arrays, meta: arrays["scores"].tolist(), what="scores")
[0.0, 1.0, 2.0]
>>> read_kept(path, {"registry_sha256": "another"}, lambda arrays, meta: arrays, what="scores") is None
True
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from tooltrie.errors import ArtifactError

__all__ = ["keep", "read_kept"]

logger = logging.getLogger(__name__)
_Kept = TypeVar("_Kept")


def read_kept(path: Path | None, expected: Mapping[str, str],
              accept: Callable[[dict[str, np.ndarray[Any, Any]], dict[str, str]], _Kept], *, what: str) -> _Kept | None:
    """What ``accept`` makes of the arrays and metadata kept at ``path``; None when there is no such file, when its
    metadata differs from ``expected`` anywhere, or when it cannot be read or ``accept`` raises (logged)."""
    if path is None or not path.is_file():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            if any(meta.get(key) != value for key, value in expected.items()):
                return None  # another registry version or kind: made afresh
            arrays = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - a safetensors file, not a dict
        return accept(arrays, meta)
    except Exception as exc:  # a damaged file, or arrays that do not fit: made afresh, never trusted
        logger.warning("the kept %s %s is not used, and is made afresh: %s", what, path, exc)
        return None


def keep(path: Path, arrays: Mapping[str, np.ndarray[Any, Any]], metadata: Mapping[str, str], *, what: str) -> None:
    """Write ``arrays`` and ``metadata`` to ``path`` atomically; a failure is logged, not raised."""
    from safetensors.numpy import save

    from tooltrie.compiler.artifact import write_atomically

    try:
        write_atomically(path, save({name: np.ascontiguousarray(array) for name, array in arrays.items()},
                                    metadata=dict(metadata)))
    except ArtifactError as exc:
        logger.warning("the tools' %s was not cached: %s", what, exc)
