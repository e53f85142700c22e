"""SGLang reasoning detector for MiniMax M3 (`--reasoning-parser minimax-m3` / `minimax_m3`).

Output shapes, by `thinking_mode` (the prompt ends are in the chat template):
- enabled: the prompt ends with `<mm:think>`, so the reply starts inside reasoning
  (`force_reasoning`) and reasoning runs to `</mm:think>`; a redundant leading `<mm:think>` is
  dropped;
- disabled / adaptive: the reply may open with `<mm:think>` (adaptive models that choose to think)
  or with a stray `</mm:think>` (history renders earlier replies that way), both dropped as
  markup; anything else is content from the first character.

Only a tag at a boundary is markup: at the start of the reply or of the reasoning, and right
after the closer that ends the reasoning (or the stray one), each after whitespace. There a run
of the same tag counts as one: M3 has been seen to double its stray closer before content or a
tool-call block, and a model may re-open reasoning the prompt already opened. `<mm:think>` or
`</mm:think>` anywhere else (inside reasoning, after the first content character) is text.

Tags may be split across stream chunks at any point: undecidable text is held back, never
guessed, so streaming and one-shot parsing give the same split. Text held back when the stream
ends is released (reasoning inside reasoning, content elsewhere), never dropped.

Differences from SGLang 0.5.23's `MiniMaxM3Detector`: a stray closer split across chunks is
still dropped, a mid-content `<mm:think>` does not turn the rest into reasoning, the
whitespace before a leading tag is treated as markup, and repeated boundary tags are dropped
(upstream drops one leading closer, so a second one reaches the client as content).
"""

from typing import Any, List, Tuple

from sglang.srt.parser.reasoning_parser import (
    BaseReasoningFormatDetector,
    StreamingParseResult,
)

from sglang_m3.parsers.m3_format import THINK_CLOSE, THINK_OPEN, partial_suffix_length

_WHITESPACE = " \t\r\n"
# _CLOSED: reasoning just ended (or a stray closer was dropped); further closers are markup.
_START, _REASONING, _CLOSED, _CONTENT = "start", "reasoning", "closed", "content"


class MiniMaxM3ReasoningDetector(BaseReasoningFormatDetector):
    """Splits M3 replies into reasoning and content, streaming or in one go."""

    def __init__(
        self,
        stream_reasoning: bool = True,
        force_reasoning: bool = False,
        continue_final_message: bool = False,
        previous_content: str = "",
        force_nonempty_content: bool = False,
    ):
        super().__init__(
            THINK_OPEN,
            THINK_CLOSE,
            force_reasoning=force_reasoning,
            stream_reasoning=stream_reasoning,
            continue_final_message=continue_final_message,
            previous_content=_continued_text(previous_content),
            force_nonempty_content=force_nonempty_content,
        )
        # The base class settled `_in_reasoning` from force_reasoning and previous_content.
        if self._in_reasoning:
            self._state = _REASONING
        elif self.previous_content.strip():
            self._state = _CONTENT  # continuing a reply whose content already began
        else:
            self._state = _START
        # Before the first reasoning character, a leading `<mm:think>` is still markup.
        self._at_reasoning_start = self._state == _REASONING and not self.previous_content
        self._pending = ""
        self._unsent_reasoning = ""
        self._saw_content = False

    def get_self_opened_think_start_token_ids(self, tokenizer) -> List[int]:
        """Adaptive replies open `<mm:think>` themselves (only `enabled` prefills it); SGLang
        counts the reasoning tokens of such replies from this tag."""
        return tokenizer.encode(THINK_OPEN, add_special_tokens=False)

    # -- one-shot ----------------------------------------------------------------------------

    def detect_and_parse(self, text: str) -> StreamingParseResult:
        reasoning, content = self._advance_with(text)
        held_reasoning, held_content = self._release_held()
        reasoning, content = reasoning + held_reasoning, content + held_content
        if self._force_nonempty_content and not content:
            reasoning, content = "", reasoning
        return StreamingParseResult(normal_text=content, reasoning_text=reasoning)

    # -- streaming ---------------------------------------------------------------------------

    def parse_streaming_increment(self, new_text: str) -> StreamingParseResult:
        reasoning, content = self._advance_with(new_text)
        return self._streamed(reasoning, content, final=False)

    def finish(self) -> StreamingParseResult:
        return self._streamed(*self._release_held(), final=True)

    def _advance_with(self, new_text: str) -> Tuple[str, str]:
        self._pending += new_text
        return self._advance()

    def _release_held(self) -> Tuple[str, str]:
        """End of output: held-back text belongs to the part it was held in."""
        held, self._pending = self._pending, ""
        return (held, "") if self._state == _REASONING else ("", held)

    def _streamed(self, reasoning: str, content: str, final: bool) -> StreamingParseResult:
        """Apply `stream_reasoning=False` (reasoning released whole, at its end) and
        `force_nonempty_content` (as upstream: a stream that ends without content repeats its
        reasoning as content)."""
        if not self.stream_reasoning:
            self._unsent_reasoning += reasoning
            reasoning = ""
            if self._state != _REASONING or final:
                reasoning, self._unsent_reasoning = self._unsent_reasoning, ""
        self._saw_content = self._saw_content or bool(content)
        self._accumulated_reasoning += reasoning
        if final and self._force_nonempty_content and not self._saw_content:
            return StreamingParseResult(normal_text=self._accumulated_reasoning)
        return StreamingParseResult(normal_text=content, reasoning_text=reasoning)

    def _advance(self) -> Tuple[str, str]:
        """Consume every decidable prefix of the pending text; return (reasoning, content)."""
        reasoning_parts: List[str] = []
        content_parts: List[str] = []
        while self._pending:
            if self._state == _START:
                if not self._leave_start():
                    break
            elif self._state == _REASONING:
                if self._at_reasoning_start and not self._drop_leading(THINK_OPEN):
                    break
                self._at_reasoning_start = False
                end = self._pending.find(THINK_CLOSE)
                if end == -1:
                    keep = partial_suffix_length(self._pending, THINK_CLOSE)
                    reasoning_parts.append(self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep:]
                    break
                reasoning_parts.append(self._pending[:end])
                self._pending = self._pending[end + len(THINK_CLOSE):]
                self._state = _CLOSED
            elif self._state == _CLOSED:
                if not self._drop_leading(THINK_CLOSE):
                    break
                self._state = _CONTENT
            else:
                content_parts.append(self._pending)
                self._pending = ""
        self._in_reasoning = self._state == _REASONING
        return "".join(reasoning_parts), "".join(content_parts)

    def _leave_start(self) -> bool:
        """Decide how the reply opens; False while the pending text could still be a tag."""
        head = self._pending.lstrip(_WHITESPACE)
        for tag, next_state in ((THINK_OPEN, _REASONING), (THINK_CLOSE, _CLOSED)):
            if head.startswith(tag):
                self._pending = head[len(tag):]
                self._state = next_state
                self._at_reasoning_start = next_state == _REASONING
                return True
        if not head or THINK_OPEN.startswith(head) or THINK_CLOSE.startswith(head):
            return False
        self._state = _CONTENT
        return True

    def _drop_leading(self, tag: str) -> bool:
        """Drop every `tag` (each with the whitespace before it) at the start of the pending
        text: a run of boundary tags is one boundary (module docstring).

        False while undecided (the text so far is whitespace, or could still begin a tag); True
        once the next thing is known not to be `tag`. Whitespace not followed by `tag` stays.
        """
        while True:
            head = self._pending.lstrip(_WHITESPACE)
            if not head.startswith(tag):
                return bool(head) and not tag.startswith(head)
            self._pending = head[len(tag):]


def _continued_text(content: Any) -> str:
    """The text of the assistant message a request continues, as the chat template renders it.

    SGLang passes that message's `content` as the request holds it: a string, OpenAI content
    parts, or None (a message of tool calls only). Only text parts are content the reply goes
    on from; thinking parts are reasoning the template renders apart, media are placeholders.
    """
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content if getattr(part, "type", None) == "text")
