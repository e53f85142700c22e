"""Property tests: tool calls rendered by the project's chat template parse back exactly, one-shot
and under any chunking; truncated or corrupted output neither raises nor loses a character."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.entrypoints.openai.protocol import Tool

from sglang_m3.parsers import tool_call_scanner
from sglang_m3.parsers.declared_tools import tool_lookup
from sglang_m3.parsers.m3_format import INVOKE_CLOSE, INVOKE_OPEN_PREFIX, NAMESPACE, TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from sglang_m3.parsers.tool_call_detector import MiniMaxM3ToolCallDetector
from sglang_m3.parsers.tool_call_scanner import ParsedCall, ToolCallScanner, scan_all
from tests.parsers import m3_strategies as m3

PROPERTY_SETTINGS = settings(max_examples=150, deadline=None)
HISTORY_AI_PREFIX = "]~b]ai\n</mm:think>"
TURN_END = "[e~[\n"


def rendered_reply(tokenizer, generated_calls, content=""):
    """The assistant reply exactly as the chat template writes it in history."""
    prompt = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": content, "tool_calls": m3.history_tool_calls(generated_calls)},
        ],
        tokenize=False,
    )
    start = prompt.rindex(HISTORY_AI_PREFIX) + len(HISTORY_AI_PREFIX)
    assert prompt.endswith(TURN_END)
    return prompt[start: -len(TURN_END)]


def sglang_tools(generated_calls):
    return [Tool.model_validate(tool) for tool in m3.openai_tools(generated_calls)]


def expected_arguments(generated_calls):
    return [(name, json.dumps(value, ensure_ascii=False)) for name, _, value in generated_calls]


def parse_one_shot(text, tools):
    result = MiniMaxM3ToolCallDetector().detect_and_parse(text, tools)
    return result.normal_text, [(call.name, call.parameters) for call in result.calls]


def parse_streamed(chunks, tools):
    """Feed chunks, then finish; check each call's name arrives once, before its arguments."""
    detector = MiniMaxM3ToolCallDetector()
    normal_text = ""
    names, arguments = {}, {}
    results = [detector.parse_streaming_increment(chunk, tools) for chunk in chunks]
    results.append(detector.finish(tools))
    for result in results:
        normal_text += result.normal_text
        for item in result.calls:
            if item.name is not None:
                assert item.tool_index not in names, "function name sent twice"
                names[item.tool_index] = item.name
                arguments[item.tool_index] = ""
            assert item.tool_index in names, "arguments before the function name"
            arguments[item.tool_index] += item.parameters
    assert sorted(names) == list(range(len(names)))
    return normal_text, [(names[index], arguments[index]) for index in sorted(names)]


def scanned_text(events):
    """The input as the scanner accounts for it: content, consumed markup and raw invokes."""
    return "".join(getattr(event, "raw", None) or event.text for event in events)


@PROPERTY_SETTINGS
@given(generated=m3.calls(), content=m3.free_text, middle=m3.free_text, trailing=m3.free_text, data=st.data())
def test_rendered_calls_parse_back_exactly(chat_tokenizer, generated, content, middle, trailing, data):
    """One block, or the calls split over two blocks with text between and after them."""
    split = data.draw(st.integers(1, len(generated)))
    reply = rendered_reply(chat_tokenizer, generated[:split], content) + middle
    if split < len(generated):
        reply += rendered_reply(chat_tokenizer, generated[split:])
    reply += trailing
    tools = sglang_tools(generated)
    normal_text, calls = parse_one_shot(reply, tools)
    assert calls == expected_arguments(generated)
    assert normal_text == (content + "\n" if content else "") + middle + trailing


@PROPERTY_SETTINGS
@given(generated=m3.calls(), content=m3.free_text, data=st.data())
def test_streaming_equals_one_shot_under_any_chunking(chat_tokenizer, generated, content, data):
    reply = rendered_reply(chat_tokenizer, generated, content)
    tools = sglang_tools(generated)
    cuts = data.draw(m3.chunkings(len(reply)))
    assert parse_streamed(m3.split_at(reply, cuts), tools) == parse_one_shot(reply, tools)
    assert parse_streamed(list(reply), tools)[1] == expected_arguments(generated)


def _truncation_oracle(reply, length):
    """What a reply cut after `length` characters must parse to: the invokes complete by then
    are calls; the text outside the block and the uncommitted rest of the block are content."""
    prefix = reply[:length]
    block_start = reply.find(TOOL_CALL_OPEN)
    block_end = reply.find(TOOL_CALL_CLOSE) + len(TOOL_CALL_CLOSE)
    invoke_ends = []
    position = block_start
    while (position := reply.find(INVOKE_CLOSE, position)) != -1 and position < block_end:
        position += len(INVOKE_CLOSE)
        invoke_ends.append(position)
    if length < block_start + len(TOOL_CALL_OPEN):
        return prefix, 0
    complete = [end for end in invoke_ends if end <= length]
    if length >= block_end:
        return reply[:block_start] + prefix[block_end:], len(complete)
    resume = complete[-1] if complete else block_start
    return reply[:block_start] + prefix[resume:], len(complete)


@PROPERTY_SETTINGS
@given(generated=m3.calls(), content=m3.free_text, data=st.data())
def test_truncated_output_keeps_every_character(chat_tokenizer, generated, content, data):
    reply = rendered_reply(chat_tokenizer, generated, content)
    tools = sglang_tools(generated)
    length = data.draw(st.integers(0, len(reply)))
    prefix = reply[:length]

    normal_text, calls = parse_one_shot(prefix, tools)
    expected_text, complete_calls = _truncation_oracle(reply, length)
    assert normal_text == expected_text
    assert calls == expected_arguments(generated)[:complete_calls]
    assert parse_streamed(m3.split_at(prefix, data.draw(m3.chunkings(length))), tools) == (normal_text, calls)


_corruption_pieces = st.one_of(
    st.sampled_from(
        [NAMESPACE, "<", ">", "/", '"', TOOL_CALL_OPEN, TOOL_CALL_CLOSE, INVOKE_CLOSE, "<item>", "\n"]
    ),
    m3.free_text,
)


@PROPERTY_SETTINGS
@given(generated=m3.calls(), content=m3.free_text, data=st.data())
def test_corrupted_output_never_raises_nor_loses_text(chat_tokenizer, generated, content, data):
    reply = rendered_reply(chat_tokenizer, generated, content)
    for _ in range(data.draw(st.integers(1, 3))):
        start = data.draw(st.integers(0, len(reply)))
        end = data.draw(st.integers(start, min(len(reply), start + 20)))
        reply = reply[:start] + data.draw(_corruption_pieces) + reply[end:]
    tools = sglang_tools(generated)
    lookup = tool_lookup({name: schema for name, schema, _ in generated})

    assert scanned_text(scan_all(reply, lookup)) == reply
    normal_text, calls = parse_one_shot(reply, tools)
    known = {name for name, _, _ in generated}
    assert all(name in known and isinstance(json.loads(arguments), dict) for name, arguments in calls)
    assert parse_streamed(m3.split_at(reply, data.draw(m3.chunkings(len(reply)))), tools) == (normal_text, calls)


_markup_soup = st.lists(
    st.sampled_from(list('ab <>/"=\n') + [NAMESPACE, 'invoke name="f">', "tool_call>", "item>"]),
    max_size=40,
).map("".join)


@PROPERTY_SETTINGS
@given(text=_markup_soup, data=st.data())
def test_arbitrary_markup_soup_is_accounted_for(text, data):
    """Random mixes of marker fragments: the scanner's events give back the input exactly and do
    not depend on chunking."""
    lookup = tool_lookup({"f": {"type": "object", "properties": {"item": {"type": "string"}}}})
    one_shot = scan_all(text, lookup)
    assert scanned_text(one_shot) == text
    scanner = ToolCallScanner(lookup)
    events = []
    for chunk in m3.split_at(text, data.draw(m3.chunkings(len(text)))):
        events += scanner.feed(chunk)
    events += scanner.finish()
    assert scanned_text(events) == text
    assert [e for e in events if hasattr(e, "raw")] == [e for e in one_shot if hasattr(e, "raw")]


def scanned_in_chunks(lookup, chunks):
    scanner = ToolCallScanner(lookup)
    events = [event for chunk in chunks for event in scanner.feed(chunk)]
    return tool_call_scanner._merged(events + scanner.finish())


STRING_ARGUMENT = tool_lookup({"f": {"type": "object", "properties": {"s": {"type": "string"}}}})
# Text that holds no marker but may end in the start of one (no "[": no piece completes another).
_filler = st.text(alphabet="ab <>/]\n", max_size=120) | st.sampled_from([NAMESPACE[:length] for length in range(1, len(NAMESPACE))])
_in_argument = st.sampled_from(["", NAMESPACE, INVOKE_CLOSE, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, INVOKE_OPEN_PREFIX + 'f">'])


@PROPERTY_SETTINGS
@given(before=_filler, marker=_in_argument, after=_filler, trailing=m3.free_text, size=st.integers(1, 40), data=st.data())
def test_an_open_invoke_is_searched_alike_wherever_chunks_cut_it(before, marker, after, trailing, size, data):
    """A long argument with a marker (or none) at any offset from the chunk cuts: the same events
    as in one shot, in fixed-size and in random chunks; a call exactly when no marker broke it."""
    argument = before + marker + after
    text = f'{TOOL_CALL_OPEN}\n{INVOKE_OPEN_PREFIX}f">{NAMESPACE}<s>{argument}{NAMESPACE}</s>\n{INVOKE_CLOSE}\n{TOOL_CALL_CLOSE}{trailing}'
    one_shot = scan_all(text, STRING_ARGUMENT)
    assert scanned_text(one_shot) == text
    calls = [(event.name, event.arguments) for event in one_shot if isinstance(event, ParsedCall)]
    assert calls == ([] if NAMESPACE in argument else [("f", {"s": argument})])
    fixed = [text[start: start + size] for start in range(0, len(text), size)]
    assert scanned_in_chunks(STRING_ARGUMENT, fixed) == one_shot
    assert scanned_in_chunks(STRING_ARGUMENT, m3.split_at(text, data.draw(m3.chunkings(len(text))))) == one_shot


#: the longest end of an open invoke that a marker written without spacing may still start in
MARKER_OVERLAP = max(map(len, (INVOKE_CLOSE, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, INVOKE_OPEN_PREFIX))) - 1


def test_streaming_a_long_argument_searches_each_character_a_bounded_number_of_times(monkeypatch):
    """Work, not time. Every search of an open invoke goes through `_first_marker`, over the text
    the scanner still holds (which each chunk is also joined to): 200 KB fed 4 characters at a
    time is searched in pieces of at most a marker's length plus one chunk, about as many
    characters in all as one-shot scanning plus that overlap per chunk. Before, every chunk
    searched (and copied) the whole invoke so far again: quadratic."""
    searched = []
    first_marker = tool_call_scanner._first_marker

    def counted_first_marker(text, *markers):
        searched.append(len(text))
        return first_marker(text, *markers)

    monkeypatch.setattr(tool_call_scanner, "_first_marker", counted_first_marker)
    content = 'def f(x):\n    return x < 3 and "<b>"\n' * 5500
    text = f'ok {TOOL_CALL_OPEN}\n{INVOKE_OPEN_PREFIX}f">\n{NAMESPACE}<s>{content}{NAMESPACE}</s>\n{INVOKE_CLOSE}\n{TOOL_CALL_CLOSE}'
    chunk_size = 4
    chunks = [text[start: start + chunk_size] for start in range(0, len(text), chunk_size)]
    assert len(text) > 200_000

    events = scanned_in_chunks(STRING_ARGUMENT, chunks)
    assert [(event.name, event.arguments) for event in events if isinstance(event, ParsedCall)] == [("f", {"s": content})]
    assert max(searched) <= MARKER_OVERLAP + chunk_size
    assert sum(searched) <= len(text) + len(chunks) * MARKER_OVERLAP
