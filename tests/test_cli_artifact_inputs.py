"""Commands that take a registry take what ``tooltrie compile`` makes: gen-data's training data follows the
artifact's contract (its separator), from ``--registry ARTIFACT`` alone or from the registry with ``--separator``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tooltrie.cli import main
from tooltrie.compiler import Artifact, TokenizerInfo
from tooltrie.kernels import TrieMatcher

NAMES = ["search, then summarize", "get_weather", "translate, detect language", "send_email"]
QUERIES = [{"query": "What's the weather in Oslo?", "tools": ["get_weather"]},
           {"query": "Look up the news and give me the gist, then mail it",
            "tools": ["search, then summarize", "send_email"]}]


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOOLTRIE_CACHE_DIR", str(tmp_path / "cache"))  # not the user's compile cache


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    folder = tmp_path_factory.mktemp("inputs")
    registry = folder / "commas.jsonl"
    registry.write_text("".join(json.dumps({"name": n, "description": f"does {n}"}) + "\n" for n in NAMES),
                        encoding="utf-8")
    queries = folder / "q.jsonl"
    queries.write_text("".join(json.dumps(q) + "\n" for q in QUERIES), encoding="utf-8")
    artifact = folder / "commas.trie.safetensors"
    assert main(["compile", str(registry), "--separator", r"\n", "-o", str(artifact)]) == 0
    return registry, queries, artifact


@pytest.mark.parametrize("how", ["artifact-as-registry", "registry-with-separator", "registry-and-artifact"])
def test_gen_data_follows_the_artifacts_contract(files: tuple[Path, Path, Path], tmp_path: Path, how: str) -> None:
    registry, queries, artifact = files
    given = {"artifact-as-registry": ["--registry", str(artifact)],
             "registry-with-separator": ["--registry", str(registry), "--separator", r"\n"],
             "registry-and-artifact": ["--registry", str(registry), "--artifact", str(artifact)]}[how]
    out = tmp_path / "data"
    assert main(["gen-data", *given, "--queries", str(queries), "--no-descriptions", "-o", str(out)]) == 0
    records = [json.loads(line) for line in (out / "train.jsonl").read_text(encoding="utf-8").splitlines()]
    records += [json.loads(line) for line in (out / "validation.jsonl").read_text(encoding="utf-8").splitlines()]
    tokenizer = TokenizerInfo.load("smollm2-135m")
    loaded = Artifact.load(artifact)
    assert {tuple(r["tools"]) for r in records} == {tuple(q["tools"]) for q in QUERIES}
    for record in records:
        assert record["completion_ids"] == [*tokenizer.encode("\n".join(record["tools"])), tokenizer.eos_id]
        assert 'separated by "\n"' in record["prompt"]
        matcher = TrieMatcher(loaded, len(record["tools"]))
        assert all(matcher.accept_token(t) for t in record["completion_ids"]) and matcher.is_terminated()


def test_the_default_separator_refuses_these_names(files: tuple[Path, Path, Path], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    registry, queries, _ = files
    assert main(["gen-data", "--registry", str(registry), "--queries", str(queries), "-o", str(tmp_path / "d")]) == 2
    assert "--separator '\\n'" in capsys.readouterr().err


def test_an_artifact_keeps_its_own_separator(files: tuple[Path, Path, Path], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    _, queries, artifact = files
    assert main(["gen-data", "--registry", str(artifact), "--separator", "; ", "--queries", str(queries),
                 "-o", str(tmp_path / "d")]) == 2
    assert "compiled for contract" in capsys.readouterr().err


def test_serve_reads_each_artifact_once_and_refuses_a_bad_one_before_the_model(
        files: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A 100,000-tool artifact takes seconds a read: ``serve`` reads it once (to refuse a bad file before the model
    loads, and then to serve it)."""
    import uvicorn

    import tooltrie.serve.model as model_module
    from tooltrie.testing import tiny_llama

    _, _, artifact = files
    tiny_llama().save_pretrained(tmp_path / "model")
    reads: list[Path] = []
    load = Artifact.load.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(Artifact, "load", classmethod(lambda cls, path, **kw: (reads.append(Path(path)),
                                                                             load(cls, path, **kw))[1]))
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: None)
    assert main(["serve", "--model", str(tmp_path / "model"), "--tokenizer", "smollm2-135m", "--registry",
                 str(artifact)]) == 0
    assert reads.count(artifact) == 1, reads
    broken = tmp_path / "broken.trie.safetensors"
    broken.write_bytes(artifact.read_bytes()[:-10])
    monkeypatch.setattr(model_module, "load_model", lambda *a, **k: pytest.fail("the model loaded first"))
    assert main(["serve", "--model", str(tmp_path / "model"), "--registry", str(broken)]) == 2
    assert "broken.trie.safetensors" in capsys.readouterr().err
