"""Repeated think tags at the reasoning boundaries are framing, not text.

M3 has been seen to write its stray closer twice (`</mm:think></mm:think>` before content or a
tool-call block), and a closer right after the one that ends its reasoning; a prompt that
already opened `<mm:think>` may be followed by the model opening it again. A tag in those
places never carries meaning, so a run of them is dropped as one would be. A tag anywhere
else (inside reasoning, after the first content character) stays text, as before.
"""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.entrypoints.openai.protocol import Tool
from sglang.srt.parser.reasoning_parser import MiniMaxM3Detector as UpstreamReasoningDetector

from sglang_m3.parsers.m3_format import NAMESPACE as NS
from sglang_m3.parsers.m3_format import THINK_CLOSE, THINK_OPEN
from sglang_m3.parsers.reasoning_detector import MiniMaxM3ReasoningDetector
from sglang_m3.parsers.tool_call_detector import MiniMaxM3ToolCallDetector
from tests.parsers import m3_strategies as m3
from tests.parsers.test_reasoning_detector import one_shot, plain_text, split_oracle, streamed

PROPERTY_SETTINGS = settings(max_examples=200, deadline=None)


@pytest.mark.parametrize(
    "text, force, expected",
    [
        ("</mm:think></mm:think>Hello.", False, ("", "Hello.")),
        ("</mm:think>\n</mm:think>\nHello", False, ("", "\nHello")),
        ("\n</mm:think></mm:think></mm:think>", False, ("", "")),
        ("plan</mm:think></mm:think>answer", True, ("plan", "answer")),
        ("plan</mm:think>\n</mm:think>\n\nanswer", True, ("plan", "\n\nanswer")),
        ("<mm:think>plan</mm:think></mm:think>answer", False, ("plan", "answer")),
        ("<mm:think><mm:think>plan</mm:think>answer", False, ("plan", "answer")),
        ("<mm:think>\n<mm:think>plan</mm:think>answer", True, ("plan", "answer")),
        # Tags that are not at a boundary stay text.
        ("plan</mm:think>answer</mm:think>", True, ("plan", "answer</mm:think>")),
        ("answer</mm:think></mm:think>tail", False, ("", "answer</mm:think></mm:think>tail")),
        ("<mm:think>a<mm:think>b</mm:think>c", False, ("a<mm:think>b", "c")),
        ("</mm:think>x</mm:think>", False, ("", "x</mm:think>")),
        # Whitespace after the boundary, with no tag behind it, is the content's or reasoning's.
        ("plan</mm:think>\n\n", True, ("plan", "\n\n")),
        ("<mm:think>\nplan</mm:think>", False, ("\nplan", "")),
    ],
)
def test_repeated_boundary_tags_are_dropped(text, force, expected):
    assert one_shot(text, force_reasoning=force) == expected
    assert streamed([text], force_reasoning=force) == expected
    assert streamed(list(text), force_reasoning=force) == expected


def test_upstream_keeps_the_second_stray_closer():
    """SGLang 0.5.23 drops one leading closer only, so the second reaches the client."""
    result = UpstreamReasoningDetector().detect_and_parse("</mm:think></mm:think>Hello.")
    assert (result.reasoning_text, result.normal_text) == ("", "</mm:think>Hello.")


@st.composite
def replies_with_repeated_tags(draw):
    """(text, force_reasoning, reasoning, content): each boundary tag written 1-3 times, with
    optional whitespace before each repeat (and before a run that opens the reply)."""

    def run(tag):
        repeats = draw(st.integers(0, 2))
        return tag + "".join(draw(st.sampled_from(["", " ", "\n"])) + tag for _ in range(repeats))

    lead = draw(st.sampled_from(["", " ", "\n"]))
    reasoning, content = draw(plain_text), draw(plain_text)
    shape = draw(st.sampled_from(["enabled", "enabled_reopened", "adaptive_think", "stray_close"]))
    if shape == "enabled":
        return reasoning + run(THINK_CLOSE) + content, True, reasoning, content
    if shape == "enabled_reopened":
        return lead + run(THINK_OPEN) + reasoning + run(THINK_CLOSE) + content, True, reasoning, content
    if shape == "adaptive_think":
        return lead + run(THINK_OPEN) + reasoning + run(THINK_CLOSE) + content, False, reasoning, content
    return lead + run(THINK_CLOSE) + content, False, "", content


@PROPERTY_SETTINGS
@given(reply=replies_with_repeated_tags(), data=st.data())
def test_repeated_boundary_tags_split_alike_under_any_chunking(reply, data):
    text, force, reasoning, content = reply
    assert one_shot(text, force_reasoning=force) == (reasoning, content)
    cuts = data.draw(m3.chunkings(len(text)))
    assert streamed(m3.split_at(text, cuts), force_reasoning=force) == (reasoning, content)


def test_doubled_stray_closer_before_a_tool_call_leaves_no_content():
    """The reported shape: two closers, then the call block. Reasoning parser first, then the
    tool-call parser on its content, as SGLang's chat serving runs them."""
    tools = [Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}})]
    reply = f'</mm:think></mm:think>{NS}<tool_call>\n{NS}<invoke name="f">\n{NS}<n>3{NS}</n>\n{NS}</invoke>\n{NS}</tool_call>'
    content = MiniMaxM3ReasoningDetector().detect_and_parse(reply).normal_text
    result = MiniMaxM3ToolCallDetector().detect_and_parse(content, tools)
    assert result.normal_text == ""
    assert [(call.name, json.loads(call.parameters)) for call in result.calls] == [("f", {"n": 3})]


_soup = st.lists(
    st.sampled_from([THINK_OPEN, THINK_CLOSE, " ", "\n", "a", "<", "</mm:", "think>", "<mm:", "b c"]),
    max_size=12,
).map("".join)


@PROPERTY_SETTINGS
@given(text=_soup, force=st.booleans(), data=st.data())
def test_any_mix_of_tags_and_text_splits_as_specified(text, force, data):
    """Tags, their fragments, whitespace and text in any order (truncations included): one-shot
    and any chunking give the specified split (`split_oracle`)."""
    expected = split_oracle(text, force)
    assert one_shot(text, force_reasoning=force) == expected
    assert streamed(m3.split_at(text, data.draw(m3.chunkings(len(text)))), force_reasoning=force) == expected
