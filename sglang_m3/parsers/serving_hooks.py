"""Hook functions that put SGLang's chat serving on the M3 parsers' side (listed in plugin.py).

SGLang 0.5.23 applies its M3 request rules (thinking / `reasoning_effort` mapped onto the
template's `thinking_mode`, tool-call pairing checks, tool-result ordering) only when the served
config's `model_type` is `minimax_m3_vl`, and keys the forced-reasoning logic on the literal
parser name `minimax-m3`. A text-only M3 checkpoint and the `minimax_m3` spelling of the parser
name would silently skip both.
"""

from sglang_m3.integration.hooks import M3_ARCHITECTURES

PARSER_NAME = "minimax-m3"
PARSER_ALIASES = ("minimax_m3",)

M3_MODEL_TYPES = ("minimax_m3", "minimax_m3_vl", "minimax_m3_vl_text")


def serves_m3(hf_config) -> bool:
    """True for M3 configs, text-only or VL, by architecture name or model type."""
    architectures = getattr(hf_config, "architectures", None) or []
    return bool(set(architectures) & set(M3_ARCHITECTURES)) or getattr(hf_config, "model_type", None) in M3_MODEL_TYPES


def canonical_parser_name(name):
    """`minimax_m3` -> `minimax-m3`; any other name unchanged."""
    return PARSER_NAME if name in PARSER_ALIASES else name


def adopt_m3_chat_rules(result, serving_chat, *args, **kwargs):
    """AFTER `OpenAIServingChat.__init__`: canonical parser names, M3 rules for every M3 config."""
    serving_chat.reasoning_parser = canonical_parser_name(serving_chat.reasoning_parser)
    serving_chat.tool_call_parser = canonical_parser_name(serving_chat.tool_call_parser)
    hf_config = getattr(serving_chat.tokenizer_manager.model_config, "hf_config", None)
    if hf_config is not None and serves_m3(hf_config):
        serving_chat.is_minimax_m3 = True
    return result


def keep_m3_markers_in_output(result, serving_chat, request, *args, **kwargs):
    """AFTER `OpenAIServingChat._patch_reasoning_skip_special_tokens`: M3's think tags and the
    `]<]minimax[>[` namespace must reach the reasoning and tool-call parsers, which they do not
    when a tokenizer marks them special and the request skips special tokens (the default)."""
    if PARSER_NAME in (serving_chat.reasoning_parser, serving_chat.tool_call_parser):
        request.skip_special_tokens = False
    return result
