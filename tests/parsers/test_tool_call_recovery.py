"""Output the strict format does not allow but whose intent is unambiguous: repeated members
become arrays, a wrongly named closing tag closes the only open element, a function name
matches a declared tool case-insensitively. Each recovery logs a debug line; nothing ever
becomes a call to a tool that was not declared."""

import json
import logging

import pytest

from sglang_m3.parsers.m3_format import NAMESPACE as NS
from tests.parsers.test_tool_call_properties import parse_one_shot, parse_streamed, sglang_tools


def arg(tag, value):
    return f"{NS}<{tag}>{value}{NS}</{tag}>"


def block(body, name="f"):
    return f'{NS}<tool_call>\n{NS}<invoke name="{name}">\n{body}{NS}</invoke>\n{NS}</tool_call>'


def parsed(text, declared):
    """(content, [(name, arguments)]) for tools name -> schema; streaming, one character at a
    time, must give the same."""
    tools = sglang_tools([(name, schema, None) for name, schema in declared.items()])
    normal_text, calls = parse_one_shot(text, tools)
    assert parse_streamed(list(text), tools) == (normal_text, calls)
    return normal_text, [(name, json.loads(arguments)) for name, arguments in calls]


@pytest.fixture
def debug_log(caplog):
    caplog.set_level(logging.DEBUG, logger="sglang_m3.parsers")
    return caplog


def debug_lines(caplog):
    return [record.getMessage() for record in caplog.records if record.levelno == logging.DEBUG]


# ---- repeated members ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "schema",
    [None, {}, {"type": "object"}, {"type": "object", "additionalProperties": {"type": "string"}}],
)
def test_repeated_child_of_an_untyped_or_open_object_becomes_an_array(schema):
    properties = {} if schema is None else {"o": schema}
    text = block(arg("o", arg("tag", "a") + arg("tag", "b")))
    assert parsed(text, {"f": {"type": "object", "properties": properties}}) == ("", [("f", {"o": {"tag": ["a", "b"]}})])


def test_repeated_members_keep_first_appearance_order_and_are_typed_as_array_items():
    schema = {
        "type": "object",
        "properties": {"ids": {"type": "array", "items": {"type": "string"}}, "n": {"type": "integer"}},
    }
    text = block(arg("ids", "1") + "\n" + arg("n", "3") + "\n" + arg("ids", "2") + arg("ids", "3"))
    assert parsed(text, {"f": schema}) == ("", [("f", {"ids": ["1", "2", "3"], "n": 3})])


def test_repeated_members_take_the_array_branch_of_a_union():
    union = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]}
    text = block(arg("x", "4") + arg("x", "5"))
    assert parsed(text, {"f": {"properties": {"x": union}}}) == ("", [("f", {"x": [4, 5]})])


def test_item_form_stays_the_canonical_array_and_mixes_with_named_members():
    schema = {"type": "object", "properties": {"x": {}}}
    assert parsed(block(arg("x", arg("item", "1") + arg("item", "2"))), {"f": schema})[1] == [("f", {"x": [1, 2]})]
    mixed = block(arg("x", arg("item", "1") + arg("item", "2") + arg("name", "n")))
    assert parsed(mixed, {"f": schema})[1] == [("f", {"x": {"item": [1, 2], "name": "n"}})]


@pytest.mark.parametrize(
    "schema, values, expected",
    [
        ({"type": "string"}, ["a", "b"], ["a", "b"]),
        ({"type": "integer"}, ["1", "two"], [1, "two"]),
        ({"type": "object", "properties": {"k": {"type": "integer"}}}, [arg("k", "1"), arg("k", "2") + arg("k", "3")], [{"k": 1}, {"k": [2, 3]}]),
    ],
)
def test_repeated_key_whose_schema_allows_no_array_keeps_the_call(debug_log, schema, values, expected):
    """Like any value its schema rejects, the key reaches the client as the model wrote it:
    the array of its values, each read by the key's schema (verbatim where that fails)."""
    text = block("".join(arg("x", value) for value in values))
    assert parsed(text, {"f": {"type": "object", "properties": {"x": schema}}}) == ("", [("f", {"x": expected})])
    assert any("<x> repeats" in line for line in debug_lines(debug_log))


# ---- wrongly named closing tags -----------------------------------------------------------

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}


def test_wrong_closing_tag_closes_the_only_open_element(debug_log):
    text = block(f"{NS}<city>Paris{NS}</town>" + arg("days", "3"))
    assert parsed(text, {"f": WEATHER}) == ("", [("f", {"city": "Paris", "days": 3})])
    assert any("<city> closed by </town>" in line for line in debug_lines(debug_log))


def test_wrong_closing_tag_of_a_top_level_container_is_taken(debug_log):
    schema = {"type": "object", "properties": {"where": {"type": "object", "properties": {"days": {"type": "integer"}}}}}
    text = block(f"{NS}<where>" + arg("days", "2") + f"{NS}</place>")
    assert parsed(text, {"f": schema}) == ("", [("f", {"where": {"days": 2}})])
    assert any("<where> closed by </place>" in line for line in debug_lines(debug_log))


@pytest.mark.parametrize(
    "body",
    [
        f"{NS}<where>{NS}<days>2{NS}</dayz>{NS}</where>",  # two elements open: which one is meant?
        f"{NS}<city>Paris{NS}</ci ty",  # not a closing tag at all
        f"{NS}<city>Paris{NS}</>",
    ],
)
def test_wrong_closing_tag_with_nesting_or_malformed_stays_content(body):
    text = "Let me look. " + block(body)
    assert parsed(text, {"f": WEATHER}) == (text, [])


# ---- function names -----------------------------------------------------------------------


def test_function_name_matching_one_declared_tool_case_insensitively(debug_log):
    text = block(arg("city", "Oslo"), name="Get_Weather")
    assert parsed(text, {"get_weather": WEATHER}) == ("", [("get_weather", {"city": "Oslo"})])
    assert any("'Get_Weather'" in line and "'get_weather'" in line for line in debug_lines(debug_log))


def test_exact_name_wins_over_a_case_insensitive_one():
    text = block(arg("city", "Oslo"), name="Lookup")
    declared = {"lookup": WEATHER, "Lookup": {"type": "object", "properties": {"city": {"type": "integer"}}}}
    assert parsed(text, declared) == ("", [("Lookup", {"city": "Oslo"})])


@pytest.mark.parametrize(
    "declared",
    [
        {"lookup": WEATHER, "LOOKUP": WEATHER},  # two tools fit: ambiguous
        {"look_up": WEATHER},  # none fits
        {},
    ],
)
def test_name_fitting_no_single_declared_tool_is_never_a_call(declared):
    text = "Checking. " + block(arg("city", "Oslo"), name="LookUp")
    assert parsed(text, declared) == (text, [])


def test_forwarding_unknown_tools_still_prefers_the_declared_spelling(monkeypatch):
    monkeypatch.setenv("SGLANG_FORWARD_UNKNOWN_TOOLS", "1")
    declared = {"get_weather": WEATHER}
    assert parsed(block(arg("days", "3"), name="GET_WEATHER"), declared)[1] == [("get_weather", {"days": 3})]
    assert parsed(block(arg("days", "3"), name="other"), declared)[1] == [("other", {"days": 3})]
