"""A tool's arguments, read from what registries already carry.

Two shapes are taken, in every format:

- a JSON schema object, as OpenAI tools (``parameters``), MCP (``inputSchema``) and BFCL write it:
  ``{"type": "object", "properties": {name: {"type", "description", "enum"}}, "required": [names]}``;
- the native list, as ``Tool.content()`` writes it: ``[{"name", "description"?, "type"?, "required"?, "values"?}]``.

Only the top level is read: nested objects stay one parameter described by their own text.

>>> [p.name for p in parameters({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})]
['city']
>>> parameters([{"name": "unit", "values": ["C", "F"]}])[0].values
('C', 'F')
"""

from __future__ import annotations

import json
from typing import Any

from tooltrie.registry.model import Parameter
from tooltrie.registry.problems import kind

_NATIVE_KEYS = frozenset({"name", "description", "type", "required", "values"})


def parameters(value: Any) -> tuple[Parameter, ...]:
    """The parameters ``value`` describes (None: none); ValueError saying what is wrong otherwise."""
    if value is None:
        return ()
    if isinstance(value, dict):
        found = _from_schema(value)
    elif isinstance(value, list):
        found = tuple(_from_native(item, i) for i, item in enumerate(value))
    else:
        raise ValueError(f"parameters must be a JSON schema object or a list of parameters, got {kind(value)}")
    for parameter in found:
        try:
            "".join([parameter.name, parameter.description, parameter.type, *parameter.values]).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"parameter {parameter.name!r} is not valid Unicode (a lone surrogate?)") from None
    return found


def _from_schema(schema: dict[str, Any]) -> tuple[Parameter, ...]:
    properties = schema.get("properties") or {}
    if not isinstance(properties, dict):
        raise ValueError(f"parameters' 'properties' must be a mapping, got {kind(properties)}")
    required = schema.get("required") or []
    if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
        raise ValueError(f"parameters' 'required' must be a list of names, got {kind(required)}")
    found = []
    for name, spec in properties.items():
        if not str(name):
            raise ValueError("parameters' 'properties' has a parameter with an empty name")
        if not isinstance(spec, dict):
            raise ValueError(f"parameter {name!r} must be a schema object, got {kind(spec)}")
        declared = spec.get("type", "")
        enum = spec.get("enum") or []
        if not isinstance(enum, list):
            raise ValueError(f"parameter {name!r}: 'enum' must be a list, got {kind(enum)}")
        found.append(Parameter(
            name=str(name),
            description=_text(spec.get("description"), f"parameter {name!r}: 'description'"),
            type="|".join(map(str, declared)) if isinstance(declared, list) else str(declared),
            required=name in required,
            values=tuple(_value_text(item) for item in enum),
        ))
    return tuple(found)


def _from_native(item: Any, index: int) -> Parameter:
    where = f"parameters[{index}]"
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        raise ValueError(f"{where} must be a mapping with a non-empty 'name', got {kind(item)}")
    unknown = sorted(set(map(str, item)) - _NATIVE_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(_NATIVE_KEYS)}")
    values = item.get("values") or []
    if not isinstance(values, list):
        raise ValueError(f"{where}: 'values' must be a list, got {kind(values)}")
    required = item.get("required", False)
    if not isinstance(required, bool):
        raise ValueError(f"{where}: 'required' must be true or false, got {kind(required)}")
    return Parameter(name=item["name"], description=_text(item.get("description"), f"{where}: 'description'"),
                     type=_text(item.get("type"), f"{where}: 'type'"), required=required,
                     values=tuple(_value_text(value) for value in values))


def _text(value: Any, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, got {kind(value)}")
    return value


def _value_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)



__all__ = ["parameters"]
