"""The evaluation harness end to end on CPU with the tiny model: every arm answers, the constrained arms are valid,
the engine and ``generate`` + ``TrieLogitsProcessor`` agree, the XGrammar arm's grammar lets repeats through, and
the results come out as JSON, Markdown and PNG side by side (also through ``tooltrie eval``)."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from support.serve import tiny_model

from tooltrie.cli import main
from tooltrie.compiler import Artifact, TokenizerInfo
from tooltrie.compiler.ebnf import exactly_k_ebnf
from tooltrie.compiler.tokenizer_info import BUNDLED_TOKENIZERS_DIR
from tooltrie.eval.backends import EvalSetup, XGrammarArm
from tooltrie.eval.cli import add_commands as add_eval_commands
from tooltrie.eval.datasets import load_split
from tooltrie.eval.harness import evaluate
from tooltrie.eval.report import write_results
from tooltrie.eval.results import read_results
from tooltrie.kernels import TrieMatcher
from tooltrie.serve.prompt import Prompt

ARMS = ["engine", "hf", "unconstrained", "xgrammar"]


@pytest.fixture(scope="module")
def setup(catalog_artifact: Artifact, smollm: TokenizerInfo) -> EvalSetup:
    return EvalSetup(model=tiny_model(), tokenizer=smollm, artifact=catalog_artifact, prompt=Prompt.style("short"),
                     batch_size=2, max_new_tokens=8)


@pytest.fixture(scope="module")
def results(setup: EvalSetup) -> dict[str, Any]:
    queries = load_split("metatool-single", "test")[:3] + load_split("metatool-multi", "test")[:2]
    return evaluate(queries, ARMS, setup, progress=False, meta={"dataset": "metatool-mixed", "split": "test"})


def test_every_arm_answers_every_query(results: dict[str, Any]) -> None:
    assert list(results["arms"]) == ARMS
    assert len(results["answers"]) == 5
    for answer in results["answers"]:
        assert set(ARMS) <= set(answer)
    assert results["settings"]["ks"] == [1, 2]
    assert set(results["arms"]["engine"]["by_k"]) == {"1", "2"}


@pytest.mark.parametrize("arm", ["engine", "hf"])
def test_constrained_arms_are_always_valid(results: dict[str, Any], arm: str) -> None:
    summary = results["arms"][arm]["summary"]
    assert summary["valid"] == summary["trie_accepted"] == 1.0
    assert summary["hallucinated"] == summary["repeated"] == summary["wrong_count"] == 0.0


def test_engine_and_generate_with_our_processor_give_the_same_answers(results: dict[str, Any]) -> None:
    assert [a["engine"]["text"] for a in results["answers"]] == [a["hf"]["text"] for a in results["answers"]]
    assert results["arms"]["hf"]["summary"]["same_as_engine"] == 1.0
    assert "same_as_engine" not in results["arms"]["engine"]["summary"]
    same = [a["engine"]["text"] == a["unconstrained"]["text"] for a in results["answers"]]
    assert results["arms"]["unconstrained"]["summary"]["same_as_engine"] == sum(same) / len(same)


def test_unconstrained_arm_is_scored_by_parse(results: dict[str, Any]) -> None:
    summary = results["arms"]["unconstrained"]["summary"]
    for answer in results["answers"]:  # whatever it said, it was parsed as the contract says
        assert answer["unconstrained"]["predicted"] == (answer["unconstrained"]["text"].split(", ")
                                                        if answer["unconstrained"]["text"] else [])
    assert summary["valid"] < 1.0  # a random model's free text is no answer


def test_xgrammar_arm_gets_the_exactly_k_ebnf_and_lets_repeats_through(setup: EvalSetup) -> None:
    import xgrammar

    arm = XGrammarArm(setup)
    artifact = setup.artifact
    assert arm.grammar(2) == exactly_k_ebnf(artifact.registry.names, 2, artifact.contract)
    repeated = [*setup.tokenizer.encode("NewsTool, NewsTool"), artifact.eos_id]
    matcher = xgrammar.GrammarMatcher(arm._compiler.compile_grammar(arm.grammar(2)))
    assert all(matcher.accept_token(t) for t in repeated) and matcher.is_terminated()
    ours = TrieMatcher(artifact, 2)
    accepted = [ours.accept_token(t) for t in repeated]
    assert not all(accepted) and not ours.is_terminated()  # the trie refuses the second NewsTool


def test_report_files_are_written_side_by_side(results: dict[str, Any], tmp_path: Path) -> None:
    paths = write_results(results, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["accuracy.png", "answers.jsonl", "latency.png", "report.md",
                                                            "results.json"]
    assert json.loads(paths["results"].read_text(encoding="utf-8"))["arms"].keys() == results["arms"].keys()
    for png in ("accuracy", "latency"):
        assert paths[png].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = paths["report"].read_text(encoding="utf-8")
    assert "| arm | answers | exact-set |" in report and "By k:" in report
    assert "Answers identical to the engine arm's (same text): hf 100.0%" in report
    for arm in ARMS:
        assert f"| {arm} | 5 |" in report
    assert "![accuracy.png](accuracy.png)" in report


def model_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The tiny model saved as a model directory with the bundled tokenizer, the cache in ``tmp_path``."""
    monkeypatch.setenv("TOOLTRIE_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = tmp_path / "model"
    tiny_model().save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(BUNDLED_TOKENIZERS_DIR / "smollm2-135m" / name, model_dir / name)
    return model_dir


def test_cli_eval_with_a_model_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_network: None,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = model_directory(tmp_path, monkeypatch)
    queries = tmp_path / "q.jsonl"
    queries.write_text('{"query": "weather in Oslo", "tools": ["WeatherTool"]}\n'
                       '{"query": "stocks and news", "tools": ["FinanceTool", "NewsTool"]}\n', encoding="utf-8")
    code = main(["eval", "--model", str(model_dir), "--dataset", str(queries), "--arms", "engine,unconstrained",
                 "--prompt-style", "short", "--max-new-tokens", "4", "--no-plots", "-o", str(tmp_path / "out")])
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["arm"] for line in lines] == ["engine", "unconstrained"] and lines[0]["valid"] == 1.0
    results = read_results(tmp_path / "out" / "results.json")
    assert results["settings"]["prompt_style"] == "short" and results["settings"]["split"] == "all"
    assert (tmp_path / "out" / "report.md").is_file() and not (tmp_path / "out" / "accuracy.png").exists()


def test_eval_ranks_as_ask_and_serve_do_by_default() -> None:
    """``tooltrie eval``'s engine arm ranks by ``--ranker auto`` unless told, as ``ask`` and ``serve`` answer."""
    parser = argparse.ArgumentParser()
    add_eval_commands(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["eval", "-o", "out"]).ranker == "auto"
    assert parser.parse_args(["eval", "-o", "out", "--ranker", "model"]).ranker == "model"


def test_cli_eval_measures_the_default_ranker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_network: None,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Without ``--ranker``, the engine arm is measured as ``ask`` and ``serve`` answer by default (``auto``), and
    the record says what it resolved to: a model without an adapter ranks by the prior alone, so its engine arm
    answers exactly as the lexical prior's own arm."""
    model_dir = model_directory(tmp_path, monkeypatch)
    queries = tmp_path / "q.jsonl"
    queries.write_text('{"query": "weather in Oslo", "tools": ["WeatherTool"]}\n'
                       '{"query": "stock prices and the news", "tools": ["FinanceTool", "NewsTool"]}\n'
                       '{"query": "find me a job", "tools": ["JobTool"]}\n', encoding="utf-8")
    code = main(["eval", "--model", str(model_dir), "--dataset", str(queries), "--arms", "engine,lexical",
                 "--prior", "lexical", "--prompt-style", "short", "--no-plots", "-o", str(tmp_path / "out")])
    assert code == 0
    capsys.readouterr()
    results = read_results(tmp_path / "out" / "results.json")
    assert results["settings"]["ranker"] == "retrieval" and results["settings"]["ranker_asked"] == "auto"
    answers = [json.loads(line) for line in (tmp_path / "out" / "answers.jsonl").read_text().splitlines()]
    assert len(answers) == 3
    assert [a["engine"]["predicted"] for a in answers] == [a["lexical"]["predicted"] for a in answers]


def test_cli_eval_scores_plain_and_need_describing_requests_in_one_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_network: None, capsys: pytest.CaptureFixture[str]) -> None:
    """Sets over one registry joined by commas are one run, its summary per kind; sets over two registries are
    refused before any model is loaded."""
    from tooltrie.eval.datasets import load_split

    model_dir = model_directory(tmp_path, monkeypatch)
    code = main(["eval", "--model", str(model_dir), "--dataset", "catalog-needs:validation,metatool-multi",
                 "--arms", "lexical", "--prior", "lexical", "--no-plots", "-o", str(tmp_path / "out")])
    assert code == 0
    capsys.readouterr()
    results = read_results(tmp_path / "out" / "results.json")
    needs, plain = load_split("catalog-needs", "validation"), load_split("metatool-multi", "test")
    assert results["settings"]["dataset"] == "catalog-needs,metatool-multi"
    assert results["settings"]["split"] == "validation,test"
    by_kind = results["arms"]["lexical"]["by_kind"]
    assert (by_kind["need"]["answers"], by_kind["plain"]["answers"]) == (len(needs), len(plain))
    code = main(["eval", "--model", str(tmp_path / "no-model"), "--dataset", "catalog-needs:test,bfcl-needs:test",
                 "--arms", "lexical", "-o", str(tmp_path / "mixed")])
    assert code != 0 and "labelled over different registries" in capsys.readouterr().err


def test_the_vllm_arms_load_the_model_the_other_arms_run(catalog_artifact: Artifact, smollm: TokenizerInfo,
                                                          tmp_path: Path) -> None:
    """vLLM loads a directory: the one written holds the model in memory (an adapter merged into it, its dtype),
    not the base model's directory, and is written once per model."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from tooltrie.eval.vllm_backend import served_model_dir

    model = copy.deepcopy(tiny_model()).to(torch.bfloat16)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)  # as a merged adapter would: weights no base directory holds
    setup = EvalSetup(model=model, tokenizer=smollm, artifact=catalog_artifact, prompt=Prompt.style("short"))
    directory = served_model_dir(setup)
    assert served_model_dir(setup) == directory and (directory / "tokenizer.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(directory, dtype="auto")
    assert loaded.dtype == torch.bfloat16
    saved, held = loaded.state_dict(), model.state_dict()
    assert saved.keys() == held.keys() and all(torch.equal(saved[name], held[name]) for name in held)
