"""Hypothesis strategies: JSON schemas with a conforming value each, and tool calls over them.

Every generated value reads back unambiguously under the typing rules of
`sglang_m3.parsers.schema_values` (the format writes scalars as bare text, so e.g. the string
"null" under a nullable string schema cannot be told from null; such values are not generated).
"""

import json
import re

from hypothesis import strategies as st

from sglang_m3.parsers.m3_format import NAMESPACE

# ASCII digits, as the parser reads them: text in other digits is a string.
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")

names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True).filter(
    lambda name: name not in ("tool_call", "item")
)

# Free text as a model writes it: any characters, markup markers excluded.
free_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",)), max_size=30
).filter(lambda text: NAMESPACE not in text)


def _looks_like_json_literal(text: str) -> bool:
    stripped = text.strip()
    return (
        stripped in ("true", "false", "null")
        or bool(_NUMBER.fullmatch(stripped))
        or stripped[:1] in ("{", "[")
    )


untyped_strings = free_text.filter(lambda text: not _looks_like_json_literal(text))
finite_numbers = st.one_of(
    st.integers(min_value=-(10**20), max_value=10**20),
    st.floats(allow_nan=False, allow_infinity=False),
)


def _enum_pairs():
    # Members are told apart by how they are written: "5" and 5 may not both be members.
    members = st.lists(
        st.one_of(free_text, st.integers(-1000, 1000)),
        min_size=1,
        max_size=5,
        unique_by=lambda value: value if isinstance(value, str) else json.dumps(value),
    )
    return members.flatmap(lambda values: st.sampled_from(values).map(lambda value: ({"enum": values}, value)))


def scalar_pairs(untyped_allowed: bool = True):
    """(schema, value) for scalar schemas."""
    options = [
        free_text.map(lambda text: ({"type": "string"}, text)),
        st.integers(-(10**20), 10**20).map(lambda number: ({"type": "integer"}, number)),
        finite_numbers.map(lambda number: ({"type": "number"}, number)),
        st.booleans().map(lambda flag: ({"type": "boolean"}, flag)),
        st.just(({"type": "null"}, None)),
        _enum_pairs(),
        st.one_of(
            free_text.filter(lambda text: text.strip() != "null"),  # blank text is the string
            st.none(),
        ).map(lambda value: ({"type": ["string", "null"]}, value)),
        st.one_of(
            st.integers(-1000, 1000),
            free_text.filter(lambda text: not re.fullmatch(r"-?(?:0|[1-9][0-9]*)", text.strip())),
        ).map(lambda value: ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, value)),
    ]
    if untyped_allowed:
        options.append(
            st.one_of(untyped_strings, st.integers(-1000, 1000), st.booleans(), st.none()).map(
                lambda value: ({}, value)
            )
        )
    return st.one_of(*options)


def object_pairs(children):
    def build(entries):
        properties = {name: schema for name, (schema, _) in entries}
        value = {name: child_value for name, (_, child_value) in entries}
        return {"type": "object", "properties": properties, "required": list(properties)}, value

    return st.lists(st.tuples(names, children), max_size=4, unique_by=lambda entry: entry[0]).map(build)


def array_pairs(children):
    def build(item_schema_and_values):
        item_schema, values = item_schema_and_values
        return {"type": "array", "items": item_schema}, values

    # One item schema shared by all elements: draw it with one value, repeat that value.
    return st.tuples(children, st.integers(0, 3)).map(
        lambda drawn: build((drawn[0][0], [drawn[0][1]] * drawn[1]))
    )


def typed_pairs(untyped_allowed: bool = True):
    """(schema, value) for nested schemas (objects, arrays, scalars)."""
    return st.recursive(
        scalar_pairs(untyped_allowed),
        lambda children: st.one_of(object_pairs(children), array_pairs(children)),
        max_leaves=8,
    )


def calls(untyped_allowed: bool = True, max_calls: int = 3):
    """A list of (function name, parameters schema, arguments) with distinct names."""
    call = st.tuples(names, object_pairs(typed_pairs(untyped_allowed)))
    return st.lists(call, min_size=1, max_size=max_calls, unique_by=lambda entry: entry[0]).map(
        lambda entries: [(name, schema, value) for name, (schema, value) in entries]
    )


def openai_tools(generated_calls):
    return [
        {"type": "function", "function": {"name": name, "parameters": schema}}
        for name, schema, _ in generated_calls
    ]


def history_tool_calls(generated_calls):
    return [
        {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": value}}
        for index, (name, _, value) in enumerate(generated_calls)
    ]


def chunkings(text_length: int):
    """Sorted distinct cut positions inside a text of `text_length` characters."""
    if text_length < 2:
        return st.just([])
    return st.lists(st.integers(1, text_length - 1), max_size=12, unique=True).map(sorted)


def split_at(text: str, cuts):
    bounds = [0, *cuts, len(text)]
    return [text[start:end] for start, end in zip(bounds, bounds[1:])]
