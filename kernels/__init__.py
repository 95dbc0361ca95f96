"""Decoding under a compiled trie: the rules, the batched state, and the backends that apply them.

Backends (one file each, ``BACKENDS``): ``reference`` (row by row through ``rules.py``: the oracle), ``cpu`` (the
walk compiled with Numba) and ``cuda`` (the same walk as CUDA kernels; needs the ``cuda`` extra). ``TrieBatch``
(``batch.py``) is the production path every consumer drives; ``step`` is one choice over a whole ``BatchState``
(``backend="auto"``: the CPU's compiled walk).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from tooltrie.compiler.artifact import Artifact
from tooltrie.kernels.batch import BACKENDS, TrieBatch
from tooltrie.kernels.bitmask import (
    allocate_token_bitmask,
    apply_token_bitmask_inplace,
    get_bitmask_shape,
)
from tooltrie.kernels.matcher import TrieMatcher
from tooltrie.kernels.rules import Status
from tooltrie.kernels.state import BatchState, check_k
from tooltrie.kernels.vocab import VocabMap

StepFn = Callable[..., npt.NDArray[np.int32]]


def _reference() -> StepFn:
    from tooltrie.kernels.reference import step as reference_step

    return reference_step


def _cpu() -> StepFn:
    from tooltrie.kernels.cpu import step as cpu_step

    return cpu_step


_STEPS: dict[str, Callable[[], StepFn]] = {"reference": _reference, "cpu": _cpu}


def step(artifact: Artifact, state: BatchState, logits: Any, *, backend: str = "auto", **options: Any
         ) -> npt.NDArray[np.int32]:
    """One decode step for the whole batch; see ``kernels/reference.py`` for the semantics."""
    return _backend("cpu" if backend == "auto" else backend)(artifact, state, logits, **options)


@functools.cache
def _backend(name: str) -> StepFn:
    if name not in _STEPS:
        raise ValueError(f"unknown backend {name!r}; choose from {['auto', *_STEPS]}")
    return _STEPS[name]()


__all__ = [
    "BACKENDS",
    "BatchState",
    "Status",
    "TrieBatch",
    "TrieMatcher",
    "VocabMap",
    "allocate_token_bitmask",
    "apply_token_bitmask_inplace",
    "check_k",
    "get_bitmask_shape",
    "step",
]
