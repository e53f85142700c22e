"""Typing by schema and the handling of broken calls, case by case."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.entrypoints.openai.protocol import Tool

from sglang_m3.parsers.m3_format import NAMESPACE as NS
from sglang_m3.parsers.tool_call_detector import MiniMaxM3ToolCallDetector
from tests.parsers.test_tool_call_properties import parse_streamed, rendered_reply


def block(*invokes):
    return f"{NS}<tool_call>\n" + "".join(invokes) + f"{NS}</tool_call>"


def invoke(name, body):
    return f'{NS}<invoke name="{name}">\n{body}{NS}</invoke>\n'


def arg(tag, value):
    return f"{NS}<{tag}>{value}{NS}</{tag}>"


def tool(name, parameters):
    return Tool.model_validate({"type": "function", "function": {"name": name, "parameters": parameters}})


def parse(text, tools):
    result = MiniMaxM3ToolCallDetector().detect_and_parse(text, tools)
    return result.normal_text, [(call.name, json.loads(call.parameters)) for call in result.calls]


def arguments_of(schema, body):
    normal_text, calls = parse(block(invoke("f", body)), [tool("f", {"type": "object", "properties": {"x": schema}})])
    assert normal_text == ""
    return calls[0][1]["x"]


@pytest.mark.parametrize(
    "schema, text, expected",
    [
        ({"type": "string"}, "  keep  spacing \n", "  keep  spacing \n"),
        ({"type": "string"}, "42", "42"),
        ({"type": "integer"}, " -17 ", -17),
        ({"type": "integer"}, "five", "five"),
        ({"type": "number"}, "2.5e3", 2500.0),
        ({"type": "number"}, "7", 7),
        ({"type": "boolean"}, "True", True),
        ({"type": "boolean"}, "yes", "yes"),
        ({"type": "null"}, "null", None),
        ({"type": ["integer", "null"]}, "null", None),
        ({"type": ["string", "null"]}, "null", None),
        ({"type": ["string", "null"]}, "nil", "nil"),
        # The template writes None as `null` and "" as nothing: blank text is the string
        # wherever a string may be meant, null only where none may.
        ({"type": ["string", "null"]}, "", ""),
        ({"type": ["string", "null"]}, "  ", "  "),
        ({"anyOf": [{"type": "string"}, {"type": "null"}]}, "", ""),
        ({"type": "string", "nullable": True}, "\n", "\n"),
        ({"anyOf": [{}, {"type": "null"}]}, "", ""),
        ({"type": ["integer", "null"]}, "", None),
        ({"type": "null"}, " ", None),
        ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, "5", 5),
        ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, "5a", "5a"),
        ({"oneOf": [{"type": "boolean"}, {"type": "number"}]}, "0.5", 0.5),
        ({"enum": ["red", "green"]}, "green", "green"),
        ({"enum": [1, 2, 3]}, "2", 2),
        ({"enum": ["a", "b"]}, "c", "c"),
        ({"const": 3}, "3", 3),
        ({}, "42", 42),
        ({}, "4x2", "4x2"),
        ({}, "true", True),
        ({}, ' {"a": [1]} ', {"a": [1]}),
        ({}, "[unclosed", "[unclosed"),
        ({"type": "object"}, '{"inline": "json"}', {"inline": "json"}),
        ({"type": "array", "items": {"type": "integer"}}, "", []),
        ({"type": "array", "items": {"type": "integer"}}, "[1, 2]", [1, 2]),
        ({"type": "object", "properties": {"a": {"type": "integer"}}}, "", {}),
    ],
)
def test_scalar_text_is_typed_by_schema(schema, text, expected):
    value = arguments_of(schema, arg("x", text))
    assert json.dumps(value) == json.dumps(expected)


@pytest.mark.parametrize(
    "schema, body, expected",
    [
        (
            {"type": "array", "items": {"type": "number"}},
            arg("item", "1") + "\n" + arg("item", "2.5"),
            [1, 2.5],
        ),
        (
            {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
            arg("item", "7") + arg("item", "7"),
            ["7", 7],
        ),
        (
            {"type": "object", "additionalProperties": {"type": "integer"}},
            arg("k1", "1") + arg("k2", "2"),
            {"k1": 1, "k2": 2},
        ),
        ({}, arg("item", "1") + arg("item", "b"), [1, "b"]),
        ({}, arg("a", "1") + arg("b", arg("item", "x")), {"a": 1, "b": ["x"]}),
        (
            {"$ref": "#/$defs/Point"},
            arg("lat", "1.5") + arg("label", "3"),
            {"lat": 1.5, "label": "3"},
        ),
        (
            {"allOf": [{"properties": {"lat": {"type": "number"}}}, {"properties": {"label": {"type": "string"}}}]},
            arg("lat", "2") + arg("label", "2"),
            {"lat": 2, "label": "2"},
        ),
        (
            {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]},
            arg("item", "3"),
            [3],
        ),
    ],
)
def test_containers(schema, body, expected):
    parameters = {
        "type": "object",
        "properties": {"x": schema},
        "$defs": {"Point": {"type": "object", "properties": {"lat": {"type": "number"}, "label": {"type": "string"}}}},
    }
    _, calls = parse(block(invoke("f", arg("x", body))), [tool("f", parameters)])
    assert json.dumps(calls[0][1]["x"]) == json.dumps(expected)


def _refuse_constant(name):
    raise ValueError(f"{name} is not JSON")


def strict_json(text):
    """`json.loads` without Python's NaN / Infinity extension."""
    return json.loads(text, parse_constant=_refuse_constant)


@pytest.mark.parametrize(
    "schema, text",
    [
        ({"type": "integer"}, "1٣"),  # Arabic-Indic digit
        ({"type": "number"}, "3.１４"),  # full-width digits
        ({"anyOf": [{"type": "string"}, {"type": "number"}]}, "2０２4"),
        ({}, "1٢"),
        ({"type": "integer"}, "9" * 5000),  # past Python's int conversion limit
        ({}, "-" + "9" * 5000),
        ({"type": "number"}, "1e400"),  # beyond a double: JSON has no infinity
        ({"type": ["number", "null"]}, "-1e999"),
        ({}, "-1e999"),
        ({"type": "object"}, '{"a": 1e400}'),
        ({"type": "array"}, "[NaN]"),
        ({}, '{"a": Infinity}'),
    ],
)
def test_number_like_text_json_cannot_carry_is_kept_verbatim(schema, text):
    """The call is kept, holding the text as the model wrote it, in arguments that are JSON."""
    result = MiniMaxM3ToolCallDetector().detect_and_parse(
        block(invoke("f", arg("x", text))), [tool("f", {"type": "object", "properties": {"x": schema}})]
    )
    assert result.normal_text == ""
    assert [(call.name, strict_json(call.parameters)) for call in result.calls] == [("f", {"x": text})]


def _json_number(text):
    """What strict JSON reads `text` as, when that is a finite number; else None."""
    try:
        value = strict_json(text)
    except ValueError:
        return None
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


@settings(max_examples=300, deadline=None)
@given(
    # `\d` draws digits of every script; exponents reach past a double's range.
    text=st.from_regex(r"-?\d{1,4}(\.\d{1,3})?([eE][+-]?\d{1,3})?", fullmatch=True),
    schema=st.sampled_from(
        [{"type": "number"}, {"type": "integer"}, {}, {"anyOf": [{"type": "string"}, {"type": "number"}]}]
    ),
)
def test_number_like_text_is_a_json_number_or_kept_verbatim(text, schema):
    """Never a lost call nor invalid JSON: the number JSON reads (an integer for `integer`),
    else the text as written; streamed one character at a time, the same."""
    tools = [tool("f", {"type": "object", "properties": {"x": schema}})]
    number = _json_number(text)
    if schema.get("type") == "integer" and not isinstance(number, int):
        number = None
    expected = {"x": text if number is None else number}
    reply = block(invoke("f", arg("x", text)))
    result = MiniMaxM3ToolCallDetector().detect_and_parse(reply, tools)
    assert [(call.name, call.parameters) for call in result.calls] == [("f", json.dumps(expected, ensure_ascii=False))]
    assert strict_json(result.calls[0].parameters) == expected
    assert parse_streamed(list(reply), tools) == ("", [("f", result.calls[0].parameters)])


@pytest.mark.parametrize("arguments", [{"note": "", "tag": "  "}, {"note": None, "tag": None}, {"note": "null?", "tag": " x"}])
def test_nullable_strings_round_trip_through_the_chat_template(chat_tokenizer, arguments):
    """The project's template writes None as `null` and a string as its text, so each reads back."""
    schema = {
        "type": "object",
        "properties": {"note": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "tag": {"type": ["string", "null"]}},
    }
    reply = rendered_reply(chat_tokenizer, [("save", schema, arguments)])
    assert parse(reply, [tool("save", schema)]) == ("", [("save", arguments)])


WEATHER = tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}})
GOOD = invoke("get_weather", arg("city", "Paris"))


def test_several_invokes_and_blocks_keep_text_around():
    text = "Sure." + block(GOOD, invoke("get_weather", arg("city", "Rome"))) + " and " + block(GOOD) + " done"
    assert parse(text, [WEATHER]) == (
        "Sure. and  done",
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Paris"})],
    )


@pytest.mark.parametrize(
    "rejected",
    [
        invoke("unknown_fn", arg("city", "Paris")),
        invoke("get_weather", arg("city", "Paris") + "junk"),
        invoke("get_weather", f"{NS}<city>{NS}<name>Paris{NS}</town>{NS}</city>"),
        invoke("get_weather", f"{NS}<city>Paris"),
        invoke("get_weather", f"{NS}<city>Paris{NS}</city"),
        f'{NS}<invoke name="get_weather>{arg("city", "x")}{NS}</invoke>',
    ],
)
def test_a_complete_invoke_that_cannot_be_a_call_is_content_and_its_block_goes_on(rejected):
    """Its own `</invoke>` ends it, so the calls after it in the block are still calls."""
    text = "Hi " + block(GOOD, rejected, GOOD)
    paris = ("get_weather", {"city": "Paris"})
    assert parse(text, [WEATHER]) == ("Hi " + rejected.rstrip("\n"), [paris, paris])


def test_text_that_is_no_invoke_ends_its_block_and_returns_as_content():
    good_call = GOOD.rstrip("\n")  # the newline after it is block spacing, not yet committed
    consumed = f"{NS}<tool_call>\n" + good_call
    text = "Hi " + block(GOOD, "stray text", GOOD)
    assert parse(text, [WEATHER]) == (text.replace(consumed, "", 1), [("get_weather", {"city": "Paris"})])


def test_no_declared_tools_means_markup_stays_content():
    text = "x" + block(GOOD)
    assert parse(text, []) == (text, [])


def test_forwarding_unknown_tools_when_sglang_is_told_to(monkeypatch):
    monkeypatch.setenv("SGLANG_FORWARD_UNKNOWN_TOOLS", "1")
    _, calls = parse(block(invoke("other", arg("n", "3"))), [WEATHER])
    assert calls == [("other", {"n": 3})]


def test_non_stream_tool_index_is_the_tool_position_streaming_index_the_call_order():
    tools = [tool("a", {}), WEATHER]
    text = block(GOOD, invoke("a", ""))
    one_shot = MiniMaxM3ToolCallDetector().detect_and_parse(text, tools)
    assert [(c.tool_index, c.name) for c in one_shot.calls] == [(1, "get_weather"), (0, "a")]
    streamed = MiniMaxM3ToolCallDetector().parse_streaming_increment(text, tools)
    assert [(c.tool_index, c.name) for c in streamed.calls if c.name] == [(0, "get_weather"), (1, "a")]


def test_stream_bookkeeping_shows_every_call_fully_sent():
    detector = MiniMaxM3ToolCallDetector()
    detector.parse_streaming_increment(block(GOOD), [WEATHER])
    assert detector.prev_tool_call_arr == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert detector.streamed_args_for_tool == ['{"city": "Paris"}']


def test_deep_nesting_is_refused_not_crashed():
    body = f"{NS}<item>" * 200 + "x" + f"{NS}</item>" * 200
    text = block(invoke("get_weather", arg("city", body)))
    assert parse(text, [WEATHER]) == (text, [])
