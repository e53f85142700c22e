"""Split M3 output into content text and tool calls, incrementally and chunk-independently.

One state machine serves both the streaming and the one-shot parser (the one-shot parser feeds
the whole text and finishes), so the two agree by construction: the events depend on the text,
never on where chunks were cut.

Rules:
- Outside a block everything is content; `]<]minimax[>[<tool_call>` opens a block.
- Every marker may have whitespace between its namespace token and its tag
  (`m3_format.TAG_SPACING`); it is part of the marker. A namespace token and whitespace that
  make no marker are kept as written (content outside a block).
- Inside a block only whitespace, invokes and the block's closing tag may appear. Each
  complete invoke (`]<]minimax[>[<invoke name="...">` ... `]<]minimax[>[</invoke>`) of a
  declared function (`declared_tools`) that parses becomes one call, emitted when its closing
  tag arrives: a call is never sent before it is known to be good, because a streamed call
  cannot be taken back.
- A complete invoke that cannot be a call (an undeclared function, arguments that do not
  parse) is content: its extent is known from its own `</invoke>`, so the block goes on and
  the well-formed calls beside it stay calls. A block whose invokes were all rejected is
  content whole, its tags included.
- At the first thing in a block that is neither an invoke nor the closing tag (junk text, a
  nested block marker, an invoke broken by another marker), the block ends there: what the
  block held uncommitted and everything after it are scanned again as content (a later
  `]<]minimax[>[<tool_call>` opens a new block). No character is dropped.
- A stream that ends inside a block (the model stopped mid-call) returns the uncommitted rest
  as content.

Cost: an open invoke is searched for its end once, not again per chunk. The part of it known to
hold no marker moves out of the buffer, so feeding a long argument in small chunks costs time
linear in its length (the buffer the next chunk joins and searches stays a few markers long).
Whitespace after a namespace token that ends the buffer is set aside until a tag completes or
cannot, so a model looping on newlines there is not searched again per chunk either.
"""

import json
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Pattern, Union

from sglang_m3.parsers.m3_format import (
    INVOKE_CLOSE,
    INVOKE_OPEN_PREFIX,
    INVOKE_OPEN_SUFFIX,
    NAMESPACE,
    TAG_SPACING,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    may_become_tag,
    spaced_markers,
    tag_of,
    undecided_start,
)
from sglang_m3.parsers.declared_tools import ToolLookup
from sglang_m3.parsers.schema_values import arguments_from_elements
from sglang_m3.parsers.xml_elements import MalformedCall, parse_siblings

_WHITESPACE = " \t\r\n"
_INVOKE_CLOSE_TAG = tag_of(INVOKE_CLOSE)
_OUTSIDE_MARKERS = (TOOL_CALL_OPEN,)
_BLOCK_MARKERS = (TOOL_CALL_CLOSE, INVOKE_OPEN_PREFIX)
# In an invoke, any marker but its closing tag means the invoke is broken.
_INVOKE_MARKERS = (INVOKE_CLOSE, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, INVOKE_OPEN_PREFIX)
_BLOCK_OPEN = spaced_markers(*_OUTSIDE_MARKERS)
_BLOCK_CLOSE = spaced_markers(TOOL_CALL_CLOSE)
_INVOKE_OPEN = spaced_markers(INVOKE_OPEN_PREFIX)
_IN_INVOKE = spaced_markers(*_INVOKE_MARKERS)


@dataclass(frozen=True)
class ContentText:
    text: str


@dataclass(frozen=True)
class Markup:
    """Block markup consumed around calls (opening tag, spacing, closing tag)."""

    text: str


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: Dict[str, Any]
    raw: str  # the invoke exactly as written

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


ScanEvent = Union[ContentText, Markup, ParsedCall]
# Joining `text` / `raw` of all events in order gives back the input exactly.


def opens_block(text: str) -> bool:
    """Whether `text` holds a block opening (`]<]minimax[>[<tool_call>`, spacing allowed)."""
    return _BLOCK_OPEN.search(text) is not None


def parse_invoke(raw: str, lookup_tool: ToolLookup) -> ParsedCall:
    """Parse one complete invoke, from its opening prefix through `]<]minimax[>[</invoke>`
    (spacing after either namespace token allowed)."""
    name_start = _INVOKE_OPEN.match(raw).end()
    header_end = raw.find(INVOKE_OPEN_SUFFIX, name_start)
    if header_end == -1:
        raise MalformedCall("invoke header has no closing '\">'")
    name = raw[name_start:header_end]
    if not name or any(char in name for char in '"<>\n'):
        raise MalformedCall(f"invalid function name {name!r}")
    try:
        tool = lookup_tool(name)
    except KeyError:
        raise MalformedCall(f"unknown function {name!r}") from None
    # the closing marker starts at the last namespace token: its tag holds none
    body = raw[header_end + len(INVOKE_OPEN_SUFFIX): raw.rfind(NAMESPACE)]
    children = parse_siblings(body)
    try:
        arguments = arguments_from_elements(children, tool.parameters)
    except Exception as error:  # a tool schema of unexpected shape must not break the response
        raise MalformedCall(f"arguments of {name!r} do not fit its schema: {error}") from error
    return ParsedCall(name=tool.name, arguments=arguments, raw=raw)


class ToolCallScanner:
    """Incremental splitter of M3 output into `ContentText` and `ParsedCall` events."""

    def __init__(self, lookup_tool: ToolLookup):
        self._lookup_tool = lookup_tool
        self._buffer = ""
        self._in_block = False
        # Block text read but not yet committed by a good invoke or the closing tag: markup,
        # and rejected invokes as content. It is all content if the block never commits.
        self._uncommitted: List[ScanEvent] = []
        self._block_has_call = False
        # The open invoke's text known to hold no marker (its opening tag first); the buffer
        # goes on from its end. Empty while no invoke is open.
        self._invoke_head: List[str] = []
        # What follows a namespace token that ends the buffer, set aside while it may still be
        # the spacing and the start of a tag (`_past_namespace`): the spacing in pieces, so
        # joining is paid once, then the tag's first characters.
        self._spacing: List[str] = []
        self._tag_start = ""

    def feed(self, text: str) -> List[ScanEvent]:
        text = self._past_namespace(text)
        if not text:
            return []
        self._buffer += text
        events: List[ScanEvent] = []
        while self._step(events):
            pass
        self._set_aside_after_namespace()
        return _merged(events)

    def finish(self) -> List[ScanEvent]:
        """End of output: whatever is still held back is content."""
        rest = _text_of(self._uncommitted) + "".join(self._invoke_head) + self._buffer + self._release_after_namespace()
        self._buffer, self._uncommitted, self._in_block, self._invoke_head = "", [], False, []
        return [ContentText(rest)] if rest else []

    def _past_namespace(self, text: str) -> str:
        """The text to scan now. While the buffer ends with a namespace token, what follows it is
        set aside until it completes a tag or cannot: scanned with the buffer, a run of spacing
        there (a model looping on newlines) would be searched again with every chunk. Delaying
        text changes no event: the scan does not depend on where chunks are cut."""
        if not self._buffer.endswith(NAMESPACE):
            return text
        if not self._tag_start:
            spaces = len(text) - len(text.lstrip(TAG_SPACING))
            self._spacing.append(text[:spaces])
            text = text[spaces:]
        self._tag_start += text
        if may_become_tag(self._tag_start, _INVOKE_MARKERS):
            return ""
        return self._release_after_namespace()

    def _release_after_namespace(self) -> str:
        """The text set aside after the buffer's namespace token, now handed to the scan."""
        released = "".join(self._spacing) + self._tag_start
        self._spacing, self._tag_start = [], ""
        return released

    def _set_aside_after_namespace(self) -> None:
        """After a scan, moves the spacing and tag start that follow the buffer's last namespace
        token aside (`_past_namespace`), so the buffer ends with the token. The buffer then holds
        only what the scan could not decide, so the search from its end is short."""
        cut = self._buffer.rfind(NAMESPACE) + len(NAMESPACE)
        after = self._buffer[cut:]
        tag_start = after.lstrip(TAG_SPACING)
        if cut < len(NAMESPACE) or not after or not may_become_tag(tag_start, _INVOKE_MARKERS):
            return
        self._spacing, self._tag_start = [after[: len(after) - len(tag_start)]], tag_start
        self._buffer = self._buffer[:cut]

    def _step(self, events: List[ScanEvent]) -> bool:
        """Consume what can be decided now; False when more text is needed."""
        if not self._in_block:
            return self._step_outside(events)
        if self._invoke_head:
            return self._step_invoke(events)
        return self._step_in_block(events)

    def _step_outside(self, events: List[ScanEvent]) -> bool:
        opening = _first_marker(self._buffer, _BLOCK_OPEN)
        if opening is None:
            keep_from = undecided_start(self._buffer, _OUTSIDE_MARKERS)
            events.append(ContentText(self._buffer[:keep_from]))
            self._buffer = self._buffer[keep_from:]
            return False
        events.append(ContentText(self._buffer[: opening.start()]))
        self._uncommitted = [Markup(opening.group())]
        self._buffer = self._buffer[opening.end():]
        self._in_block, self._block_has_call = True, False
        return True

    def _step_in_block(self, events: List[ScanEvent]) -> bool:
        spaces = len(self._buffer) - len(self._buffer.lstrip(_WHITESPACE))
        if spaces:
            self._uncommitted.append(Markup(self._buffer[:spaces]))
            self._buffer = self._buffer[spaces:]
        if not self._buffer:
            return False
        closing = _BLOCK_CLOSE.match(self._buffer)
        if closing:
            self._uncommitted.append(Markup(closing.group()))
            self._buffer = self._buffer[closing.end():]
            self._close_block(events)
            return True
        invoke = _INVOKE_OPEN.match(self._buffer)
        if invoke:
            self._invoke_head = [invoke.group()]
            self._buffer = self._buffer[invoke.end():]
            return True
        if undecided_start(self._buffer, _BLOCK_MARKERS) == 0:
            return False
        self._abandon_block(events)
        return True

    def _step_invoke(self, events: List[ScanEvent]) -> bool:
        """In an open invoke: its closing tag ends it; another marker first breaks the block."""
        marker = _first_marker(self._buffer, _IN_INVOKE)
        if marker is None:
            searched = undecided_start(self._buffer, _INVOKE_MARKERS)
            if searched > 0:
                self._invoke_head.append(self._buffer[:searched])
                self._buffer = self._buffer[searched:]
            return False
        if marker.group("tag") != _INVOKE_CLOSE_TAG:
            self._abandon_block(events)
            return True
        end = marker.end()
        raw = "".join(self._invoke_head) + self._buffer[:end]
        self._buffer, self._invoke_head = self._buffer[end:], []
        try:
            call = parse_invoke(raw, self._lookup_tool)
        except MalformedCall:
            self._uncommitted.append(ContentText(raw))
            return True
        events.extend(self._uncommitted)
        events.append(call)
        self._uncommitted, self._block_has_call = [], True
        return True

    def _close_block(self, events: List[ScanEvent]) -> None:
        """The block's closing tag was read: what it held stands as read (markup, rejected
        invokes as content) when the block yielded a call or rejected nothing (an empty block
        is markup); a block of rejected invokes only is content whole."""
        rejected = any(isinstance(event, ContentText) for event in self._uncommitted)
        if rejected and not self._block_has_call:
            events.append(ContentText(_text_of(self._uncommitted)))
        else:
            events.extend(self._uncommitted)
        self._uncommitted, self._in_block = [], False

    def _abandon_block(self, events: List[ScanEvent]) -> None:
        """The block breaks here: what it held uncommitted is content, the rest (an open invoke
        included) is rescanned."""
        events.append(ContentText(_text_of(self._uncommitted)))
        self._buffer = "".join(self._invoke_head) + self._buffer
        self._uncommitted, self._invoke_head = [], []
        self._in_block = False


def _text_of(events: List[ScanEvent]) -> str:
    """The input text a run of content and markup events was read from."""
    return "".join(event.text for event in events)


def _first_marker(text: str, markers: Pattern[str]) -> Optional[re.Match]:
    """The first of the `spaced_markers` in `text`, None when there is none yet. Every search
    for a marker goes through here (the cost tests count the text searched)."""
    return markers.search(text)


def _merged(events: List[ScanEvent]) -> List[ScanEvent]:
    """Drop empty text and markup events and join adjacent ones of the same kind."""
    merged: List[ScanEvent] = []
    for event in events:
        if isinstance(event, (ContentText, Markup)):
            if not event.text:
                continue
            if merged and type(merged[-1]) is type(event):
                merged[-1] = type(event)(merged[-1].text + event.text)
                continue
        merged.append(event)
    return merged


def scan_all(text: str, lookup_tool: ToolLookup) -> List[ScanEvent]:
    """One-shot scan of a complete output."""
    scanner = ToolCallScanner(lookup_tool)
    return _merged(scanner.feed(text) + scanner.finish())
