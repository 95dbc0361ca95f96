"""Named exceptions: each message says what was expected, what arrived, and where."""

from __future__ import annotations


class TooltrieError(Exception):
    """Base class of every error tooltrie raises on purpose."""


class RegistryError(TooltrieError, ValueError):
    """A registry file (or a tool in it) is malformed; the message names the file, position and tool."""


class TokenizerError(TooltrieError, ValueError):
    """A tokenizer could not be loaded or lacks what the contract needs (e.g. a stop token)."""


class CompileError(TooltrieError, ValueError):
    """The registry cannot be represented as a trie over this tokenizer's canonical token ids."""


class ArtifactError(TooltrieError, ValueError):
    """An artifact file is unreadable, truncated, or internally inconsistent."""


class ArtifactMismatchError(ArtifactError):
    """An artifact is used with a different tokenizer, registry or contract than it was compiled for."""


class DecodeError(TooltrieError, ValueError):
    """A decode request is invalid before it starts (e.g. k outside 1..number of tools)."""


class ModelError(TooltrieError, RuntimeError):
    """A language model is missing, unreadable, or does not fit its tokenizer; the message says how to get it."""
