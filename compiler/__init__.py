"""Compile a tool registry into a trie over a tokenizer's canonical token ids.

Three objects, three lifetimes: :class:`TokenizerInfo` (built once per tokenizer), :class:`Artifact` (an
immutable compiled registry, saved as one file), and the per-request decoding state in ``tooltrie.kernels``.
"""

from __future__ import annotations

from tooltrie.compiler.artifact import CONSTANT_MEMORY_BUDGET, Artifact
from tooltrie.compiler.cache import compile_cached
from tooltrie.compiler.compile import compile_registry
from tooltrie.compiler.contract import Contract
from tooltrie.compiler.tokenizer_info import TokenizerInfo
from tooltrie.compiler.trie import CompiledTrie, Split, phase_of

__all__ = [
    "CONSTANT_MEMORY_BUDGET",
    "Artifact",
    "CompiledTrie",
    "Contract",
    "Split",
    "TokenizerInfo",
    "compile_cached",
    "compile_registry",
    "phase_of",
]
