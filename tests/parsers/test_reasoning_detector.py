"""The M3 reasoning detector: exact splits per thinking mode, chunk-independence, truncation."""

import copy
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

from sglang_m3.parsers.m3_format import THINK_CLOSE, THINK_OPEN
from sglang_m3.parsers.reasoning_detector import MiniMaxM3ReasoningDetector
from tests.parsers import m3_strategies as m3

PROPERTY_SETTINGS = settings(max_examples=200, deadline=None)

# Reasoning and content text as a model writes it: no think tags inside.
plain_text = m3.free_text.filter(lambda text: "<mm:" not in text and "</mm:" not in text)
spacing = st.sampled_from(["", " ", "\n", " \n\t"])


def one_shot(text, **options):
    result = MiniMaxM3ReasoningDetector(**options).detect_and_parse(text)
    return result.reasoning_text, result.normal_text


def streamed(chunks, **options):
    detector = MiniMaxM3ReasoningDetector(**options)
    reasoning = content = ""
    for result in [*(detector.parse_streaming_increment(c) for c in chunks), detector.finish()]:
        reasoning += result.reasoning_text
        content += result.normal_text
    return reasoning, content


@st.composite
def replies(draw):
    """(reply text, force_reasoning, expected reasoning, expected content) over every shape."""
    reasoning, content, lead = draw(plain_text), draw(plain_text), draw(spacing)
    shape = draw(st.sampled_from(["enabled", "enabled_redundant_open", "adaptive_think", "stray_close", "plain"]))
    if shape == "enabled":
        return reasoning + THINK_CLOSE + content, True, reasoning, content
    if shape == "enabled_redundant_open":
        return lead + THINK_OPEN + reasoning + THINK_CLOSE + content, True, reasoning, content
    if shape == "adaptive_think":
        return lead + THINK_OPEN + reasoning + THINK_CLOSE + content, False, reasoning, content
    if shape == "stray_close":
        return lead + THINK_CLOSE + content, False, "", content
    content = draw(plain_text.filter(lambda text: text.strip() != ""))
    return content, False, "", content


@PROPERTY_SETTINGS
@given(reply=replies(), data=st.data())
def test_split_is_exact_and_chunk_independent(reply, data):
    text, force, reasoning, content = reply
    assert one_shot(text, force_reasoning=force) == (reasoning, content)
    cuts = data.draw(m3.chunkings(len(text)))
    assert streamed(m3.split_at(text, cuts), force_reasoning=force) == (reasoning, content)
    assert streamed(list(text), force_reasoning=force) == (reasoning, content)


def _tag_run(tag):
    """One or more `tag`, each after optional whitespace: a boundary written once or repeated."""
    return re.compile(f"(?:[ \t\r\n]*{re.escape(tag)})+")


def _after_run(tag, text):
    """`text` less a leading run of `tag`; None when it does not start with one."""
    run = _tag_run(tag).match(text)
    return text[run.end():] if run else None


def split_oracle(text, force):
    """The specified split, written directly: a leading run of openers (after whitespace) starts
    reasoning, a leading run of closers outside reasoning is dropped, the first closer inside
    reasoning ends it and a run of closers right after it is dropped too; everything else is
    kept where it stands."""
    rest, in_reasoning = text, force
    if _after_run(THINK_OPEN, text) is not None:
        rest, in_reasoning = _after_run(THINK_OPEN, text), True
    elif _after_run(THINK_CLOSE, text) is not None and not force:
        return "", _after_run(THINK_CLOSE, text)
    if not in_reasoning:
        return "", text
    reasoning, _, content = rest.partition(THINK_CLOSE)
    after_closers = _after_run(THINK_CLOSE, content)
    return reasoning, content if after_closers is None else after_closers


@PROPERTY_SETTINGS
@given(reply=replies(), data=st.data())
def test_truncated_reply_keeps_everything_but_markup(reply, data):
    text, force, _, _ = reply
    prefix = text[: data.draw(st.integers(0, len(text)))]
    expected = split_oracle(prefix, force)
    assert one_shot(prefix, force_reasoning=force) == expected
    cuts = data.draw(m3.chunkings(len(prefix)))
    assert streamed(m3.split_at(prefix, cuts), force_reasoning=force) == expected


@pytest.mark.parametrize(
    "text, force, expected",
    [
        ("<mm:think>plan</mm:think>answer", False, ("plan", "answer")),
        ("</mm:think>answer", False, ("", "answer")),
        ("\n</mm:think>\nanswer", False, ("", "\nanswer")),
        ("plan</mm:think>answer", True, ("plan", "answer")),
        ("<mm:think>plan</mm:think>answer", True, ("plan", "answer")),
        ("still thinking", True, ("still thinking", "")),
        ("<mm:think>cut off", False, ("cut off", "")),
        ("answer mentions <mm:think> later", False, ("", "answer mentions <mm:think> later")),
        ("answer</mm:think>tail", False, ("", "answer</mm:think>tail")),
        ("</mm:th", False, ("", "</mm:th")),
        ("", False, ("", "")),
        ("", True, ("", "")),
    ],
)
def test_examples(text, force, expected):
    assert one_shot(text, force_reasoning=force) == expected
    assert streamed(list(text), force_reasoning=force) == expected


def test_stray_closer_split_across_chunks_is_dropped():
    assert streamed(["</mm:", "thi", "nk>", "hello"]) == ("", "hello")


def test_stream_reasoning_off_releases_reasoning_whole_at_its_end():
    detector = MiniMaxM3ReasoningDetector(stream_reasoning=False, force_reasoning=True)
    first = detector.parse_streaming_increment("step one, ")
    second = detector.parse_streaming_increment("step two</mm:think>done")
    assert (first.reasoning_text, first.normal_text) == ("", "")
    assert (second.reasoning_text, second.normal_text) == ("step one, step two", "done")


def test_force_nonempty_content_shows_reasoning_when_there_is_no_answer():
    assert one_shot("only thoughts", force_reasoning=True, force_nonempty_content=True) == ("", "only thoughts")
    assert one_shot("t</mm:think>a", force_reasoning=True, force_nonempty_content=True) == ("t", "a")


def test_continuing_a_final_message_keeps_its_part():
    inside = MiniMaxM3ReasoningDetector(continue_final_message=True, previous_content="<mm:think>so far")
    assert (inside.detect_and_parse(" more</mm:think>ok").reasoning_text) == " more"
    after = MiniMaxM3ReasoningDetector(continue_final_message=True, previous_content="Hello")
    assert after.detect_and_parse("</mm:think> world").normal_text == "</mm:think> world"


def _continued_content(content):
    """The last message's content as SGLang hands it over: validated by the request model."""
    request = ChatCompletionRequest(
        model="m", continue_final_message=True, messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": content}]
    )
    return request.messages[-1].content


@pytest.mark.parametrize(
    "parts, text",
    [
        ([{"type": "text", "text": "Hel"}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}, {"type": "text", "text": "lo"}], "Hello"),
        ([{"type": "text", "text": "<mm:think>so far"}], "<mm:think>so far"),
        ([{"type": "thinking", "thinking": "hidden"}], ""),
        (None, ""),
    ],
)
@pytest.mark.parametrize("continuation", [" more", "</mm:think> world", " more</mm:think>ok"])
def test_continuing_a_message_of_content_parts_continues_its_text(parts, text, continuation):
    """Content parts (or none, beside tool calls) continue as the text their text parts render."""
    as_parts = MiniMaxM3ReasoningDetector(continue_final_message=True, previous_content=_continued_content(parts))
    as_text = MiniMaxM3ReasoningDetector(continue_final_message=True, previous_content=text)
    ours, expected = as_parts.detect_and_parse(continuation), as_text.detect_and_parse(continuation)
    assert (ours.reasoning_text, ours.normal_text) == (expected.reasoning_text, expected.normal_text)


def test_self_opened_reasoning_is_announced_by_the_open_tag(chat_tokenizer):
    tokenizer = copy.deepcopy(chat_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": [THINK_OPEN]})
    ids = MiniMaxM3ReasoningDetector().get_self_opened_think_start_token_ids(tokenizer)
    assert tokenizer.decode(ids) == THINK_OPEN
