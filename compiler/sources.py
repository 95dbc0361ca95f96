"""What a command is given where it takes a registry: a registry file, or an artifact ``tooltrie compile`` made.

An artifact's header holds its registry and contract, so everything a registry file gives (names, pointers, the
prompt's catalog, the separator) comes from it; it is only checked against the tokenizer it is used with. A
registry file is compiled (through the cache) with the contract's default separator or the one given.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from tooltrie.compiler.artifact import Artifact
from tooltrie.compiler.cache import compile_cached
from tooltrie.compiler.contract import Contract
from tooltrie.compiler.tokenizer_info import TokenizerInfo
from tooltrie.registry.loader import load_registry
from tooltrie.registry.model import Registry

ARTIFACT_SUFFIX = ".safetensors"


def is_artifact(path: str | Path) -> bool:
    """A safetensors file (by suffix, or by its first bytes: a little-endian header length, then ``{``).

    >>> from tooltrie.registry import CATALOG_PATH
    >>> is_artifact(CATALOG_PATH)
    False
    """
    path = Path(path)
    if path.suffix.lower() == ARTIFACT_SUFFIX:
        return True
    try:
        with path.open("rb") as handle:
            head = handle.read(9)
    except OSError:
        return False
    return len(head) == 9 and head[8:9] == b"{" and 0 < struct.unpack("<Q", head[:8])[0] < path.stat().st_size


def registry_of(path: str | Path) -> Registry:
    """The registry a registry file or an artifact holds (an artifact is read and checked, not compiled)."""
    return Artifact.load(path).registry if is_artifact(path) else load_registry(path)


def artifact_from(path: str | Path, tokenizer: TokenizerInfo, *, separator: str | None = None,
                  cache_dir: str | Path | None = None, loaded: Artifact | None = None) -> Artifact:
    """The artifact of ``path``: loaded and checked against ``tokenizer`` (and ``separator``, when given) if it is
    one, else the registry file compiled with ``separator`` (default: the contract's), through the cache.
    ``loaded``: the artifact of ``path`` read already (checked here, not read again: at 100,000 tools a read takes
    4 s)."""
    if loaded is not None or is_artifact(path):
        contract = None if separator is None else Contract(separator=separator)
        if loaded is None:
            return Artifact.load(path, tokenizer=tokenizer, contract=contract)
        loaded.check_compatible(tokenizer=tokenizer, contract=contract, where=str(path))
        return loaded
    contract = Contract() if separator is None else Contract(separator=separator)
    return compile_cached(load_registry(path), tokenizer, contract, cache_dir=cache_dir)


def tokenizer_source(path: str | Path) -> str | None:
    """The tokenizer an artifact was compiled for (its bundled name or path), or None for a registry file; read
    from the header alone, so a command can load the right tokenizer before the artifact."""
    if not is_artifact(path):
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="np") as handle:
            source = json.loads((handle.metadata() or {})["tooltrie"])["tokenizer"]["source"]
    except Exception:  # unreadable: Artifact.load names the problem when the command loads it
        return None
    return source if isinstance(source, str) else None
