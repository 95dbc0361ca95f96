"""``tooltrie gen-data``: records whose targets are the engine's own tokens (trie paths + stop), checked three ways;
clear errors for labels the trie cannot express; determinism; no held-out query trained on; and the Makefile rules
that regenerate the artifact, the training data and the evaluation grammar when the registry changes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support.serve import tiny_model, whole_prompt_ids

from tooltrie.cli import main
from tooltrie.compiler import Artifact, TokenizerInfo, compile_registry
from tooltrie.eval.datasets import DatasetError, LabelledQuery, load_split
from tooltrie.kernels import TrieMatcher
from tooltrie.registry import make_registry
from tooltrie.serve.engine import Engine, Request
from tooltrie.serve.prompt import Prompt
from tooltrie.train.compose import SINGLE, task
from tooltrie.train.data import load_training_data
from tooltrie.train.training_data import RECORD_KEYS, RecordMaker, generate_training_data

REPO = Path(__file__).resolve().parents[1]
USER_QUERIES = [
    {"query": "What's the weather like in Oslo this weekend?", "tools": ["WeatherTool"]},
    {"query": "Latest headlines about the stock market", "tools": ["NewsTool", "FinanceTool"]},
    {"query": "Convert 100 dollars to yen and show me a chart of the rate", "tools": ["ExchangeTool", "ChartTool"]},
    {"query": "Find a recipe, a restaurant and a movie for tonight",
     "tools": ["DietTool", "RestaurantBookingTool", "MediaTool"]},
]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def generated(catalog_artifact: Artifact, smollm: TokenizerInfo, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[Path, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("gen")
    queries = write_jsonl(folder / "mine.jsonl", USER_QUERIES * 3 + [
        {"query": f"which tool for task number {i}?", "tools": ["NotesTool"]} for i in range(8)])
    meta = generate_training_data(folder / "out", artifact=catalog_artifact, tokenizer=smollm,
                                  queries=["metatool-multi", "catalog-situations", str(queries)], seed=3,
                                  validation_fraction=0.25,
                                  compose=40)
    return folder / "out", meta


def test_composed_requests_chain_distinct_tools_along_trie_paths(generated: tuple[Path, dict[str, Any]],
                                                                 catalog_artifact: Artifact) -> None:
    """The composed records went through the checks of every record (the test above); here: they are there, one
    templated request per tool and 40 chains of 2 or 3 distinct tools, each named in the request's order."""
    out, meta = generated
    assert meta["compose"] == 40 and meta["counts"]["by_source"]["train"]["composed"] == 47 + 40
    registry = catalog_artifact.registry
    tasks = {tool.name: task(tool) for tool in registry.tools}
    chains = [r for r in read_jsonl(out / "train.jsonl") if r["k"] > 1 and r["query"].lower().find(
        tasks[r["tools"][0]].lower()) >= 0 and all(tasks[t].lower() in r["query"].lower() for t in r["tools"])]
    assert len(chains) >= 40
    for record in chains:
        assert len(set(record["tools"])) == record["k"] in (2, 3)
        places = [record["query"].lower().index(tasks[t].lower()) for t in record["tools"]]
        assert places == sorted(places), record


def test_tools_with_parameters_get_requests_giving_arguments(smollm: TokenizerInfo, tmp_path: Path) -> None:
    """One request per tool with parameters, labelled with that tool alone, giving the required arguments first: an
    enum's value, a number for a numeric type, else the parameter's words or description; verified like every
    record (trie path, decode, template)."""
    registry = make_registry([
        {"name": "convert_temperature", "description": "Convert a temperature between scales.", "parameters": {
            "properties": {"value": {"type": "number"}, "scale": {"type": "string", "enum": ["C", "F"]}},
            "required": ["value", "scale"]}},
        {"name": "read_file", "description": "Read a file from disk.", "parameters": [
            {"name": "filePath", "description": "The path of the file.", "required": True},
            {"name": "encoding", "type": "string"}]},
        {"name": "ping", "description": "Check that the service is up."},
    ], name="params")
    artifact = compile_registry(registry, smollm)
    generate_training_data(tmp_path / "out", artifact=artifact, tokenizer=smollm, queries=[], compose=2, seed=5)
    records = read_jsonl(tmp_path / "out" / "train.jsonl")
    assert len(records) == 3 + 3 + 2 + 2  # descriptions, a templated request per tool, 2 with arguments, 2 chains
    by_tool = {tool.name: tool for tool in registry.tools}
    arguments = [r for r in records if r["k"] == 1 and r["query"] not in {
        by_tool[r["tools"][0]].description, *(template.format(a=task(by_tool[r["tools"][0]])).capitalize()
                                              for template in SINGLE)}]
    assert sorted(r["tools"][0] for r in arguments) == ["convert_temperature", "read_file"]
    for record in arguments:
        query = record["query"]
        if record["tools"] == ["convert_temperature"]:
            assert re.search(r"value \d+ and scale [CF]\b", query), query
        else:
            assert "the file path" in query or "the path of the file" in query, query
            assert query.index("file") < query.index("encoding"), query  # the required one first


def test_records_have_the_format_and_verified_targets(generated: tuple[Path, dict[str, Any]],
                                                      catalog_artifact: Artifact, smollm: TokenizerInfo) -> None:
    out, meta = generated
    situations = {q.query for q in load_split("catalog-situations", "all")}
    prompt = Prompt.style("short")
    registry, contract = catalog_artifact.registry, catalog_artifact.contract
    for split in ("train", "validation"):
        records = read_jsonl(out / f"{split}.jsonl")
        assert len(records) == meta["counts"][split] > 0
        for record in records:
            assert tuple(record) == RECORD_KEYS
            assert record["kind"] == ("need" if record["query"] in situations else "")
            tools, k = record["tools"], record["k"]
            assert k == len(tools)
            assert (record["prompt"], record["completion"]) == prompt.training_text(registry, contract,
                                                                                   record["query"], tools)
            assert record["prompt_ids"] == smollm.encode(record["prompt"])  # no special-token strings in these
            ids = record["completion_ids"]
            # the canonical encoding of the rendered answer, then the stop token
            assert ids == [*smollm.encode(contract.render(tools)), smollm.eos_id]
            assert record["completion"].startswith(smollm.decode(ids))
            matcher = TrieMatcher(catalog_artifact, k)
            assert all(matcher.accept_token(t) for t in ids) and matcher.is_terminated()
            assert matcher.tool_names() == tools
    needs = {r["query"] for r in read_jsonl(out / "train.jsonl") if r["kind"] == "need"}
    assert needs and {e.query for e in load_training_data(out, catalog_artifact).train if e.kind == "need"} == needs


def test_completion_ids_are_what_the_engine_emits(catalog_artifact: Artifact, smollm: TokenizerInfo) -> None:
    engine = Engine(tiny_model(), smollm, catalog_artifact, prompt=Prompt.style("short"))
    maker = RecordMaker(catalog_artifact, smollm, Prompt.style("short"))
    for query, k in (("weather in Oslo", 1), ("stocks and news", 2), ("a movie, a recipe and a restaurant", 3)):
        answer = engine.run([Request(query, k)])[0]
        names = [tool.name for tool in answer.tools]
        record = maker.record(LabelledQuery(query, tuple(names), where="engine"))
        assert record["completion_ids"] == answer.token_ids
        assert record["prompt_ids"] == whole_prompt_ids(engine, query, k)


def test_meta_names_its_inputs(generated: tuple[Path, dict[str, Any]], catalog_artifact: Artifact,
                               smollm: TokenizerInfo) -> None:
    _, meta = generated
    assert meta["registry"]["sha256"] == catalog_artifact.registry.sha256
    assert meta["artifact_sha256"] == catalog_artifact.sha256
    assert meta["contract_sha256"] == catalog_artifact.contract.sha256 == catalog_artifact.summary()["contract_sha256"]
    assert meta["tokenizer"]["fingerprint"] == smollm.fingerprint
    assert meta["prompt"]["style"] == "short" and meta["prompt"]["system"] == Prompt.style("short").system
    assert meta["seed"] == 3
    counts = meta["counts"]
    assert counts["by_source"]["train"]["registry"] == len(catalog_artifact.registry)  # one description per tool
    assert counts["by_source"]["train"]["metatool-multi"] == len(load_split("metatool-multi", "train"))
    assert counts["by_source"]["train"]["catalog-situations"] == len(load_split("catalog-situations", "train"))
    assert counts["by_k"]["train"] == {"1": 47 + 11, "2": 360 + 12, "3": 3} or sum(
        counts["by_k"]["train"].values()) == counts["train"]


def test_same_seed_same_bytes_other_seed_other_order(catalog_artifact: Artifact, smollm: TokenizerInfo,
                                                      tmp_path: Path) -> None:
    queries = str(write_jsonl(tmp_path / "q.jsonl", USER_QUERIES * 4))
    outputs = []
    for seed, name in ((1, "a"), (1, "b"), (2, "c")):
        generate_training_data(tmp_path / name, artifact=catalog_artifact, tokenizer=smollm, queries=[queries],
                               seed=seed, validation_fraction=0.0)
        outputs.append((tmp_path / name / "train.jsonl").read_bytes())
    assert outputs[0] == outputs[1]
    assert outputs[0] != outputs[2] and sorted(outputs[0].splitlines()) == sorted(outputs[2].splitlines())


def test_held_out_queries_are_never_trained_on(catalog_artifact: Artifact, smollm: TokenizerInfo,
                                               tmp_path: Path) -> None:
    tested = load_split("metatool-single", "test")[:3]
    rows = [{"query": "  " + q.query.upper() + " ", "tools": list(q.tools)} for q in tested] + USER_QUERIES
    excluded = write_jsonl(tmp_path / "mine_test.jsonl", [USER_QUERIES[0]])
    meta = generate_training_data(tmp_path / "out", artifact=catalog_artifact, tokenizer=smollm,
                                  queries=[str(write_jsonl(tmp_path / "q.jsonl", rows))], exclude=[excluded],
                                  validation_fraction=0.0, descriptions=False)
    assert meta["counts"]["dropped_held_out"] == 4
    assert sorted(r["query"] for r in read_jsonl(tmp_path / "out" / "train.jsonl")) == sorted(
        row["query"] for row in USER_QUERIES[1:])


def test_a_text_is_never_in_both_splits(catalog_artifact: Artifact, smollm: TokenizerInfo, tmp_path: Path) -> None:
    """A user's file that repeats queries keeps each text, with all its copies, on one side; a validation text that
    is also a tool's description leaves the registry's examples in train."""
    rows = [{"query": f"question number {i % 10}", "tools": ["WeatherTool"]} for i in range(40)]
    repeated = str(write_jsonl(tmp_path / "repeated.jsonl", rows))
    for seed in range(3):
        meta = generate_training_data(tmp_path / f"out{seed}", artifact=catalog_artifact, tokenizer=smollm,
                                      queries=[repeated], seed=seed, validation_fraction=0.3)
        train, validation = ({r["query"] for r in read_jsonl(tmp_path / f"out{seed}" / f"{split}.jsonl")}
                             for split in ("train", "validation"))
        assert len(validation) == 3 and meta["counts"]["validation"] == 12 and not train & validation
    tool = catalog_artifact.registry.tools[0]
    described = str(write_jsonl(tmp_path / "described.jsonl", [{"query": tool.description, "tools": [tool.name]}] * 3))
    meta = generate_training_data(tmp_path / "described", artifact=catalog_artifact, tokenizer=smollm,
                                  queries=[described], validation_fraction=0.9)
    assert (meta["counts"]["validation"], meta["counts"]["dropped_in_validation"]) == (3, 1)
    assert tool.description not in {r["query"] for r in read_jsonl(tmp_path / "described" / "train.jsonl")}
    with pytest.raises(DatasetError, match="validation fraction must be at least 0 and below 1, got 1"):
        generate_training_data(tmp_path / "bad", artifact=catalog_artifact, tokenizer=smollm, queries=[repeated],
                               validation_fraction=1.0)
    assert main(["gen-data", "--no-queries", "--queries", repeated, "-o", str(tmp_path / "both")]) == 2


BAD_LABELS = [  # (tools, what the error says)
    (["WeatherTol"], "'WeatherTol' is not in registry 'catalog' \\(did you mean 'WeatherTool'\\?\\)"),
    (["NewsTool", "NewsTool"], "NewsTool named more than once"),
]


@pytest.mark.parametrize(("tools", "message"), BAD_LABELS)
def test_a_label_the_trie_cannot_express_names_file_and_line(catalog_artifact: Artifact, smollm: TokenizerInfo,
                                                             tmp_path: Path, tools: list[str], message: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [USER_QUERIES[0], {"query": "q", "tools": tools}])
    with pytest.raises(DatasetError, match=rf"bad\.jsonl:2: .*{message}"):
        generate_training_data(tmp_path / "out", artifact=catalog_artifact, tokenizer=smollm, queries=[str(path)])
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_wrong_k_in_a_user_file_is_refused(tmp_path: Path, catalog_artifact: Artifact, smollm: TokenizerInfo) -> None:
    path = write_jsonl(tmp_path / "k.jsonl", [{"query": "q", "tools": ["NewsTool"], "k": 2}])
    with pytest.raises(DatasetError, match=r"k\.jsonl:1: 'k' is 2 but 1 tools"):
        generate_training_data(tmp_path / "out", artifact=catalog_artifact, tokenizer=smollm, queries=[str(path)])


def test_output_directory_is_replaced_whole(catalog_artifact: Artifact, smollm: TokenizerInfo,
                                            tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.jsonl").write_text("old\n", encoding="utf-8")
    generate_training_data(out, artifact=catalog_artifact, tokenizer=smollm,
                           queries=[str(write_jsonl(tmp_path / "q.jsonl", USER_QUERIES))])
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.jsonl", "validation.jsonl"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_cli_gen_data_and_grammar(saved_catalog_artifact: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    queries = write_jsonl(tmp_path / "q.jsonl", USER_QUERIES)
    assert main(["gen-data", "--artifact", str(saved_catalog_artifact), "--queries", str(queries),
                 "--prompt-style", "catalog", "--no-descriptions", "-o", str(tmp_path / "data")]) == 0
    meta = json.loads((tmp_path / "data" / "meta.json").read_text(encoding="utf-8"))
    assert meta["prompt"]["style"] == "catalog" and meta["counts"]["by_source"]["train"] == {str(queries): 4}
    assert "Tools:\nFinanceTool: " in read_jsonl(tmp_path / "data" / "train.jsonl")[0]["prompt"]
    assert main(["grammar", str(saved_catalog_artifact), "--k", "2", "-o", str(tmp_path / "k2.ebnf")]) == 0
    grammar = (tmp_path / "k2.ebnf").read_text(encoding="utf-8")
    assert grammar.startswith('root ::= tool ", " tool\ntool ::= "FinanceTool" | ')
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"query": "q", "tools": ["Nope"]}])
    assert main(["gen-data", "--artifact", str(saved_catalog_artifact), "--queries", str(bad),
                 "-o", str(tmp_path / "x")]) == 2
    assert "bad.jsonl:1: tool 'Nope' is not in registry" in capsys.readouterr().err


# --- the Makefile: a registry change regenerates the artifact, the training data and the evaluation grammar ------


def _make(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    variables = ["VENV=venv", "REGISTRY=reg.yaml", "TOKENIZER=tok.json"]
    return subprocess.run(["make", "-f", str(REPO / "Makefile"), "-C", str(folder), *variables, *args],
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_regenerates_artifact_training_data_and_grammar_when_the_registry_changes(tmp_path: Path) -> None:
    files = ["pyproject.toml", "venv/.installed", "reg.yaml", "tok.json", "build/reg.trie.safetensors",
             "build/reg.training/meta.json", "build/reg.k1.ebnf", "build/reg.k2.ebnf"]
    for age, name in enumerate(files):  # each file newer than the ones before it: all up to date
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x", encoding="utf-8")
        os.utime(path, (1_000_000 + age, 1_000_000 + age))
    targets = ["compile-registry", "training-data", "eval-grammar"]
    assert _make(tmp_path, "-q", *targets).returncode == 0, "everything should be up to date"

    os.utime(tmp_path / "reg.yaml")  # the registry changes
    assert _make(tmp_path, "-q", *targets).returncode == 1
    plan = _make(tmp_path, "-n", *targets).stdout
    assert "tooltrie compile reg.yaml --tokenizer tok.json --embed -o build/reg.trie.safetensors" in plan
    assert "tooltrie gen-data --registry reg.yaml --artifact build/reg.trie.safetensors" in plan
    assert "-o build/reg.training" in plan
    for k in (1, 2):
        assert f"tooltrie grammar build/reg.trie.safetensors --k {k} -o build/reg.k{k}.ebnf" in plan
    assert "pip install" not in plan  # the environment itself is untouched

    # each product also depends on the registry directly, not only through the artifact
    os.utime(tmp_path / "build/reg.trie.safetensors")
    os.utime(tmp_path / "reg.yaml")
    plan = _make(tmp_path, "-n", "training-data", "eval-grammar", "-o", "build/reg.trie.safetensors").stdout
    assert "tooltrie gen-data" in plan and "tooltrie grammar" in plan
