"""Structure of M3's namespaced argument XML, before any typing.

An invoke body is a run of sibling elements `]<]minimax[>[<tag>...]<]minimax[>[</tag>`
separated by optional whitespace. An element holds either nested elements (objects, arrays of
`<item>`) or raw text (a scalar, kept verbatim here; `schema_values` types it).

As in XML, whitespace between a tag's name and its `>` is not part of the name: `<path >` and
`</path >` are the element `path`.

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

from sglang_m3.parsers.m3_format import NAMESPACE

logger = logging.getLogger(__name__)

MAX_DEPTH = 64
_WHITESPACE = " \t\r\n"
_OPEN = NAMESPACE + "<"
_CLOSE = NAMESPACE + "</"


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
        if text.startswith(_CLOSE, position):
            if closing_tag is None:
                raise MalformedCall(f"closing tag without an open element at offset {position}")
            return tuple(children), _close(text, position, closing_tag, depth - 1)
        if not text.startswith(_OPEN, position):
            raise MalformedCall(f"text between elements at offset {position}: {text[position:position + 20]!r}")
        element, position = _parse_element(text, position, depth)
        children.append(element)


def _parse_element(text: str, position: int, depth: int) -> Tuple[Element, int]:
    if depth >= MAX_DEPTH:
        raise MalformedCall(f"elements nested deeper than {MAX_DEPTH}")
    name_start = position + len(_OPEN)
    name_end = text.find(">", name_start)
    if name_end == -1:
        raise MalformedCall(f"unterminated tag at offset {position}")
    tag = _tag_name(text[name_start:name_end])
    if not _valid_name(tag):
        raise MalformedCall(f"invalid element name {tag!r} at offset {position}")

    body_start = name_end + 1
    first = _skip_whitespace(text, body_start)
    if text.startswith(_OPEN, first) and not text.startswith(_CLOSE, first):
        children, end = _parse_run(text, first, closing_tag=tag, depth=depth + 1)
        return Element(tag=tag, text=None, children=children), end

    body_end = text.find(NAMESPACE, body_start)
    if body_end == -1:
        raise MalformedCall(f"element <{tag}> is never closed")
    if not text.startswith(_CLOSE, body_end):
        raise MalformedCall(f"element <{tag}> mixes text and markup")
    return Element(tag=tag, text=text[body_start:body_end]), _close(text, body_end, tag, depth)


def _tag_name(written: str) -> str:
    """The element name a tag writes: XML allows whitespace before the tag's `>`."""
    return written.rstrip(_WHITESPACE)


def _valid_name(tag: str) -> bool:
    return bool(tag) and "<" not in tag and NAMESPACE not in tag and tag[0] not in _WHITESPACE + "/"


def _close(text: str, position: int, tag: str, depth: int) -> int:
    """End of the closing tag at `position`, which closes element `tag` found at `depth`."""
    name_start = position + len(_CLOSE)
    name_end = text.find(">", name_start)
    name = _tag_name(text[name_start:name_end]) if name_end != -1 else ""
    if not _valid_name(name):
        raise MalformedCall(f"element <{tag}> has a malformed closing tag at offset {position}")
    if name != tag:
        if depth != 0:
            raise MalformedCall(f"element <{tag}> closed by </{name}> at offset {position}")
        logger.debug("argument <%s> closed by </%s>: taken as its end, no other element is open", tag, name)
    return name_end + 1
