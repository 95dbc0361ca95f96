"""Read a registry from the formats agents already use, validating at the door.

Formats, picked by extension and shape:

- native YAML (``.yaml``/``.yml``): ``{name?, description?, source?, license?, tools: [{name, description,
  pointer?, tags?, examples?, parameters?}]}``; unknown keys are errors (they are usually typos);
- an OpenAI tools list (``.json``): ``[{"type": "function", "function": {"name", "description", ...}}]``, or the
  Responses API's flat ``[{"type": "function", "name", "description", ...}]``, its ``custom`` tools and its
  ``namespace`` groups of them (each tool tagged with its namespace's name), bare or under ``"tools"``; an Anthropic
  tools list (``input_schema``); a platform's own tools (web search, code execution...) are refused in a file and
  left out of an agent's request (``tool_list_registry``);
- an MCP ``tools/list`` result (``.json``): ``{"tools": [{"name", "description", "inputSchema"}]}``, bare or
  inside a JSON-RPC response's ``"result"``;
- JSONL (``.jsonl``): one ``{"name", "description", ...}`` object per line; extra keys are kept out of the way;
- an OpenAPI 3 document (``.json`` or ``.yaml``, known by its top-level ``openapi: 3.x``): one tool per operation,
  as ``registry/openapi.py`` says (a Swagger 2.0 document is refused).

A tool's ``parameters`` (MCP: ``inputSchema``) are read as ``registry/parameters.py`` says: a JSON schema object or
the native list.

Every error is a :class:`RegistryError` naming the file, the line or index, and the tool. A file that cannot be
read as a list of entries stops at once; problems of single entries (bad names, duplicates, wrong field types) are
all collected, and reported together as one :class:`RegistryProblems` grouped by cause.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from tooltrie.errors import RegistryError
from tooltrie.registry.model import Parameter, Registry, Tool
from tooltrie.registry.openapi import NAMINGS, Naming, is_openapi, tool_entries
from tooltrie.registry.parameters import parameters
from tooltrie.registry.problems import Problem, RegistryProblems, kind

# What a tools list's platform tools (web search, code execution, ...) get: refused (a registry file), or left out
# (an agent's own request, which lists them beside its tools).
PlatformTools = Literal["refuse", "skip"]
_NATIVE_TOP_KEYS = frozenset({"name", "description", "source", "license", "tools"})
_NATIVE_TOOL_KEYS = frozenset({"name", "description", "pointer", "tags", "examples", "parameters"})
_TEXT_FIELDS = ("name", "description", "pointer", "tags", "examples")
_JSON_WHITESPACE = " \t\n\r"  # what json.loads skips around a value
# json.loads's own scanner: the (value, end) of the JSON value at an index (typeshed does not declare it).
_scan_json = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


@dataclass(slots=True)
class _Record:
    """One raw tool entry and where it was found (a slotted class: a registry may hold 100,000 of them)."""

    fields: Any  # a mapping, for a well-formed entry
    where: str
    refused: str | None = None  # why the entry is not a tool at all (then ``fields`` is None)


def load_registry(path: str | Path, *, name: str | None = None, problems: list[Problem] | None = None,
                  require_descriptions: bool = False, openapi_names: Naming = "operation_id") -> Registry:
    """Load and validate a registry file.

    With ``problems`` given, problems of single entries are appended to it and the registry of the entries
    without any is returned (for a report that adds the compiler's own checks); without it they are raised
    together as :class:`RegistryProblems`. ``require_descriptions``: an empty description is a problem too.
    ``openapi_names``: an OpenAPI operation's tool is named by its ``operationId`` (``"operation_id"``; the method
    and path where it has none) or by its method and path (``"path"``: ``GET /person/{person_id}/movie_credits``
    -> ``get_person_movie_credits``).

    >>> from tooltrie.registry import CATALOG_PATH
    >>> catalog = load_registry(CATALOG_PATH)
    >>> len(catalog), catalog.tools[0].name, catalog.tools[0].pointer
    (47, 'FinanceTool', 'catalog/FinanceTool')
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark is not part of the content
    except FileNotFoundError:
        raise RegistryError(f"{path}: registry file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RegistryError(f"{path}: cannot read the registry: {exc}") from None
    return parse_registry(text, source=str(path), suffix=path.suffix.lower(), name=name or path.stem,
                          problems=problems, require_descriptions=require_descriptions, openapi_names=openapi_names)


def parse_registry(text: str, *, source: str, suffix: str, name: str, problems: list[Problem] | None = None,
                   require_descriptions: bool = False, openapi_names: Naming = "operation_id") -> Registry:
    """Parse registry text whose format is given by a file ``suffix`` (``.yaml``, ``.json``, ``.jsonl``) and, for
    an OpenAPI document, by its content."""
    if openapi_names not in NAMINGS:
        raise ValueError(f"openapi_names must be one of {NAMINGS}, got {openapi_names!r}")
    root, data = None, None
    if suffix in (".yaml", ".yml"):
        root, data = _read_yaml(text, source)
    elif suffix == ".json":
        data = _read_json_document(text, source)
    elif suffix != ".jsonl":
        raise RegistryError(f"{source}: unknown registry format {suffix!r}: expected .yaml, .yml, .json or .jsonl")
    strict = False  # native YAML: unknown keys are errors
    if is_openapi(data):
        records = [_Record(entry.fields, entry.where, entry.refused)
                   for entry in tool_entries(data, source=source, names=openapi_names)]
    elif suffix == ".jsonl":
        records = _read_jsonl(text, source)
    elif suffix == ".json":
        records = list(_json_records(data, source))
    else:
        records, name = _native_records(root, data, source, name)
        strict = True
    return _registry_from_records(records, strict=strict, name=name, source=source, problems=problems,
                                  require_descriptions=require_descriptions)


def tool_list_registry(tools: Any, *, name: str, source: str, platform_tools: PlatformTools = "skip") -> Registry:
    """A registry from a tools list as an agent sends it (its OpenAI function, custom and namespace tools, Anthropic
    tools, or MCP ``tools/list`` entries; ``defer_loading`` and other keys are left to the caller), the platform's
    own tools left out. Raises ``RegistryProblems`` for bad entries, each named by its index in the list.

    >>> tool_list_registry([{"type": "web_search"}, {"type": "namespace", "name": "crm", "description": "CRM",
    ...                      "tools": [{"type": "function", "name": "get_customer", "parameters": None}]},
    ...                     {"name": "get_weather", "input_schema": {"type": "object"}}], name="agent",
    ...                    source="request").names
    ['get_customer', 'get_weather']
    """
    return _registry_from_records(list(_json_records(tools, source, platform_tools=platform_tools)), strict=False,
                                  name=name, source=source)


def make_registry(entries: list[dict[str, Any]], *, name: str, source: str = "<inline>") -> Registry:
    """Validate tool entries given as Python mappings (the native schema's fields).

    >>> make_registry([{"name": "get_weather"}, {"name": "get_user"}], name="demo").names
    ['get_weather', 'get_user']
    """
    records = [_Record(entry, f"{source} (tools[{i}])") for i, entry in enumerate(entries)]
    return _registry_from_records(records, strict=True, name=name, source=source)


def _registry_from_records(records: list[_Record], *, strict: bool, name: str, source: str,
                           problems: list[Problem] | None = None, require_descriptions: bool = False) -> Registry:
    found: list[Problem] = []
    tools = [tool for record in records
             if (tool := _tool_from_record(record, strict=strict, registry_name=name, problems=found)) is not None]
    if not records:
        raise RegistryError(f"{source}: the registry has no tools")
    tools = _drop_duplicates(tools, found)
    if require_descriptions:
        found += [Problem.of(tool, "empty_description", "tool has no description")
                  for tool in tools if not tool.description.strip()]
    if found:
        if problems is None:
            raise RegistryProblems(found, source=source)
        problems += found  # reported with the compiler's own problems; the tools without any go on
        bad = {(problem.where, problem.tool) for problem in found}
        tools = [tool for tool in tools if (tool.where.removesuffix(f" {tool.name!r}"), tool.name) not in bad]
    return Registry(name=name, tools=tuple(tools), source=source)


def _read_yaml(text: str, source: str) -> tuple[yaml.Node | None, Any]:
    """The document's root node (for line numbers) and its value."""
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is not None:  # before constructing, which writes merge keys (<<) into the mappings they merge
            _refuse_duplicate_keys(root, source)
        data = loader.construct_document(root) if root is not None else None
    except yaml.YAMLError as exc:
        raise RegistryError(f"{source}: invalid YAML: {exc}") from None
    except RecursionError:
        raise RegistryError(f"{source}: invalid YAML: an alias refers to a node that holds it") from None
    finally:
        loader.dispose()
    return root, data


def _native_records(root: yaml.Node | None, data: Any, source: str, name: str) -> tuple[list[_Record], str]:
    if not isinstance(data, dict):
        raise RegistryError(f"{source}: expected a mapping with a 'tools' list at the top level, got {kind(data)}")
    unknown = sorted(set(map(str, data)) - _NATIVE_TOP_KEYS)
    if unknown:
        raise RegistryError(
            f"{source}: unknown top-level key(s) {unknown}; allowed: {sorted(_NATIVE_TOP_KEYS)}"
        )
    tools = data.get("tools")
    if not isinstance(tools, list):
        raise RegistryError(f"{source}: 'tools' must be a list of tools, got {kind(tools)}")
    tool_nodes = next(value for key, value in root.value if key.value == "tools").value  # type: ignore[union-attr]
    records = [_Record(raw, f"{source}:{node.start_mark.line + 1} (tools[{i}])")
               for i, (raw, node) in enumerate(zip(tools, tool_nodes, strict=True))]
    declared = data.get("name", name)
    if not isinstance(declared, str) or not declared:
        raise RegistryError(f"{source}: 'name' must be a non-empty string, got {declared!r}")
    return records, declared


def first_duplicate_key(node: yaml.Node, visited: set[int] | None = None) -> tuple[yaml.Node, int, int] | None:
    """The first mapping key given twice under ``node`` (YAML lets a later one silently win): (key node, its line,
    the first one's line), or None. A node reached again through an alias is looked at once."""
    visited = set() if visited is None else visited
    if id(node) in visited:
        return None
    visited.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: dict[object, int] = {}
        for key, _ in node.value:
            line = key.start_mark.line + 1
            if key.value in seen:
                return key, line, seen[key.value]
            seen[key.value] = line
    if isinstance(node, yaml.MappingNode | yaml.SequenceNode):
        for child in node.value:
            for part in child if isinstance(child, tuple) else (child,):
                found = first_duplicate_key(part, visited)
                if found is not None:
                    return found
    return None


def _refuse_duplicate_keys(node: yaml.Node, source: str) -> None:
    """In a registry a duplicate key is always a mistake."""
    found = first_duplicate_key(node)
    if found is not None:
        key, line, first = found
        raise RegistryError(f"{source}:{line}: duplicate key {key.value!r} (first at line {first})")


def _read_jsonl(text: str, source: str) -> list[_Record]:
    # JSON lines end at "\n" only: str.splitlines() would also break inside strings at U+2028 and the like.
    records = []
    for line_number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            where = f"{source}:{line_number}"
            records.append(_Record(_json_line(line, where), where))
    return records


def _json_line(line: str, where: str) -> Any:
    """``json.loads(line)``, calling the decoder's scanner directly (json.loads costs three times as much per line
    in Python around it); a line the scanner does not take whole goes to json.loads, which names the error."""
    body = line.strip(_JSON_WHITESPACE)
    try:
        value, end = _scan_json(body, 0)
        if end == len(body):
            return value
    except (StopIteration, json.JSONDecodeError):
        pass
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise RegistryError(f"{where}: invalid JSON: {exc.msg} (column {exc.colno})") from None


def _read_json_document(text: str, source: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise RegistryError(f"{source}:{exc.lineno}: invalid JSON: {exc.msg} (column {exc.colno})") from None


def _json_records(data: Any, source: str, *, platform_tools: PlatformTools = "refuse") -> Iterator[_Record]:
    if isinstance(data, dict) and isinstance(data.get("result"), dict):  # a JSON-RPC response to tools/list
        data = data["result"]
    if isinstance(data, dict) and data.get("nextCursor"):
        raise RegistryError(f"{source}: one page of an MCP tools/list result (nextCursor {data['nextCursor']!r}): "
                            "the tools of the later pages would be missing; fetch every page and list them together")
    if isinstance(data, dict) and "tools" in data:
        data = data["tools"]
    if not isinstance(data, list):
        raise RegistryError(
            f"{source}: expected an OpenAI tools list or an MCP tools/list result ({{\"tools\": [...]}}), "
            f"got {kind(data)}"
        )
    for i, entry in enumerate(data):
        yield from _entry_records(entry, source, f"tools[{i}]", platform_tools)


def _entry_records(entry: Any, source: str, path: str, platform_tools: PlatformTools,
                   namespace: str | None = None) -> Iterator[_Record]:
    """The tool records of one entry of a tools list: an MCP or Anthropic tool (no ``type``, or Anthropic's
    ``custom``), an OpenAI function (nested under ``function`` or flat) or custom tool, or an OpenAI namespace of
    them (each tagged with the namespace's name). A platform's own tool (web search, code execution, the
    platform's tool search...) is not one to search: refused, or with ``platform_tools="skip"`` left out."""
    where = f"{source} ({path})"
    if not isinstance(entry, dict) or ("type" not in entry and "function" not in entry):
        yield _Record(_in_namespace(entry, namespace), where)
        return
    kind_of = entry.get("type", "function")
    if kind_of == "namespace" and namespace is None:
        name, tools = entry.get("name"), entry.get("tools")
        if not isinstance(name, str) or not name.strip() or not isinstance(tools, list):
            yield _Record(None, where, refused="an OpenAI namespace needs a name and a list of tools")
            return
        for j, inner in enumerate(tools):
            yield from _entry_records(inner, source, f"{path}.tools[{j}]", platform_tools, namespace=name)
        return
    if kind_of == "function" and "function" in entry:  # Chat Completions: {"type": "function", "function": {...}}
        if not isinstance(entry["function"], dict):
            yield _Record(None, f"{where}.function",
                          refused=f"expected a mapping (an object), got {kind(entry['function'])}")
            return
        yield _Record(_in_namespace(entry["function"], namespace), where)
    elif kind_of == "function" and "name" not in entry:
        yield _Record(None, f"{where}.function", refused="expected a mapping (an object), got nothing")
    elif kind_of in ("function", "custom"):  # the Responses API's flat function, a custom tool (either platform)
        yield _Record(_in_namespace({k: v for k, v in entry.items() if k != "type"}, namespace), where)
    elif platform_tools == "refuse":
        yield _Record(None, where, refused=f"tool type {kind_of!r} is a platform's own tool, not one to search (a "
                                           "'function', a 'custom' tool or a 'namespace' of them is)")


def _in_namespace(fields: Any, namespace: str | None) -> Any:
    """An entry of an OpenAI namespace carries the namespace's name among its tags."""
    if namespace is None or not isinstance(fields, dict):
        return fields
    tags = fields.get("tags")
    return {**fields, "tags": [*tags, namespace] if isinstance(tags, list) else [namespace]}


def _tool_from_record(record: _Record, *, strict: bool, registry_name: str, problems: list[Problem]) -> Tool | None:
    """The tool of one entry, or None with the entry's problems appended to ``problems``.

    The usual entry passes each check in a C call or two (a printable name has no line break and no lone
    surrogate; ASCII text is valid Unicode), so 100,000 plain entries cost little more than building their tools.
    """
    where, fields = record.where, record.fields
    if record.refused is not None or not isinstance(fields, dict):
        detail = record.refused or f"expected a mapping (an object), got {kind(fields)}"
        problems.append(Problem("entry", where, None, detail))
        return None
    name = fields.get("name")
    if not isinstance(name, str):
        problems.append(Problem("entry", where, None, f"tool name must be a string, got {kind(name)}"))
        return None
    found: list[tuple[str, str]] = []  # (cause, detail)
    if not (name.isprintable() and name and name == name.strip()):  # printable: no line break, no surrogate
        found += _name_problems(name)
    if strict and not fields.keys() <= _NATIVE_TOOL_KEYS:
        unknown = sorted(set(map(str, fields)) - _NATIVE_TOOL_KEYS)
        found.append(("entry", f"unknown key(s) {unknown}; allowed: {sorted(_NATIVE_TOOL_KEYS)}"))
    description = fields.get("description")
    if description is None:
        description = ""
    elif not isinstance(description, str):
        found.append(("entry", f"description must be a string, got {kind(description)}"))
    pointer = fields.get("pointer", f"{registry_name}/{name}")
    if not isinstance(pointer, str) or not pointer.strip():
        found.append(("entry", f"pointer must be a non-empty string, got {pointer!r}"))
    found += _unicode_problems(fields)
    lists = {}
    for field_name in ("tags", "examples"):
        try:
            lists[field_name] = _string_list(fields.get(field_name), field_name)
        except ValueError as exc:
            found.append(("entry", str(exc)))
    schema = fields.get("parameters") if strict or "parameters" in fields else fields.get(
        "inputSchema", fields.get("input_schema"))  # MCP's, Anthropic's
    arguments: tuple[Parameter, ...] = ()
    if schema is not None:
        try:
            arguments = parameters(schema)
        except ValueError as exc:
            found.append(("entry", str(exc)))
    if found:
        problems += [Problem(cause, where, name, detail) for cause, detail in found]
        return None
    return Tool(name=name, description=description, pointer=pointer, tags=lists["tags"], examples=lists["examples"],
                parameters=arguments, where=f"{where} {name!r}")


def _name_problems(name: str) -> list[tuple[str, str]]:
    found = []
    if not name.strip():
        found.append(("empty_name", "tool name is empty"))
    elif name != name.strip():
        found.append(("whitespace", "tool name has leading or trailing whitespace"))
    if len((name + "x").splitlines()) > 1:  # \n, \r, U+2028, U+0085, ...
        found.append(("line_break", "tool name contains a newline or another line break"))
    return found


def _unicode_problems(fields: dict[str, Any]) -> list[tuple[str, str]]:
    """One problem per text field holding a string that is not valid Unicode (a lone surrogate)."""
    found = []
    for field_name in _TEXT_FIELDS:
        value = fields.get(field_name)
        if value is None or (isinstance(value, str) and value.isascii()):  # the usual field: nothing to encode
            continue
        for text in _texts(value):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                found.append(("entry", f"{field_name} is not valid Unicode (a lone surrogate?)"))
                break
    return found


def _drop_duplicates(tools: list[Tool], problems: list[Problem]) -> list[Tool]:
    """The tools whose name is not taken by an earlier one; each later one is a problem."""
    first_seen: dict[str, Tool] = {}
    kept = []
    for tool in tools:
        earlier = first_seen.setdefault(tool.name, tool)
        if earlier is tool:
            kept.append(tool)
        else:
            problems.append(Problem.of(tool, "duplicate_name",
                                       f"duplicate tool name, first defined at {earlier.where}"))
    return kept


def _string_list(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError(f"{what} must be a list of strings, got {value!r:.80}")
    return tuple(value)


def _texts(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    return [item for item in value if isinstance(item, str)] if isinstance(value, list) else []

