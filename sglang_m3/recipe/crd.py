"""JSON Schema and the Kubernetes CRD schema, both generated from the pydantic models.

The full CustomResourceDefinition (names, status schema, printer columns) belongs to the
operator (``m3_operator.crd``), which writes the status; this module supplies its schema.

Kubernetes wants a *structural* OpenAPI v3 schema: every node typed, no ``$ref``, no
``anyOf``/``oneOf`` carrying types, no ``additionalProperties`` beside ``properties``, and
OpenAPI 3.0's boolean ``exclusiveMinimum``. ``crd_openapi_schema`` rewrites pydantic's JSON
Schema into that form, so the CRD never drifts from the models the CLI validates with.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from .schema import Recipe

# Keys of pydantic's output that carry no meaning for Kubernetes. Defaults are left to the
# operator (which applies the pydantic defaults), so that stored objects show what was written.
_DROPPED_KEYS = {"title", "default", "$defs"}


def recipe_json_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of a recipe file, as pydantic generates it."""
    return Recipe.model_json_schema(by_alias=True, mode="validation")


def crd_openapi_schema() -> dict[str, Any]:
    """The ``openAPIV3Schema`` of the M3Recipe CRD."""
    source = recipe_json_schema()
    definitions = source.get("$defs", {})
    schema = _structural(source, definitions)
    schema["properties"]["metadata"] = _metadata(schema["properties"]["metadata"])
    return schema


def _metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """Kubernetes validates metadata itself and lets a CRD constrain ``name`` and
    ``generateName`` only (no other field, not even a description). The name keeps its pattern
    and length, so the API server refuses a name the operator could not use at ``kubectl
    apply``, as ``recipe validate`` does."""
    return {"type": "object", "properties": {"name": metadata["properties"]["name"]}}


def _structural(node: Any, definitions: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_structural(item, definitions) for item in node]
    if not isinstance(node, dict):
        return node
    node = _resolve_ref(node, definitions)
    node = _fold_nullable(node, definitions)
    result: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED_KEYS:
            continue
        if key == "description":
            result[key] = _one_line(value)
        elif key == "const":
            result["enum"] = [value]
        elif key == "exclusiveMinimum":
            result["minimum"] = value
            result["exclusiveMinimum"] = True
        elif key == "exclusiveMaximum":
            result["maximum"] = value
            result["exclusiveMaximum"] = True
        elif key == "additionalProperties" and value is False:
            continue  # structural schemas prune unknown fields; false is not allowed here
        elif key == "properties":
            result[key] = {name: _structural(sub, definitions) for name, sub in value.items()}
        else:
            result[key] = _structural(value, definitions)
    if "enum" in result and "type" not in result:
        result["type"] = _enum_type(result["enum"])
    return result


def _resolve_ref(node: dict, definitions: dict) -> dict:
    """Inline ``{"$ref": ...}``; sibling keys (the field's own description) win."""
    if "$ref" not in node:
        return node
    name = node["$ref"].rsplit("/", 1)[-1]
    resolved = copy.deepcopy(definitions[name])
    resolved.update({key: value for key, value in node.items() if key != "$ref"})
    return _resolve_ref(resolved, definitions)


def _fold_nullable(node: dict, definitions: dict) -> dict:
    """``anyOf: [X, {type: null}]`` -> X with ``nullable: true``."""
    options = node.get("anyOf")
    if options is None:
        return node
    non_null = [option for option in options if option.get("type") != "null"]
    if len(non_null) != 1:
        raise ValueError(f"cannot express a union of {len(non_null)} types structurally: {node}")
    folded = {key: value for key, value in node.items() if key != "anyOf"}
    folded.update(_resolve_ref(non_null[0], definitions))
    folded.update({key: value for key, value in node.items() if key != "anyOf"})
    if len(non_null) < len(options):
        folded["nullable"] = True
    return folded


def _enum_type(values: list) -> str:
    kinds = {type(value) for value in values}
    if kinds == {str}:
        return "string"
    if kinds == {bool}:
        return "boolean"
    if kinds <= {int}:
        return "integer"
    raise ValueError(f"enum of mixed types {values}")


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()

