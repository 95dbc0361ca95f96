"""tooltrie: a tool-selection decoder.

A registry of tools is compiled into a trie over a language model's own token ids; decoding under the trie
yields exactly k distinct, real tools. See ``docs/trie.md`` for the layout and the mask walk.
"""

from __future__ import annotations

from tooltrie.errors import (
    ArtifactError,
    ArtifactMismatchError,
    CompileError,
    DecodeError,
    RegistryError,
    TokenizerError,
    TooltrieError,
)

__version__ = "0.1.0"

__all__ = [
    "ArtifactError",
    "ArtifactMismatchError",
    "CompileError",
    "DecodeError",
    "RegistryError",
    "TokenizerError",
    "TooltrieError",
    "__version__",
]
