"""A part of an extra that is not installed is named with its pip command, by the command line and on import."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import pytest

import tooltrie.extras
from tooltrie.cli import main
from tooltrie.extras import missing_extra_message, require_extra


def _without(monkeypatch: pytest.MonkeyPatch, *hidden: str) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name in hidden else real(name, *args)

    monkeypatch.setattr(tooltrie.extras.importlib.util, "find_spec", find_spec)


def test_require_extra_names_the_extra_and_its_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    require_extra("model", "numpy")  # present: nothing happens
    _without(monkeypatch, "torch")
    with pytest.raises(ModuleNotFoundError, match=r"torch not installed: .*pip install 'tooltrie\[model\]'") as caught:
        require_extra("model", "numpy", "torch")
    assert caught.value.name == "torch"


@pytest.mark.parametrize(("module", "extra"), [("torch", "model"), ("fastapi", "serve"), ("peft", "train"),
                                               ("xgrammar", "eval"), ("numba_cuda", "cuda"), ("torch.nn", "model")])
def test_every_extra_has_its_modules(module: str, extra: str) -> None:
    assert f"pip install 'tooltrie[{extra}]'" in (missing_extra_message(module) or "")


def test_serving_without_the_model_extra(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _without(monkeypatch, "torch")
    for name in [name for name in sys.modules if name == "tooltrie.serve" or name.startswith("tooltrie.serve.")]:
        monkeypatch.delitem(sys.modules, name)  # imported afresh, as in a process without torch
    assert main(["serve", "--port", "0"]) == 2
    assert "pip install 'tooltrie[model]'" in capsys.readouterr().err
