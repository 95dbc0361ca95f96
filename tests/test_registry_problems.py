"""One run names every problem of a registry: grouped by cause, each with its place and its tool, capped per cause
with a count of the rest; ``--format json`` lists them all; a separator none of the names contain is proposed, and
it compiles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tooltrie.cli import main
from tooltrie.compiler import Contract, TokenizerInfo, compile_registry
from tooltrie.options import separator_text
from tooltrie.registry import load_registry
from tooltrie.registry.problems import CAUSES, Problem, RegistryProblems

# (file suffix, file text, expected problems as (cause, place, tool)); "{f}" stands for the file's path.
BAD_REGISTRIES = [
    pytest.param(
        ".json",
        json.dumps({"tools": [{"name": " search"}, {"name": "get_weather"}, {"name": "read, write"},
                              {"name": "get_weather"}, {"name": "list\nall"}, {"name": "<|im_end|>"},
                              {"name": "fetch "}, {"name": 7}, {"name": "copy, paste"}]}),
        [("whitespace", "{f} (tools[0])", " search"), ("duplicate_name", "{f} (tools[3])", "get_weather"),
         ("line_break", "{f} (tools[4])", "list\nall"), ("whitespace", "{f} (tools[6])", "fetch "),
         ("entry", "{f} (tools[7])", None), ("separator", "{f} (tools[2])", "read, write"),
         ("separator", "{f} (tools[8])", "copy, paste"), ("special_token", "{f} (tools[5])", "<|im_end|>")],
        id="mcp-json"),
    pytest.param(
        ".yaml",
        "tools:\n- name: a\n- name: ' b'\n- name: a\n  description: again\n- name: c, d\n- name: ok\n  tags: x\n"
        "- name: get\n- name: \"get\\x04\"\n",
        [("whitespace", "{f}:3 (tools[1])", " b"), ("duplicate_name", "{f}:4 (tools[2])", "a"),
         ("entry", "{f}:7 (tools[4])", "ok"), ("separator", "{f}:6 (tools[3])", "c, d"),
         ("duplicate_path", "{f}:10 (tools[6])", "get\x04")],
        id="native-yaml"),
    pytest.param(
        ".jsonl",
        '{"name": "x "}\n{"name": "y"}\n\n{"name": "\\u0004\\u0006"}\n{"name": "y"}\n{"name": "p, q"}\n'
        '{"name": "z", "parameters": {"properties": ["city"]}}\n{"name": "w", "inputSchema": "city"}\n',
        [("whitespace", "{f}:1", "x "), ("duplicate_name", "{f}:5", "y"), ("entry", "{f}:7", "z"),
         ("entry", "{f}:8", "w"), ("separator", "{f}:6", "p, q"), ("no_tokens", "{f}:4", "\x04\x06")],
        id="jsonl"),
]


def _expected(rows: list[tuple[str, str, str | None]], path: Path) -> list[tuple[str, str, str | None]]:
    return [(cause, place.replace("{f}", str(path)), tool) for cause, place, tool in rows]


@pytest.mark.parametrize(("suffix", "text", "problems"), BAD_REGISTRIES)
def test_every_problem_in_one_run(tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str, text: str,
                                  problems: list[tuple[str, str, str | None]]) -> None:
    path = tmp_path / f"tools{suffix}"
    path.write_text(text, encoding="utf-8")
    expected = _expected(problems, path)
    # JSON: every problem, with its cause, place and tool; grouped in the order of CAUSES.
    assert main(["compile", str(path), "--format", "json", "-o", str(tmp_path / "out.safetensors")]) == 2
    report = json.loads(capsys.readouterr().out)
    found = [(p["cause"], p["where"], p["tool"]) for p in report["problems"]]
    assert sorted(found, key=str) == sorted(expected, key=str)
    order = [list(CAUSES).index(cause) for cause, _, _ in found]
    assert order == sorted(order)
    assert report["count"] == len(expected) and sum(report["counts"].values()) == len(expected)
    assert not (tmp_path / "out.safetensors").exists()
    # Text: one line per problem (place, tool), under a heading per cause with its count.
    assert main(["compile", str(path), "-o", str(tmp_path / "out.safetensors")]) == 2
    err = capsys.readouterr().err
    assert f"{len(expected)} problems" in err
    for cause in {cause for cause, _, _ in expected}:
        count = sum(1 for c, _, _ in expected if c == cause)
        assert f"{CAUSES[cause]} ({count}):" in err
    for _, place, tool in expected:
        assert f"  {place}{'' if tool is None else ' ' + repr(tool)}: " in err


@pytest.mark.parametrize(("suffix", "text", "problems"), BAD_REGISTRIES)
def test_the_proposed_separator_is_in_no_name_and_compiles(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           suffix: str, text: str,
                                                           problems: list[tuple[str, str, str | None]]) -> None:
    path = tmp_path / f"tools{suffix}"
    path.write_text(text, encoding="utf-8")
    assert main(["compile", str(path), "--format", "json", "-o", str(tmp_path / "out.safetensors")]) == 2
    report = json.loads(capsys.readouterr().out)
    separator = report["suggested_separator"]
    assert separator is not None and f"--separator '{separator.encode('unicode_escape').decode()}'" in report["hint"]
    # Drop every entry with a problem other than the separator: the rest compiles with the proposal.
    found: list[Problem] = []
    registry = load_registry(path, problems=found)
    others = {(p.where, p.tool) for p in found}
    assert all(separator not in tool.name for tool in registry.tools)
    clean = [t for t in registry.tools if (t.where.removesuffix(f" {t.name!r}"), t.name) not in others
             or ", " in t.name]
    assert any(", " in t.name for t in clean)
    tokenizer = TokenizerInfo.load("smollm2-135m")
    try:
        compile_registry(registry, tokenizer, Contract(separator=separator))
    except RegistryProblems as exc:  # only the problems that are not the separator's remain
        assert {p.cause for p in exc.problems} <= {c for c, _, _ in problems} - {"separator"}


def test_a_cap_per_cause_with_a_count_of_the_rest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "many.jsonl"
    path.write_text("".join(json.dumps({"name": f"tool_{i} "}) + "\n" for i in range(25)) + '{"name": "ok"}\n',
                    encoding="utf-8")
    assert main(["compile", str(path), "-o", str(tmp_path / "o.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "names with leading or trailing whitespace (25):" in err and "... and 15 more" in err
    assert err.count("tool name has leading or trailing whitespace") == 10
    assert main(["compile", str(path), "--format", "json", "-o", str(tmp_path / "o.safetensors")]) == 2
    assert len(json.loads(capsys.readouterr().out)["problems"]) == 25  # JSON: no cap


def test_a_registry_with_only_the_separator_problem_compiles_with_the_proposal(tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture[str]
                                                                               ) -> None:
    path = tmp_path / "commas.json"
    names = ["search, then summarize", "get_weather", "a; b", "x | y", "book, pay"]
    path.write_text(json.dumps([{"type": "function", "function": {"name": n}} for n in names]), encoding="utf-8")
    assert main(["compile", str(path), "-o", str(tmp_path / "a.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "names containing the separator (2):" in err and "--separator '\\n'" in err
    assert main(["compile", str(path), "--separator", r"\n", "-o", str(tmp_path / "a.safetensors")]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "a.safetensors")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["contract"]["separator"] == "\n" and [t["name"] for t in summary["tools"]] == names


def test_other_errors_as_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile", str(tmp_path / "none.yaml"), "--format", "json", "-o", str(tmp_path / "o")]) == 2
    report = json.loads(capsys.readouterr().out)
    assert report["error"] == "RegistryError" and "registry file not found" in report["message"]


def test_empty_descriptions_when_required(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n- name: a\n  description: fine\n- name: b\n- name: ' c'\n", encoding="utf-8")
    assert main(["compile", str(path), "--require-descriptions", "-o", str(tmp_path / "o.safetensors")]) == 2
    err = capsys.readouterr().err
    assert f"empty descriptions (1):\n  {path}:4 (tools[1]) 'b': tool has no description" in err
    assert f"{path}:5 (tools[2]) ' c'" in err  # and the other problems of the same run
    path.write_text("tools:\n- name: a\n- name: b\n", encoding="utf-8")
    assert main(["compile", str(path), "-o", str(tmp_path / "o.safetensors")]) == 0  # not required by default


@pytest.mark.parametrize(("typed", "separator"), [(r"\n", "\n"), (r"\t", "\t"), (", ", ", "), (r"a\\n", "a\\n"),
                                                  (r"\x", "\\x")])
def test_separator_escapes(typed: str, separator: str) -> None:
    assert separator_text(typed) == separator
