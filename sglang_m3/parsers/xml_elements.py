"""Structure of M3's namespaced argument XML, before any typing.

An invoke body is a run of sibling elements `]<]minimax[>[<tag>...]<]minimax[>[</tag>`
separated by optional whitespace. An element holds either nested elements (objects, arrays of
`<item>`) or raw text (a scalar, kept verbatim here; `schema_values` types it).

As in XML, whitespace between a tag's name and its `>` is not part of the name: `<path >` and
`</path >` are the element `path`. Whitespace between the namespace token and a tag's `<` is
part of the tag (`m3_format.TAG_SPACING`), never of a value: `]<]minimax[>[\n<path>` opens `path`.

One recovery is taken because its intent is unambiguous: a closing tag with the wrong name
while exactly one element is open (a top-level argument) closes that element, with a debug
log line. With elements nested, a wrong name could close any of them, so it stays an error.

Anything else (text between siblings, a wrong closing tag inside nesting, an element that
never closes, a leaf holding a namespace marker) raises `MalformedCall`: the caller then hands
the whole invoke back as content instead of guessing.
"""

import logging
from dataclasses import dataclass
from typing import Optional, Tuple

from sglang_m3.parsers.m3_format import NAMESPACE, TAG_SPACING

logger = logging.getLogger(__name__)

MAX_DEPTH = 64
# between elements, and after the namespace token of a tag: the same characters
_WHITESPACE = TAG_SPACING


class MalformedCall(ValueError):
    """The text is not a well-formed M3 tool call; the message says where and why."""


@dataclass(frozen=True)
class Element:
    """One XML element: `text` for a leaf, `children` (possibly empty) for a container."""

    tag: str
    text: Optional[str]
    children: Tuple["Element", ...] = ()

    @property
    def is_leaf(self) -> bool:
        return self.text is not None


def parse_siblings(text: str) -> Tuple[Element, ...]:
    """Parse a whole invoke body: whitespace-separated elements and nothing else."""
    children, position = _parse_run(text, 0, closing_tag=None, depth=0)
    if position != len(text):
        raise MalformedCall(f"unexpected text at offset {position}: {text[position:position + 20]!r}")
    return children


def _skip_whitespace(text: str, position: int) -> int:
    while position < len(text) and text[position] in _WHITESPACE:
        position += 1
    return position


def _tag_bracket(text: str, position: int) -> int:
    """The position of the `<` of a tag written at `position` (the namespace token, its
    spacing, then `<`), or -1 when no tag starts there."""
    if not text.startswith(NAMESPACE, position):
        return -1
    bracket = _skip_whitespace(text, position + len(NAMESPACE))
    return bracket if text.startswith("<", bracket) else -1


def _is_closing(text: str, bracket: int) -> bool:
    return bracket != -1 and text.startswith("</", bracket)


def _parse_run(
    text: str, position: int, closing_tag: Optional[str], depth: int
) -> Tuple[Tuple[Element, ...], int]:
    """Parse siblings from `position` up to the closing tag of the parent (or the end)."""
    children = []
    while True:
        position = _skip_whitespace(text, position)
        if position == len(text):
            if closing_tag is not None:
                raise MalformedCall(f"element <{closing_tag}> is never closed")
            return tuple(children), position
        bracket = _tag_bracket(text, position)
        if _is_closing(text, bracket):
            if closing_tag is None:
                raise MalformedCall(f"closing tag without an open element at offset {position}")
            return tuple(children), _close(text, bracket, closing_tag, depth - 1)
        if bracket == -1:
            raise MalformedCall(f"text between elements at offset {position}: {text[position:position + 20]!r}")
        element, position = _parse_element(text, bracket, depth)
        children.append(element)


def _parse_element(text: str, bracket: int, depth: int) -> Tuple[Element, int]:
    """The element whose opening tag has its `<` at `bracket`, and the position after it."""
    if depth >= MAX_DEPTH:
        raise MalformedCall(f"elements nested deeper than {MAX_DEPTH}")
    name_start = bracket + 1
    name_end = text.find(">", name_start)
    if name_end == -1:
        raise MalformedCall(f"unterminated tag at offset {bracket}")
    tag = _tag_name(text[name_start:name_end])
    if not _valid_name(tag):
        raise MalformedCall(f"invalid element name {tag!r} at offset {bracket}")

    body_start = name_end + 1
    first = _skip_whitespace(text, body_start)
    child = _tag_bracket(text, first)
    if child != -1 and not _is_closing(text, child):
        children, end = _parse_run(text, first, closing_tag=tag, depth=depth + 1)
        return Element(tag=tag, text=None, children=children), end

    body_end = text.find(NAMESPACE, body_start)
    if body_end == -1:
        raise MalformedCall(f"element <{tag}> is never closed")
    closing = _tag_bracket(text, body_end)
    if not _is_closing(text, closing):
        raise MalformedCall(f"element <{tag}> mixes text and markup")
    return Element(tag=tag, text=text[body_start:body_end]), _close(text, closing, tag, depth)


def _tag_name(written: str) -> str:
    """The element name a tag writes: XML allows whitespace before the tag's `>`."""
    return written.rstrip(_WHITESPACE)


def _valid_name(tag: str) -> bool:
    return bool(tag) and "<" not in tag and NAMESPACE not in tag and tag[0] not in _WHITESPACE + "/"


def _close(text: str, bracket: int, tag: str, depth: int) -> int:
    """End of the closing tag whose `</` is at `bracket`, which closes element `tag` found at `depth`."""
    name_start = bracket + len("</")
    name_end = text.find(">", name_start)
    name = _tag_name(text[name_start:name_end]) if name_end != -1 else ""
    if not _valid_name(name):
        raise MalformedCall(f"element <{tag}> has a malformed closing tag at offset {bracket}")
    if name != tag:
        if depth != 0:
            raise MalformedCall(f"element <{tag}> closed by </{name}> at offset {bracket}")
        logger.debug("argument <%s> closed by </%s>: taken as its end, no other element is open", tag, name)
    return name_end + 1
