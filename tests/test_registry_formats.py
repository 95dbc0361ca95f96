"""The registry loader reads the same tools from every supported format, and the bundled registries load."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tooltrie.registry import BFCL_PATH, CATALOG_PATH, Registry, load_registry, make_registry, parse_registry
from tooltrie.registry.model import Parameter

# Names chosen to be awkward: shared prefixes, a prefix of another name, case, dots, non-ASCII, an emoji.
TOOLS = [
    {"name": "get_weather", "description": "Current weather for a city."},
    {"name": "get", "description": "Fetch a URL."},
    {"name": "get_weather_forecast", "description": "Five-day forecast; \"quoted\" text, a colon: here."},
    {"name": "Get", "description": ""},
    {"name": "math.sqrt", "description": "Square root."},
    {"name": "météo_日本", "description": "Wetter, weather, 天気 ☀️"},
    {"name": "send 📧", "description": "Send an email\nwith two lines."},
]
NAMES = [tool["name"] for tool in TOOLS]
DESCRIPTIONS = [tool["description"] for tool in TOOLS]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "description": "City name."},
                                          "unit": {"type": "string", "enum": ["C", "F"]}}, "required": ["city"]}
NATIVE_PARAMETERS = [{"name": "city", "type": "string", "description": "City name.", "required": True},
                     {"name": "unit", "type": "string", "values": ["C", "F"]}]
PARAMETERS = (Parameter("city", "City name.", "string", required=True), Parameter("unit", type="string",
                                                                                   values=("C", "F")))


def _native_yaml(name: str | None = None, parameters: object = SCHEMA) -> str:
    document: dict[str, object] = {"description": "demo tools", "source": "tests", "license": "MIT",
                                   "tools": [{**tool, "parameters": parameters} for tool in TOOLS]}
    if name is not None:
        document["name"] = name
    return yaml.safe_dump(document, allow_unicode=True, sort_keys=False)


def _openai(wrapped: bool) -> str:
    entries = [{"type": "function", "function": {**tool, "parameters": SCHEMA, "strict": True}} for tool in TOOLS]
    return json.dumps({"tools": entries} if wrapped else entries, ensure_ascii=False, indent=2)


def _mcp(jsonrpc: bool) -> str:
    result = {"tools": [{**tool, "inputSchema": SCHEMA, "annotations": {"readOnlyHint": True}} for tool in TOOLS],
              "nextCursor": None}
    document = {"jsonrpc": "2.0", "id": 7, "result": result} if jsonrpc else result
    return json.dumps(document, ensure_ascii=False)


def _jsonl() -> str:
    lines = [json.dumps({**tool, "parameters": SCHEMA, "extra": [1, 2]}, ensure_ascii=False) for tool in TOOLS]
    return "\n".join(lines[:3]) + "\n\n" + "\n".join(lines[3:]) + "\n"  # a blank line is skipped


FORMATS = {
    "yaml": (".yaml", lambda: _native_yaml()),
    "yml": (".yml", lambda: _native_yaml(parameters=NATIVE_PARAMETERS)),
    "yaml-named": (".yaml", lambda: _native_yaml("demo")),
    "openai-bare": (".json", lambda: _openai(wrapped=False)),
    "openai-under-tools": (".json", lambda: _openai(wrapped=True)),
    "mcp-bare": (".json", lambda: _mcp(jsonrpc=False)),
    "mcp-jsonrpc": (".json", lambda: _mcp(jsonrpc=True)),
    "jsonl": (".jsonl", _jsonl),
}


def _write(tmp_path: Path, label: str, suffix: str, text: str) -> Path:
    # Every file is called demo.<ext> (in its own folder), so every registry is named "demo".
    folder = tmp_path / label
    folder.mkdir()
    path = folder / f"demo{suffix}"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture()
def loaded(tmp_path: Path) -> dict[str, Registry]:
    return {label: load_registry(_write(tmp_path, label, suffix, make()))
            for label, (suffix, make) in FORMATS.items()}


@pytest.mark.parametrize("label", list(FORMATS))
def test_each_format_gives_the_same_tools(loaded: dict[str, Registry], label: str) -> None:
    registry = loaded[label]
    assert registry.name == "demo"
    assert registry.names == NAMES
    assert [tool.description for tool in registry.tools] == DESCRIPTIONS
    assert [tool.pointer for tool in registry.tools] == [f"demo/{name}" for name in NAMES]
    assert all(tool.parameters == PARAMETERS for tool in registry.tools)
    assert len(registry) == len(TOOLS)


def test_registry_hash_is_format_independent(loaded: dict[str, Registry]) -> None:
    hashes = {label: registry.sha256 for label, registry in loaded.items()}
    assert len(set(hashes.values())) == 1, hashes


def test_registry_hash_changes_with_content() -> None:
    base = make_registry(TOOLS, name="demo")
    renamed = make_registry([{**TOOLS[0], "name": "get_weather2"}, *TOOLS[1:]], name="demo")
    redescribed = make_registry([{**TOOLS[0], "description": "other"}, *TOOLS[1:]], name="demo")
    reordered = make_registry([*TOOLS[1:], TOOLS[0]], name="demo")
    hashes = [r.sha256 for r in (base, renamed, redescribed, reordered)]
    assert len(set(hashes)) == 4


# The hashes the bundled registries had when content_json was json.dumps of content(): training data and the
# shipped adapter record them, so the bytes hashed must never change.
BUNDLED_SHA256 = {
    "catalog": "d20b4ce4f718ae75f09b505957fd3e3c373642e2e00c9b46ed10a070e1fa3185",
    "bfcl": "18da0db69b9a8d52edee3d6d7890d084706ab3e235f1725aa9c03b214f90acd9",
}
AWKWARD_TEXT = ["", "plain", "quote \" backslash \\ slash /", "tab\t nl\n cr\r", "\x00\x01\x1f\x7f", "é 日本 ☀️ 📧",
                "\u2028\u2029\x85", "</script>", "&<>'"]


def test_bundled_registry_hashes_never_change() -> None:
    assert {"catalog": load_registry(CATALOG_PATH).sha256, "bfcl": load_registry(BFCL_PATH).sha256} == BUNDLED_SHA256


@pytest.mark.parametrize("registry", [
    pytest.param(lambda: load_registry(CATALOG_PATH), id="catalog"),
    pytest.param(lambda: load_registry(BFCL_PATH), id="bfcl"),
    pytest.param(lambda: make_registry(TOOLS, name="demo"), id="awkward-names"),
    pytest.param(lambda: make_registry([
        {"name": f"t{i}", "description": text, "pointer": f"p/{text}x", "tags": AWKWARD_TEXT[:i],
         "examples": AWKWARD_TEXT[i:]} for i, text in enumerate(AWKWARD_TEXT)], name="awkward"), id="awkward-text"),
])
def test_content_json_is_json_dumps_of_the_content(registry: Callable[[], Registry]) -> None:
    """The canonical JSON written without dicts is the one json.dumps gave before, byte for byte."""
    loaded = registry()
    assert loaded.content_json == json.dumps([tool.content() for tool in loaded.tools], sort_keys=True,
                                             ensure_ascii=False)


@pytest.mark.parametrize("line", [
    '{"name": "a"}', ' \t{"name": "a"}\r', '{"name": "a", "tags": ["x", "y"], "n": 1.5e3, "z": null}', '"a"', "[1]",
    "7", '{"name": "a"} x', '{"name": "a"}{"name": "b"}', '{"name": "a",}', '{"name": "a"', "\ufeff{}", "\x0c{}",
    "{} \x0c", "nul", '{"a": "\\ud800"}', '{"a": "\x01"}',
])
def test_jsonl_lines_read_as_json_loads_reads_them(tmp_path: Path, line: str) -> None:
    """JSONL lines go through json's scanner directly; what it accepts and what it refuses (with the message) is
    json.loads's verdict on the line."""
    from tooltrie.errors import RegistryError
    from tooltrie.registry.loader import _json_line

    try:
        expected: object = json.loads(line)
    except json.JSONDecodeError as exc:
        with pytest.raises(RegistryError, match=re.escape(f"f:1: invalid JSON: {exc.msg} (column {exc.colno})")):
            _json_line(line, "f:1")
    else:
        assert _json_line(line, "f:1") == expected


def test_pointer_defaults_to_registry_name_slash_tool_name(tmp_path: Path) -> None:
    # The YAML's declared name wins over the file name.
    path = _write(tmp_path, "named", ".yaml", _native_yaml("weather-server"))
    registry = load_registry(path)
    assert registry.name == "weather-server"
    assert [t.pointer for t in registry.tools] == [f"weather-server/{name}" for name in NAMES]
    # A load-time name override replaces the file stem.
    json_path = _write(tmp_path, "json", ".json", _openai(wrapped=False))
    assert load_registry(json_path, name="srv").tools[0].pointer == "srv/get_weather"


def test_explicit_pointer_tags_and_examples_are_kept(tmp_path: Path) -> None:
    text = """\
name: demo
tools:
- name: get_weather
  description: Weather.
  pointer: mcp://weather/get_weather
  tags: [weather, read-only]
  examples: ["weather in Paris?", "is it raining"]
- name: get_user
"""
    registry = load_registry(_write(tmp_path, "yaml", ".yaml", text))
    first, second = registry.tools
    assert first.pointer == "mcp://weather/get_weather"
    assert first.tags == ("weather", "read-only")
    assert first.examples == ("weather in Paris?", "is it raining")
    assert (second.pointer, second.description, second.tags, second.examples) == ("demo/get_user", "", (), ())


def test_parse_registry_matches_load_registry(tmp_path: Path) -> None:
    text = _mcp(jsonrpc=True)
    parsed = parse_registry(text, source="<mem>", suffix=".json", name="demo")
    assert parsed.names == NAMES
    assert parsed.sha256 == load_registry(_write(tmp_path, "mcp", ".json", text)).sha256


def test_suffix_is_case_insensitive(tmp_path: Path) -> None:
    path = _write(tmp_path, "upper", ".YAML", _native_yaml())
    assert load_registry(path).names == NAMES


def test_make_registry_and_index() -> None:
    registry = make_registry([{"name": "a"}, {"name": "b", "description": "B"}], name="inline")
    assert registry.names == ["a", "b"]
    assert registry.index("b") == 1
    assert registry.tools[1].pointer == "inline/b"
    with pytest.raises(KeyError):
        registry.index("c")


def test_bundled_catalog() -> None:
    catalog = load_registry(CATALOG_PATH)
    assert catalog.name == "catalog"
    assert len(catalog) == 47
    assert len(set(catalog.names)) == 47
    assert catalog.tools[0].name == "FinanceTool"
    assert all(t.pointer == f"catalog/{t.name}" for t in catalog.tools)
    assert all(t.description for t in catalog.tools)


def test_bundled_bfcl() -> None:
    bfcl = load_registry(BFCL_PATH)
    assert bfcl.name == "bfcl"
    assert len(bfcl) == 1853
    assert len(set(bfcl.names)) == 1853
    assert all(t.pointer == f"bfcl/{t.name}" for t in bfcl.tools)
    # BFCL has exactly three pairs of names that differ only in case; they are distinct tools.
    by_folded: dict[str, list[str]] = {}
    for name in bfcl.names:
        by_folded.setdefault(name.casefold(), []).append(name)
    pairs = sorted(sorted(group) for group in by_folded.values() if len(group) > 1)
    assert pairs == [["GET_PARCEL_STATE", "get_parcel_state"], ["calculate_BMI", "calculate_bmi"],
                     ["calculate_ROI", "calculate_roi"]]


def test_the_responses_apis_flat_tools_and_yaml_merge_keys_load(tmp_path: Path) -> None:
    wrapped = [{"type": "function", "function": {"name": "get_a", "description": "x",
                                                 "parameters": {"type": "object", "properties": {"city": {}}}}}]
    flat = [{"type": "function", "name": "get_a", "description": "x", "strict": True,
             "parameters": {"type": "object", "properties": {"city": {}}}}]
    (tmp_path / "wrapped.json").write_text(json.dumps(wrapped))
    (tmp_path / "flat.json").write_text(json.dumps(flat))
    assert load_registry(tmp_path / "flat.json", name="t").sha256 == load_registry(tmp_path / "wrapped.json",
                                                                                   name="t").sha256
    (tmp_path / "merged.yaml").write_text("tools:\n  - &base {name: get_a, description: shared, tags: [x]}\n"
                                          "  - <<: *base\n    name: get_b\n")
    merged = load_registry(tmp_path / "merged.yaml")
    assert [(t.name, t.description, t.tags) for t in merged.tools] == [("get_a", "shared", ("x",)),
                                                                        ("get_b", "shared", ("x",))]
