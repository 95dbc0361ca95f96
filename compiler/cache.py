"""A cache of compiled artifacts keyed by (registry hash, tokenizer fingerprint, contract hash).

An unchanged registry costs one lookup. The cache lives in ``$TOOLTRIE_CACHE_DIR`` or
``~/.cache/tooltrie/artifacts``; an unreadable entry is recompiled and replaced, never trusted.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path

from tooltrie.compiler.artifact import FORMAT_VERSION, Artifact
from tooltrie.compiler.compile import compile_registry
from tooltrie.compiler.contract import Contract
from tooltrie.compiler.tokenizer_info import TokenizerInfo
from tooltrie.errors import ArtifactError
from tooltrie.registry.model import Registry


def default_cache_dir() -> Path:
    configured = os.environ.get("TOOLTRIE_CACHE_DIR")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tooltrie" / "artifacts"


def cache_key(registry: Registry, tokenizer: TokenizerInfo, contract: Contract) -> str:
    """The tools' content, and the name and file the artifact records (the content hash leaves them out: a renamed
    or copied registry must not come back under its old name or file)."""
    parts = [FORMAT_VERSION, registry.sha256, registry.name, registry.source, tokenizer.fingerprint, contract.sha256]
    return hashlib.sha256(repr(parts).encode("utf-8")).hexdigest()[:32]


def compile_cached(registry: Registry, tokenizer: TokenizerInfo, contract: Contract | None = None, *,
                   cache_dir: str | Path | None = None) -> Artifact:
    """Return the cached artifact for these inputs, compiling (and caching) it on a miss."""
    contract = contract or Contract()
    label = re.sub(r"[^A-Za-z0-9_-]+", "_", registry.name)[:40]  # readable, and never a path of its own
    path = Path(cache_dir or default_cache_dir()) / f"{label}-{cache_key(registry, tokenizer, contract)}.safetensors"
    if path.is_file():
        try:
            return Artifact.load(path, tokenizer=tokenizer, registry=registry, contract=contract)
        except ArtifactError:
            pass  # corrupt or stale: recompile below and replace it atomically
    artifact = compile_registry(registry, tokenizer, contract)
    try:
        artifact.save(path)
    except ArtifactError as exc:  # the cache is an optimisation: an unwritable one costs a compile, not the answer
        logging.getLogger(__name__).warning("the compiled artifact was not cached: %s", exc)
    return artifact
