"""Golden tests for the M3 chat template: every expected prompt is written out by hand in the
M3 format of M3_FACTS s.4, so a change in rendering shows up as a readable diff."""

import jinja2
import pytest

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}

TOOLS_SECTION = (
    "# Tools\n"
    "You may call one or more of the functions below. Their signatures, in JSON Schema:\n"
    "<tools>\n"
    '{"name": "get_weather", "description": "Current weather", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}\n'
    "</tools>\n"
    "To call functions, reply with one block holding one invoke per call, one element per "
    "argument (objects nest, array elements repeat <item>):\n"
    "]<]minimax[>[<tool_call>\n"
    ']<]minimax[>[<invoke name="FUNCTION_NAME">\n'
    "]<]minimax[>[<ARGUMENT_NAME>value]<]minimax[>[</ARGUMENT_NAME>\n"
    "]<]minimax[>[</invoke>\n"
    "]<]minimax[>[</tool_call>"
)


def test_single_user_turn_adaptive_is_the_default(render):
    assert render([{"role": "user", "content": "Hello"}]) == (
        "]~!b[]~b]user\nHello[e~[\n]~b]ai\n"
    )


@pytest.mark.parametrize(
    "template_kwargs, prompt_end",
    [
        ({"thinking_mode": "enabled"}, "]~b]ai\n<mm:think>"),
        ({"thinking_mode": "disabled"}, "]~b]ai\n</mm:think>"),
        ({"thinking_mode": "adaptive"}, "]~b]ai\n"),
        ({"reasoning_effort": "none"}, "]~b]ai\n</mm:think>"),
        ({"reasoning_effort": "minimal"}, "]~b]ai\n</mm:think>"),
        ({"reasoning_effort": "low"}, "]~b]ai\n"),
        ({"reasoning_effort": "high"}, "]~b]ai\n"),
    ],
)
def test_thinking_mode_and_effort_set_the_generation_prefix(render, template_kwargs, prompt_end):
    """thinking_mode picks the prefix; without it, effort none / minimal means disabled."""
    prompt = render([{"role": "user", "content": "Hi"}], **template_kwargs)
    assert prompt == "]~!b[]~b]user\nHi[e~[\n" + prompt_end


def test_explicit_thinking_mode_wins_over_reasoning_effort(render):
    prompt = render(
        [{"role": "user", "content": "Hi"}], thinking_mode="enabled", reasoning_effort="none"
    )
    assert prompt.endswith("]~b]ai\n<mm:think>")


def test_unknown_thinking_mode_is_rejected_with_its_value(render):
    with pytest.raises(jinja2.exceptions.TemplateError, match="thinking_mode.*'sometimes'"):
        render([{"role": "user", "content": "Hi"}], thinking_mode="sometimes")


def test_no_generation_prompt(render):
    prompt = render([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert prompt == "]~!b[]~b]user\nHi[e~[\n"


def test_system_developer_user_turns(render):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
    ]
    assert render(messages) == (
        "]~!b["
        "]~b]system\nYou are terse.[e~[\n"
        "]~b]developer\nAnswer in French.[e~[\n"
        "]~b]user\nHi[e~[\n"
        "]~b]ai\n"
    )


def test_tools_join_the_system_turn(render):
    messages = [{"role": "system", "content": "Be useful."}, {"role": "user", "content": "Hi"}]
    assert render(messages, tools=[WEATHER_TOOL]) == (
        "]~!b[]~b]system\nBe useful.\n\n" + TOOLS_SECTION + "[e~[\n"
        "]~b]user\nHi[e~[\n]~b]ai\n"
    )


def test_tools_without_system_message_get_their_own_system_turn(render):
    assert render([{"role": "user", "content": "Hi"}], tools=[WEATHER_TOOL]) == (
        "]~!b[]~b]system\n" + TOOLS_SECTION + "[e~[\n]~b]user\nHi[e~[\n]~b]ai\n"
    )


def test_media_parts_become_placeholders(render):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare "},
                {"type": "image"},
                {"type": "text", "text": " and "},
                {"type": "video"},
            ],
        }
    ]
    assert render(messages) == (
        "]~!b[]~b]user\nCompare ]<]image[>[ and ]<]video[>[[e~[\n]~b]ai\n"
    )


def test_thinking_content_parts_count_as_reasoning(render):
    reply = {"role": "assistant", "content": [{"type": "thinking", "thinking": "plan"}, {"type": "text", "text": "A"}]}
    current = render([{"role": "user", "content": "Q"}, reply], add_generation_prompt=False)
    assert current == "]~!b[]~b]user\nQ[e~[\n]~b]ai\n<mm:think>plan</mm:think>A[e~[\n"
    earlier = render([{"role": "user", "content": "Q"}, reply, {"role": "user", "content": "R"}])
    assert earlier == "]~!b[]~b]user\nQ[e~[\n]~b]ai\n</mm:think>A[e~[\n]~b]user\nR[e~[\n]~b]ai\n"


def test_earlier_reasoning_is_dropped_from_history(render):
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "private thought"},
        {"role": "user", "content": "Q2"},
    ]
    prompt = render(messages, thinking_mode="enabled")
    assert prompt == (
        "]~!b["
        "]~b]user\nQ1[e~[\n"
        "]~b]ai\n</mm:think>A1[e~[\n"
        "]~b]user\nQ2[e~[\n"
        "]~b]ai\n<mm:think>"
    )
    assert "private thought" not in prompt


def test_tool_call_and_result_turns(render):
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Two cities, two calls.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
    ]
    assert render(messages, tools=[WEATHER_TOOL]) == (
        "]~!b[]~b]system\n" + TOOLS_SECTION + "[e~[\n"
        "]~b]user\nWeather in Paris and Rome?[e~[\n"
        "]~b]ai\n<mm:think>Two cities, two calls.</mm:think>Checking.\n"
        "]<]minimax[>[<tool_call>\n"
        ']<]minimax[>[<invoke name="get_weather">\n'
        "]<]minimax[>[<city>Paris]<]minimax[>[</city>\n"
        "]<]minimax[>[<days>2]<]minimax[>[</days>\n"
        "]<]minimax[>[</invoke>\n"
        ']<]minimax[>[<invoke name="get_weather">\n'
        "]<]minimax[>[<city>Rome]<]minimax[>[</city>\n"
        "]<]minimax[>[</invoke>\n"
        "]<]minimax[>[</tool_call>[e~[\n"
        "]~b]tool\nsunny[e~[\n"
        "]~b]tool\nrain[e~[\n"
        "]~b]ai\n"
    )


def test_earlier_tool_loop_loses_reasoning_but_keeps_calls(render):
    messages = [
        {"role": "user", "content": "Q1"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "call it",
            "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": {}}},
            ],
        },
        {"role": "tool", "content": "done"},
        {"role": "assistant", "content": "It is done."},
        {"role": "user", "content": "Q2"},
    ]
    assert render(messages, thinking_mode="disabled") == (
        "]~!b["
        "]~b]user\nQ1[e~[\n"
        "]~b]ai\n</mm:think>"
        "]<]minimax[>[<tool_call>\n"
        ']<]minimax[>[<invoke name="f">]<]minimax[>[</invoke>\n'
        "]<]minimax[>[</tool_call>[e~[\n"
        "]~b]tool\ndone[e~[\n"
        "]~b]ai\n</mm:think>It is done.[e~[\n"
        "]~b]user\nQ2[e~[\n"
        "]~b]ai\n</mm:think>"
    )


def test_nested_arguments_render_as_namespaced_xml(render):
    arguments = {
        "query": "  spaced  text <b> ",
        "limit": 5,
        "ratio": 0.25,
        "exact": False,
        "cursor": None,
        "filter": {"tags": ["a", "b"], "range": {"lo": 1, "hi": 2}},
        "empty": [],
    }
    messages = [
        {"role": "user", "content": "search"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": arguments}}],
        },
    ]
    ns = "]<]minimax[>["
    assert render(messages, add_generation_prompt=False) == (
        "]~!b[]~b]user\nsearch[e~[\n"
        "]~b]ai\n</mm:think>"
        f"{ns}<tool_call>\n"
        f'{ns}<invoke name="search">\n'
        f"{ns}<query>  spaced  text <b> {ns}</query>\n"
        f"{ns}<limit>5{ns}</limit>\n"
        f"{ns}<ratio>0.25{ns}</ratio>\n"
        f"{ns}<exact>false{ns}</exact>\n"
        f"{ns}<cursor>null{ns}</cursor>\n"
        f"{ns}<filter>{ns}<tags>{ns}<item>a{ns}</item>{ns}<item>b{ns}</item>{ns}</tags>"
        f"{ns}<range>{ns}<lo>1{ns}</lo>{ns}<hi>2{ns}</hi>{ns}</range>{ns}</filter>\n"
        f"{ns}<empty>{ns}</empty>\n"
        f"{ns}</invoke>\n"
        f"{ns}</tool_call>[e~[\n"
    )


def test_string_arguments_are_refused_with_the_function_name(render):
    messages = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
        },
    ]
    with pytest.raises(jinja2.exceptions.TemplateError, match="'f': arguments must be an object"):
        render(messages)


def test_unknown_role_is_rejected(render):
    with pytest.raises(jinja2.exceptions.TemplateError, match="unsupported message role 'narrator'"):
        render([{"role": "narrator", "content": "x"}])


def test_sglang_reads_the_template_as_m3(chat_tokenizer):
    """SGLang inspects a template to choose how to feed it: content as OpenAI parts (so media
    placeholders render), reasoning history through `reasoning_content`, and M3's parsers as the
    suggested ones."""
    from sglang.srt.parser.jinja_template_utils import (
        detect_jinja_template_content_format,
        jinja_template_reads_reasoning_content,
    )
    from sglang.srt.parser.template_detection import (
        REASONING_PARSER_RULES,
        TOOL_CALL_PARSER_RULES,
        build_detection_context,
        detect_reasoning_pattern,
        match_rules,
    )

    template = chat_tokenizer.chat_template
    assert detect_jinja_template_content_format(template) == "openai"
    assert jinja_template_reads_reasoning_content(template)
    force_reasoning, reasoning_config = detect_reasoning_pattern(template)
    context = build_detection_context(template, chat_tokenizer, reasoning_config, force_reasoning)
    assert match_rules(context, REASONING_PARSER_RULES, "reasoning parser") == "minimax-m3"
    assert match_rules(context, TOOL_CALL_PARSER_RULES, "tool-call parser") == "minimax-m3"
