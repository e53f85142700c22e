"""Constrained M3 tool calls: the structural tag accepts what the template writes, and whatever a
model sampling at random inside it produces parses into valid calls."""

import json
import math
import random
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_m3.parsers.m3_format import NAMESPACE
from sglang_m3.parsers.structural_tag import build_structural_tag, narrowed_schema
from sglang_m3.parsers.tool_call_detector import MiniMaxM3ToolCallDetector
from tests.parsers import m3_strategies as m3
from tests.parsers.test_tool_call_properties import rendered_reply, sglang_tools

TAG_SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# A byte-level vocabulary (any UTF-8 text can be spelled) plus the namespace marker as one token,
# as in M3's tokenizer, and an end-of-turn token.
VOCAB = [bytes([value]) for value in range(256)] + [NAMESPACE.encode(), b"<eot>"]
MARKER, EOT = len(VOCAB) - 2, len(VOCAB) - 1
TOKENIZER_INFO = xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOT])
COMPILER = xgr.GrammarCompiler(TOKENIZER_INFO)


def grammar_for(tools, tool_choice="required"):
    return xgr.Grammar.from_structural_tag(build_structural_tag(tools, tool_choice, reasoning=False, parallel_tool_calls=True))


def sample(tools, tool_choice, rng, max_steps=20000):
    """Generate like a random-weight model: uniform over the tokens the grammar allows, except
    that the turn ends with probability 1/2 and the namespace marker is taken with probability
    1/10 whenever allowed (so free strings end after some ten characters, not some 250)."""
    matcher = xgr.GrammarMatcher(COMPILER.compile_structural_tag(
        build_structural_tag(tools, tool_choice, reasoning=False, parallel_tool_calls=True)
    ))
    bitmask = xgr.allocate_token_bitmask(1, TOKENIZER_INFO.vocab_size)
    output = b""
    for _ in range(max_steps):
        matcher.fill_next_token_bitmask(bitmask)
        allowed = torch.nonzero(xgr.testing.bitmask_to_bool_mask(bitmask, TOKENIZER_INFO.vocab_size)[0]).flatten().tolist()
        if allowed == [EOT] or (EOT in allowed and rng.random() < 0.5):
            return output.decode("utf-8", errors="replace")
        if MARKER in allowed and rng.random() < 0.1:
            token = MARKER
        else:
            token = rng.choice([t for t in allowed if t != EOT])
        assert matcher.accept_token(token)
        output += VOCAB[token]
    pytest.fail(f"no end of turn after {max_steps} tokens: {output[:300]!r}")


@TAG_SETTINGS
@given(generated=m3.calls(untyped_allowed=False), content=m3.free_text)
def test_template_rendered_calls_are_accepted_by_the_grammar(chat_tokenizer, generated, content):
    reply = rendered_reply(chat_tokenizer, generated, "")
    tools = m3.openai_tools(generated)
    assert xgr.testing._is_grammar_accept_string(grammar_for(tools), reply)
    name = generated[0][0]
    forced = {"type": "function", "function": {"name": name}}
    assert xgr.testing._is_grammar_accept_string(grammar_for(tools, forced), rendered_reply(chat_tokenizer, generated[:1], ""))
    assert not xgr.testing._is_grammar_accept_string(grammar_for(tools), content + "no call at all")


def _beyond_a_double(value):
    return isinstance(value, str) and bool(re.fullmatch(r"-?[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?", value)) and math.isinf(float(value))


_NUMBER_CHECK = jsonschema.Draft202012Validator.TYPE_CHECKER
# XGrammar's number grammar has no bound on the exponent, and a number beyond a double reaches
# the client as the text the model wrote (JSON has no infinity): the one value it admits that
# its schema does not type.
_SampledArgumentsValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=_NUMBER_CHECK.redefine(
        "number", lambda checker, value: _NUMBER_CHECK.is_type(value, "number") or _beyond_a_double(value)
    ),
)


@TAG_SETTINGS
@given(generated=m3.calls(untyped_allowed=False, max_calls=2), seed=st.integers(0, 2**32 - 1))
def test_randomly_sampled_constrained_output_parses_into_schema_valid_calls(generated, seed):
    tools = m3.openai_tools(generated)
    schemas = {name: schema for name, schema, _ in generated}
    forced_name = generated[-1][0]
    for tool_choice in ("required", {"type": "function", "function": {"name": forced_name}}):
        text = sample(tools, tool_choice, random.Random(seed))
        result = MiniMaxM3ToolCallDetector().detect_and_parse(text, sglang_tools(generated))
        assert result.calls, f"no call parsed from {text!r}"
        for call in result.calls:
            _SampledArgumentsValidator(schemas[call.name]).validate(json.loads(call.parameters))
        if tool_choice != "required":
            assert {call.name for call in result.calls} == {forced_name}


@pytest.mark.parametrize(
    "schema",
    [
        {},
        {"type": "object"},
        {"type": "object", "properties": {"free": {}, "list": {"type": "array"}}},
        {"type": "object", "additionalProperties": {"type": "integer"}, "required": ["n"]},
        {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "object"}}},
    ],
)
def test_schemas_xgrammar_refuses_are_narrowed_to_a_compilable_subset(schema):
    """XGrammar's M3 converter rejects unconstrained sub-schemas; the narrowed schema compiles
    and everything sampled from it still satisfies the original schema."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    sglang_tool = sglang_tools([("f", schema, None)])
    for seed in range(5):
        text = sample(tools, "required", random.Random(seed))
        calls = MiniMaxM3ToolCallDetector().detect_and_parse(text, sglang_tool).calls
        assert calls
        for call in calls:
            jsonschema.validate(json.loads(call.parameters), schema)


def test_narrowing_keeps_declared_structure_and_drops_open_ends():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {}},
        "additionalProperties": {"type": "string"},
        "required": ["a", "c"],
    }
    assert narrowed_schema(schema) == {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "string"}},
        "required": ["a", "c"],
        "additionalProperties": False,
    }


def test_auto_choice_with_strict_tools_constrains_calls_but_allows_plain_answers():
    """tool_choice=auto constrains only when tools are strict (SGLang's rule); then a plain
    answer and a well-formed call are both allowed, a malformed call is not."""
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    from sglang_m3.parsers import register_parsers

    register_parsers()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    tool = Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}})
    kind, tag = FunctionCallParser([tool], "minimax-m3").get_structure_constraint("auto")
    assert kind == "structural_tag"
    grammar = xgr.Grammar.from_structural_tag(tag)
    call = f'{NAMESPACE}<tool_call>\n{NAMESPACE}<invoke name="f">\n{NAMESPACE}<n>4{NAMESPACE}</n>\n{NAMESPACE}</invoke>\n{NAMESPACE}</tool_call>'
    assert xgr.testing._is_grammar_accept_string(grammar, "Just an answer.")
    assert xgr.testing._is_grammar_accept_string(grammar, "Let me look. " + call)
    assert not xgr.testing._is_grammar_accept_string(grammar, call.replace("<n>4", "<n>four"))


# ---- string keywords XGrammar's M3 style cannot compile ------------------------------------

STRING_BOUNDS = ("pattern", "format", "minLength", "maxLength")
_STRING_BOUND_VALUES = {
    "pattern": st.sampled_from([r"^[a-z]+$", r"\d{3}-\d{4}", r"^[A-Z][a-z]*( [A-Z][a-z]*)*$"]),
    "format": st.sampled_from(["date", "date-time", "time", "email", "uri", "uuid", "ipv4", "hostname", "no-such-format"]),
    "minLength": st.integers(0, 5),
    "maxLength": st.integers(0, 20),
}


def _may_hold_a_string(schema):
    declared = schema.get("type")
    return declared == "string" or (isinstance(declared, list) and "string" in declared) or "enum" in schema


@st.composite
def _with_string_bounds(draw, schema):
    """`schema` with random string keywords on sub-schemas that may hold strings (and now and
    then on others, where they mean nothing)."""
    if isinstance(schema, list):
        return [draw(_with_string_bounds(sub)) for sub in schema]
    if not isinstance(schema, dict):
        return schema
    bounded = {key: draw(_with_string_bounds(sub)) if key in ("items", "anyOf") else sub for key, sub in schema.items()}
    if isinstance(schema.get("properties"), dict):
        bounded["properties"] = {name: draw(_with_string_bounds(sub)) for name, sub in schema["properties"].items()}
    if _may_hold_a_string(schema) or draw(st.integers(0, 9)) == 0:
        for key in draw(st.lists(st.sampled_from(STRING_BOUNDS), unique=True)):
            bounded[key] = draw(_STRING_BOUND_VALUES[key])
    return bounded


def without_string_bounds(schema):
    """What the constraint still enforces of `schema`: everything but the string keywords."""
    if isinstance(schema, list):
        return [without_string_bounds(sub) for sub in schema]
    if not isinstance(schema, dict):
        return schema
    kept = {key: without_string_bounds(sub) for key, sub in schema.items() if key not in STRING_BOUNDS}
    for key in ("properties", "$defs"):
        if isinstance(schema.get(key), dict):
            kept[key] = {name: without_string_bounds(sub) for name, sub in schema[key].items()}
    return kept


@st.composite
def bounded_calls(draw):
    """m3 calls whose schemas carry string keywords; the arguments are not used."""
    generated = draw(m3.calls(untyped_allowed=False, max_calls=2))
    return [(name, draw(_with_string_bounds(schema)), value) for name, schema, value in generated]


@TAG_SETTINGS
@given(generated=bounded_calls(), seed=st.integers(0, 2**32 - 1))
def test_string_keywords_compile_and_the_rest_of_the_schema_holds(generated, seed):
    """`pattern`, `format`, `minLength` and `maxLength` anywhere in a tool's schema compile
    under every constrained tool choice (XGrammar's own check refused them); sampled calls
    satisfy everything else in the schema."""
    tools = m3.openai_tools(generated)
    forced = {"type": "function", "function": {"name": generated[-1][0]}}
    for tool_choice in ("required", forced, "auto"):
        COMPILER.compile_structural_tag(build_structural_tag(tools, tool_choice, reasoning=False, parallel_tool_calls=True))
    schemas = {name: without_string_bounds(schema) for name, schema, _ in generated}
    text = sample(tools, "required", random.Random(seed))
    result = MiniMaxM3ToolCallDetector().detect_and_parse(text, sglang_tools(generated))
    assert result.calls, f"no call parsed from {text!r}"
    for call in result.calls:
        _SampledArgumentsValidator(schemas[call.name]).validate(json.loads(call.parameters))


def _required_property(schema):
    return {"type": "object", "properties": {"p": schema}, "required": ["p"]}


_DATE = {"type": "string", "format": "date"}
_CODE = {"type": "string", "pattern": r"^\d{3}$", "minLength": 3, "maxLength": 3}


@pytest.mark.parametrize(
    "schema",
    [
        _required_property({"type": "string", "maxLength": 5}),
        _required_property({"type": "string", "minLength": 1}),
        _required_property({"type": "string", "pattern": "^[a-z]+$"}),
        _required_property({"type": "string", "format": "email"}),
        _required_property(_required_property(_DATE)),
        _required_property({"type": "array", "items": _CODE}),
        _required_property({"type": "array", "items": _required_property(_DATE)}),
        _required_property({"type": "array", "prefixItems": [{"type": "integer"}], "items": _CODE}),
        _required_property({"anyOf": [_CODE, {"type": "integer"}]}),
        _required_property({"type": ["string", "null"], "maxLength": 4}),
        {"type": "object", "properties": {"p": {"$ref": "#/$defs/Code"}}, "required": ["p"], "$defs": {"Code": _CODE}},
    ],
    ids=["maxLength", "minLength", "pattern", "format", "nested-object", "array-items", "array-of-objects",
         "items-after-prefixItems", "anyOf", "type-list", "ref"],
)
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "f"}}, "auto"])
def test_string_keywords_anywhere_compile(schema, tool_choice):
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}]
    COMPILER.compile_structural_tag(build_structural_tag(tools, tool_choice, reasoning=False, parallel_tool_calls=True))


def test_string_keywords_are_dropped_and_nothing_else():
    schema = _required_property({"type": "string", "format": "date", "pattern": "x", "minLength": 1, "maxLength": 9, "description": "d"})
    assert narrowed_schema(schema)["properties"]["p"] == {"type": "string", "description": "d"}
    assert narrowed_schema(_required_property({"type": "integer", "minimum": 1}))["properties"]["p"] == {"type": "integer", "minimum": 1}
    # relaxed as everywhere: they do not take enum members away either
    assert narrowed_schema(_required_property({"enum": ["", "ab"], "pattern": "^[a-z]+$"}))["properties"]["p"] == {"enum": ["", "ab"]}


# ---- conjunctions and property names --------------------------------------------------------

_TOOL_CHOICES = ("required", {"type": "function", "function": {"name": "f"}}, "auto")


def assert_sampled_calls_satisfy(schema, seeds=range(6)):
    """The narrowed schema compiles under every constrained tool choice, and the calls a random
    model samples inside the grammar are valid for `schema` itself."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}]
    for tool_choice in _TOOL_CHOICES:
        COMPILER.compile_structural_tag(build_structural_tag(tools, tool_choice, reasoning=False, parallel_tool_calls=True))
    validator = _SampledArgumentsValidator(schema)
    sglang_tool = sglang_tools([("f", schema, None)])
    for seed in seeds:
        text = sample(tools, "required", random.Random(seed))
        calls = MiniMaxM3ToolCallDetector().detect_and_parse(text, sglang_tool).calls
        assert calls, f"no call parsed from {text!r}"
        for call in calls:
            arguments = json.loads(call.parameters)
            assert validator.is_valid(arguments), (arguments, [error.message for error in validator.iter_errors(arguments)], text)


_INT = {"type": "integer"}
_OBJ_A = {"type": "object", "properties": {"a": _INT}, "required": ["a"]}
_OBJ_B = {"type": "object", "properties": {"b": {"type": "string"}, "c": {"type": "boolean"}}, "required": ["b"]}
_BOUND_ONLY_BRANCH = _required_property({"type": "integer", "allOf": [{"minimum": 3}]})
_NAMES_PATTERN = {"type": "object", "properties": {"ok": _INT, "Bad": _INT}, "propertyNames": {"pattern": "^[a-z]+$"}}

CONJUNCTIONS = {
    # two branches or more: "minimax_m3_xml does not support unconstrained schemas"
    "type-and-bound": _required_property({"allOf": [_INT, {"minimum": 3}]}),
    "bounds-across-branches": _required_property({"allOf": [{"type": "number"}, {"maximum": 10}, {"exclusiveMinimum": 0}]}),
    "objects": {"allOf": [_OBJ_A, _OBJ_B]},
    "ref-and-extension": {"allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"n": _INT}, "required": ["n"]}], "$defs": {"Base": _OBJ_B}},
    "closed-branch": {"allOf": [{"type": "object", "properties": {"a": _INT}, "additionalProperties": False}, {"properties": {"b": _INT}}]},
    "unions": _required_property({"allOf": [{"anyOf": [_INT, {"type": "string"}]}, {"anyOf": [{"type": "number"}, {"type": "null"}]}]}),
    "enum-and-bound": _required_property({"allOf": [{"enum": [1, 2, 3]}, {"minimum": 2}]}),
    # found by the hypothesis test: a branch whose bounds cross ("Invalid range") is left out
    "crossed-bounds-in-a-union": _required_property({"allOf": [{"anyOf": [{"type": "integer", "maximum": 0}, {"type": "boolean"}]}, {"anyOf": [{"minimum": 1000}, {}]}]}),
    "in-a-recursive-definition": {
        "type": "object",
        "properties": {"list": {"$ref": "#/$defs/Node"}},
        "required": ["list"],
        "$defs": {"Node": {"type": "object", "properties": {"v": _INT, "next": {"allOf": [{"$ref": "#/$defs/Node"}, {"required": ["v"]}]}}}},
    },
    # one branch: XGrammar took the branch for the whole schema, a bound-only one narrowed to a string
    "bound-only-branch": _BOUND_ONLY_BRANCH,
    "required-only-branch": {"type": "object", "properties": {"a": _INT}, "allOf": [{"required": ["a"]}]},
    # fractional bounds on an integer: "Integer constraint must be a whole number"
    "fractional-integer-bounds": _required_property({"type": "integer", "minimum": 0.5, "exclusiveMaximum": 3.5}),
    "fractional-exclusive-minimum-and-whole-maximum": _required_property({"type": "integer", "exclusiveMinimum": -1.5, "maximum": 2}),
    # propertyNames: "minimax_m3_xml requires fixed object property names"
    "propertyNames": _NAMES_PATTERN,
    "propertyNames-open": _required_property({"type": "object", "propertyNames": {"maxLength": 3}, "additionalProperties": _INT}),
    # a closed object cannot reach minProperties with the names propertyNames leaves: an optional one is left out
    "propertyNames-minProperties": {
        "type": "object",
        "properties": {"n": _INT, "o": {"type": "object", "properties": {"a": {}, "b": {}, "d": {}}, "propertyNames": {"pattern": "^[a-c]+$"}, "minProperties": 3}},
        "required": ["n"],
    },
}


@pytest.mark.parametrize("schema", list(CONJUNCTIONS.values()), ids=list(CONJUNCTIONS))
def test_conjunctions_and_property_names_compile_and_sampled_calls_satisfy_the_schema(schema):
    assert_sampled_calls_satisfy(schema)


def test_conjunctions_are_merged_into_one_schema():
    assert narrowed_schema(_BOUND_ONLY_BRANCH)["properties"]["p"] == {"type": "integer", "minimum": 3}
    merged = narrowed_schema(CONJUNCTIONS["objects"])
    assert (merged["properties"], merged["required"]) == ({"a": _INT, "b": {"type": "string"}, "c": {"type": "boolean"}}, ["a", "b"])
    assert narrowed_schema(CONJUNCTIONS["closed-branch"])["properties"] == {"a": _INT}
    assert narrowed_schema(CONJUNCTIONS["enum-and-bound"])["properties"]["p"] == {"enum": [2, 3], "minimum": 2}
    assert narrowed_schema(CONJUNCTIONS["fractional-integer-bounds"])["properties"]["p"] == {"type": "integer", "minimum": 1, "maximum": 3}
    assert narrowed_schema(_required_property({"type": "integer", "minimum": 0.2, "maximum": 0.8})) is False


def test_property_names_refused_are_left_out():
    assert narrowed_schema(_NAMES_PATTERN) == {"type": "object", "properties": {"ok": _INT}, "additionalProperties": False}


def test_a_tool_whose_narrowed_parameters_admit_nothing_is_refused_by_name():
    """The hypothesis test's CI case at the root: the names `propertyNames` leaves cannot reach
    `minProperties` in a closed object. No relaxation: the request gets a 400 naming the tool."""
    schema = {"type": "object", "properties": {"a": {}, "b": {}, "d": {}}, "propertyNames": {"pattern": "^[a-c]+$"}, "minProperties": 3}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    with pytest.raises(ValueError, match="tool 'f'"):
        build_structural_tag(tools, "required", reasoning=False, parallel_tool_calls=True)


# Satisfiable by construction: each strategy draws (schema, a value valid for it), and uses only
# keywords the narrowing guarantees, so the oracle is the schema itself.
_SHARED = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["id"]}
_DECOYS = [{"type": "boolean"}, {"type": "integer", "minimum": 1000}, {"type": "array", "minItems": 1}, {"type": "null"}]


@st.composite
def _bounded_scalars(draw):
    """A range or an enum spread over `allOf` branches, bound-only branches beside a type."""
    kind = draw(st.sampled_from(["integer", "number"]))
    value = draw(st.integers(-50, 50))
    low, high = value - draw(st.integers(0, 5)), value + draw(st.integers(0, 5))
    bounds = [draw(st.sampled_from([{"minimum": low}, {"exclusiveMinimum": low - 1}])), {"maximum": high}]
    if draw(st.booleans()):
        members = draw(st.lists(st.sampled_from([low - 1, high + 1, "x", 0.5]), max_size=3, unique=True))
        bounds.append({"enum": [value, *members]})
    parts = draw(st.permutations([{"type": kind}, *bounds]))
    if draw(st.booleans()):
        return {"allOf": parts}, value
    return {**parts[0], "allOf": parts[1:]}, value


_LEAVES = st.one_of(
    _bounded_scalars(),
    st.sampled_from([({"type": "string"}, "s"), ({"type": "boolean"}, True), ({"type": ["integer", "null"]}, None), ({}, "free")]),
)


@st.composite
def _split_objects(draw, children):
    """One object's members declared and required across `allOf` branches, now and then beside
    a branch closed to them, a refused name and `propertyNames`."""
    entries = draw(st.lists(st.tuples(st.sampled_from(["a", "b", "c", "kind"]), children), min_size=1, max_size=4, unique_by=lambda e: e[0]))
    branches = [{"properties": {}, "required": []} for _ in range(draw(st.integers(1, 3)))]
    for name, (schema, _) in entries:
        branch = draw(st.sampled_from(branches))
        branch["properties"][name] = schema
        if draw(st.booleans()):
            draw(st.sampled_from(branches))["required"].append(name)
    if draw(st.booleans()):
        branches.append({"type": "object", "properties": {name: {} for name, _ in entries}, "additionalProperties": False})
    schema = {"type": "object", "allOf": branches} if draw(st.booleans()) else {"allOf": [{"type": "object"}, *branches]}
    if draw(st.booleans()):
        schema["propertyNames"] = {"pattern": "^[a-z]+$"}
        branches[0]["properties"]["Bad"] = {"type": "integer"}
    return schema, {name: value for name, (_, value) in entries}


@st.composite
def _unions_in_conjunctions(draw, children):
    """`anyOf`s under `allOf` (multiplied out) and a union beside other keywords."""
    (schema, value), decoys = draw(children), draw(st.lists(st.sampled_from(_DECOYS), min_size=2, max_size=2))
    if draw(st.booleans()):
        return {"allOf": [{"anyOf": [schema, decoys[0]]}, {"anyOf": [decoys[1], schema]}]}, value
    return {"anyOf": [schema, decoys[0]], "allOf": [{"anyOf": [decoys[1], {}]}]}, value


@st.composite
def _refs_in_conjunctions(draw, children):
    """A shared definition extended by `allOf` siblings, or beside other keywords."""
    schema, value = draw(children)
    extension = {"properties": {"more": schema}, "required": ["more"]}
    if draw(st.booleans()):
        return {"allOf": [{"$ref": "#/$defs/Shared"}, extension]}, {"id": 7, "more": value}
    return {"$ref": "#/$defs/Shared", **extension}, {"id": 7, "more": value}


@st.composite
def _arrays(draw, children):
    (schema, value), count = draw(children), draw(st.integers(0, 2))
    return {"allOf": [{"type": "array", "items": schema}, {"maxItems": 2}, {"minItems": count}]}, [value] * count


_CONJUNCTION_VALUES = st.recursive(
    _LEAVES,
    lambda children: st.one_of(_split_objects(children), _unions_in_conjunctions(children), _refs_in_conjunctions(children), _arrays(children)),
    max_leaves=5,
)


@st.composite
def conjunction_tools(draw):
    schema, value = draw(_split_objects(_CONJUNCTION_VALUES))
    schema["$defs"] = {"Shared": _SHARED}
    jsonschema.validate(value, schema)  # the strategies' own check
    return schema


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=conjunction_tools(), seed=st.integers(0, 2**32 - 1))
def test_conjunctions_compile_and_sampled_calls_satisfy_the_schema(schema, seed):
    """`allOf` anywhere (bound-only branches, split objects, closed branches, unions and `$ref`s
    in it), unions beside other keywords and `propertyNames`: the narrowing admits something,
    compiles under required, a named tool and strict auto, and random samples satisfy the
    schema as written (no relaxation: there are no string bounds or `oneOf`s here)."""
    assert narrowed_schema(schema) is not False
    assert_sampled_calls_satisfy(schema, seeds=[seed])
