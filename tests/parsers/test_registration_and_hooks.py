"""Parser registration in SGLang's tables and the serving hook functions."""

import argparse
from types import SimpleNamespace

import pytest
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, Tool
from sglang.srt.function_call.function_call_parser import FunctionCallParser
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
