"""Turn parsed M3 argument elements into JSON values, typed by the tool's JSON schema.

M3 writes every scalar as raw text, so the schema decides what the text means:
- `string`: the text verbatim (whitespace included);
- `integer` / `number` / `boolean` / `null`: JSON literals (surrounding whitespace ignored);
- `object`: child elements by name; `array`: repeated `<item>` elements;
- `enum` / `const`: the member whose rendering equals the text;
- `anyOf` / `oneOf` / type lists: the most specific alternative that accepts the value
  (null, boolean, integer, number, object, array, then untyped, string last), so `"5"`
  under `anyOf: [string, integer]` reads as the integer 5 whatever the listed order;
- `$ref` into `$defs` / `definitions`, `allOf` (merged), `prefixItems`, `additionalProperties`;
- untyped schemas (missing, `{}`, a bare `true`) by content: JSON literals become numbers,
  booleans, null, objects or arrays; anything else stays a string; children all named `item`
  form an array, other children an object.

A value the schema rejects (say `five` for an integer) is kept as the verbatim string rather
than dropped: the client sees exactly what the model wrote.
"""

import json
import re
from typing import Any, Dict, List, Optional, Sequence

from sglang_m3.parsers.m3_format import ARRAY_ITEM_TAG
from sglang_m3.parsers.xml_elements import Element, MalformedCall

_JSON_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_JSON_INTEGER = re.compile(r"-?(?:0|[1-9]\d*)")
_MAX_REF_HOPS = 32

# Lower rank is tried first: specific readings before the catch-all string.
_TYPE_RANK = {"null": 0, "boolean": 1, "integer": 2, "number": 3, "object": 4, "array": 5, None: 6, "string": 7}
_TYPE_ALIASES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}


class _Mismatch(Exception):
    """This schema alternative does not accept the value; try the next one."""


def arguments_from_elements(children: Sequence[Element], parameters_schema: Any) -> Dict[str, Any]:
    """JSON arguments of one invoke: its top-level elements read as an object."""
    typer = _SchemaTyper(parameters_schema)
    return typer.object_from_children(children, typer.resolve(parameters_schema))


class _SchemaTyper:
    def __init__(self, root_schema: Any):
        self.root = root_schema if isinstance(root_schema, dict) else {}

    # -- schema helpers -------------------------------------------------------------------

    def resolve(self, schema: Any) -> Optional[dict]:
        """Follow `$ref`s and merge `allOf`; None means untyped."""
        for _ in range(_MAX_REF_HOPS):
            if not isinstance(schema, dict):
                return None
            ref = schema.get("$ref")
            if not isinstance(ref, str):
                break
            target = self._lookup(ref)
            rest = {key: val for key, val in schema.items() if key != "$ref"}
            schema = {**target, **rest} if isinstance(target, dict) else rest
        else:
            return None
        all_of = schema.get("allOf")
        if isinstance(all_of, list):
            merged = {key: val for key, val in schema.items() if key != "allOf"}
            for part in all_of:
                part = self.resolve(part) or {}
                properties = {**part.get("properties", {}), **merged.get("properties", {})}
                merged = {**part, **merged}
                if properties:
                    merged["properties"] = properties
            schema = merged
        return schema

    def _lookup(self, ref: str) -> Any:
        if not ref.startswith("#/"):
            return None
        node: Any = self.root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    def alternatives(self, schema: Optional[dict]) -> List[Optional[dict]]:
        """The single-type readings of a schema, most specific first."""
        if schema is None:
            return [None]
        options: List[Optional[dict]] = []
        base = {key: val for key, val in schema.items() if key not in ("anyOf", "oneOf")}
        branches = schema.get("anyOf") or schema.get("oneOf")
        if isinstance(branches, list) and branches:
            for branch in branches:
                branch = self.resolve(branch)
                options.extend(self.alternatives(None if branch is None else {**base, **branch}))
        else:
            types = _schema_types(schema)
            if len(types) > 1:
                options.extend({**schema, "type": each} for each in types)
            else:
                options.append(schema if _is_typed(schema) else None)
        return sorted(options, key=lambda option: _TYPE_RANK.get(_primary_type(option), 6))

    # -- conversion -----------------------------------------------------------------------

    def value(self, element: Element, schema: Any) -> Any:
        schema = self.resolve(schema)
        for option in self.alternatives(schema):
            try:
                return self._value_as(element, option)
            except _Mismatch:
                continue
        if element.is_leaf:
            return element.text
        return self._untyped(element)

    def _value_as(self, element: Element, schema: Optional[dict]) -> Any:
        if schema is None:
            return self._untyped(element)
        members = _enum_members(schema)
        if members is not None:
            return self._enum_member(element, members)
        kind = _primary_type(schema)
        if kind == "object":
            return self._object(element, schema)
        if kind == "array":
            return self._array(element, schema)
        if not element.is_leaf:
            raise _Mismatch()
        return _scalar(element.text, kind)

    def _enum_member(self, element: Element, members: list) -> Any:
        if not element.is_leaf:
            value = self._untyped(element)
            if value in members:
                return value
            raise _Mismatch()
        for candidate in (element.text, element.text.strip()):
            for member in members:
                if _render_scalar(member) == candidate:
                    return member
        raise _Mismatch()

    def _object(self, element: Element, schema: dict) -> Dict[str, Any]:
        if element.is_leaf:
            return _json_text(element.text, dict)
        return self.object_from_children(element.children, schema)

    def object_from_children(self, children: Sequence[Element], schema: Optional[dict]) -> Dict[str, Any]:
        schema = schema or {}
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        extra = schema.get("additionalProperties")
        result: Dict[str, Any] = {}
        for child in children:
            if child.tag in result:
                raise MalformedCall(f"argument <{child.tag}> appears twice")
            child_schema = properties.get(child.tag, extra if isinstance(extra, dict) else None)
            result[child.tag] = self.value(child, child_schema)
        return result

    def _array(self, element: Element, schema: dict) -> List[Any]:
        if element.is_leaf:
            return _json_text(element.text, list)
        if any(child.tag != ARRAY_ITEM_TAG for child in element.children):
            raise _Mismatch()
        prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
        items = schema.get("items")
        return [
            self.value(child, prefix[index] if index < len(prefix) else items)
            for index, child in enumerate(element.children)
        ]

    def _untyped(self, element: Element) -> Any:
        if element.is_leaf:
            return _untyped_text(element.text)
        if element.children and all(child.tag == ARRAY_ITEM_TAG for child in element.children):
            return [self._untyped(child) for child in element.children]
        return self.object_from_children(element.children, None)


def _schema_types(schema: dict) -> List[str]:
    declared = schema.get("type")
    if isinstance(declared, str):
        declared = [declared]
    if not isinstance(declared, list):
        declared = []
    types = [_TYPE_ALIASES.get(t.lower(), t.lower()) for t in declared if isinstance(t, str)]
    if not types:
        if "properties" in schema or "additionalProperties" in schema:
            types = ["object"]
        elif "items" in schema or "prefixItems" in schema:
            types = ["array"]
    return types


def _is_typed(schema: dict) -> bool:
    return bool(_schema_types(schema)) or _enum_members(schema) is not None


def _primary_type(schema: Optional[dict]) -> Optional[str]:
    if schema is None:
        return None
    types = _schema_types(schema)
    if types:
        return types[0]
    members = _enum_members(schema)
    if members is not None:
        kinds = {_json_kind(member) for member in members}
        return kinds.pop() if len(kinds) == 1 else None
    return None


def _json_kind(value: Any) -> Optional[str]:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return None


def _enum_members(schema: dict) -> Optional[list]:
    if "const" in schema:
        return [schema["const"]]
    members = schema.get("enum")
    return members if isinstance(members, list) and members else None


def _render_scalar(value: Any) -> Optional[str]:
    """How the chat template writes a scalar; None for containers."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    return None


def _scalar(text: str, kind: Optional[str]) -> Any:
    stripped = text.strip()
    if kind == "string":
        return text
    if kind == "integer" and _JSON_INTEGER.fullmatch(stripped):
        return int(stripped)
    if kind == "number" and _JSON_NUMBER.fullmatch(stripped):
        return json.loads(stripped)
    if kind == "boolean" and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    if kind == "null" and stripped in ("null", ""):
        return None
    raise _Mismatch()


def _json_text(text: str, expected: type) -> Any:
    """An object or array written as inline JSON text, or empty."""
    stripped = text.strip()
    if not stripped:
        return expected()
    try:
        value = json.loads(stripped)
    except ValueError:
        raise _Mismatch() from None
    if not isinstance(value, expected):
        raise _Mismatch()
    return value


def _untyped_text(text: str) -> Any:
    stripped = text.strip()
    if stripped in ("true", "false", "null") or _JSON_NUMBER.fullmatch(stripped):
        return json.loads(stripped)
    if stripped[:1] in ("{", "["):
        try:
            return json.loads(stripped)
        except ValueError:
            return text
    return text
