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


# ---- every JSON Schema keyword: compiled, and sampled calls hold (schema_narrowing) --------

_TOOL_CHOICES = ("required", {"type": "function", "function": {"name": "f"}}, "auto")
# Documented relaxations (sglang_m3/parsers/schema_narrowing.py): what the constraint does not
# enforce. `oneOf` is read as `anyOf`; `not` holds only of types.
_RELAXED = (*STRING_BOUNDS, "uniqueItems", "maxContains")


def relaxed(schema):
    """What the constraint still enforces of `schema`, after the documented relaxations."""
    if isinstance(schema, list):
        return [relaxed(sub) for sub in schema]
    if not isinstance(schema, dict):
        return schema
    kept = {}
    for key, sub in schema.items():
        if key in _RELAXED or key == "not" and not (isinstance(sub, dict) and set(sub) <= {"type"}):
            continue
        if key in ("properties", "$defs", "definitions", "dependentSchemas", "patternProperties"):
            kept[key] = {name: relaxed(value) for name, value in sub.items()} if isinstance(sub, dict) else sub
        elif key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "enum", "const", "required", "examples", "default"):
            kept[key] = sub
        else:
            kept["anyOf" if key == "oneOf" else key] = relaxed(sub)
    if isinstance(kept.get("minProperties"), int) and kept["minProperties"] > len(kept.get("properties", {})):
        del kept["minProperties"]
    # Earlier drafts' and OpenAPI's forms, as the 2020-12 validator reads them.
    if isinstance(kept.get("items"), list):
        kept["prefixItems"] = kept.pop("items")
        kept["items"] = kept.pop("additionalItems", True)
    if kept.pop("nullable", False) is True and isinstance(kept.get("type"), str):
        kept["type"] = [kept["type"], "null"]
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if isinstance(kept.get(exclusive), bool):  # draft 4, read by the 2020-12 validator
            if kept.pop(exclusive) and bound in kept:
                kept[exclusive] = kept.pop(bound)
    return kept


def assert_constrained_calls_hold(schema, seeds=range(4), validated=None):
    """The grammar compiles under every constrained tool choice, and what a random model
    samples in it parses into calls valid for `validated` (default: `schema` relaxed)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}]
    for tool_choice in _TOOL_CHOICES:
        COMPILER.compile_structural_tag(build_structural_tag(tools, tool_choice, reasoning=False, parallel_tool_calls=True))
    validator = _SampledArgumentsValidator(relaxed(schema) if validated is None else validated)
    sglang_tool = sglang_tools([("f", schema, None)])
    for seed in seeds:
        text = sample(tools, "required", random.Random(seed))
        calls = MiniMaxM3ToolCallDetector().detect_and_parse(text, sglang_tool).calls
        assert calls, f"no call parsed from {text!r}"
        for call in calls:
            arguments = json.loads(call.parameters)
            assert validator.is_valid(arguments), (arguments, next(validator.iter_errors(arguments)).message, text)


_INT = {"type": "integer"}
_OBJ_A = {"type": "object", "properties": {"a": _INT}, "required": ["a"]}
_OBJ_B = {"type": "object", "properties": {"b": {"type": "string"}, "c": {"type": "boolean"}}, "required": ["b"]}
_NODE = {"type": "object", "properties": {"v": _INT, "next": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}}, "required": ["v"]}

REGRESSIONS = {
    # allOf with two branches or more: "minimax_m3_xml does not support unconstrained schemas"
    "allOf-type-and-bound": _required_property({"allOf": [_INT, {"minimum": 3}]}),
    "allOf-bounds-only": _required_property({"allOf": [{"type": "number"}, {"maximum": 10}, {"exclusiveMinimum": 0}]}),
    "allOf-objects": {"allOf": [_OBJ_A, _OBJ_B]},
    "allOf-nested-objects": _required_property({"allOf": [_OBJ_A, {"properties": {"a": {"maximum": 5}, "d": {"type": "null"}}, "required": ["d"]}]}),
    "allOf-ref-and-required": {"type": "object", "properties": {"p": {"allOf": [{"$ref": "#/$defs/B"}, {"required": ["c"]}]}},
                               "required": ["p"], "$defs": {"B": _OBJ_B}},
    "allOf-of-anyOfs": _required_property({"allOf": [{"anyOf": [_INT, {"type": "string"}]}, {"anyOf": [{"type": "number"}, {"type": "null"}]}]}),
    # a bound-only branch narrowed to a string made the schema impossible, or the bound was lost
    "bound-only": _required_property({"minimum": 3, "maximum": 9}),
    "anyOf-with-sibling-type": _required_property({"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": -5}]}),
    "anyOf-with-sibling-object": {"type": "object", "properties": {"a": _INT, "b": _INT}, "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
    "ref-with-sibling-bound": {**_required_property({"$ref": "#/$defs/N", "maximum": 5}), "$defs": {"N": {"type": "integer", "minimum": 1}}},
    # propertyNames: "minimax_m3_xml requires fixed object property names"
    "propertyNames": {"type": "object", "properties": {"ok": _INT, "Bad": _INT}, "propertyNames": {"pattern": "^[a-z]+$"}},
    "propertyNames-open": _required_property({"type": "object", "propertyNames": {"maxLength": 3}, "additionalProperties": _INT}),
    # ignored by XGrammar: sampled calls broke them
    "if-then-else": _required_property({"type": "integer", "if": {"minimum": 0}, "then": {"maximum": 10}, "else": {"maximum": -5}}),
    "dependentRequired": _required_property({"type": "object", "properties": {"a": _INT, "b": _INT}, "dependentRequired": {"a": ["b"]}}),
    "dependentSchemas": _required_property({"type": "object", "properties": {"a": _INT, "b": _INT},
                                            "dependentSchemas": {"a": {"properties": {"b": {"minimum": 100}}, "required": ["b"]}}}),
    "number-multipleOf": _required_property({"type": "number", "multipleOf": 0.5, "minimum": 0.2, "maximum": 30.7}),
    "contains": _required_property({"type": "array", "items": _INT, "contains": {"minimum": 5, "maximum": 6}}),
    "not-type": _required_property({"type": ["integer", "string"], "not": {"type": "string"}}),
    "not-untyped": _required_property({"not": {"type": "string"}, "maximum": 1e300, "minimum": -1e300}),
    "boolean-not-const": _required_property({"type": "boolean", "not": {"const": True}}),
    "ref-sibling-pointer": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 2}, "b": {"$ref": "#/properties/a"}}, "required": ["b"]},
    # enums XGrammar wrote so that they read back as other values, or refused
    "enum-number-text": _required_property({"enum": [1.5, -0.0, 1e10, 1e-07]}),
    "enum-typed": _required_property({"type": "string", "enum": ["a", "b", 1]}),
    "enum-integral-float": _required_property({"type": "integer", "enum": [1.0, 2]}),
    "enum-namespace-marker": _required_property({"enum": [f"a{NAMESPACE}b", "c"]}),
    # refused by XGrammar's checks
    "integer-fractional-bounds": _required_property({"type": "integer", "minimum": 2.5, "maximum": 4.5}),
    "integer-beyond-int64": _required_property({"type": "integer", "minimum": 10**20, "maximum": 10**20 + 5}),
    "draft4-exclusive": _required_property({"type": "integer", "minimum": 0, "exclusiveMinimum": True, "maximum": 3, "exclusiveMaximum": True}),
    "draft4-items": _required_property({"type": "array", "items": [_INT, {"type": "boolean"}], "additionalItems": False}),
    "minProperties-beyond-declared": _required_property({"type": "object", "properties": {"a": _INT}, "additionalProperties": _INT, "minProperties": 2}),
    "unwritable-name": {"type": "object", "properties": {"a>b": _INT, "": _INT, "/x": _INT, "ok": _INT}},
    "false-property": _required_property({"type": "object", "properties": {"a": _INT, "gone": False}}),
    "nullable": _required_property({"type": "integer", "nullable": True}),
    "recursive-ref": {"type": "object", "properties": {"list": {"$ref": "#/$defs/Node"}}, "required": ["list"], "$defs": {"Node": _NODE}},
    "root-ref": {"type": "object", "properties": {"v": _INT, "child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["v"]},
    "annotations": _required_property({"type": "integer", "title": "t", "description": "d", "examples": [1], "default": 2, "deprecated": True}),
}


@pytest.mark.parametrize("schema", list(REGRESSIONS.values()), ids=list(REGRESSIONS))
def test_schema_keywords_compile_and_sampled_calls_hold(schema):
    assert_constrained_calls_hold(schema)


def test_narrowing_merges_allOf_and_folds_bound_only_branches():
    assert narrowed_schema(_required_property({"allOf": [_INT, {"minimum": 3}]}))["properties"]["p"] == {"type": "integer", "minimum": 3}
    assert narrowed_schema(_required_property({"minimum": 3}))["properties"]["p"] == {"type": "number", "minimum": 3}
    merged = narrowed_schema({"allOf": [_OBJ_A, _OBJ_B]})
    assert list(merged["properties"]) == ["a", "b", "c"] and merged["required"] == ["a", "b"]
    assert narrowed_schema(REGRESSIONS["propertyNames"])["properties"] == {"ok": {"type": "integer"}}


def test_impossible_allOf_stays_impossible_and_the_root_still_compiles():
    """A contradiction is not hidden inside a branch (an optional property goes), and a tool
    whose arguments admit nothing still compiles (an empty object)."""
    schema = {"type": "object", "properties": {"x": {"allOf": [_INT, {"type": "string"}]}, "y": _INT}}
    assert narrowed_schema(schema)["properties"] == {"y": {"type": "integer"}}
    assert narrowed_schema(_required_property({"allOf": [_INT, {"type": "string"}]})) == {"type": "object", "properties": {}, "additionalProperties": False}
    assert_constrained_calls_hold(_required_property(False), seeds=range(1), validated={"type": "object", "maxProperties": 0})


# Schemas as clients write them, each keyword at top level and nested; every one satisfiable.
_NAME = st.sampled_from(["a", "b", "c", "d", "kind", "x_y"])
_SCALARS = st.one_of(
    st.sampled_from([{}, True, {"type": "string"}, {"type": "boolean"}, {"type": "null"}, {"type": ["string", "null"]},
                     {"type": "integer", "nullable": True}, {"type": "string", "format": "date"}, {"minimum": 3},
                     {"not": {"type": "string"}, "minimum": -1e9, "maximum": 1e9}, {"type": ["integer", "boolean"], "not": {"type": "integer"}},
                     {"type": "boolean", "not": {"const": False}}, {"const": "fixed"}, {"enum": ["red", 7, None, True, 2.5]},
                     {"type": "string", "enum": ["a", "b", 3]}, {"type": "integer", "minimum": 2.5, "maximum": 9.5},
                     {"type": "integer", "minimum": 0, "exclusiveMinimum": True}, {"type": "integer", "minimum": 10**19},
                     {"type": "integer", "if": {"minimum": 0}, "then": {"maximum": 100}, "else": {"minimum": -100}},
                     {"allOf": [{"type": "integer"}, {"minimum": -5}, {"maximum": 50}]},
                     {"allOf": [{"type": "number"}, {"exclusiveMaximum": 1}]}, {"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": -5}]},
                     {"oneOf": [{"type": "string"}, {"type": "integer"}]}, {"type": "string", "title": "t", "examples": ["e"], "default": "e"}]),
    st.tuples(st.integers(-50, 50), st.integers(0, 50), st.booleans()).map(
        lambda t: {"type": "number" if t[2] else "integer", "minimum": t[0], "exclusiveMaximum": t[0] + t[1] + 1}),
    st.sampled_from([0.5, 0.25, 2.5, 3, 7]).map(lambda step: {"type": "number", "multipleOf": step, "maximum": 1000}),
)


@st.composite
def _objects(draw, children):
    names = draw(st.lists(_NAME, max_size=4, unique=True))
    properties = {name: draw(children) for name in names}
    required = draw(st.lists(st.sampled_from(names), unique=True)) if names else []
    schema = {"type": "object", "properties": properties, "required": required}
    extra = draw(st.sampled_from([None, False, True, {"type": "integer"}, "propertyNames", "unevaluated"]))
    if extra == "propertyNames":
        schema["propertyNames"] = {"pattern": "^[a-c]+$"}
        schema["required"] = [name for name in required if re.fullmatch("[a-c]+", name)]
    elif extra == "unevaluated":
        schema["unevaluatedProperties"] = False
    elif extra is not None:
        schema["additionalProperties"] = extra
    if names and draw(st.booleans()):
        schema["minProperties"] = draw(st.integers(0, len(names)))
        schema["maxProperties"] = max(len(schema["required"]), schema["minProperties"]) + draw(st.integers(0, 2))
    optional = [name for name in names if name not in schema["required"]]
    if len(names) >= 2 and draw(st.booleans()):
        trigger, needed = names[0], names[1]
        if draw(st.booleans()):
            schema["dependentRequired"] = {trigger: [needed]}
        else:
            schema["dependentSchemas"] = {trigger: {"required": [needed]}}
    if optional and draw(st.booleans()):
        schema["if"] = {"required": [optional[0]]}
        schema["then"] = {"properties": {optional[0]: {"type": "integer"}}} if properties[optional[0]] in ({}, True) else {}
    return schema


@st.composite
def _arrays(draw, children):
    item = draw(children)
    schema = {"type": "array", "items": item}
    low = draw(st.integers(0, 2))
    shape = draw(st.sampled_from(["plain", "bounded", "unique", "prefix", "draft4", "contains"]))
    if shape == "bounded":
        schema.update(minItems=low, maxItems=low + draw(st.integers(0, 2)))
    elif shape == "unique":
        schema["uniqueItems"] = True
    elif shape == "prefix":
        schema = {"type": "array", "prefixItems": [item, {"type": "boolean"}], "items": False}
    elif shape == "draft4":
        schema = {"type": "array", "items": [item], "additionalItems": {"type": "boolean"}}
    elif shape == "contains":
        schema.update(contains=item, minContains=draw(st.integers(1, 2)), maxContains=3)
    return schema


@st.composite
def _combined(draw, children):
    """allOf / anyOf / oneOf / $ref over children (satisfiable by construction)."""
    first, second = draw(children), draw(children)
    shape = draw(st.sampled_from(["anyOf", "oneOf-typed", "allOf-annotated", "allOf-objects", "ref"]))
    if shape == "anyOf":
        return {"anyOf": [first, second]}
    if shape == "oneOf-typed":
        return {"oneOf": [{"type": "object", "properties": {"kind": {"const": "one"}, "v": first}, "required": ["kind"]},
                          {"type": "object", "properties": {"kind": {"const": "two"}, "v": second}, "required": ["kind"]}]}
    if shape == "allOf-annotated":
        return {"allOf": [first, {"description": "annotated"}]}
    if shape == "allOf-objects":
        return {"allOf": [{"type": "object", "properties": {"a": first}, "required": ["a"]},
                          {"type": "object", "properties": {"b": second}}]}
    return {"$ref": "#/$defs/Shared", "description": "shared"}


_KEYWORD_SCHEMAS = st.recursive(
    _SCALARS, lambda children: st.one_of(_objects(children), _arrays(children), _combined(children)), max_leaves=6
)


@st.composite
def keyword_tools(draw):
    """A parameters object over `_KEYWORD_SCHEMAS`, with the `$defs` its `$ref`s use
    (a shared definition and a recursive linked list)."""
    root = draw(_objects(_KEYWORD_SCHEMAS))
    if draw(st.booleans()):
        root = {"allOf": [root, {"type": "object", "properties": {"list": {"$ref": "#/$defs/Node"}}}]}
    root["$defs"] = {"Shared": draw(_SCALARS), "Node": _NODE}
    return root


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=keyword_tools(), seed=st.integers(0, 2**32 - 1))
def test_any_schema_keyword_compiles_and_sampled_calls_hold(schema, seed):
    """allOf, anyOf, oneOf, not, if/then/else, const, mixed enums, type lists, nullable,
    propertyNames, dependentRequired / dependentSchemas, unevaluatedProperties, item and
    property counts, uniqueItems, contains, bounds, multipleOf, $ref and recursion, draft-4
    forms, boolean schemas and annotations, at top level and nested: the grammar compiles for
    required, a named tool and auto with a strict tool, and random samples parse into calls
    that satisfy the schema less the documented relaxations."""
    assert_constrained_calls_hold(schema, seeds=[seed])
