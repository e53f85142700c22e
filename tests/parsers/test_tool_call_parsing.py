"""Typing by schema and the handling of broken calls, case by case."""

import json

import pytest
from sglang.srt.entrypoints.openai.protocol import Tool

from sglang_m3.parsers.m3_format import NAMESPACE as NS
from sglang_m3.parsers.tool_call_detector import MiniMaxM3ToolCallDetector


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


WEATHER = tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}})
GOOD = invoke("get_weather", arg("city", "Paris"))


def test_several_invokes_and_blocks_keep_text_around():
    text = "Sure." + block(GOOD, invoke("get_weather", arg("city", "Rome"))) + " and " + block(GOOD) + " done"
    assert parse(text, [WEATHER]) == (
        "Sure. and  done",
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Paris"})],
    )


@pytest.mark.parametrize(
    "broken",
    [
        invoke("unknown_fn", arg("city", "Paris")),
        invoke("get_weather", arg("city", "Paris") + "junk"),
        invoke("get_weather", f"{NS}<city>{NS}<name>Paris{NS}</town>{NS}</city>"),
        invoke("get_weather", f"{NS}<city>Paris"),
        invoke("get_weather", f"{NS}<city>Paris{NS}</city"),
        f'{NS}<invoke name="get_weather>{arg("city", "x")}{NS}</invoke>',
        "stray text",
    ],
)
def test_a_broken_invoke_ends_its_block_and_returns_as_content(broken):
    good_call = GOOD.rstrip("\n")  # the newline after it is block spacing, not yet committed
    consumed = f"{NS}<tool_call>\n" + good_call
    text = "Hi " + block(GOOD, broken, GOOD)
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
