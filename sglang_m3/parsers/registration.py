"""Register the M3 parsers in SGLang's parser tables, under the upstream name and its alias.

`FunctionCallParser.ToolCallParserEnum` and `ReasoningParser.DetectorMap` are plain class-level
dicts; replacing the `minimax-m3` entries makes auto-selection (by architecture) and explicit
`--tool-call-parser` / `--reasoning-parser` flags use this project's detectors. The name lists
SGLang offers as CLI choices before those modules load get the alias too.
"""

from sglang_m3.parsers.serving_hooks import PARSER_ALIASES, PARSER_NAME


def register_parsers() -> None:
    from sglang.srt.function_call import parser_names
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from sglang.srt.parser import reasoning_parser_names
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    from sglang_m3.parsers.reasoning_detector import MiniMaxM3ReasoningDetector
    from sglang_m3.parsers.tool_call_detector import MiniMaxM3ToolCallDetector

    for name in (PARSER_NAME, *PARSER_ALIASES):
        FunctionCallParser.ToolCallParserEnum[name] = MiniMaxM3ToolCallDetector
        ReasoningParser.DetectorMap[name] = MiniMaxM3ReasoningDetector
        for names in (parser_names.TOOL_CALL_PARSER_NAMES, reasoning_parser_names.REASONING_PARSER_NAMES):
            if name not in names:
                names.append(name)
