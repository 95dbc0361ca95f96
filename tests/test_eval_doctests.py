"""The doctests of ``tooltrie.eval`` (its folder is not among pytest's doctest paths: one module there imports vLLM)."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["tooltrie.eval.compare", "tooltrie.eval.datasets", "tooltrie.eval.scoring"]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
