"""Tool-call defects found by an audit against SGLang 0.5.23's own M3 parser, the chat
template's format and XML itself. Each section reproduces one defect and pins the reading the
client should get, one-shot and streamed.
"""

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.entrypoints.openai.protocol import Tool
from sglang.srt.function_call.minimax_m3 import MinimaxM3Detector as UpstreamToolDetector

from sglang_m3.parsers.m3_format import NAMESPACE as NS
from sglang_m3.parsers.tool_call_detector import MiniMaxM3ToolCallDetector
from tests.parsers import m3_strategies as m3
from tests.parsers.test_differential_upstream import _streamed as streamed
from tests.parsers.test_tool_call_properties import rendered_reply, sglang_tools

AUDIT_SETTINGS = settings(max_examples=100, deadline=None)


def _tool(parameters, name="f"):
    return Tool.model_validate({"type": "function", "function": {"name": name, "parameters": parameters}})


TOOLS = [
    _tool(
        {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "limit": {"type": "integer"},
                "filter": {"type": "object", "properties": {"depth": {"type": "integer"}}},
            },
        }
    )
]


def _call(body):
    return f'{NS}<tool_call>\n{NS}<invoke name="f">\n{body}{NS}</invoke>\n{NS}</tool_call>'


def _one_shot(text, tools=TOOLS, detector=MiniMaxM3ToolCallDetector):
    result = detector().detect_and_parse(text, tools)
    return result.normal_text, [(call.name, json.loads(call.parameters)) for call in result.calls]


def _streamed(chunks, tools=TOOLS):
    """Content and calls of the project's detector fed ``chunks`` (the differential tests' reader)."""
    return streamed(MiniMaxM3ToolCallDetector(), chunks, tools)


def _assert_parses_to(text, expected, tools=TOOLS):
    assert _one_shot(text, tools) == expected
    assert _streamed(list(text), tools) == expected
    assert _streamed(m3.split_at(text, range(7, len(text), 7)), tools) == expected


# ---- 1. whitespace before a tag's `>` is not part of the argument name --------------------------


@pytest.mark.parametrize(
    "body, arguments",
    [
        (f"{NS}<path >/tmp{NS}</path >\n{NS}<limit\n>5{NS}</limit>\n", {"path": "/tmp", "limit": 5}),
        (f"{NS}<path\t>/tmp{NS}</path>\n{NS}<limit>5{NS}</limit >\n", {"path": "/tmp", "limit": 5}),
        (f"{NS}<filter >{NS}<depth >2{NS}</depth >{NS}</filter>\n", {"filter": {"depth": 2}}),
    ],
)
def test_whitespace_before_a_tag_end_is_not_part_of_the_argument_name(body, arguments):
    """XML allows whitespace between a tag's name and its `>`: `<path >` is the declared `path`,
    typed by its schema, not an unknown key "path " typed by content."""
    _assert_parses_to(_call(body), ("", [("f", arguments)]))


def test_upstream_reads_the_spaced_tag_name_alike():
    """SGLang's own one-shot parser strips the name too (its streaming path breaks on it)."""
    text = _call(f"{NS}<path >/tmp{NS}</path >\n")
    assert _one_shot(text, detector=UpstreamToolDetector) == ("", [("f", {"path": "/tmp"})])


_ARGUMENT_TAG = re.compile(re.escape(NS) + r"(</?)(?![/\s])(?!invoke[ >]|tool_call>)([^<>]*)>")


@AUDIT_SETTINGS
@given(generated=m3.calls(), content=m3.free_text, data=st.data())
def test_spaced_argument_tags_read_as_the_rendered_ones(chat_tokenizer, generated, content, data):
    """Any whitespace before the `>` of the template's argument tags leaves the calls unchanged."""
    reply = rendered_reply(chat_tokenizer, generated, content)
    spaced = _ARGUMENT_TAG.sub(
        lambda match: f"{NS}{match[1]}{match[2]}{data.draw(st.sampled_from([' ', '  ', chr(10), chr(9)]))}>", reply
    )
    tools = sglang_tools(generated)
    expected = _one_shot(reply, tools)
    assert len(expected[1]) == len(generated)
    assert _one_shot(spaced, tools) == expected


# ---- 2. a rejected invoke does not take the block's other calls with it -------------------------

_GOOD = f'{NS}<invoke name="f">\n{NS}<path>/a{NS}</path>\n{NS}</invoke>'
_UNKNOWN = f'{NS}<invoke name="nope">\n{NS}<path>/b{NS}</path>\n{NS}</invoke>'
_BROKEN = f'{NS}<invoke name="f">\n{NS}<path>{NS}<t>x{NS}</u>{NS}</path>\n{NS}</invoke>'
_BAD_HEADER = f'{NS}<invoke name="f>\n{NS}<path>/b{NS}</path>\n{NS}</invoke>'


def _block(*invokes):
    return f"{NS}<tool_call>\n" + "".join(invoke + "\n" for invoke in invokes) + f"{NS}</tool_call>"


@pytest.mark.parametrize("rejected", [_UNKNOWN, _BROKEN, _BAD_HEADER])
@pytest.mark.parametrize("order", [("rejected", "good"), ("good", "rejected", "good"), ("good", "rejected")])
def test_a_complete_invoke_that_cannot_be_a_call_is_content_and_the_block_goes_on(rejected, order):
    """A call to an undeclared tool, or one whose arguments do not parse, ends at its own
    `</invoke>`: it comes back as content, and the well-formed calls beside it in the same block
    are still calls (the block's tags are markup, as in any block that yields a call)."""
    invokes = [rejected if part == "rejected" else _GOOD for part in order]
    good_calls = [("f", {"path": "/a"})] * order.count("good")
    _assert_parses_to("Hi " + _block(*invokes) + " bye", ("Hi " + rejected + " bye", good_calls))


def test_upstream_keeps_the_declared_calls_beside_an_unknown_one():
    """SGLang's own parser also keeps the declared call (it drops the undeclared one silently)."""
    assert _one_shot(_block(_UNKNOWN, _GOOD), detector=UpstreamToolDetector) == ("", [("f", {"path": "/a"})])


@pytest.mark.parametrize("rejected", [_UNKNOWN, _BROKEN])
def test_a_block_of_rejected_invokes_only_stays_content_exactly(rejected):
    text = "Hi " + _block(rejected, rejected) + " bye"
    _assert_parses_to(text, (text, []))


@AUDIT_SETTINGS
@given(generated=m3.calls(), content=m3.free_text, data=st.data())
def test_an_undeclared_call_among_rendered_calls_leaves_them_all_calls(chat_tokenizer, generated, content, data):
    """The template's calls with one invoke of an undeclared tool put anywhere among them: every
    declared call parses back, and the undeclared invoke is the only extra content."""
    reply = rendered_reply(chat_tokenizer, generated, content)
    tools = sglang_tools(generated)
    starts = [match.start() for match in re.finditer(re.escape(f'{NS}<invoke name="'), reply)]
    at = data.draw(st.sampled_from([*starts, reply.rindex(f"{NS}</tool_call>")]))
    undeclared = f'{NS}<invoke name="undeclared tool">\n{NS}<x>1{NS}</x>\n{NS}</invoke>'
    mixed = reply[:at] + undeclared + "\n" + reply[at:]

    content_alone, calls = _one_shot(reply, tools)
    assert len(calls) == len(generated)
    expected = (content_alone + undeclared, calls)
    assert _one_shot(mixed, tools) == expected
    assert _streamed(m3.split_at(mixed, data.draw(m3.chunkings(len(mixed)))), tools) == expected


# ---- 3. blank text under a nullable array or object is the empty container -----------------------

_NULLABLE_CONTAINERS = [
    ({"type": ["array", "null"], "items": {"type": "integer"}}, []),
    ({"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}], "default": None}, []),
    ({"type": "array", "items": {"type": "string"}, "nullable": True}, []),
    ({"type": ["object", "null"]}, {}),
    ({"anyOf": [{"type": "object", "properties": {"a": {"type": "string"}}}, {"type": "null"}]}, {}),
]


@pytest.mark.parametrize("schema, empty", _NULLABLE_CONTAINERS)
@pytest.mark.parametrize("blank", ["", "\n", "  "])
def test_blank_text_under_a_nullable_container_is_the_empty_container(schema, empty, blank):
    """The chat template writes [] and {} as an empty element and None as `null`, so blank text
    under `Optional[list]` / `Optional[dict]` (Pydantic's `anyOf: [array, null]`) is the empty
    container; `null` stays None."""
    tools = [_tool({"type": "object", "properties": {"x": schema}})]
    _assert_parses_to(_call(f"{NS}<x>{blank}{NS}</x>"), ("", [("f", {"x": empty})]), tools)
    _assert_parses_to(_call(f"{NS}<x>null{NS}</x>"), ("", [("f", {"x": None})]), tools)


def test_blank_text_where_only_null_reads_it_is_still_null():
    tools = [_tool({"type": "object", "properties": {"x": {"type": ["integer", "null"]}}})]
    _assert_parses_to(_call(f"{NS}<x>{NS}</x>"), ("", [("f", {"x": None})]), tools)


_nullable_container_values = st.one_of(
    st.none(),
    st.lists(st.integers(-100, 100), max_size=3),
    st.dictionaries(st.sampled_from(["a", "b"]), st.integers(-100, 100), max_size=2),
)


@AUDIT_SETTINGS
@given(values=st.lists(_nullable_container_values, min_size=1, max_size=3))
def test_nullable_containers_round_trip_through_the_chat_template(chat_tokenizer, values):
    """Optional lists and dicts, empty ones and None included, read back as the template wrote them."""
    properties, arguments = {}, {}
    for index, value in enumerate(values):
        kind = "object" if isinstance(value, dict) else "array"
        members = {"additionalProperties": {"type": "integer"}} if kind == "object" else {"items": {"type": "integer"}}
        properties[f"p{index}"] = {"anyOf": [{"type": kind, **members}, {"type": "null"}]}
        arguments[f"p{index}"] = value
    schema = {"type": "object", "properties": properties}
    reply = rendered_reply(chat_tokenizer, [("save", schema, arguments)])
    assert _one_shot(reply, [_tool(schema, name="save")]) == ("", [("save", arguments)])
