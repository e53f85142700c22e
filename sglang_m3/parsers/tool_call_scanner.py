"""Split M3 output into content text and tool calls, incrementally and chunk-independently.

One state machine serves both the streaming and the one-shot parser (the one-shot parser feeds
the whole text and finishes), so the two agree by construction: the events depend on the text,
never on where chunks were cut.

Rules:
- Outside a block everything is content; `]<]minimax[>[<tool_call>` opens a block.
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
"""

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple, Union

from sglang_m3.parsers.m3_format import (
    INVOKE_CLOSE,
    INVOKE_OPEN_PREFIX,
    INVOKE_OPEN_SUFFIX,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    partial_suffix_length,
)
from sglang_m3.parsers.declared_tools import ToolLookup
from sglang_m3.parsers.schema_values import arguments_from_elements
from sglang_m3.parsers.xml_elements import MalformedCall, parse_siblings

_WHITESPACE = " \t\r\n"
# Markers that cannot occur inside one invoke: seeing one first means the invoke is broken.
_FOREIGN_IN_INVOKE = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, INVOKE_OPEN_PREFIX)
_INVOKE_MARKERS = (INVOKE_CLOSE, *_FOREIGN_IN_INVOKE)
# Text of an open invoke searched without finding a marker, less this many last characters
# (where one may still be starting), holds none.
_MARKER_OVERLAP = max(map(len, _INVOKE_MARKERS)) - 1


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


def parse_invoke(raw: str, lookup_tool: ToolLookup) -> ParsedCall:
    """Parse one complete invoke, from its opening prefix through `]<]minimax[>[</invoke>`."""
    header_end = raw.find(INVOKE_OPEN_SUFFIX, len(INVOKE_OPEN_PREFIX))
    if header_end == -1:
        raise MalformedCall("invoke header has no closing '\">'")
    name = raw[len(INVOKE_OPEN_PREFIX):header_end]
    if not name or any(char in name for char in '"<>\n'):
        raise MalformedCall(f"invalid function name {name!r}")
    try:
        tool = lookup_tool(name)
    except KeyError:
        raise MalformedCall(f"unknown function {name!r}") from None
    body = raw[header_end + len(INVOKE_OPEN_SUFFIX): len(raw) - len(INVOKE_CLOSE)]
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

    def feed(self, text: str) -> List[ScanEvent]:
        self._buffer += text
        events: List[ScanEvent] = []
        while self._step(events):
            pass
        return _merged(events)

    def finish(self) -> List[ScanEvent]:
        """End of output: whatever is still held back is content."""
        rest = _text_of(self._uncommitted) + "".join(self._invoke_head) + self._buffer
        self._buffer, self._uncommitted, self._in_block, self._invoke_head = "", [], False, []
        return [ContentText(rest)] if rest else []

    def _step(self, events: List[ScanEvent]) -> bool:
        """Consume what can be decided now; False when more text is needed."""
        if not self._in_block:
            return self._step_outside(events)
        if self._invoke_head:
            return self._step_invoke(events)
        return self._step_in_block(events)

    def _step_outside(self, events: List[ScanEvent]) -> bool:
        start = self._buffer.find(TOOL_CALL_OPEN)
        if start == -1:
            keep = partial_suffix_length(self._buffer, TOOL_CALL_OPEN)
            events.append(ContentText(self._buffer[: len(self._buffer) - keep]))
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        events.append(ContentText(self._buffer[:start]))
        self._uncommitted = [Markup(TOOL_CALL_OPEN)]
        self._buffer = self._buffer[start + len(TOOL_CALL_OPEN):]
        self._in_block, self._block_has_call = True, False
        return True

    def _step_in_block(self, events: List[ScanEvent]) -> bool:
        spaces = len(self._buffer) - len(self._buffer.lstrip(_WHITESPACE))
        if spaces:
            self._uncommitted.append(Markup(self._buffer[:spaces]))
            self._buffer = self._buffer[spaces:]
        if not self._buffer:
            return False
        if self._buffer.startswith(TOOL_CALL_CLOSE):
            self._uncommitted.append(Markup(TOOL_CALL_CLOSE))
            self._buffer = self._buffer[len(TOOL_CALL_CLOSE):]
            self._close_block(events)
            return True
        if self._buffer.startswith(INVOKE_OPEN_PREFIX):
            self._invoke_head = [INVOKE_OPEN_PREFIX]
            self._buffer = self._buffer[len(INVOKE_OPEN_PREFIX):]
            return True
        if INVOKE_OPEN_PREFIX.startswith(self._buffer) or TOOL_CALL_CLOSE.startswith(self._buffer):
            return False
        self._abandon_block(events)
        return True

    def _step_invoke(self, events: List[ScanEvent]) -> bool:
        """In an open invoke: its closing tag ends it; another marker first breaks the block."""
        position, marker = _first_marker(self._buffer)
        if position == -1:
            searched = len(self._buffer) - _MARKER_OVERLAP
            if searched > 0:
                self._invoke_head.append(self._buffer[:searched])
                self._buffer = self._buffer[searched:]
            return False
        if marker != INVOKE_CLOSE:
            self._abandon_block(events)
            return True
        end = position + len(INVOKE_CLOSE)
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


def _first_marker(text: str) -> Tuple[int, str]:
    """The first marker in the text of an open invoke (its opening tag excluded) that ends the
    invoke: (position, marker), or (-1, "") when there is none yet."""
    found = [(position, marker) for marker in _INVOKE_MARKERS if (position := text.find(marker)) != -1]
    return min(found, default=(-1, ""))


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
