"""Structure of M3's namespaced argument XML, before any typing.

An invoke body is a run of sibling elements `]<]minimax[>[<tag>...]<]minimax[>[</tag>`
separated by optional whitespace. An element holds either nested elements (objects, arrays of
`<item>`) or raw text (a scalar, kept verbatim here; `schema_values` types it).

Anything else (text between siblings, a closing tag that does not match, an element that never
closes, a leaf holding a namespace marker) raises `MalformedCall`: the caller then hands the
whole invoke back as content instead of guessing.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

from sglang_m3.parsers.m3_format import NAMESPACE, element_close

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
            expected = element_close(closing_tag)
            if not text.startswith(expected, position):
                raise MalformedCall(f"element <{closing_tag}> closed by a different tag at offset {position}")
            return tuple(children), position + len(expected)
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
    tag = text[name_start:name_end]
    if not tag or "<" in tag or NAMESPACE in tag or tag[0] in _WHITESPACE + "/":
        raise MalformedCall(f"invalid element name {tag!r} at offset {position}")

    body_start = name_end + 1
    first = _skip_whitespace(text, body_start)
    if text.startswith(_OPEN, first) and not text.startswith(_CLOSE, first):
        children, end = _parse_run(text, first, closing_tag=tag, depth=depth + 1)
        return Element(tag=tag, text=None, children=children), end

    closing = element_close(tag)
    body_end = text.find(closing, body_start)
    if body_end == -1:
        raise MalformedCall(f"element <{tag}> is never closed")
    value = text[body_start:body_end]
    if NAMESPACE in value:
        raise MalformedCall(f"element <{tag}> mixes text and markup")
    return Element(tag=tag, text=value), body_end + len(closing)
