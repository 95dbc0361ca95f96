"""Bad registries are refused at the door with a RegistryError naming the file, the line or index, and the tool."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tooltrie.compiler import Contract, TokenizerInfo, compile_registry
from tooltrie.compiler.tokenizer_info import BUNDLED_TOKENIZERS_DIR
from tooltrie.errors import RegistryError
from tooltrie.registry import load_registry, make_registry

# (suffix, file text, message pattern). "{file}" in a pattern stands for the escaped path of the file.
LOAD_CASES = [
    pytest.param(".yaml", "tools:\n- name: a\n- name: b\n- name: a\n",
                 r"{file}:4 \(tools\[2\]\) 'a': duplicate tool name, first defined at {file}:2 \(tools\[0\]\) 'a'",
                 id="duplicate-name-yaml"),
    pytest.param(".jsonl", '{"name": "a"}\n{"name": "b"}\n\n{"name": "b"}\n',
                 r"{file}:4 'b': duplicate tool name, first defined at {file}:2 'b'", id="duplicate-name-jsonl"),
    pytest.param(".json", json.dumps([{"name": "x"}, {"name": "a"}, {"name": "a"}]),
                 r"{file} \(tools\[2\]\) 'a': duplicate tool name, first defined at {file} \(tools\[1\]\) 'a'",
                 id="duplicate-name-json"),
    pytest.param(".yaml", "tools:\n- name: a\n- name: ''\n", r"{file}:3 \(tools\[1\]\) '': tool name is empty",
                 id="empty-name"),
    pytest.param(".yaml", "tools:\n- description: no name here\n",
                 r"{file}:2 \(tools\[0\]\): tool name must be a string, got nothing", id="missing-name"),
    pytest.param(".yaml", "tools:\n- name: 42\n", r"{file}:2 \(tools\[0\]\): tool name must be a string, got int 42",
                 id="non-string-name-int"),
    pytest.param(".yaml", "tools:\n- name: yes\n",
                 r"{file}:2 \(tools\[0\]\): tool name must be a string, got bool True", id="non-string-name-bool"),
    pytest.param(".json", json.dumps([{"name": ["a"]}]),
                 r"{file} \(tools\[0\]\): tool name must be a string, got list", id="non-string-name-json"),
    pytest.param(".yaml", "tools:\n- name: '   '\n", r"{file}:2 \(tools\[0\]\) '   ': tool name is empty",
                 id="whitespace-only-name"),
    pytest.param(".yaml", "tools:\n- name: ' get'\n",
                 r"{file}:2 \(tools\[0\]\) ' get': tool name has leading or trailing whitespace",
                 id="leading-whitespace"),
    pytest.param(".jsonl", '{"name": "get\\t"}\n',
                 r"{file}:1 'get\\t': tool name has leading or trailing whitespace", id="trailing-whitespace"),
    pytest.param(".yaml", 'tools:\n- name: "get\\nuser"\n',
                 r"{file}:2 \(tools\[0\]\) 'get\\nuser': tool name contains a newline", id="newline-in-name"),
    pytest.param(".json", json.dumps([{"name": "get\r\nuser"}]),
                 r"{file} \(tools\[0\]\) 'get\\r\\nuser': tool name contains a newline", id="crlf-in-name"),
    pytest.param(".yaml", "name: empty\ntools: []\n", r"{file}: the registry has no tools", id="empty-registry-yaml"),
    pytest.param(".json", "[]", r"{file}: the registry has no tools", id="empty-registry-json"),
    pytest.param(".jsonl", "\n\n", r"{file}: the registry has no tools", id="empty-registry-jsonl"),
    pytest.param(".yaml", "tools:\n- name: a\nversion: 2\n",
                 r"{file}: unknown top-level key\(s\) \['version'\]; allowed: \['description', 'license', 'name', "
                 r"'source', 'tools'\]", id="unknown-top-level-key"),
    pytest.param(".yaml", "tools:\n- name: a\n- name: b\n  descripton: typo\n",
                 r"{file}:3 \(tools\[1\]\) 'b': unknown key\(s\) \['descripton'\]", id="unknown-tool-key-yaml"),
    pytest.param(".yaml", "tools:\n  get_weather: {description: x}\n",
                 r"{file}: 'tools' must be a list of tools, got dict", id="tools-not-a-list-mapping"),
    pytest.param(".yaml", "tools: get_weather\n", r"{file}: 'tools' must be a list of tools, got str 'get_weather'",
                 id="tools-not-a-list-string"),
    pytest.param(".yaml", "name: x\n", r"{file}: 'tools' must be a list of tools, got nothing", id="tools-missing"),
    pytest.param(".yaml", "tools:\n- get_weather\n",
                 r"{file}:2 \(tools\[0\]\): expected a mapping \(an object\), got str 'get_weather'",
                 id="tool-not-a-mapping"),
    pytest.param(".yaml", "- name: a\n", r"{file}: expected a mapping with a 'tools' list at the top level, got list",
                 id="top-level-list-yaml"),
    pytest.param(".yaml", "", r"{file}: expected a mapping with a 'tools' list at the top level, got nothing",
                 id="empty-yaml-file"),
    pytest.param(".yaml", "name: 7\ntools:\n- name: a\n", r"{file}: 'name' must be a non-empty string, got 7",
                 id="registry-name-not-a-string"),
    pytest.param(".yaml", "tools:\n- name: a\n- name: [b\n", r"(?s){file}: invalid YAML: .*line 3",
                 id="invalid-yaml"),
    pytest.param(".yaml", "tools:\n- name: a\n---\ntools: []\n", r"{file}: invalid YAML", id="two-yaml-documents"),
    pytest.param(".json", '[\n  {"name": "a"},\n  {"name": }\n]\n', r"{file}:3: invalid JSON: Expecting value",
                 id="invalid-json"),
    pytest.param(".jsonl", '{"name": "a"}\n{"name": "b"}\n{"name": "c",}\n',
                 r"{file}:3: invalid JSON: .* \(column \d+\)", id="invalid-jsonl-line"),
    pytest.param(".jsonl", '{"name": "a"}\n["b"]\n', r"{file}:2: expected a mapping \(an object\), got list",
                 id="jsonl-line-not-an-object"),
    pytest.param(".json", json.dumps([{"type": "function", "function": {"name": "a"}},
                                      {"type": "retrieval", "function": {"name": "b"}}]),
                 r"{file} \(tools\[1\]\): tool type 'retrieval' is a platform's own tool, not one to search",
                 id="openai-type-not-function"),
    pytest.param(".json", json.dumps({"tools": [{"type": "function", "description": "neither wrapped nor named"}]}),
                 r"{file} \(tools\[0\]\)\.function: expected a mapping \(an object\), got nothing",
                 id="openai-function-missing"),
    pytest.param(".json", json.dumps({"name": "a", "description": "one tool, not a list"}),
                 r"{file}: expected an OpenAI tools list or an MCP tools/list result", id="json-not-a-tools-list"),
    pytest.param(".json", json.dumps({"jsonrpc": "2.0", "id": 1, "error": {"code": -32601, "message": "nope"}}),
                 r"{file}: expected an OpenAI tools list or an MCP tools/list result", id="jsonrpc-error-response"),
    pytest.param(".json", json.dumps({"tools": [1]}),
                 r"{file} \(tools\[0\]\): expected a mapping \(an object\), got int", id="json-tool-not-an-object"),
    pytest.param(".txt", "tools:\n- name: a\n",
                 r"{file}: unknown registry format '\.txt': expected \.yaml, \.yml, \.json or \.jsonl",
                 id="wrong-extension"),
    pytest.param("", "tools:\n- name: a\n", r"{file}: unknown registry format ''", id="no-extension"),
    pytest.param(".yaml", "tools:\n- name: a\n  tags: weather\n",
                 r"{file}:2 \(tools\[0\]\) 'a': tags must be a list of strings, got 'weather'", id="tags-a-string"),
    pytest.param(".yaml", "tools:\n- name: a\n  tags: [weather, 3]\n",
                 r"{file}:2 \(tools\[0\]\) 'a': tags must be a list of strings, got \['weather', 3\]",
                 id="tags-not-all-strings"),
    pytest.param(".jsonl", '{"name": "a", "examples": {"q": "x"}}\n',
                 r"{file}:1 'a': examples must be a list of strings", id="examples-not-a-list"),
    pytest.param(".yaml", "tools:\n- name: a\n  description: 5\n",
                 r"{file}:2 \(tools\[0\]\) 'a': description must be a string, got int 5",
                 id="description-not-a-string"),
    pytest.param(".yaml", "tools:\n- name: a\n  pointer: ''\n",
                 r"{file}:2 \(tools\[0\]\) 'a': pointer must be a non-empty string, got ''", id="empty-pointer"),
    pytest.param(".json", json.dumps({"jsonrpc": "2.0", "id": 1, "result": {"tools": [{"name": "a"}],
                                                                          "nextCursor": "abc"}}),
                 r"{file}: one page of an MCP tools/list result \(nextCursor 'abc'\): the tools of the later pages",
                 id="mcp-page"),
    pytest.param(".json", json.dumps({"tools": [{"name": "a", "inputSchema": {"properties": {"": {}}}}]}),
                 r"{file} \(tools\[0\]\) 'a': parameters' 'properties' has a parameter with an empty name",
                 id="empty-parameter-name"),
    pytest.param(".yaml", "tools: [&a {name: x, tags: [*a]}]\n",
                 r"{file}:1 \(tools\[0\]\) 'x': tags must be a list of strings", id="recursive-alias"),
]


@pytest.mark.parametrize(("suffix", "text", "pattern"), LOAD_CASES)
def test_bad_registry_file(tmp_path: Path, suffix: str, text: str, pattern: str) -> None:
    path = tmp_path / f"registry{suffix}"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(RegistryError, match=pattern.replace("{file}", re.escape(str(path)))):
        load_registry(path)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(RegistryError, match=re.escape(f"{path}: registry file not found")):
        load_registry(path)


def test_directory_instead_of_file(tmp_path: Path) -> None:
    folder = tmp_path / "reg.yaml"
    folder.mkdir()
    with pytest.raises(RegistryError, match=re.escape(f"{folder}: cannot read the registry")):
        load_registry(folder)


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("tools:\n- name: m\xe9t\xe9o\n".encode("latin-1"))
    with pytest.raises(RegistryError, match=re.escape(f"{path}: cannot read the registry")):
        load_registry(path)


def test_registry_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="no tools"):
        make_registry([], name="empty")


def test_make_registry_rejects_unknown_keys_and_non_mappings() -> None:
    with pytest.raises(RegistryError, match=r"<inline> \(tools\[1\]\) 'b': unknown key\(s\) \['inputSchema'\]"):
        make_registry([{"name": "a"}, {"name": "b", "inputSchema": {}}], name="x")
    with pytest.raises(RegistryError, match=r"<inline> \(tools\[0\]\): expected a mapping"):
        make_registry(["a"], name="x")  # type: ignore[list-item]


# Names refused when compiled: (names, tokenizer, separator, pattern naming the offending tool).
COMPILE_CASES = [
    pytest.param(["get_weather", "get, weather"], "smollm2-135m", ", ",
                 r"<inline> \(tools\[1\]\) 'get, weather': tool name contains the contract's separator ', '",
                 id="separator-in-name"),
    pytest.param(["a", "b;c"], "gpt2", ";", r"\(tools\[1\]\) 'b;c': tool name contains the contract's separator ';'",
                 id="semicolon-separator-in-name"),
    pytest.param(["a | b", "c"], "gpt2", " | ", r"\(tools\[0\]\) 'a \| b': .*separator ' \| '",
                 id="pipe-separator-in-name"),
    pytest.param(["FinanceTool", "<|im_end|>"], "smollm2-135m", ", ",
                 r"\(tools\[1\]\) '<\|im_end\|>': tool name contains a special token of smollm2-135m "
                 r"\(e\.g\. the stop token '<\|im_end\|>'\)", id="stop-token-as-name-smollm2"),
    pytest.param(["stop<|endoftext|>now"], "gpt2", ", ",
                 r"\(tools\[0\]\) 'stop<\|endoftext\|>now': tool name contains a special token of gpt2",
                 id="stop-token-inside-name-gpt2"),
    pytest.param(["a", "<|im_start|>assistant"], "smollm2-135m", ", ",
                 r"\(tools\[1\]\) '<\|im_start\|>assistant': tool name contains a special token of smollm2-135m",
                 id="other-special-token-smollm2"),
    pytest.param(["get", "\x04\x06"], "smollm2-135m", ", ",
                 r"\(tools\[1\]\) '\\x04\\x06': tool name renders to no tokens with smollm2-135m",
                 id="no-tokens-smollm2-control-chars"),
    pytest.param(["get_weather", "get_weather\x04"], "smollm2-135m", ", ",
                 r"\(tools\[1\]\) 'get_weather\\x04': tool name tokenizes exactly like 'get_weather' "
                 r"\(<inline> \(tools\[0\]\) 'get_weather'\)", id="same-tokens-as-another-name-smollm2"),
]


@pytest.mark.parametrize(("names", "tokenizer_name", "separator", "pattern"), COMPILE_CASES)
def test_names_refused_at_compile_time(tokenizers: dict[str, TokenizerInfo], names: list[str], tokenizer_name: str,
                                       separator: str, pattern: str) -> None:
    registry = make_registry([{"name": name} for name in names], name="inline")  # loads: the loader cannot know
    with pytest.raises(RegistryError, match=pattern):
        compile_registry(registry, tokenizers[tokenizer_name], Contract(separator=separator))


def test_compile_error_names_the_file_line_and_tool(tmp_path: Path, smollm: TokenizerInfo) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n- name: get_weather\n- name: get_weather, now\n", encoding="utf-8")
    registry = load_registry(path)
    with pytest.raises(RegistryError, match=re.escape(f"{path}:3 (tools[1]) 'get_weather, now'") + ".*separator"):
        compile_registry(registry, smollm)


def test_stop_token_text_is_an_ordinary_name_for_a_tokenizer_without_it(gpt2: TokenizerInfo) -> None:
    # "<|im_end|>" is special only for smollm2; for GPT-2 it is plain text and compiles.
    registry = make_registry([{"name": "<|im_end|>"}, {"name": "b"}], name="inline")
    artifact = compile_registry(registry, gpt2)
    assert artifact.token_path(["<|im_end|>", "b"]) == gpt2.encode("<|im_end|>, b")
    assert gpt2.eos_id not in artifact.trie.edge_token.tolist()


def test_which_names_render_to_no_tokens(tokenizers: dict[str, TokenizerInfo]) -> None:
    # GPT-2's byte-level vocabulary has all 256 bytes: every non-empty text gets tokens. SmolLM2's lacks 21 byte
    # values (among them 0x04, 0x06, 0x13 and the UTF-8 lead bytes 0xF1, 0xF2), which its BPE silently drops.
    for text in ["\u200b", "\x00", "\x04", "\ufeff", "\u0301", "\U000e0001", "\x7f", "~", "\U00040000"]:
        assert tokenizers["gpt2"].encode(text), text
    assert tokenizers["smollm2-135m"].encode("\x04\x06\x13") == []
    assert tokenizers["smollm2-135m"].encode("get\x04") == tokenizers["smollm2-135m"].encode("get")


def test_name_that_renders_to_no_tokens(tmp_path: Path) -> None:
    # A GPT-2 tokenizer whose normalizer deletes "~": the name "~~" then encodes to nothing.
    spec = json.loads((BUNDLED_TOKENIZERS_DIR / "gpt2" / "tokenizer.json").read_text(encoding="utf-8"))
    spec["normalizer"] = {"type": "Replace", "pattern": {"String": "~"}, "content": ""}
    folder = tmp_path / "gpt2-tilde"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    shutil.copy(BUNDLED_TOKENIZERS_DIR / "gpt2" / "tokenizer_config.json", folder / "tokenizer_config.json")
    tokenizer = TokenizerInfo.load(folder)
    assert tokenizer.encode("~~") == []
    registry = make_registry([{"name": "get"}, {"name": "~~"}], name="inline")
    with pytest.raises(RegistryError, match=r"\(tools\[1\]\) '~~': tool name renders to no tokens with "
                       + re.escape(str(folder))):
        compile_registry(registry, tokenizer)


@pytest.mark.parametrize("tokenizer_name", ["smollm2-135m", "gpt2"])
def test_names_differing_only_in_case_compile(tokenizers: dict[str, TokenizerInfo], tokenizer_name: str) -> None:
    tokenizer = tokenizers[tokenizer_name]
    names = ["get_parcel_state", "GET_PARCEL_STATE", "Get_Parcel_State", "calculate_bmi", "calculate_BMI"]
    artifact = compile_registry(make_registry([{"name": n} for n in names], name="case"), tokenizer)
    paths = {tuple(artifact.token_path([name])) for name in names}
    assert len(paths) == len(names)
    for name in names:
        assert artifact.token_path([name]) == tokenizer.encode(name)
    assert artifact.token_path(names) == tokenizer.encode(", ".join(names))


def _lowercasing_gpt2(tmp_path: Path) -> TokenizerInfo:
    """GPT-2 with a Lowercase normalizer: a tokenizer that does not tell case apart."""
    spec = json.loads((BUNDLED_TOKENIZERS_DIR / "gpt2" / "tokenizer.json").read_text(encoding="utf-8"))
    spec["normalizer"] = {"type": "Lowercase"}
    path = tmp_path / "uncased.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    return TokenizerInfo.load(path, eos_token="<|endoftext|>")


def test_names_differing_only_in_case_with_an_uncased_tokenizer(tmp_path: Path) -> None:
    tokenizer = _lowercasing_gpt2(tmp_path)
    registry = make_registry([{"name": "get_user"}, {"name": "Get_User"}], name="case")
    with pytest.raises(RegistryError, match=r"\(tools\[1\]\) 'Get_User': tool name tokenizes exactly like "
                       r"'get_user' \(<inline> \(tools\[0\]\) 'get_user'\) \(they differ only in case"):
        compile_registry(registry, tokenizer)


# ---- Regressions: bugs found while writing these tests ----


def test_duplicate_top_level_tools_key(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text("tools:\n- name: a\ntools:\n- name: b\n- name: c\n", encoding="utf-8")
    with pytest.raises(RegistryError, match=re.escape(str(path))):
        load_registry(path)


@pytest.mark.parametrize("char", ["\u2028", "\u0085"], ids=["U+2028", "U+0085"])
def test_jsonl_string_with_unicode_line_separator(tmp_path: Path, char: str) -> None:
    path = tmp_path / "tools.jsonl"
    lines = [json.dumps({"name": "a", "description": f"one{char}two"}, ensure_ascii=False), json.dumps({"name": "b"})]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    registry = load_registry(path)
    assert registry.names == ["a", "b"]
    assert registry.tools[0].description == f"one{char}two"


def test_lone_surrogate_in_name(tmp_path: Path, gpt2: TokenizerInfo) -> None:
    path = tmp_path / "tools.json"
    path.write_text('[{"name": "a\\ud800b"}, {"name": "c"}]', encoding="utf-8")
    with pytest.raises(RegistryError, match=re.escape(str(path))):
        compile_registry(load_registry(path), gpt2)


def test_same_tokens_as_another_name_with_a_longer_name_present(smollm: TokenizerInfo) -> None:
    # SmolLM2 drops the byte 0x04, so "get" and "get\x04" tokenize alike; "get_user" is longer than both.
    registry = make_registry([{"name": "get"}, {"name": "get\x04"}, {"name": "get_user"}], name="dup")
    with pytest.raises(RegistryError, match="tokenizes exactly like 'get'"):
        compile_registry(registry, smollm)


def test_names_differing_only_in_case_with_a_longer_name_present(tmp_path: Path) -> None:
    tokenizer = _lowercasing_gpt2(tmp_path)
    registry = make_registry([{"name": "get_user"}, {"name": "Get_User"}, {"name": "get_user_by_id"}], name="case")
    with pytest.raises(RegistryError, match="differ only in case"):
        compile_registry(registry, tokenizer)


@pytest.mark.parametrize(("value", "message"), [
    ("city", "parameters must be a JSON schema object or a list of parameters, got str 'city'"),
    ({"properties": ["city"]}, "parameters' 'properties' must be a mapping, got list"),
    ({"properties": {"city": "string"}}, "parameter 'city' must be a schema object, got str 'string'"),
    ({"properties": {"city": {"description": 3}}}, "parameter 'city': 'description' must be a string, got int 3"),
    ({"properties": {"unit": {"enum": "C"}}}, "parameter 'unit': 'enum' must be a list, got str 'C'"),
    ({"properties": {}, "required": "city"}, "parameters' 'required' must be a list of names, got str 'city'"),
    ([{"description": "no name"}], "parameters\\[0\\] must be a mapping with a non-empty 'name'"),
    ([{"name": "a", "enum": ["x"]}], "parameters\\[0\\]: unknown key\\(s\\) \\['enum'\\]"),
    ([{"name": "a", "required": "yes"}], "parameters\\[0\\]: 'required' must be true or false, got str 'yes'"),
    ([{"name": "a\udc80"}], "parameter 'a\\\\udc80' is not valid Unicode"),
])
def test_bad_parameters_are_named(value: object, message: str) -> None:
    with pytest.raises(RegistryError, match=rf"<inline> \(tools\[0\]\) 't': {message}"):
        make_registry([{"name": "t", "parameters": value}], name="x")
