"""The command line: ``tooltrie compile`` then ``tooltrie inspect``; errors exit with code 2 and name the file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tooltrie.cli import main
from tooltrie.compiler import Artifact, Contract, TokenizerInfo
from tooltrie.registry import BFCL_PATH, CATALOG_PATH, OPENAPI_DIR, load_registry

REGISTRY = """\
name: demo
description: a small registry for the CLI test
tools:
- name: get_weather
  description: Current weather.
- name: get_weather_forecast
  description: Forecast.
- name: send_email
  description: Send an email.
  pointer: mcp://mail/send_email
"""


@pytest.fixture()
def registry_file(tmp_path: Path) -> Path:
    path = tmp_path / "demo.yaml"
    path.write_text(REGISTRY, encoding="utf-8")
    return path


def _inspect(path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    return json.loads(out)


@pytest.mark.parametrize("tokenizer_name", ["smollm2-135m", "gpt2"])
def test_compile_then_inspect(registry_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              tokenizers: dict[str, TokenizerInfo], tokenizer_name: str) -> None:
    out = tmp_path / "out" / "demo.trie.safetensors"
    assert main(["compile", str(registry_file), "--tokenizer", tokenizer_name, "-o", str(out)]) == 0
    stderr = capsys.readouterr().err
    assert re.search(rf"{re.escape(str(out))}: 3 tools, \d+ nodes, \d+ edges, \d+ device bytes, placement constant",
                     stderr), stderr
    assert out.is_file()  # and beside it the lexical index, made once, now (the prior's dense part only with --embed)
    assert sorted(p.name for p in out.parent.iterdir()) == ["demo.trie.lexical.safetensors", "demo.trie.safetensors"]

    summary = _inspect(out, capsys)
    registry = load_registry(registry_file)
    tokenizer = tokenizers[tokenizer_name]
    assert summary["placement"] == "constant"
    assert summary["format"] == "tooltrie-artifact"
    assert summary["contract_sha256"] == Contract().sha256
    reg = summary["registry"]
    assert isinstance(reg, dict)
    assert reg["sha256"] == registry.sha256
    assert reg["name"] == "demo"
    assert reg["tools"] == 3
    assert summary["tools"] == [{"name": "get_weather", "pointer": "demo/get_weather"},
                                {"name": "get_weather_forecast", "pointer": "demo/get_weather_forecast"},
                                {"name": "send_email", "pointer": "mcp://mail/send_email"}]
    assert next(iter(summary)) == "placement"  # placement comes first in the printed JSON, the tools last
    assert list(summary)[-2:] == ["chains", "tools"]
    assert summary["chains"] == {"tools needing an identifier": 0, "found": {}, "not found": []}
    assert summary["prior_kept"] == {"lexical": "ready", "embeddings": "missing"}
    tok = summary["tokenizer"]
    assert isinstance(tok, dict)
    assert tok["fingerprint"] == tokenizer.fingerprint
    assert tok["source"] == tokenizer_name
    assert tok["eos_id"] == tokenizer.eos_id
    trie = summary["trie"]
    assert isinstance(trie, dict)
    assert trie["tools"] == 3 and trie["fits_constant_memory"] is True
    # The file is a usable artifact for exactly these inputs.
    artifact = Artifact.load(out, tokenizer=tokenizer, registry=registry, contract=Contract())
    assert artifact.sha256 == summary["artifact_sha256"]
    assert artifact.token_path(["send_email", "get_weather"]) == tokenizer.encode("send_email, get_weather")


def test_compile_with_a_separator(registry_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  gpt2: TokenizerInfo) -> None:
    out = tmp_path / "pipe.safetensors"
    assert main(["compile", str(registry_file), "--tokenizer", "gpt2", "--separator", " | ", "-o", str(out)]) == 0
    capsys.readouterr()
    summary = _inspect(out, capsys)
    assert summary["contract"] == {"version": 1, "separator": " | ", "stop": "eos"}
    artifact = Artifact.load(out, contract=Contract(separator=" | "))
    assert artifact.token_path(["get_weather", "send_email"]) == gpt2.encode("get_weather | send_email")


def test_inspect_reports_global_placement_for_bfcl(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bfcl.safetensors"
    assert main(["compile", str(BFCL_PATH), "-o", str(out)]) == 0
    assert "placement global" in capsys.readouterr().err
    summary = _inspect(out, capsys)
    assert summary["placement"] == "global"
    trie = summary["trie"]
    assert isinstance(trie, dict)
    assert trie["fits_constant_memory"] is False and trie["tools"] == 1853


def test_inspect_shows_the_chains_of_an_openapi_registry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """TMDB's OpenAPI document: 33 operations take a path id; its five searches find five of the eight entities."""
    out = tmp_path / "tmdb.safetensors"
    assert main(["compile", str(OPENAPI_DIR / "tmdb.json"), "-o", str(out)]) == 0
    capsys.readouterr()
    assert _inspect(out, capsys)["chains"] == {
        "tools needing an identifier": 33,
        "found": {entity: [f"GET_search-{entity}"] for entity in ("collection", "company", "movie", "person", "tv")},
        "not found": ["credit", "network", "review"]}


def test_default_tokenizer_is_smollm2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      smollm: TokenizerInfo) -> None:
    out = tmp_path / "catalog.safetensors"
    assert main(["compile", str(CATALOG_PATH), "-o", str(out)]) == 0
    capsys.readouterr()
    summary = _inspect(out, capsys)
    tok = summary["tokenizer"]
    assert isinstance(tok, dict)
    assert tok["fingerprint"] == smollm.fingerprint
    assert summary["placement"] == "constant"


BAD_REGISTRIES = [
    pytest.param("bad.yaml", "tools:\n- name: a\n- name: a\n", r"bad\.yaml:3 \(tools\[1\]\) 'a': duplicate tool name",
                 id="duplicate"),
    pytest.param("bad.yaml", "tools: [\n", r"bad\.yaml: invalid YAML", id="invalid-yaml"),
    pytest.param("bad.jsonl", '{"name": "a"}\n{"name": \n', r"bad\.jsonl:2: invalid JSON", id="invalid-jsonl"),
    pytest.param("bad.yaml", "tools:\n- name: 'a, b'\n", r"bad\.yaml:2 \(tools\[0\]\) 'a, b': tool name contains "
                 r"the contract's separator", id="separator-in-name"),
    pytest.param("bad.txt", "tools:\n- name: a\n", r"bad\.txt: unknown registry format", id="wrong-extension"),
]


@pytest.mark.parametrize(("filename", "text", "pattern"), BAD_REGISTRIES)
def test_compile_bad_registry_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], filename: str, text: str,
                                      pattern: str) -> None:
    path = tmp_path / filename
    path.write_text(text, encoding="utf-8")
    out = tmp_path / "out.safetensors"
    assert main(["compile", str(path), "-o", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("tooltrie compile: error: ")
    assert str(path) in captured.err
    assert re.search(pattern, captured.err), captured.err
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [path]


def test_compile_missing_registry_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.yaml"
    assert main(["compile", str(missing), "-o", str(tmp_path / "o.safetensors")]) == 2
    assert f"error: {missing}: registry file not found" in capsys.readouterr().err


def test_compile_unknown_tokenizer_exits_2(registry_file: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile", str(registry_file), "--tokenizer", "no-such-tok", "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tooltrie compile: error: no-such-tok: no such tokenizer file or directory")
    assert "gpt2" in err and "smollm2-135m" in err


def test_inspect_bad_artifact_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"junk" * 64)
    assert main(["inspect", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"tooltrie inspect: error: {path}: not a readable tooltrie artifact")


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["compile"])
    assert info.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_compile_keeps_the_prior_beside_the_artifact_where_ask_reads_it(registry_file: Path, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``compile --embed`` keeps the lexical index and the tools' embeddings beside the artifact; the ranker of that
    artifact (what ``ask`` and ``serve`` use) reads both and makes neither; ``inspect`` says so, and says "stale" once
    the files belong to another registry version."""
    from support.encoders import MadeUpEncoder

    import tooltrie.retrieval as retrieval
    from tooltrie.lexical import LexicalIndex
    from tooltrie.ranker import UNTRAINED, ranker_for

    monkeypatch.setattr(retrieval, "SentenceEncoder", MadeUpEncoder)  # the encoder compile makes: no download
    out = tmp_path / "demo.trie.safetensors"
    assert main(["compile", str(registry_file), "--embed", "-o", str(out)]) == 0
    stderr = capsys.readouterr().err
    assert "the lexical index" in stderr and "3 tools embedded" in stderr, stderr
    assert _inspect(out, capsys)["prior_kept"] == {"lexical": "ready", "embeddings": "ready"}

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("made again, not read")

    artifact = Artifact.load(out)
    ranker = ranker_for(artifact, out, UNTRAINED)
    monkeypatch.setattr(LexicalIndex, "build", never)
    monkeypatch.setattr(MadeUpEncoder, "encode", never)
    assert ranker.lexical.n_tools == 3 and ranker.tool_embeddings.shape[0] == 3
    # another registry compiled to the same path: the files beside are another version's until made again
    other = tmp_path / "other.yaml"
    other.write_text(REGISTRY.replace("Send an email.", "Send an email now."), encoding="utf-8")
    monkeypatch.undo()
    assert main(["compile", str(other), "-o", str(out)]) == 0
    capsys.readouterr()
    assert _inspect(out, capsys)["prior_kept"] == {"lexical": "ready", "embeddings": "stale"}
