"""Constrained M3 tool calls: an XGrammar structural tag in M3's namespaced XML.

XGrammar 0.2.7 knows the M3 call layout (`get_model_structural_tag("minimax_m3", ...)`, argument
style `minimax_m3_xml`), but its converter refuses many schemas real clients send (unconstrained
sub-schemas, `allOf`, `propertyNames`, string bounds) and treats every non-strict tool as
unconstrained. M3's argument XML cannot be written without a schema to follow, so every tool is
constrained by a *narrowed* copy of its schema (`schema_narrowing` says what is kept, merged,
left out or relaxed, and why).
"""

from typing import Any, Dict, List, Literal, Union

from xgrammar import StructuralTag, get_model_structural_tag

from sglang_m3.parsers.schema_narrowing import narrowed_schema

XGRAMMAR_MODEL = "minimax_m3"
# M3 separates elements with a newline; a cap on whitespace runs between elements keeps a
# degenerate model (random weights, repetition) from spinning in spacing forever.
MAX_WHITESPACE_BETWEEN_ELEMENTS = 8


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
    return get_model_structural_tag(
        model=XGRAMMAR_MODEL,
        tools=[_constrained_tool(tool["function"]) for tool in tools],
        tool_choice=tool_choice,
        reasoning=reasoning,
        parallel_tool_calls=parallel_tool_calls,
        max_whitespace_cnt=MAX_WHITESPACE_BETWEEN_ELEMENTS,
    )


def _constrained_tool(function: Dict[str, Any]) -> Dict[str, Any]:
    """The strict tool XGrammar is given; a ValueError (the request's 400) when no arguments
    are left to constrain the call to."""
    parameters = narrowed_schema(function.get("parameters") or {"type": "object"})
    if parameters is False:
        raise ValueError(f"tool {function['name']!r}: its parameters schema leaves no arguments a constrained call can write")
    return {"type": "function", "function": {"name": function["name"], "parameters": parameters, "strict": True}}
