"""Differential tests against SGLang 0.5.23's own MiniMax M3 tool-call and reasoning detectors.

On well-formed output both must agree exactly (names, arguments, content; reasoning split).
The generated domain leaves out only the cases where the two differ on purpose; each of those
has its own test below that pins both behaviours and says why this project's is the one served.
"""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.entrypoints.openai.protocol import Tool
from sglang.srt.function_call.minimax_m3 import MinimaxM3Detector as UpstreamToolDetector
from sglang.srt.parser.reasoning_parser import MiniMaxM3Detector as UpstreamReasoningDetector

from sglang_m3.parsers.m3_format import NAMESPACE as NS
from sglang_m3.parsers.reasoning_detector import MiniMaxM3ReasoningDetector
from sglang_m3.parsers.tool_call_detector import MiniMaxM3ToolCallDetector
from tests.parsers import m3_strategies as m3
from tests.parsers.test_tool_call_properties import rendered_reply, sglang_tools

DIFF_SETTINGS = settings(max_examples=150, deadline=None)

# The common domain: non-empty strings without trailing whitespace (differences 1 and 9),
# numbers that are not integral floats (difference 2), typed schemas only (differences 3, 4),
# no null under a nullable string (difference 10), no member named like an enclosing one
# (difference 11).
_common_strings = m3.free_text.filter(lambda text: text and text == text.rstrip())
_common_scalars = st.one_of(
    _common_strings.map(lambda text: ({"type": "string"}, text)),
    st.integers(-(10**12), 10**12).map(lambda number: ({"type": "integer"}, number)),
    st.floats(allow_nan=False, allow_infinity=False)
    .filter(lambda number: not number.is_integer() and math.isfinite(number))
    .map(lambda number: ({"type": "number"}, number)),
    st.booleans().map(lambda flag: ({"type": "boolean"}, flag)),
    st.sampled_from(["a", "b c"]).map(lambda member: ({"type": "string", "enum": ["a", "b c"]}, member)),
    _common_strings.filter(lambda text: text not in ("null", "Null", "NULL")).map(
        lambda value: ({"type": ["string", "null"]}, value)
    ),
)


def _common_values():
    return st.recursive(
        _common_scalars,
        lambda children: st.one_of(
            st.lists(st.tuples(m3.names, children), max_size=3, unique_by=lambda e: e[0]).map(
                lambda entries: (
                    {"type": "object", "properties": {name: schema for name, (schema, _) in entries}},
                    {name: value for name, (_, value) in entries},
                )
            ),
            st.tuples(children, st.integers(1, 3)).map(
                lambda drawn: ({"type": "array", "items": drawn[0][0]}, [drawn[0][1]] * drawn[1])
            ),
        ),
        max_leaves=6,
    )


common_calls = st.lists(
    st.tuples(
        m3.names,
        st.lists(st.tuples(m3.names, _common_values()), max_size=4, unique_by=lambda e: e[0]),
    ),
    min_size=1,
    max_size=3,
    unique_by=lambda entry: entry[0],
).map(
    lambda entries: [
        (
            name,
            {"type": "object", "properties": {key: schema for key, (schema, _) in arguments}},
            {key: value for key, (_, value) in arguments},
        )
        for name, arguments in entries
    ]
).filter(lambda calls: not any(_reuses_an_enclosing_name(value) for _, _, value in calls))


def _reuses_an_enclosing_name(value, enclosing=()):
    if isinstance(value, list):
        return any(_reuses_an_enclosing_name(each, enclosing) for each in value)
    if isinstance(value, dict):
        return any(key in enclosing or _reuses_an_enclosing_name(each, (*enclosing, key)) for key, each in value.items())
    return False


def _one_shot(detector, text, tools):
    result = detector.detect_and_parse(text, tools)
    return result.normal_text, [(call.name, json.loads(call.parameters)) for call in result.calls]


def _streamed(detector, chunks, tools):
    content, names, arguments = "", {}, {}
    results = [detector.parse_streaming_increment(chunk, tools) for chunk in chunks]
    results.append(detector.finish(tools))
    for result in results:
        content += result.normal_text
        for item in result.calls:
            if item.name:
                names[item.tool_index] = item.name
            arguments[item.tool_index] = arguments.get(item.tool_index, "") + item.parameters
    return content, [(names[index], json.loads(arguments[index])) for index in sorted(names)]


@DIFF_SETTINGS
@given(generated=common_calls, content=m3.free_text, data=st.data())
def test_tool_calls_agree_with_upstream_on_well_formed_output(chat_tokenizer, generated, content, data):
    reply = rendered_reply(chat_tokenizer, generated, content)
    tools = sglang_tools(generated)
    ours = _one_shot(MiniMaxM3ToolCallDetector(), reply, tools)
    assert ours == _one_shot(UpstreamToolDetector(), reply, tools)
    chunks = m3.split_at(reply, data.draw(m3.chunkings(len(reply))))
    assert _streamed(MiniMaxM3ToolCallDetector(), chunks, tools) == _streamed(UpstreamToolDetector(), chunks, tools) == ours


_plain = m3.free_text.filter(lambda text: "<mm:" not in text and "</mm:" not in text and text == text.lstrip())


@DIFF_SETTINGS
@given(
    reasoning=_plain,
    content=_plain,
    shape=st.sampled_from(["forced", "opened", "stray_close", "plain"]),
)
def test_reasoning_split_agrees_with_upstream_on_well_formed_output(reasoning, content, shape):
    force = shape == "forced"
    text = {
        "forced": reasoning + "</mm:think>" + content,
        "opened": "<mm:think>" + reasoning + "</mm:think>" + content,
        "stray_close": "</mm:think>" + content,
        "plain": content,
    }[shape]
    ours = MiniMaxM3ReasoningDetector(force_reasoning=force).detect_and_parse(text)
    theirs = UpstreamReasoningDetector(force_reasoning=force).detect_and_parse(text)
    assert (ours.reasoning_text, ours.normal_text) == (theirs.reasoning_text, theirs.normal_text)


# ---- intentional differences -------------------------------------------------------------------

WEATHER = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {
                    "s": {"type": "string"},
                    "n": {"type": "number"},
                    "u": {},
                    "a": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
                },
            },
        },
    }
)


def _call(body, name="f"):
    return f'{NS}<tool_call>\n{NS}<invoke name="{name}">\n{body}{NS}</invoke>\n{NS}</tool_call>'


@pytest.mark.parametrize(
    "body, ours, upstream, why",
    [
        (
            f"{NS}<s>indented:\n  x = 1\n{NS}</s>",
            {"s": "indented:\n  x = 1\n"},
            {"s": "indented:\n  x = 1"},
            "1. A string argument is what the model wrote; upstream strips trailing whitespace, "
            "which corrupts code and patch arguments.",
        ),
        (
            f"{NS}<n>5.0{NS}</n>",
            {"n": 5.0},
            {"n": 5},
            "2. A number keeps the form the model wrote (JSON 5.0); upstream rewrites integral "
            "floats as integers. Numerically equal, textually faithful.",
        ),
        (
            f"{NS}<u>42{NS}</u>",
            {"u": 42},
            {"u": "42"},
            "3. Untyped schemas are typed by content (issue 4): a JSON literal is a JSON value; "
            "upstream keeps untyped numbers as strings.",
        ),
        (
            f"{NS}<a>7{NS}</a>",
            {"a": 7},
            {"a": "7"},
            "4. anyOf / oneOf alternatives type the value; upstream reads only `type` and treats "
            "anyOf schemas as untyped.",
        ),
    ],
)
def test_intentional_value_differences(body, ours, upstream, why):
    text = _call(body)
    assert _one_shot(MiniMaxM3ToolCallDetector(), text, [WEATHER]) == ("", [("f", ours)]), why
    assert _one_shot(UpstreamToolDetector(), text, [WEATHER]) == ("", [("f", upstream)]), why


def test_difference_5_unknown_function_is_content_not_dropped():
    """Upstream drops a call to an undeclared function together with its text; this parser
    hands the text back as content, so nothing the model wrote disappears."""
    text = "Let me check." + _call(f"{NS}<s>x{NS}</s>", name="nope")
    assert _one_shot(MiniMaxM3ToolCallDetector(), text, [WEATHER]) == (text, [])
    assert _one_shot(UpstreamToolDetector(), text, [WEATHER]) == ("Let me check.", [])


def test_difference_6_broken_invoke_keeps_the_good_calls_beside_it():
    """Upstream turns a whole message into content when one invoke is malformed, losing good
    calls; this parser returns the malformed invoke as content and keeps every good call."""
    good = f'{NS}<invoke name="f">{NS}<s>ok{NS}</s>{NS}</invoke>'
    broken = f'{NS}<invoke name="f">{NS}<s>{NS}<t>x{NS}</u>{NS}</s>{NS}</invoke>'
    text = f"{NS}<tool_call>{good}{broken}{good}{NS}</tool_call>"
    assert _one_shot(MiniMaxM3ToolCallDetector(), text, [WEATHER]) == (broken, [("f", {"s": "ok"})] * 2)
    assert _one_shot(UpstreamToolDetector(), text, [WEATHER]) == (text, [])


def test_difference_7_split_stray_closer_is_dropped_in_streaming():
    """Upstream assumes `</mm:think>` arrives as one chunk; split across chunks (any tokenizer
    that spells it in pieces, or a detokenizer that cuts it) it leaks into the content."""

    def stream(detector):
        parts = [detector.parse_streaming_increment(c) for c in ["</mm:", "think>", "Hi"]]
        return "".join(p.normal_text for p in parts) + detector.finish().normal_text

    assert stream(MiniMaxM3ReasoningDetector()) == "Hi"
    assert stream(UpstreamReasoningDetector()) == "</mm:think>Hi"


def test_difference_8_think_tag_mid_content_is_text():
    """Only a reply that opens with `<mm:think>` is reasoning; upstream turns everything before
    a later closing tag into reasoning when the content merely mentions the tags."""
    text = "Use <mm:think> and </mm:think> to mark thoughts."
    ours = MiniMaxM3ReasoningDetector().detect_and_parse(text)
    theirs = UpstreamReasoningDetector().detect_and_parse(text)
    assert (ours.reasoning_text, ours.normal_text) == ("", text)
    assert (theirs.reasoning_text, theirs.normal_text) == ("Use <mm:think> and ", " to mark thoughts.")


def test_difference_9_empty_string_argument_streams_as_a_string():
    """Upstream's streaming path mistakes the closing tag of an empty string argument for
    nested markup and sends `{}`; its own one-shot path says `""`, as does this parser in both."""
    text = _call(f"{NS}<s>{NS}</s>")
    assert _streamed(MiniMaxM3ToolCallDetector(), [text], [WEATHER]) == ("", [("f", {"s": ""})])
    assert _streamed(UpstreamToolDetector(), [text], [WEATHER]) == ("", [("f", {"s": {}})])
    assert _one_shot(UpstreamToolDetector(), text, [WEATHER]) == ("", [("f", {"s": ""})])


def test_difference_10_null_under_a_nullable_string_streams_as_null():
    """For `type: [string, null]`, upstream's one-shot path reads `null` as null but its
    streaming path sends the string "null"; this parser reads null in both."""
    nullable = Tool.model_validate(
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"s": {"type": ["string", "null"]}}}}}
    )
    text = _call(f"{NS}<s>null{NS}</s>")
    assert _streamed(MiniMaxM3ToolCallDetector(), [text], [nullable]) == ("", [("f", {"s": None})])
    assert _streamed(UpstreamToolDetector(), [text], [nullable]) == ("", [("f", {"s": "null"})])
    assert _one_shot(UpstreamToolDetector(), text, [nullable]) == ("", [("f", {"s": None})])


def test_difference_11_member_named_like_its_parent_streams_whole():
    """Upstream's streaming path takes the inner closing tag of `<a><a>0</a></a>` for the outer
    one and sends arguments that are not JSON; its one-shot path and this parser agree."""
    nested = Tool.model_validate(
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "object", "properties": {"a": {"type": "string"}}}}}}}
    )
    text = _call(f"{NS}<a>{NS}<a>0{NS}</a>{NS}</a>")
    assert _streamed(MiniMaxM3ToolCallDetector(), [text], [nested]) == ("", [("f", {"a": {"a": "0"}})])
    with pytest.raises(json.JSONDecodeError):
        _streamed(UpstreamToolDetector(), [text], [nested])
    assert _one_shot(UpstreamToolDetector(), text, [nested]) == ("", [("f", {"a": {"a": "0"}})])


def _tool(parameters):
    return Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": parameters}})


@pytest.mark.parametrize("blank", ["", "  "])
def test_difference_12_blank_text_under_a_nullable_string_is_the_string(blank):
    """The chat template writes None as `null` and a string as its text, so blank text under
    `type: [string, null]` is that string; upstream's streaming path agrees, its one-shot path
    says null."""
    tools = [_tool({"type": "object", "properties": {"s": {"type": ["string", "null"]}}})]
    text = _call(f"{NS}<s>{blank}{NS}</s>")
    expected = ("", [("f", {"s": blank})])
    assert _one_shot(MiniMaxM3ToolCallDetector(), text, tools) == expected
    assert _streamed(MiniMaxM3ToolCallDetector(), list(text), tools) == expected
    assert _streamed(UpstreamToolDetector(), list(text), tools) == expected
    assert _one_shot(UpstreamToolDetector(), text, tools) == ("", [("f", {"s": None})])


def test_difference_13_typed_number_text_json_cannot_carry_stays_verbatim():
    """JSON numbers are ASCII and finite. A `number` written in other digits, or beyond a
    double, is kept as written, as both parsers keep it when the schema is untyped (below);
    upstream converts other scripts' digits for a typed number and, past a double, returns the
    whole call as content."""
    digits, huge = _call(f"{NS}<n>3.１４{NS}</n>"), _call(f"{NS}<n>1e400{NS}</n>")
    assert _one_shot(MiniMaxM3ToolCallDetector(), digits, [WEATHER]) == ("", [("f", {"n": "3.１４"})])
    assert _one_shot(MiniMaxM3ToolCallDetector(), huge, [WEATHER]) == ("", [("f", {"n": "1e400"})])
    assert _one_shot(UpstreamToolDetector(), digits, [WEATHER]) == ("", [("f", {"n": 3.14})])
    assert _one_shot(UpstreamToolDetector(), huge, [WEATHER]) == (huge, [])


@pytest.mark.parametrize(
    "schema, text",
    [
        ({}, "1٢"),
        ({"anyOf": [{"type": "string"}, {"type": "number"}]}, "2０２4"),
        ({}, "-1e999"),
        ({}, "9" * 5000),
        ({"type": "integer"}, "9" * 5000),
    ],
)
def test_number_like_text_json_cannot_carry_is_the_string_as_upstream_has_it(schema, text):
    """Digits of other scripts, numbers beyond a double, integers past Python's conversion limit:
    the string the model wrote, for both parsers, one-shot and streamed."""
    tools = [_tool({"type": "object", "properties": {"x": schema}})]
    reply = _call(f"{NS}<x>{text}{NS}</x>")
    expected = ("", [("f", {"x": text})])
    for detector in (MiniMaxM3ToolCallDetector, UpstreamToolDetector):
        assert _one_shot(detector(), reply, tools) == expected
        assert _streamed(detector(), m3.split_at(reply, range(7, len(reply), 7)), tools) == expected


# ---- recoveries shared with upstream ----------------------------------------------------------


@pytest.mark.parametrize(
    "parameters, body, arguments",
    [
        (
            {"type": "object", "properties": {"o": {"type": "object"}}},
            f"{NS}<o>{NS}<tag>a{NS}</tag>{NS}<tag>b{NS}</tag>{NS}</o>",
            {"o": {"tag": ["a", "b"]}},
        ),
        (
            {"oneOf": [{"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "string"}}, "flag": {"type": "string"}}}]},
            f"{NS}<ids>{NS}<item>12{NS}</item>{NS}<item>34{NS}</item>{NS}</ids>{NS}<flag>true{NS}</flag>",
            {"ids": ["12", "34"], "flag": "true"},
        ),
    ],
)
def test_repeated_members_and_root_unions_agree_with_upstream(parameters, body, arguments):
    """A repeated member is an array and a root union types the arguments, as upstream does."""
    text = _call(body)
    for detector in (MiniMaxM3ToolCallDetector(), UpstreamToolDetector()):
        assert _one_shot(detector, text, [_tool(parameters)]) == ("", [("f", arguments)])
