"""Whitespace between the namespace token and the tag it prefixes is markup, never content.

The real tokenizer writes `]<]minimax[>[` as one token, and a model may follow it with a newline
or spaces before the tag (`]<]minimax[>[\n<invoke name="f">`). SGLang 0.5.23's own detector
removes such whitespace before every tag it reads (`MinimaxM3Detector.TAG_SPACING_RE`,
`[ \t\r\n]+` between the token and a `<`); this parser reads it alike, one-shot and streamed,
but keeps content verbatim: a namespace token and whitespace that open no block stay content.
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sglang.srt.function_call.minimax_m3 import MinimaxM3Detector as UpstreamToolDetector

from sglang_m3.parsers import tool_call_scanner
from sglang_m3.parsers.declared_tools import tool_lookup
from sglang_m3.parsers.m3_format import NAMESPACE as NS
from sglang_m3.parsers.tool_call_detector import MiniMaxM3ToolCallDetector
from sglang_m3.parsers.tool_call_scanner import ContentText, ParsedCall, scan_all
from tests.parsers import m3_strategies as m3
from tests.parsers.test_differential_upstream import DIFF_SETTINGS, WEATHER, _one_shot, _streamed, common_calls
from tests.parsers.test_tool_call_properties import (
    PROPERTY_SETTINGS,
    expected_arguments,
    parse_one_shot,
    parse_streamed,
    rendered_reply,
    scanned_in_chunks,
    scanned_text,
    sglang_tools,
)

_spacing = st.text(alphabet=" \t\r\n", max_size=3)


def _spaced(reply, data):
    """``reply`` with drawn whitespace (often none) after each namespace token."""
    first, *rest = reply.split(NS)
    return first + "".join(NS + data.draw(_spacing) + part for part in rest)


@PROPERTY_SETTINGS
@given(generated=m3.calls(), content=m3.free_text, trailing=m3.free_text, data=st.data())
def test_spacing_after_namespace_tokens_parses_as_without_it(chat_tokenizer, generated, content, trailing, data):
    """Every tag of a rendered reply (block, invokes, arguments, nested elements) may have
    whitespace after its namespace token: the same calls and the same content, under any chunking."""
    reply = rendered_reply(chat_tokenizer, generated, content) + trailing
    spaced = _spaced(reply, data)
    tools = sglang_tools(generated)
    expected = parse_one_shot(reply, tools)
    assert expected[1] == expected_arguments(generated)
    assert parse_one_shot(spaced, tools) == expected
    assert parse_streamed(m3.split_at(spaced, data.draw(m3.chunkings(len(spaced)))), tools) == expected
    assert MiniMaxM3ToolCallDetector().has_tool_call(spaced)
    lookup = tool_lookup({name: schema for name, schema, _ in generated})
    assert scanned_text(scan_all(spaced, lookup)) == spaced


@DIFF_SETTINGS
@given(generated=common_calls, content=m3.free_text, data=st.data())
def test_spaced_tags_agree_with_upstream(chat_tokenizer, generated, content, data):
    reply = _spaced(rendered_reply(chat_tokenizer, generated, content), data)
    tools = sglang_tools(generated)
    ours = _one_shot(MiniMaxM3ToolCallDetector(), reply, tools)
    assert ours == _one_shot(UpstreamToolDetector(), reply, tools)
    assert _streamed(MiniMaxM3ToolCallDetector(), list(reply), tools) == ours


@pytest.mark.parametrize(
    "spacing",
    [
        {"invoke": "\n"},
        {"open": "\n"},
        {"argument": "\n  "},
        {"argument_close": " "},
        {"invoke_close": "\t"},
        {"close": "\r\n"},
    ],
    ids=lambda spacing: next(iter(spacing)),
)
def test_each_tag_takes_spacing_after_its_namespace_token(spacing):
    """One tag at a time: the newline after the namespace token of the invoke is the reported
    case; upstream reads every one of them as markup."""
    gap = {key: spacing.get(key, "") for key in ("open", "invoke", "argument", "argument_close", "invoke_close", "close")}
    text = (
        f'Sure.{NS}{gap["open"]}<tool_call>\n{NS}{gap["invoke"]}<invoke name="f">\n'
        f'{NS}{gap["argument"]}<s>x{NS}{gap["argument_close"]}</s>\n{NS}{gap["invoke_close"]}</invoke>\n'
        f'{NS}{gap["close"]}</tool_call> Done.'
    )
    expected = ("Sure. Done.", [("f", {"s": "x"})])
    assert _one_shot(MiniMaxM3ToolCallDetector(), text, [WEATHER]) == expected
    assert _streamed(MiniMaxM3ToolCallDetector(), list(text), [WEATHER]) == expected
    assert _one_shot(UpstreamToolDetector(), text, [WEATHER]) == expected


@pytest.mark.parametrize(
    "text",
    [f"a {NS}\n b", f"{NS} \n", f"x{NS}\t<b>y", f"{NS}\n<tool_call", f"{NS}\n<tool_call>\n{NS}\nnot a tag"],
)
def test_spacing_that_opens_no_call_stays_content_verbatim(text):
    """Outside a block, and in a block that breaks, the namespace token and its whitespace are
    content as written (upstream drops the whitespace before any `<`, content included)."""
    assert _one_shot(MiniMaxM3ToolCallDetector(), text, [WEATHER]) == (text, [])
    assert _streamed(MiniMaxM3ToolCallDetector(), list(text), [WEATHER]) == (text, [])


def test_difference_upstream_drops_spacing_before_a_bracket_in_content_too():
    """Upstream removes the spacing before any `<` everywhere, so content that merely holds the
    token loses characters; here content stays as the model wrote it."""
    text = f"x{NS}\t<b>y"
    assert _one_shot(MiniMaxM3ToolCallDetector(), text, [WEATHER]) == (text, [])
    assert _one_shot(UpstreamToolDetector(), text, [WEATHER]) == (f"x{NS}<b>y", [])


def _counted(search, searched):
    """`search` (text first), recording the length of each text it is given in `searched`."""

    def counted(text, *args):
        searched.append(len(text))
        return search(text, *args)

    return counted


_IN_INVOKE = f'{NS}<tool_call>{NS}<invoke name="f">{NS}<s>x{NS}</s>'


@pytest.mark.parametrize(
    "prefix, suffix, content, calls",
    [
        ("text ", f"<tool_call>{NS}</tool_call>", "text ", []),
        (f"{NS}<tool_call>", f'<invoke name="f">{NS}<s>x{NS}</s>{NS}</invoke>{NS}</tool_call>', "", [("f", {"s": "x"})]),
        (_IN_INVOKE, f"</invoke>{NS}</tool_call>", "", [("f", {"s": "x"})]),
    ],
    ids=["outside", "in-block", "in-invoke"],
)
def test_a_long_run_of_spacing_streamed_in_small_chunks_is_searched_about_once(prefix, suffix, content, calls, monkeypatch):
    """A model that loops on newlines after a namespace token, in each state of the scanner: the
    run is not searched again for every chunk (quadratic), and reads as markup once the tag comes."""
    searched = []
    for name in ("_first_marker", "undecided_start"):  # every search and every hold-back
        monkeypatch.setattr(tool_call_scanner, name, _counted(getattr(tool_call_scanner, name), searched))
    lookup = tool_lookup({"f": {"type": "object", "properties": {"s": {"type": "string"}}}})
    text = f"{prefix}{NS}{chr(10) * 20_000}{suffix}"
    events = scanned_in_chunks(lookup, list(text))
    assert scanned_text(events) == text
    assert "".join(event.text for event in events if isinstance(event, ContentText)) == content
    assert [(event.name, event.arguments) for event in events if isinstance(event, ParsedCall)] == calls
    assert sum(searched) <= 4 * len(text)


def test_has_tool_call_sees_a_spaced_block_opening():
    assert MiniMaxM3ToolCallDetector().has_tool_call(f"hi {NS}\n<tool_call>")
    assert not MiniMaxM3ToolCallDetector().has_tool_call(f"hi {NS}\n<tool_cal")
