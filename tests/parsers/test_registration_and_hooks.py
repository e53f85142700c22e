"""Parser registration in SGLang's tables and the serving hook functions."""

import argparse
from types import SimpleNamespace

import pytest
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, Tool
from sglang.srt.function_call.function_call_parser import FunctionCallParser
from sglang.srt.parser.reasoning_parser import MiniMaxM3Detector as UpstreamReasoningDetector
from sglang.srt.parser.reasoning_parser import ReasoningParser
from sglang.srt.server_args import ServerArgs

from sglang_m3.parsers import register_parsers
from sglang_m3.parsers.m3_format import NAMESPACE as NS
from sglang_m3.parsers.reasoning_detector import MiniMaxM3ReasoningDetector
from sglang_m3.parsers.serving_hooks import adopt_m3_chat_rules, keep_m3_markers_in_output
from sglang_m3.parsers.tool_call_detector import MiniMaxM3ToolCallDetector


@pytest.fixture(autouse=True, scope="module")
def registered():
    """As the plugin does in every SGLang process (idempotent)."""
    register_parsers()


CALL = f'{NS}<tool_call>\n{NS}<invoke name="f">\n{NS}<n>2{NS}</n>\n{NS}</invoke>\n{NS}</tool_call>'
TOOLS = [Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}})]


@pytest.mark.parametrize("name", ["minimax-m3", "minimax_m3"])
def test_both_names_select_the_project_parsers(name):
    assert FunctionCallParser.ToolCallParserEnum[name] is MiniMaxM3ToolCallDetector
    assert ReasoningParser.DetectorMap[name] is MiniMaxM3ReasoningDetector
    parser = FunctionCallParser(TOOLS, name)
    assert parser.parse_non_stream("ok " + CALL)[1][0].parameters == '{"n": 2}'
    assert parser.get_structure_constraint("required")[0] == "structural_tag"


def test_the_alias_is_a_valid_server_flag():
    cli = argparse.ArgumentParser()
    ServerArgs.add_cli_args(cli)
    args = cli.parse_args(["--model-path", "m", "--reasoning-parser", "minimax_m3", "--tool-call-parser", "minimax_m3"])
    assert (args.reasoning_parser, args.tool_call_parser) == ("minimax_m3", "minimax_m3")


@pytest.mark.parametrize("mode, expected", [("enabled", ("plan", "answer")), ("adaptive", ("", "plan</mm:think>answer"))])
def test_upstream_thinking_mode_logic_drives_the_project_reasoning_parser(mode, expected):
    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "q"}], chat_template_kwargs={"thinking_mode": mode}
    )
    parser = ReasoningParser("minimax-m3", request=request)
    assert parser.parse_non_stream("plan</mm:think>answer") == expected


@pytest.mark.parametrize("forward", [False, True])
def test_calls_with_no_tools_declared_follow_sglang_forward_unknown_tools(monkeypatch, forward):
    """SGLang's parser asks the detector (`parses_without_tools`) before it parses a request that
    declares no tools; the answer follows the setting the detector types unknown calls by."""
    if forward:
        monkeypatch.setenv("SGLANG_FORWARD_UNKNOWN_TOOLS", "1")
    else:
        monkeypatch.delenv("SGLANG_FORWARD_UNKNOWN_TOOLS", raising=False)
    text = "ok " + CALL
    expected = ("ok ", [("f", '{"n": 2}')]) if forward else (text, [])
    parser = FunctionCallParser([], "minimax-m3")
    assert parser.has_tool_call(text) is forward
    normal_text, calls = parser.parse_non_stream(text)
    assert (normal_text, [(call.name, call.parameters) for call in calls]) == expected

    parser = FunctionCallParser([], "minimax-m3")
    normal_text, names, arguments = "", [], ""
    for streamed_text, items in [*map(parser.parse_stream_chunk, text), parser.parse_stream_end()]:
        normal_text += streamed_text
        names += [item.name for item in items if item.name]
        arguments += "".join(item.parameters for item in items)
    assert (normal_text, [(name, arguments) for name in names]) == expected


def test_continuing_a_final_message_of_content_parts(monkeypatch):
    """`continue_final_message` with OpenAI content parts: SGLang hands the parts to the detector
    as they are; the reply goes on as upstream's detector has it."""
    monkeypatch.setitem(ReasoningParser.DetectorMap, "upstream-minimax-m3", UpstreamReasoningDetector)
    request = ChatCompletionRequest(
        model="m",
        continue_final_message=True,
        messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "text", "text": "Partial"}]}],
    )
    for name in ("minimax-m3", "upstream-minimax-m3"):
        parser = ReasoningParser(name, request=request)
        assert parser.parse_stream_chunk(" answer") == ("", " answer")
        assert ReasoningParser(name, request=request).parse_non_stream(" answer") == ("", " answer")


def _serving(reasoning_parser, tool_call_parser, hf_config):
    return SimpleNamespace(
        reasoning_parser=reasoning_parser,
        tool_call_parser=tool_call_parser,
        is_minimax_m3=False,
        tokenizer_manager=SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config)),
    )


@pytest.mark.parametrize(
    "hf_config",
    [
        SimpleNamespace(architectures=["MiniMaxM3SparseForCausalLM"], model_type="something_else"),
        SimpleNamespace(architectures=[], model_type="minimax_m3_vl_text"),
        SimpleNamespace(architectures=None, model_type="minimax_m3"),
    ],
)
def test_text_only_m3_gets_the_m3_request_rules_and_canonical_names(hf_config):
    serving = _serving("minimax_m3", "minimax_m3", hf_config)
    adopt_m3_chat_rules(None, serving, None, None)
    assert (serving.reasoning_parser, serving.tool_call_parser, serving.is_minimax_m3) == ("minimax-m3", "minimax-m3", True)


def test_other_models_are_left_alone():
    serving = _serving("qwen3", "hermes", SimpleNamespace(architectures=["LlamaForCausalLM"], model_type="llama"))
    adopt_m3_chat_rules(None, serving, None, None)
    assert (serving.reasoning_parser, serving.tool_call_parser, serving.is_minimax_m3) == ("qwen3", "hermes", False)


@pytest.mark.parametrize("parsers, keeps", [(("minimax-m3", None), True), ((None, "minimax-m3"), True), (("qwen3", "hermes"), False)])
def test_m3_markers_are_kept_for_the_parsers(parsers, keeps):
    serving = _serving(*parsers, SimpleNamespace())
    request = SimpleNamespace(skip_special_tokens=True)
    keep_m3_markers_in_output(None, serving, request)
    assert request.skip_special_tokens is (not keeps)
