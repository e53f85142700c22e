"""Arguments typed by the whole JSON schema: root and nested `oneOf` / `anyOf` / `allOf`,
`$ref` into `$defs` / `definitions` (recursive ones included), type lists, `nullable`,
`patternProperties`; and how ties between branches are broken."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_m3.parsers.m3_format import NAMESPACE as NS
from tests.parsers import m3_strategies as m3
from tests.parsers import schema_strategies as schemas
from tests.parsers.test_tool_call_properties import parse_one_shot, parse_streamed, rendered_reply, sglang_tools

PROPERTY_SETTINGS = settings(max_examples=120, deadline=None)


def exact(value):
    """JSON text that tells 1, 1.0 and true apart."""
    return json.dumps(value, ensure_ascii=False)


@PROPERTY_SETTINGS
@given(generated=schemas.calls(), content=m3.free_text, data=st.data())
def test_values_valid_for_combinator_schemas_parse_back(generated, content, data):
    """Arrays written as `<item>`s or as a repeated member, one-shot and under any chunking."""
    rng = data.draw(st.randoms(use_true_random=False))
    text = content + schemas.written_block(generated, repeat=lambda: rng.random() < 0.5)
    tools = sglang_tools(generated)
    normal_text, calls = parse_one_shot(text, tools)
    assert normal_text == content
    assert [(name, exact(json.loads(arguments))) for name, arguments in calls] == [
        (name, exact(value)) for name, _, value in generated
    ]
    chunks = m3.split_at(text, data.draw(m3.chunkings(len(text))))
    assert parse_streamed(chunks, tools) == (normal_text, calls)


@settings(max_examples=40, deadline=None)
@given(generated=schemas.calls())
def test_the_test_writer_writes_what_the_chat_template_writes(chat_tokenizer, generated):
    assert rendered_reply(chat_tokenizer, generated) == schemas.written_block(generated)


def arguments(parameters, body):
    """Arguments of one call of `f` with this body, checked to stream the same."""
    text = f'{NS}<tool_call>\n{NS}<invoke name="f">\n{body}{NS}</invoke>\n{NS}</tool_call>'
    tools = sglang_tools([("f", parameters, None)])
    normal_text, calls = parse_one_shot(text, tools)
    assert (normal_text, len(calls)) == ("", 1)
    assert parse_streamed(list(text), tools) == (normal_text, calls)
    return json.loads(calls[0][1])


def arg(tag, value):
    return f"{NS}<{tag}>{value}{NS}</{tag}>"


STRINGS = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}, "flag": {"type": "string"}, "raw": {"type": "string"}}}


@pytest.mark.parametrize("keyword", ["oneOf", "anyOf"])
def test_root_combinator_types_arguments_by_its_branches(keyword):
    """The issue's case: no root `properties`, only a root union; string members stay strings."""
    parameters = {keyword: [STRINGS, {"type": "object", "properties": {"other": {"type": "integer"}}, "required": ["other"]}]}
    body = arg("items", arg("item", "12") + arg("item", "34")) + arg("flag", "true") + arg("raw", '{"x":1}')
    assert arguments(parameters, body) == {"items": ["12", "34"], "flag": "true", "raw": '{"x":1}'}


def test_root_allof_and_ref_type_arguments():
    parameters = {
        "allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"count": {"type": "integer"}}}],
        "$defs": {"Base": {"type": "object", "properties": {"name": {"type": "string"}}}},
    }
    assert arguments(parameters, arg("name", "42") + arg("count", "42")) == {"name": "42", "count": 42}


def test_discriminator_picks_the_branch_the_value_validates_against():
    shapes = {
        "oneOf": [
            {"type": "object", "properties": {"kind": {"const": "circle"}, "size": {"type": "string"}}, "required": ["kind"]},
            {"type": "object", "properties": {"kind": {"const": "square"}, "size": {"type": "integer"}}, "required": ["kind"]},
        ]
    }
    parameters = {"type": "object", "properties": {"shape": shapes}}
    assert arguments(parameters, arg("shape", arg("kind", "square") + arg("size", "3"))) == {"shape": {"kind": "square", "size": 3}}
    assert arguments(parameters, arg("shape", arg("kind", "circle") + arg("size", "3"))) == {"shape": {"kind": "circle", "size": "3"}}


@pytest.mark.parametrize(
    "schema, text, expected",
    [
        # Both read and validate: the more specific kind wins, whatever the order.
        ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, "5", 5),
        ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "5", 5),
        # Only one validates: that one, even when less specific.
        ({"anyOf": [{"type": "integer", "minimum": 10}, {"type": "string"}]}, "5", "5"),
        ({"anyOf": [{"type": "integer", "minimum": 10}, {"type": "string"}]}, "50", 50),
        # None validates: the most specific reading still types the value.
        ({"anyOf": [{"type": "integer", "minimum": 10}, {"type": "string", "maxLength": 0}]}, "5", 5),
        # A string-only schema keeps the text, constraints or not.
        ({"allOf": [{"type": "string"}, {"maxLength": 1}]}, " 12 ", " 12 "),
        ({"type": ["integer", "null"]}, "null", None),
        ({"type": "integer", "nullable": True}, "null", None),
        ({"type": "string", "nullable": True}, "nil", "nil"),
        ({"type": ["boolean", "string"]}, "false", False),
        ({"type": "number", "enum": [1.5, 2.5]}, "2.5", 2.5),
        ({"allOf": [{"type": "number"}, {"type": "integer"}]}, "3", 3),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "3", "3"),
    ],
)
def test_ties_between_readings(schema, text, expected):
    parameters = {"type": "object", "properties": {"x": schema}}
    assert exact(arguments(parameters, arg("x", text))["x"]) == exact(expected)


def test_equal_object_branches_go_to_the_first_in_schema_order():
    as_string = {"type": "object", "properties": {"v": {"type": "string"}}}
    as_integer = {"type": "object", "properties": {"v": {"type": "integer"}}}
    body = arg("x", arg("v", "7"))
    assert arguments({"properties": {"x": {"anyOf": [as_string, as_integer]}}}, body) == {"x": {"v": "7"}}
    assert arguments({"properties": {"x": {"anyOf": [as_integer, as_string]}}}, body) == {"x": {"v": 7}}


def test_additional_properties_false_and_required_decide_between_objects():
    strict = {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False}
    loose = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["b"]}
    parameters = {"properties": {"x": {"anyOf": [loose, strict]}}}
    assert arguments(parameters, arg("x", arg("a", "1"))) == {"x": {"a": "1"}}
    assert arguments(parameters, arg("x", arg("a", "1") + arg("b", "2"))) == {"x": {"a": 1, "b": 2}}


def test_pattern_and_additional_properties_type_members():
    parameters = {
        "type": "object",
        "properties": {"id": {"type": "string"}},
        "patternProperties": {"^n_": {"type": "integer"}, "[": {"type": "integer"}},
        "additionalProperties": {"type": "boolean"},
    }
    body = arg("id", "7") + arg("n_count", "7") + arg("other", "true")
    assert arguments(parameters, body) == {"id": "7", "n_count": 7, "other": True}


def test_prefix_items_then_items():
    parameters = {"properties": {"x": {"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "integer"}}}}
    assert arguments(parameters, arg("x", arg("item", "1") + arg("item", "2") + arg("item", "3"))) == {"x": ["1", 2, 3]}


def test_recursive_definitions_type_every_depth():
    parameters = {
        "type": "object",
        "properties": {"tree": {"$ref": "#/definitions/Node"}},
        "definitions": {
            "Node": {
                "type": "object",
                "properties": {"id": {"type": "string"}, "kids": {"type": "array", "items": {"$ref": "#/definitions/Node"}}},
            }
        },
    }
    deep = arg("id", "1") + arg("kids", arg("item", arg("id", "2") + arg("kids", arg("item", arg("id", "3")))))
    assert arguments(parameters, arg("tree", deep)) == {"tree": {"id": "1", "kids": [{"id": "2", "kids": [{"id": "3"}]}]}}


@pytest.mark.parametrize(
    "definition, text, expected",
    [
        ({"$ref": "#/$defs/A"}, "5", "5"),  # refers only to itself: no alternative, kept as written
        ({"anyOf": [{"$ref": "#/$defs/A"}, {"type": "integer"}]}, "5", 5),  # the cycle adds nothing
        ({"allOf": [{"$ref": "#/$defs/A"}], "type": "integer"}, "5", "5"),
        ({"$ref": "#/$defs/B"}, "5", "5"),  # A -> B -> A
        ({"$ref": "#/$defs/missing"}, "5", 5),  # names nothing: untyped
    ],
)
def test_reference_cycles_terminate(definition, text, expected):
    parameters = {
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/A"}},
        "$defs": {"A": definition, "B": {"$ref": "#/$defs/A"}},
    }
    assert exact(arguments(parameters, arg("x", text))["x"]) == exact(expected)


def test_schema_that_multiplies_out_beyond_the_cap_still_parses():
    pair = {"anyOf": [{"type": "integer"}, {"type": "string"}, {"type": "boolean"}]}
    parameters = {"properties": {"x": {"allOf": [pair] * 12}}}
    assert arguments(parameters, arg("x", "5")) == {"x": 5}
