"""``tooltrie decode``: one JSON line per slot, each a finished answer of k distinct tools."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.kernels import bundled

from tooltrie.cli import main
from tooltrie.compiler import Artifact
from tooltrie.registry import CATALOG_PATH


@pytest.fixture(scope="module", params=["smollm2-135m", "gpt2"])
def artifact_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / f"catalog-{request.param}.trie.safetensors"
    assert main(["compile", str(CATALOG_PATH), "--tokenizer", request.param, "-o", str(path)]) == 0
    return path


def decode_lines(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict[str, object]]:
    capsys.readouterr()
    assert main(["decode", *argv]) == 0
    out = capsys.readouterr().out
    return [json.loads(line) for line in out.splitlines()]


@pytest.mark.parametrize(("k", "batch", "logits"), [(3, 4, "ties"), (3, 4, "random"), (1, 2, "ties"),
                                                     (5, 3, "ties")])
def test_decode_prints_one_finished_answer_per_slot(artifact_path: Path, capsys: pytest.CaptureFixture[str],
                                                    logits: str, k: int, batch: int) -> None:
    artifact = Artifact.load(artifact_path)
    tokenizer = bundled(artifact.tokenizer_meta["source"])
    names = set(artifact.registry.names)
    lines = decode_lines(capsys, str(artifact_path), "--k", str(k), "--batch", str(batch), "--logits", logits)
    assert len(lines) == batch
    for line in lines:
        assert set(line) == {"tools", "token_ids", "text", "finish_reason"}
        tools, ids = line["tools"], line["token_ids"]
        assert isinstance(tools, list) and isinstance(ids, list)
        assert line["finish_reason"] == "stop"
        assert len(tools) == k == len(set(tools)) and set(tools) <= names
        assert line["text"] == tokenizer.decode(ids)
        assert ids == [*tokenizer.encode(artifact.contract.render(tools)), tokenizer.eos_id]
        assert artifact.contract.parse(str(line["text"]), stop_text=tokenizer.eos_token) == tools


def test_decode_same_seed_same_output(artifact_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = (str(artifact_path), "--k", "3", "--batch", "4", "--logits", "ties", "--seed", "7")
    assert decode_lines(capsys, *argv) == decode_lines(capsys, *argv)


def test_decode_all_tools(artifact_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    n = len(Artifact.load(artifact_path).registry)
    (line,) = decode_lines(capsys, str(artifact_path), "--k", str(n), "--batch", "1", "--logits", "ties")
    assert line["finish_reason"] == "stop"
    assert isinstance(line["tools"], list) and len(set(line["tools"])) == n


@pytest.mark.parametrize("k", ["0", "48"])
def test_decode_refuses_k_outside_bounds(artifact_path: Path, capsys: pytest.CaptureFixture[str], k: str) -> None:
    capsys.readouterr()
    assert main(["decode", str(artifact_path), "--k", k, "--batch", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "k=" in captured.err and "1..47" in captured.err


def test_decode_refuses_another_tokenizer(artifact_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = "gpt2" if "smollm2" in artifact_path.name else "smollm2-135m"
    capsys.readouterr()
    assert main(["decode", str(artifact_path), "--k", "2", "--tokenizer", other]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "tokenizer" in captured.err
