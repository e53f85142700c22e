"""The literal markers of MiniMax M3's output format (M3_FACTS s.4), in one place.

The chat template (`chat_template.jinja`) writes the same strings; the golden tests pin both.
A model may write whitespace between the namespace token and the tag it prefixes
(`]<]minimax[>[\n<invoke name="f">`): the parsers read it as part of the tag (`TAG_SPACING`).
"""

import re
from typing import Pattern

NAMESPACE = "]<]minimax[>["
#: Whitespace allowed between the namespace token and its tag; markup, as the tag is. The real
#: tokenizer has the token on its own, so a sampled newline can follow it; SGLang 0.5.23's own
#: detector drops the same characters there (`MinimaxM3Detector.TAG_SPACING_CHARS`).
TAG_SPACING = " \t\r\n"

TOOL_CALL_OPEN = NAMESPACE + "<tool_call>"
TOOL_CALL_CLOSE = NAMESPACE + "</tool_call>"
INVOKE_OPEN_PREFIX = NAMESPACE + '<invoke name="'
INVOKE_OPEN_SUFFIX = '">'
INVOKE_CLOSE = NAMESPACE + "</invoke>"
ARRAY_ITEM_TAG = "item"

THINK_OPEN = "<mm:think>"
THINK_CLOSE = "</mm:think>"


def partial_suffix_length(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker`.

    Streaming parsers hold that much back: the marker may complete in the next chunk.
    """
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def tag_of(marker: str) -> str:
    """The tag of a namespaced marker: `marker` without its namespace token."""
    return marker[len(NAMESPACE):]


def spaced_markers(*markers: str) -> Pattern[str]:
    """Any of `markers` as a model may write it, `TAG_SPACING` allowed after the namespace token;
    group `tag` is the tag that was written."""
    tags = "|".join(re.escape(tag_of(marker)) for marker in markers)
    return re.compile(f"{re.escape(NAMESPACE)}[{TAG_SPACING}]*(?P<tag>{tags})")


def may_become_tag(text: str, markers) -> bool:
    """Whether `text`, read after a namespace token and its spacing, is a proper start of the tag
    of one of `markers` (the empty text included): the marker may still complete."""
    return any(len(text) < len(tag_of(marker)) and tag_of(marker).startswith(text) for marker in markers)


def undecided_start(text: str, markers) -> int:
    """Where the end of `text` may still grow into one of `markers` (spacing allowed): the last
    namespace token when only spacing and the start of a tag follow it, else the start of a
    partial namespace token; `len(text)` when nothing at the end may. Streaming parsers hold
    back from there. Namespace tokens cannot overlap, and no tag holds one, so a marker still
    growing can only start at the last token or at a partial one after it."""
    last = text.rfind(NAMESPACE)
    if last != -1 and may_become_tag(text[last + len(NAMESPACE):].lstrip(TAG_SPACING), markers):
        return last
    return len(text) - partial_suffix_length(text, NAMESPACE)
