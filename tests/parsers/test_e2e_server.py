"""End to end on the real SGLang server (CPU platform, tiny random-weight M3) with the openai
client: constrained tool calls, tool-result turns and thinking modes.

The model's weights are random, so nothing here depends on what it would choose: constrained
decoding must still yield a valid M3 call that the parser turns into `tool_calls`, and the
reasoning / content split must be exactly what the parser's specification says for the raw
output tokens the server reports.
"""

import json

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from sglang_m3.parsers.m3_format import NAMESPACE, THINK_CLOSE, THINK_OPEN
from tests.parsers.test_reasoning_detector import split_oracle

pytestmark = pytest.mark.server

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Forecast",
            "parameters": {
                "type": "object",
                "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}},
                "required": ["days"],
            },
        },
    },
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
QUESTION = [{"role": "user", "content": "What time is it and what is the weather?"}]
# The grammar spells the call markup token by token; a bounded call needs about 100 tokens.
CALL_TOKENS = 240


@pytest.fixture(scope="module")
def client(m3_parser_server):
    return openai.OpenAI(base_url=m3_parser_server.openai_url, api_key="unused", timeout=900)


@pytest.fixture(scope="module")
def tokenizer(m3_parser_server):
    return AutoTokenizer.from_pretrained(m3_parser_server.model_path)


def _tool_request(client, tool_choice, thinking_mode, stream):
    return client.chat.completions.create(
        model="tiny",
        messages=QUESTION,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,  # the grammar then ends the turn right after the call
        max_tokens=CALL_TOKENS,
        temperature=0,
        stream=stream,
        extra_body={"chat_template_kwargs": {"thinking_mode": thinking_mode}},
    )


def _collect_stream(stream):
    """Content, tool calls (name sent once, arguments concatenated) and the finish reason."""
    content, names, arguments, finish = "", {}, {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            if call.function.name:
                assert call.index not in names, "function name streamed twice"
                names[call.index] = call.function.name
            arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
    return content, [(names[index], arguments[index]) for index in sorted(names)], finish


def _assert_valid_calls(calls, allowed_names):
    assert calls, "no tool call parsed"
    for name, arguments in calls:
        assert name in allowed_names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    "tool_choice, thinking_mode, allowed",
    [("required", "disabled", set(SCHEMAS)), (NAMED, "adaptive", {"get_weather"})],
    ids=["required", "named"],
)
def test_constrained_call_non_streaming(client, tool_choice, thinking_mode, allowed):
    response = _tool_request(client, tool_choice, thinking_mode, stream=False)
    message = response.choices[0].message
    _assert_valid_calls([(c.function.name, c.function.arguments) for c in message.tool_calls or []], allowed)
    assert response.choices[0].finish_reason == "tool_calls"
    assert not (message.content or "").strip()


@pytest.mark.parametrize(
    "tool_choice, thinking_mode, allowed",
    [("required", "adaptive", set(SCHEMAS)), (NAMED, "disabled", {"get_weather"})],
    ids=["required", "named"],
)
def test_constrained_call_streaming(client, tool_choice, thinking_mode, allowed):
    content, calls, finish = _collect_stream(_tool_request(client, tool_choice, thinking_mode, stream=True))
    _assert_valid_calls(calls, allowed)
    assert finish == "tool_calls"
    assert not content.strip()


def _chat_with_raw(client, messages, max_tokens=12, **extra):
    """A greedy chat completion plus its prompt and output tokens as the server saw them."""
    response = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_token_ids": True, **extra},
    )
    choice = response.choices[0]
    extra_fields = choice.model_extra or {}
    return choice, extra_fields["prompt_token_ids"], extra_fields["response_token_ids"]


def _decode(tokenizer, ids):
    text = tokenizer.decode(ids, skip_special_tokens=False)
    return text[: -len(tokenizer.eos_token)] if text.endswith(tokenizer.eos_token) else text


def test_tool_result_turn_is_accepted_and_rendered_by_the_template(client, tokenizer):
    messages = [
        *QUESTION,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    choice, prompt_ids, _ = _chat_with_raw(client, messages)
    expected = tokenizer.apply_chat_template(
        [*messages[:1], {**messages[1], "tool_calls": [{**messages[1]["tool_calls"][0], "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]}, messages[2]],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert _decode(tokenizer, prompt_ids) == expected
    assert '<invoke name="get_time">' in expected and "]~b]tool\n12:00[e~[\n" in expected
    assert choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "template_kwargs, top_level, prompt_end, forced",
    [
        ({"thinking_mode": "enabled"}, {}, "]~b]ai\n" + THINK_OPEN, True),
        ({"thinking_mode": "disabled"}, {}, "]~b]ai\n" + THINK_CLOSE, False),
        ({"thinking_mode": "adaptive"}, {}, "]~b]ai\n", False),
        ({}, {}, "]~b]ai\n", False),
        ({}, {"reasoning_effort": "none"}, "]~b]ai\n" + THINK_CLOSE, False),
    ],
    ids=["enabled", "disabled", "adaptive", "default", "effort-none"],
)
def test_thinking_mode_sets_prompt_and_split(client, tokenizer, template_kwargs, top_level, prompt_end, forced):
    extra = {"chat_template_kwargs": template_kwargs} if template_kwargs else {}
    choice, prompt_ids, output_ids = _chat_with_raw(client, QUESTION, **extra, **top_level)
    prompt = _decode(tokenizer, prompt_ids)
    assert prompt.endswith(prompt_end)
    if prompt_end == "]~b]ai\n":
        assert not prompt.endswith(THINK_OPEN) and not prompt.endswith(THINK_CLOSE)
    reasoning, content = split_oracle(_decode(tokenizer, output_ids), force=forced)
    message = choice.message
    assert ((message.model_extra or {}).get("reasoning_content") or "", message.content or "") == (reasoning, content)


def test_streamed_reasoning_split_matches_non_streamed(client):
    kwargs = dict(
        model="tiny",
        messages=QUESTION,
        max_tokens=12,
        temperature=0,
        extra_body={"chat_template_kwargs": {"thinking_mode": "enabled"}},
    )
    message = client.chat.completions.create(**kwargs).choices[0].message
    reasoning = content = ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
    assert (reasoning, content) == ((message.model_extra or {}).get("reasoning_content") or "", message.content or "")
    assert reasoning, "enabled thinking must put the first output into reasoning"


BOUNDED_TOOL = {
    "type": "function",
    "function": {
        "name": "book",
        "description": "Book a table",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "day": {"type": "string", "format": "date"},
                "name": {"type": "string", "minLength": 1, "maxLength": 5},
                "phone": {"type": "string", "pattern": r"^\d{3}-\d{4}$"},
                "guests": {"type": "array", "items": {"type": "string", "maxLength": 3}},
            },
            "required": ["day"],
        },
    },
}
STRING_BOUNDS = ("format", "pattern", "minLength", "maxLength")


def _without_string_bounds(schema):
    """The tool's schema as the constraint enforces it: string keywords dropped (XGrammar's M3
    style cannot bound a string that runs to the namespace marker)."""
    kept = {key: sub for key, sub in schema.items() if key not in STRING_BOUNDS}
    if "properties" in schema:
        kept["properties"] = {name: _without_string_bounds(sub) for name, sub in schema["properties"].items()}
    if "items" in schema:
        kept["items"] = _without_string_bounds(schema["items"])
    return kept


def _one_tool_reply(client, tool: dict, tool_choice, prompt: str):
    """The greedy reply to ``prompt`` offered ``tool`` alone, one call at most."""
    response = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": prompt}],
        tools=[tool],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=CALL_TOKENS,
        temperature=0,
    )
    return response.choices[0]


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "book"}}, "auto"], ids=["required", "named", "auto-strict"]
)
def test_string_keywords_in_a_tool_schema_are_served(client, tool_choice):
    """`format`, `pattern`, `minLength` and `maxLength` got a 400 quoting XGrammar's internal
    check; now the call is constrained by the rest of the schema and answered (a call cut by
    max_tokens in a string comes back as its text, which the grammar made a call)."""
    choice = _one_tool_reply(client, BOUNDED_TOOL, tool_choice, "Book a table for tomorrow.")
    relaxed = _without_string_bounds(BOUNDED_TOOL["function"]["parameters"])
    for call in choice.message.tool_calls or []:
        assert call.function.name == "book"
        jsonschema.validate(json.loads(call.function.arguments), relaxed)
    if tool_choice != "auto":  # random weights may not end a free string within max_tokens
        assert choice.message.tool_calls or (
            choice.finish_reason == "length" and (choice.message.content or "").startswith(f"{NAMESPACE}<tool_call>")
        ), "the reply is not a constrained call"


CONJUNCTION_TOOL = {
    "type": "function",
    "function": {
        "name": "reserve",
        "description": "Reserve seats",
        "strict": True,
        "parameters": {
            "allOf": [
                {"$ref": "#/$defs/Party"},
                {"properties": {"seats": {"allOf": [{"type": "integer"}, {"minimum": 1}, {"maximum": 8}]}}, "required": ["seats"]},
            ],
            "propertyNames": {"pattern": "^[a-z]+$"},
            "$defs": {
                "Party": {
                    "type": "object",
                    "properties": {"size": {"type": "integer", "allOf": [{"minimum": 1}, {"maximum": 20}]}, "Notes": {"type": "string"}},
                    "required": ["size"],
                }
            },
        },
    },
}


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "reserve"}}, "auto"], ids=["required", "named", "auto-strict"]
)
def test_allOf_and_propertyNames_in_a_tool_schema_are_served(client, tool_choice):
    """`allOf` (of a `$ref` and an extension, of bound-only branches) and `propertyNames` got a
    400 quoting XGrammar; now the call is constrained to a merged subset of the schema, and what
    comes back satisfies the schema as written."""
    calls = _one_tool_reply(client, CONJUNCTION_TOOL, tool_choice, "Reserve seats for four.").message.tool_calls or []
    for call in calls:
        assert call.function.name == "reserve"
        jsonschema.validate(json.loads(call.function.arguments), CONJUNCTION_TOOL["function"]["parameters"])
    if tool_choice != "auto":  # random weights need not call when they may answer
        assert calls, "no constrained call"
