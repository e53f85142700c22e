"""Constrained M3 tool calls: an XGrammar structural tag in M3's namespaced XML.

XGrammar 0.2.7 knows the M3 call layout (`get_model_structural_tag("minimax_m3", ...)`, argument
style `minimax_m3_xml`), but its converter refuses unconstrained sub-schemas (`{}`, a bare
`{"type": "object"}`, `additionalProperties` schemas) and treats every non-strict tool as
unconstrained, so most real tool lists fail to compile. M3's argument XML cannot be written
without a schema to follow, so every tool is constrained by a *narrowed* copy of its schema
whose outputs all satisfy the original: untyped values become strings, objects take only their
declared properties (required ones listed as the original lists them), arrays without item
schemas hold strings.

One relaxation: in `minimax_m3_xml` a string value runs up to the next namespace marker, and
XGrammar cannot combine that exclusion with `pattern`, a `format` it knows, `minLength` or
`maxLength` (its C++ check fails the whole request). Those keywords constrain only strings, so
they are dropped and such strings are constrained to be strings, as SGLang's own XML response
templates drop length bounds; a call may then break them, and the client sees what was written.
"""

from typing import Any, Dict, List, Literal, Union

from xgrammar import StructuralTag, get_model_structural_tag

XGRAMMAR_MODEL = "minimax_m3"
# M3 separates elements with a newline; a cap on whitespace runs between elements keeps a
# degenerate model (random weights, repetition) from spinning in spacing forever.
MAX_WHITESPACE_BETWEEN_ELEMENTS = 8

_SCHEMA_LIST_KEYS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAP_KEYS = ("properties", "$defs", "definitions")
# Keywords XGrammar's `minimax_m3_xml` style cannot compile, with why they may go.
_OPEN_ENDED_KEYS = ("additionalProperties", "patternProperties")  # re-closed below
_STRING_BOUND_KEYS = ("pattern", "format", "minLength", "maxLength")  # relaxed: see the docstring
_CONSTRAINING_KEYS = ("type", "properties", "items", "prefixItems", "anyOf", "oneOf", "allOf", "$ref", "enum", "const")


def narrowed_schema(schema: Any) -> Dict[str, Any]:
    """A schema XGrammar's `minimax_m3_xml` style compiles, accepting a subset of `schema` less
    its string bounds (see the module docstring)."""
    if not isinstance(schema, dict) or not any(key in schema for key in _CONSTRAINING_KEYS):
        return {"type": "string"}
    narrowed = {key: value for key, value in schema.items() if key not in _OPEN_ENDED_KEYS + _STRING_BOUND_KEYS}
    for key in _SCHEMA_MAP_KEYS:
        if isinstance(schema.get(key), dict):
            narrowed[key] = {name: narrowed_schema(sub) for name, sub in schema[key].items()}
    for key in _SCHEMA_LIST_KEYS:
        if isinstance(schema.get(key), list):
            narrowed[key] = [narrowed_schema(sub) for sub in schema[key]]
    if _may_be(schema, "array") and "prefixItems" not in schema:
        narrowed["items"] = narrowed_schema(schema.get("items"))
    elif isinstance(schema.get("items"), dict):  # the items after `prefixItems`
        narrowed["items"] = narrowed_schema(schema["items"])
    if _may_be(schema, "object"):
        properties = narrowed.setdefault("properties", {})
        extra = schema.get("additionalProperties")
        for name in schema.get("required") or []:
            properties.setdefault(name, narrowed_schema(extra if isinstance(extra, dict) else None))
        narrowed["additionalProperties"] = False
    return narrowed


def _may_be(schema: dict, kind: str) -> bool:
    declared = schema.get("type")
    if isinstance(declared, str):
        return declared == kind
    if isinstance(declared, list):
        return kind in declared
    marker = "properties" if kind == "object" else "items"
    return marker in schema


def build_structural_tag(
    tools: List[Dict[str, Any]],
    tool_choice: Union[Literal["auto", "required"], Dict[str, Any]],
    reasoning: bool,
    parallel_tool_calls: bool,
) -> StructuralTag:
    """Structural tag for `tools` (OpenAI tool dicts) under `tool_choice`.

    `reasoning` is True only when the grammar must also cover the `<mm:think>` body (no
    reasoning parser owns it): the enabled-thinking prompt ends inside that body.
    """
    constrained_tools = [
        {
            "type": "function",
            "function": {
                "name": tool["function"]["name"],
                "parameters": narrowed_schema(tool["function"].get("parameters") or {"type": "object"}),
                "strict": True,
            },
        }
        for tool in tools
    ]
    return get_model_structural_tag(
        model=XGRAMMAR_MODEL,
        tools=constrained_tools,
        tool_choice=tool_choice,
        reasoning=reasoning,
        parallel_tool_calls=parallel_tool_calls,
        max_whitespace_cnt=MAX_WHITESPACE_BETWEEN_ELEMENTS,
    )
