"""The literal markers of MiniMax M3's output format (M3_FACTS s.4), in one place.

The chat template (`chat_template.jinja`) writes the same strings; the golden tests pin both.
"""

NAMESPACE = "]<]minimax[>["

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
