"""OpenAPI 3 documents (JSON or YAML) as registries: one tool per operation.

Each method under each path (get, put, post, delete, patch, head, options, trace) is a tool:

- name: the ``operationId``, or with ``names="path"`` (and for an operation without one) the method and the path,
  lower-case, path parameters dropped, every run of other characters than ``[a-z0-9]`` one ``_``
  (:func:`path_name`): ASCII, so that every tool-calling API takes it;
- description: ``summary`` and ``description`` joined, Markdown and HTML reduced to plain text (:func:`plain_text`);
- pointer: ``"METHOD /path"``, what to call;
- tags: the operation's ``tags``;
- parameters: the path-level ``parameters``, then the operation's (which override them by ``(name, in)``), path,
  query and header ones (a cookie belongs to the caller's session, not to the call; the ``Accept``, ``Content-Type``
  and ``Authorization`` headers are ignored, as OpenAPI says), then the ``requestBody``'s schema
  (``application/json``, else the first media type with one): an object body's properties, or one parameter
  ``body``. A name already taken keeps its first meaning (a query parameter beside a body property of its name).

A ``$ref`` is followed where the conversion reads (a path item, a parameter, its schema, a request body, its
schema and each property's own schema) and only there: the arguments are read one level deep
(``registry/parameters.py``), so a recursive schema (a tree node whose children are nodes) loads as it is, never
walked. Only refs within the document (``#/components/...``) are taken; one pointing elsewhere (another file, a
URL), one pointing nowhere and one that leads back to itself through refs alone (``A -> B -> A``) are refused.

A problem of one operation (not a mapping, a bad ``$ref``, a bad parameter) is that entry's problem, reported with
the others; a document that is not OpenAPI 3, has no operations, or gives two operations one name is refused whole.

>>> document = {"openapi": "3.0.3", "paths": {"/person/{person_id}/movie_credits": {
...     "parameters": [{"name": "person_id", "in": "path", "schema": {"type": "integer"}}],
...     "get": {"summary": "Get Movie Credits", "description": "The **movie** credits of a [person](#person)."}}}}
>>> [entry] = tool_entries(document, source="tmdb.json", names="path")
>>> entry.where
'tmdb.json (paths./person/{person_id}/movie_credits.get)'
>>> entry.fields["name"], entry.fields["pointer"]
('get_person_movie_credits', 'GET /person/{person_id}/movie_credits')
>>> entry.fields["description"]
'Get Movie Credits. The movie credits of a person.'
>>> entry.fields["parameters"]
{'type': 'object', 'properties': {'person_id': {'type': 'integer'}}, 'required': ['person_id']}
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard
from urllib.parse import unquote

from tooltrie.errors import RegistryError
from tooltrie.registry.problems import kind

METHODS = ("get", "put", "post", "delete", "patch", "head", "options", "trace")
Naming = Literal["operation_id", "path"]
NAMINGS: tuple[Naming, ...] = ("operation_id", "path")
_LOCATIONS = ("path", "query", "header", "cookie")
_IGNORED_HEADERS = frozenset({"accept", "content-type", "authorization"})  # OpenAPI: such definitions SHALL be ignored


@dataclass(frozen=True, slots=True)
class Entry:
    """One operation: its place, and its tool's fields in the native schema (or why it is no tool)."""

    where: str
    fields: dict[str, Any] | None
    refused: str | None = None


class _OperationError(ValueError):
    """A problem of one operation: reported as that entry's problem."""


def is_openapi(document: Any) -> TypeGuard[dict[str, Any]]:
    """An OpenAPI (or Swagger) document, by its top-level version key."""
    return isinstance(document, dict) and ("openapi" in document or "swagger" in document)


def tool_entries(document: dict[str, Any], *, source: str, names: Naming = "operation_id") -> list[Entry]:
    """One entry per operation, in document order; RegistryError for a document that cannot be read as tools."""
    if "openapi" not in document:
        raise RegistryError(f"{source}: top-level 'swagger': {document.get('swagger')!r}: a Swagger 2.0 document; "
                            "OpenAPI 3 is needed (convert it, e.g. with swagger2openapi)")
    if not str(document["openapi"]).startswith("3."):
        raise RegistryError(f"{source}: top-level 'openapi': {document['openapi']!r}: OpenAPI 3.x is needed")
    paths = document.get("paths")
    if not isinstance(paths, dict) or not paths:
        raise RegistryError(f"{source}: 'paths' must be a non-empty mapping of paths to operations, got {kind(paths)}")
    refs = _Refs(document)
    entries: list[Entry] = []
    first: dict[str, str] = {}  # tool name -> "METHOD /path (place)" of the operation that gave it first
    for path, raw_item in paths.items():
        try:
            item = refs.resolve(raw_item, f"paths.{path}")
            if not isinstance(item, dict):
                raise _OperationError(f"expected a mapping (an object), got {kind(item)}")
        except _OperationError as exc:
            entries.append(Entry(f"{source} (paths.{path})", None, str(exc)))
            continue
        for method in (key for key in item if key in METHODS):
            place = f"paths.{path}.{method}"
            try:
                fields = _tool_fields(str(path), method, item, refs, names=names)
            except _OperationError as exc:
                entries.append(Entry(f"{source} ({place})", None, str(exc)))
                continue
            here = f"{fields['pointer']} ({place})"
            earlier = first.setdefault(fields["name"], here)
            if earlier != here:
                raise RegistryError(f"{source}: {earlier} and {here} both give the tool name {fields['name']!r}")
            entries.append(Entry(f"{source} ({place})", fields))
    if not entries:
        raise RegistryError(f"{source}: 'paths' has no operations (one of {', '.join(METHODS)} under a path)")
    return entries


def path_name(method: str, path: str) -> str:
    """A tool name from an operation's method and path.

    >>> path_name("GET", "/person/{person_id}/movie_credits")
    'get_person_movie_credits'
    >>> path_name("get", "/me/player/currently-playing")
    'get_me_player_currently_playing'
    """
    words = re.sub(r"\{[^}]*\}", "", f"{method} {path}").lower()
    return re.sub(r"[^a-z0-9]+", "_", words).strip("_")


def _tool_fields(path: str, method: str, item: dict[str, Any], refs: _Refs, *, names: Naming) -> dict[str, Any]:
    place = f"paths.{path}.{method}"
    operation = item[method]
    if not isinstance(operation, dict):
        raise _OperationError(f"expected a mapping (an object), got {kind(operation)}")
    name = operation.get("operationId") if names == "operation_id" else None
    if name is None:
        name = path_name(method, path)
    elif not isinstance(name, str):
        raise _OperationError(f"'operationId' must be a string, got {kind(name)}")
    texts = [_text(owner.get(key), f"{owner_place}.{key}") for owner, owner_place
             in ((operation, place), (item, f"paths.{path}")) for key in ("summary", "description")]
    summary, description = texts[:2] if any(texts[:2]) else texts[2:]  # a path item's text covers its operations
    if summary and description and not summary.endswith((".", "!", "?", ":")):
        summary += "."
    fields: dict[str, Any] = {"name": name, "description": " ".join(filter(None, (summary, description))),
                              "pointer": f"{method.upper()} {path}"}
    if "tags" in operation:
        fields["tags"] = operation["tags"]  # checked by the loader, as every format's tags are
    schema = _arguments(path, method, item, refs)
    if schema["properties"]:
        fields["parameters"] = schema
    return fields


def _arguments(path: str, method: str, item: dict[str, Any], refs: _Refs) -> dict[str, Any]:
    """The operation's arguments as one JSON schema object (what ``registry/parameters.py`` reads)."""
    place = f"paths.{path}.{method}"
    operation = item[method]
    declared: dict[tuple[str, str], tuple[dict[str, Any], str]] = {}  # (name, in) -> (parameter, its place)
    for owner, owner_place in ((item, f"paths.{path}"), (operation, place)):  # the operation's override the path's
        listed = owner.get("parameters") or []
        if not isinstance(listed, list):
            raise _OperationError(f"{owner_place}.parameters must be a list, got {kind(listed)}")
        for i, raw in enumerate(listed):
            where = f"{owner_place}.parameters[{i}]"
            parameter = refs.resolve(raw, where)
            if not isinstance(parameter, dict) or not isinstance(parameter.get("name"), str) \
                    or parameter.get("in") not in _LOCATIONS:
                raise _OperationError(f"{where} must be a mapping with a 'name' and 'in' (one of {_LOCATIONS}), "
                                      f"got {kind(parameter)}")
            declared[parameter["name"], parameter["in"]] = parameter, where
    properties: dict[str, dict[str, Any]] = {}
    required: list[str] = []
    for (name, location), (parameter, where) in declared.items():
        if location == "cookie" or (location == "header" and name.lower() in _IGNORED_HEADERS) or name in properties:
            continue
        schema = parameter.get("schema")
        if schema is None and isinstance(parameter.get("content"), dict):  # the other way to give a schema
            schema = next(iter(_media_schemas(parameter["content"], f"{where}.content").values()), (None, ""))[0]
        properties[name] = _property(schema, parameter.get("description"), refs, f"{where}.schema")
        if location == "path" or _flag(parameter.get("required", False), f"{where}.required"):
            required.append(name)
    if operation.get("requestBody") is not None:
        _add_body(refs.resolve(operation["requestBody"], f"{place}.requestBody"), f"{place}.requestBody", refs,
                  properties, required)
    return {"type": "object", "properties": properties, "required": required}


def _add_body(body: Any, place: str, refs: _Refs, properties: dict[str, dict[str, Any]], required: list[str]) -> None:
    """The request body's arguments: an object's properties, or one ``body``."""
    if not isinstance(body, dict):
        raise _OperationError(f"{place} must be a mapping, got {kind(body)}")
    media = _media_schemas(body.get("content") or {}, f"{place}.content")
    if not media:
        return
    raw, schema_place = media.get("application/json") or next(iter(media.values()))
    schema = refs.resolve(raw, schema_place)
    if not isinstance(schema, dict):
        raise _OperationError(f"{schema_place} must be a schema object, got {kind(schema)}")
    if schema.get("type") != "object" and "properties" not in schema:
        if "body" not in properties:
            properties["body"] = _property(raw, body.get("description"), refs, schema_place)
            if _flag(body.get("required", False), f"{place}.required"):
                required.append("body")
        return
    body_properties = schema.get("properties") or {}
    listed = schema.get("required") or []
    if not isinstance(body_properties, dict) or not isinstance(listed, list):
        raise _OperationError(f"{schema_place}: 'properties' must be a mapping and 'required' a list")
    for name, spec in body_properties.items():
        if name not in properties:
            properties[name] = _property(spec, None, refs, f"{schema_place}.properties.{name}")
            if name in listed:
                required.append(name)


def _media_schemas(content: Any, place: str) -> dict[str, tuple[Any, str]]:
    """{media type: (its schema, the schema's place)}, for the media types that have one."""
    if not isinstance(content, dict):
        raise _OperationError(f"{place} must be a mapping of media types, got {kind(content)}")
    return {media: (value["schema"], f"{place}.{media}.schema") for media, value in content.items()
            if isinstance(value, dict) and value.get("schema") is not None}


def _property(raw: Any, description: Any, refs: _Refs, place: str) -> dict[str, Any]:
    """One argument's schema, flattened to what the registry keeps: type, description, enum."""
    schema = refs.resolve(raw, place) if raw is not None else {}
    if not isinstance(schema, dict):
        raise _OperationError(f"{place} must be a schema object, got {kind(schema)}")
    if description is None and isinstance(raw, dict):
        description = raw.get("description", schema.get("description"))  # OpenAPI 3.1: beside a $ref, it wins
    found: dict[str, Any] = {}
    declared = schema.get("type") or _alternative_types(schema, refs, place) or ("object" if "properties" in schema
                                                                                 else None)
    if declared:
        found["type"] = declared
    if description is not None:
        found["description"] = _text(description, f"{place}.description")
    if "enum" in schema:
        found["enum"] = schema["enum"]
    return found


def _alternative_types(schema: dict[str, Any], refs: _Refs, place: str) -> list[str]:
    """The types a ``oneOf``/``anyOf`` allows (``anyOf: [{type: string}, {type: "null"}]`` -> string|null)."""
    types: list[str] = []
    for key in ("oneOf", "anyOf"):
        for i, alternative in enumerate(schema.get(key) or []):
            declared = refs.resolve(alternative, f"{place}.{key}[{i}]")
            declared = declared.get("type") if isinstance(declared, dict) else None
            types += [declared] if isinstance(declared, str) and declared not in types else []
    return types


def _flag(value: Any, place: str) -> bool:
    """A ``required``: true or false (the strings too: the bundled Spotify document writes ``"true"``)."""
    if value in (True, False, "true", "false"):
        return value in (True, "true")
    raise _OperationError(f"{place} must be true or false, got {kind(value)}")


def _text(value: Any, place: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _OperationError(f"{place} must be a string, got {kind(value)}")
    return plain_text(value)


class _Refs:
    """Follows local ``$ref``s (``#/components/schemas/Pet``, JSON pointers) within one document."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document

    def resolve(self, value: Any, place: str) -> Any:
        """``value``, or what its chain of refs ends at."""
        chain: list[str] = []
        while isinstance(value, dict) and "$ref" in value:
            ref = value["$ref"]
            if not isinstance(ref, str):
                raise _OperationError(f"$ref at {place} must be a string, got {kind(ref)}")
            if not ref.startswith("#"):
                raise _OperationError(f"$ref {ref!r} at {place} points outside the document: only refs within it "
                                      "(#/components/...) are read")
            if ref in chain:
                raise _OperationError(f"$ref {ref!r} at {place} is a cycle: {' -> '.join([*chain, ref])}")
            chain.append(ref)
            value = self._target(ref, place)
        return value

    def _target(self, ref: str, place: str) -> Any:
        fragment = unquote(ref[1:])
        if fragment and not fragment.startswith("/"):
            raise _OperationError(f"$ref {ref!r} at {place} is not a JSON pointer (#/components/...)")
        value: Any = self.document
        for depth, token in enumerate(fragment.split("/")[1:] if fragment else []):
            token = token.replace("~1", "/").replace("~0", "~")
            if isinstance(value, dict) and token in value:
                value = value[token]
            elif isinstance(value, list) and token.isdigit() and int(token) < len(value):
                value = value[int(token)]
            else:
                parent = "/".join(fragment.split("/")[: depth + 1])
                raise _OperationError(f"$ref {ref!r} at {place} points nowhere: no {token!r} in #{parent}")
        return value


def _cells(row: str) -> str:
    return "; ".join(cell.strip() for cell in row.split("|")) + "\n"


# Markdown and HTML to plain text, in this order: each rule sees what the ones before it left.
_PLAIN_TEXT_RULES: list[tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]]] = [
    (re.compile(r"<(https?://[^>\s]+)>"), r"\1"),  # an autolink keeps its address
    (re.compile(r"</?(br|p|div|li|ul|ol|tr|td|th|table|h[1-6]|hr|pre|blockquote)\b[^<>]*>", re.I), "\n"),
    (re.compile(r"</?[A-Za-z][^<>]*>"), ""),  # inline tags: <a href=...>, <b>, <code>
    (re.compile(r"!?\[([^\]]*)\]\([^)]*\)"), r"\1"),  # [text](url), ![alt](image)
    (re.compile(r"\[([^\]]+)\]\[[^\]]*\]"), r"\1"),  # [text][reference]
    (re.compile(r"^ {0,3}\[[^\]]+\]:.*$", re.M), ""),  # [reference]: url
    (re.compile(r"^ {0,3}#{1,6}[ \t]+|[ \t]+#+[ \t]*$", re.M), ""),  # ## headings
    (re.compile(r"^[ \t]*(=+|-{3,}|\*{3,}|_{3,}|\|?[ \t:|-]*-[ \t:|-]*)[ \t]*$", re.M), ""),  # rules, |---|
    (re.compile(r"^[ \t]*\|(.*?)\|?[ \t]*$", re.M), lambda row: _cells(row[1])),  # | a | b | -> a; b
    (re.compile(r"^[ \t]*[-*+][ \t]+", re.M), ""),  # bullets (a numbered list keeps its numbers: they may be codes)
    (re.compile(r"(\*\*|__|~~)(?=\S)(.+?)(?<=\S)\1"), r"\2"),  # **strong**, __strong__, ~~struck~~
    (re.compile(r"(?<![\w*])\*(?=\S)(.+?)(?<=\S)\*(?![\w*])"), r"\1"),  # *emphasis*
    (re.compile(r"(?<!\w)_(?=\S)(.+?)(?<=\S)_(?!\w)"), r"\1"),  # _emphasis_ (never inside snake_case)
    (re.compile(r"`+"), ""),  # `code`, ```fences```
]


def plain_text(text: str) -> str:
    """Markdown and HTML reduced to one line of plain text.

    >>> plain_text("## Search\\nFind a [movie](#endpoint:x) by _title_, see <b>`query`</b> &amp; **more**.<br/>")
    'Search Find a movie by title, see query & more.'
    """
    for pattern, replacement in _PLAIN_TEXT_RULES:
        text = pattern.sub(replacement, text)
    return " ".join(html.unescape(text).split())
