"""SGLang tool-call detector for MiniMax M3 (`--tool-call-parser minimax-m3` / `minimax_m3`).

Differences from SGLang 0.5.23's own `MinimaxM3Detector`, all deliberate:
- one scanner (`tool_call_scanner`) serves streaming and one-shot parsing, so streamed name and
  argument deltas always concatenate to the one-shot result, whatever the chunking;
- a call is streamed once its invoke is complete and parsed (name, then the whole arguments
  JSON): a malformed, truncated or unknown call is never half-sent, it comes back as content,
  and the good calls beside it in the same block stay calls (upstream drops an unknown call's
  text, and turns a whole message with one malformed call into content);
- whitespace between the namespace token and a tag is part of the tag, as upstream reads it,
  but only where a tag is read: content keeps it (upstream drops it before any `<`, content
  included);
- string values are kept verbatim (upstream strips trailing whitespace), untyped values are
  typed by content, the whole schema types the arguments (root and nested combinators, `$ref`)
  and schema alternatives are chosen by validation, then specificity (see `schema_values`);
- like upstream, repeated same-named elements become an array and the recoveries whose intent
  is unambiguous are taken (a wrong closing tag with one element open, a function name that
  matches one declared tool case-insensitively), each with a debug log line;
- with no tools declared, or for an undeclared function, the markup stays content unless
  `SGLANG_FORWARD_UNKNOWN_TOOLS` is set (upstream parses calls to any name);
- `tool_choice="required"` / a named function is constrained by an XGrammar structural tag in
  M3's own XML (`structural_tag`), where upstream falls back to a JSON-array grammar that its
  own M3 parser cannot read.
"""

from typing import Any, Dict, List, Literal, Optional, Union

from sglang.srt.entrypoints.openai.protocol import Tool, ToolChoice
from sglang.srt.environ import envs
from sglang.srt.function_call.base_format_detector import BaseFormatDetector
from sglang.srt.function_call.core_types import (
    StreamingParseResult,
    ToolCallItem,
    _GetInfoFunc,
)

from sglang_m3.parsers.declared_tools import tool_lookup
from sglang_m3.parsers.m3_format import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from sglang_m3.parsers.structural_tag import build_structural_tag
from sglang_m3.parsers.tool_call_scanner import (
    ContentText,
    ParsedCall,
    ScanEvent,
    ToolCallScanner,
    opens_block,
    scan_all,
)


def _functions(tools: Optional[List[Tool]]) -> Dict[str, Any]:
    return {tool.function.name: tool.function.parameters for tool in tools or [] if tool.function.name}


class MiniMaxM3ToolCallDetector(BaseFormatDetector):
    """Parses `]<]minimax[>[<tool_call>` blocks into OpenAI tool calls."""

    def __init__(self):
        super().__init__()
        self.bot_token = TOOL_CALL_OPEN
        self.eot_token = TOOL_CALL_CLOSE
        self._scanner: Optional[ToolCallScanner] = None

    def _lookup(self, tools: Optional[List[Tool]]):
        return tool_lookup(_functions(tools), accept_unknown=envs.SGLANG_FORWARD_UNKNOWN_TOOLS.get())

    @classmethod
    def parses_without_tools(cls) -> bool:
        """SGLang's `FunctionCallParser` hands a request that declares no tools to the detector
        only when this says so; with `SGLANG_FORWARD_UNKNOWN_TOOLS` set, such markup is parsed
        into calls (as `_lookup` reads the same setting), otherwise it stays content unread."""
        return envs.SGLANG_FORWARD_UNKNOWN_TOOLS.get()

    def has_tool_call(self, text: str) -> bool:
        """Whether `text` opens a block, as the scanner reads it (spacing after the namespace
        token allowed): SGLang's one-shot path keeps the parse only when this says so."""
        return opens_block(text)

    def detect_and_parse(self, text: str, tools: List[Tool]) -> StreamingParseResult:
        positions = {tool.function.name: index for index, tool in enumerate(tools or [])}
        normal_text = ""
        calls: List[ToolCallItem] = []
        for event in scan_all(text, self._lookup(tools)):
            if isinstance(event, ContentText):
                normal_text += event.text
            elif isinstance(event, ParsedCall):
                calls.append(
                    ToolCallItem(
                        tool_index=positions.get(event.name, -1),
                        name=event.name,
                        parameters=event.arguments_json,
                    )
                )
        return StreamingParseResult(normal_text=normal_text, calls=calls)

    def parse_streaming_increment(self, new_text: str, tools: List[Tool]) -> StreamingParseResult:
        if self._scanner is None:
            self._scanner = ToolCallScanner(self._lookup(tools))
        return self._stream_result(self._scanner.feed(new_text))

    def finish(self, tools: List[Tool]) -> StreamingParseResult:
        if self._scanner is None:
            return StreamingParseResult()
        return self._stream_result(self._scanner.finish())

    def _stream_result(self, events: List[ScanEvent]) -> StreamingParseResult:
        """Content text, and per call its name (once) then its whole arguments JSON.

        `prev_tool_call_arr` / `streamed_args_for_tool` are what SGLang's server reads at the
        end of a stream to send arguments a detector left unsent; they always show the call
        as fully sent, so nothing is sent twice.
        """
        normal_text = ""
        calls: List[ToolCallItem] = []
        for event in events:
            if isinstance(event, ContentText):
                normal_text += event.text
            if not isinstance(event, ParsedCall):
                continue
            self.current_tool_id = len(self.prev_tool_call_arr)
            calls.append(ToolCallItem(tool_index=self.current_tool_id, name=event.name, parameters=""))
            calls.append(ToolCallItem(tool_index=self.current_tool_id, parameters=event.arguments_json))
            self.prev_tool_call_arr.append({"name": event.name, "arguments": event.arguments})
            self.streamed_args_for_tool.append(event.arguments_json)
        return StreamingParseResult(normal_text=normal_text, calls=calls)

    # -- constrained generation ------------------------------------------------------------

    def supports_structural_tag(self) -> bool:
        return True

    def structure_info(self) -> _GetInfoFunc:
        """Not used: `get_structural_tag` always answers, so SGLang never falls back to the
        legacy begin/schema/end tags, whose JSON bodies M3 does not write."""
        raise NotImplementedError("MiniMax M3 calls are constrained through get_structural_tag")

    def get_structural_tag(
        self,
        tools: Union[List[Tool], None] = None,
        tool_choice: Union[ToolChoice, Literal["auto", "required"]] = "auto",
        thinking_mode: bool = False,
        parallel_tool_calls: bool = True,
    ):
        choice = tool_choice.model_dump() if isinstance(tool_choice, ToolChoice) else tool_choice
        return build_structural_tag(
            [tool.model_dump() for tool in tools or []],
            choice,
            reasoning=thinking_mode,
            parallel_tool_calls=parallel_tool_calls,
        )
