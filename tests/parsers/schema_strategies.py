"""Hypothesis strategies: tool schemas built with combinators and `$ref`, each with an argument
value valid for it that reads back unambiguously, and an M3 writer for such values.

Unambiguous by construction, following the tie rules of `sglang_m3.parsers.schema_values`:
- a union (`anyOf` / `oneOf`) adds decoy branches only of kinds that cannot read the value's
  text (a string "5" never sits beside an integer branch), or object / array decoys the value
  cannot validate against (a required member it lacks, more items than it has);
- a discriminated union tells its object branches apart by a `const` member;
- `$ref`s point at hoisted copies of sub-schemas, and recursive definitions (a tree, a linked
  list through `anyOf: [null, $ref]`) get values of bounded depth.
"""

import json
import re

from hypothesis import strategies as st

from sglang_m3.parsers.m3_format import NAMESPACE as NS
from tests.parsers import m3_strategies as m3

_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]*)")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_DECOY_MEMBER = "decoy.member"  # never an argument name (`m3.names` has no dots)
_DECOYS = {
    "null": {"type": "null"},
    "boolean": {"type": "boolean"},
    "integer": {"type": "integer"},
    "number": {"type": "number"},
    "string": {"type": "string"},
    "object": {"type": "object", "properties": {_DECOY_MEMBER: {"type": "string"}}, "required": [_DECOY_MEMBER]},
    "array": {"type": "array", "minItems": 99},
}
_SCALAR_KINDS = ("null", "boolean", "integer", "number", "string")


def _kinds_reading_text(text):
    """The kinds whose reading of this leaf text differs from the string itself.

    Null reads blank text only where no string may be meant, and every string value here comes
    from a schema that allows one, so a null decoy takes only `null` away from a string.
    """
    stripped = text.strip()
    kinds = set()
    if stripped == "null":
        kinds.add("null")
    if stripped.lower() in ("true", "false"):
        kinds.add("boolean")
    if _INTEGER.fullmatch(stripped):
        kinds.add("integer")
    if _NUMBER.fullmatch(stripped):
        kinds.add("number")
    if stripped == "" or stripped[:1] in ("{", "["):
        kinds.update(("object", "array"))
    return kinds


def safe_decoy_kinds(value):
    """Decoy kinds that cannot take `value` away from its own branch."""
    if isinstance(value, str):
        unsafe = _kinds_reading_text(value)
    elif isinstance(value, (dict, list)) and not value:
        unsafe = {"null"}  # an empty container is written as empty text
    else:
        unsafe = set()
    return [kind for kind in _DECOYS if kind not in unsafe]


def _fresh(schema):
    return json.loads(json.dumps(schema))


@st.composite
def _unions(draw, children):
    schema, value = draw(children)
    kinds = draw(st.lists(st.sampled_from(safe_decoy_kinds(value)), max_size=3, unique=True))
    branches = [_fresh(_DECOYS[kind]) for kind in kinds]
    branches.insert(draw(st.integers(0, len(branches))), schema)
    return {draw(st.sampled_from(["anyOf", "oneOf"])): branches}, value


@st.composite
def _type_lists(draw):
    """`type: [own, others...]` in any order, with `nullable` now and then."""
    kind = draw(st.sampled_from(_SCALAR_KINDS))
    value = draw(
        {
            "null": st.none(),
            "boolean": st.booleans(),
            "integer": st.integers(-(10**6), 10**6),
            "number": m3.finite_numbers,
            "string": m3.free_text,
        }[kind]
    )
    others = [other for other in safe_decoy_kinds(value) if other in _SCALAR_KINDS and other != kind]
    extra = draw(st.lists(st.sampled_from(others), max_size=2, unique=True)) if others else []
    kinds = draw(st.permutations([kind, *extra]))
    schema = {"type": kinds if len(kinds) > 1 or draw(st.booleans()) else kind}
    if "null" not in kinds and "null" in safe_decoy_kinds(value) and draw(st.booleans()):
        schema["nullable"] = True
        if draw(st.booleans()):
            value = None
    return schema, value


@st.composite
def _bounded_numbers(draw):
    """Bounds spread over `allOf` parts: the value must validate against all of them."""
    value = draw(st.integers(-1000, 1000))
    low, high = value - draw(st.integers(0, 5)), value + draw(st.integers(1, 5))
    parts = [{"type": "integer"}, {"minimum": low}, {"exclusiveMaximum": high}]
    return {"allOf": draw(st.permutations(parts))}, value


def _object_schema(entries):
    properties = {name: schema for name, (schema, _) in entries}
    return {"properties": properties, "required": list(properties)}


@st.composite
def _split_objects(draw, children):
    """One object's members declared across `allOf` parts."""
    entries = draw(st.lists(st.tuples(m3.names, children), min_size=1, max_size=4, unique_by=lambda e: e[0]))
    cut = draw(st.integers(0, len(entries)))
    schema = {"type": "object", "allOf": [_object_schema(entries[:cut]), _object_schema(entries[cut:])]}
    return schema, {name: value for name, (_, value) in entries}


@st.composite
def _tagged_unions(draw, children):
    """`oneOf` object branches told apart by the `const` of their `kind` member."""
    branch_entries = draw(
        st.lists(
            st.lists(
                st.tuples(m3.names.filter(lambda name: name != "kind"), children),
                max_size=3,
                unique_by=lambda e: e[0],
            ),
            min_size=2,
            max_size=3,
        )
    )
    branches = []
    for index, entries in enumerate(branch_entries):
        schema = {"type": "object", **_object_schema(entries)}
        schema["properties"]["kind"] = {"const": f"kind{index}"}
        schema["required"].append("kind")
        branches.append(schema)
    chosen = draw(st.integers(0, len(branches) - 1))
    value = {name: member for name, (_, member) in branch_entries[chosen]}
    value["kind"] = f"kind{chosen}"
    return {draw(st.sampled_from(["oneOf", "anyOf"])): branches}, value


@st.composite
def _pattern_objects(draw, children):
    """Members typed by `patternProperties` (names `n_*`) and by `additionalProperties`."""
    (pattern_schema, pattern_value), (extra_schema, extra_value) = draw(children), draw(children)
    pattern_names = draw(st.lists(m3.names.map(lambda name: "n_" + name), max_size=2, unique=True))
    other_names = draw(st.lists(m3.names.filter(lambda name: not name.startswith("n_")), max_size=2, unique=True))
    schema = {"type": "object", "patternProperties": {"^n_": pattern_schema}, "additionalProperties": extra_schema}
    value = {name: pattern_value for name in pattern_names}
    value.update({name: extra_value for name in other_names})
    return schema, value


# Strings a content reading would turn into something else: only the schema keeps them strings.
_literal_looking_strings = st.sampled_from(["5", " -7 ", "2.5e3", "true", "False", "null", "", "[1, 2]", '{"a": 1}'])


def argument_pairs():
    """(schema, value) for one argument, combinators nested anywhere."""
    leaves = st.one_of(
        m3.scalar_pairs(),
        _literal_looking_strings.map(lambda text: ({"type": "string"}, text)),
        _type_lists(),
        _bounded_numbers(),
    )
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            m3.object_pairs(children),
            m3.array_pairs(children),
            _unions(children),
            _split_objects(children),
            _tagged_unions(children),
            _pattern_objects(children),
        ),
        max_leaves=6,
    )


_TREE = {
    "type": "object",
    "properties": {"label": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/definitions/Node"}}},
    "required": ["label"],
}
_LINK = {
    "type": "object",
    "properties": {"value": {"type": "integer"}, "next": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/Link"}]}},
}
_trees = st.recursive(
    m3.free_text.map(lambda label: {"label": label}),
    lambda children: st.tuples(m3.free_text, st.lists(children, max_size=3)).map(
        lambda drawn: {"label": drawn[0], "children": drawn[1]}
    ),
    max_leaves=6,
)
_links = st.recursive(
    st.integers(-99, 99).map(lambda number: {"value": number, "next": None}),
    lambda rest: st.tuples(st.integers(-99, 99), rest).map(lambda drawn: {"value": drawn[0], "next": drawn[1]}),
    max_leaves=5,
)


@st.composite
def _recursive_roots(draw):
    """Arguments whose schemas refer to themselves through `definitions` / `$defs`."""
    schema = {
        "type": "object",
        "properties": {"tree": {"$ref": "#/definitions/Node"}, "chain": {"$ref": "#/$defs/Link"}},
        "definitions": {"Node": _fresh(_TREE)},
        "$defs": {"Link": _fresh(_LINK)},
    }
    value = {}
    if draw(st.booleans()):
        value["tree"] = draw(_trees)
    if draw(st.booleans()):
        value["chain"] = draw(_links)
    return schema, value


_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties")
_SCHEMA_VALUES = ("items", "additionalProperties")


@st.composite
def _with_refs(draw, pair):
    """Hoist random sub-schemas (the root included) into `$defs` / `definitions`, leaving a
    `$ref` (sometimes a chain of them, sometimes with sibling keywords) in their place."""
    schema, value = draw(pair)
    hoisted = {}

    def rewrite(node):
        if not isinstance(node, dict):
            return node
        node = dict(node)
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                node[key] = [rewrite(sub) for sub in node[key]]
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                node[key] = {name: rewrite(sub) for name, sub in node[key].items()}
        for key in _SCHEMA_VALUES:
            if key in node:
                node[key] = rewrite(node[key])
        while draw(st.integers(0, 3)) == 3:
            container = draw(st.sampled_from(["$defs", "definitions"]))
            name = draw(st.sampled_from(["D", "a/b", "t~x"])) + str(sum(map(len, hoisted.values())))
            hoisted.setdefault(container, {})[name] = node
            pointer = name.replace("~", "~0").replace("/", "~1")
            node = {"$ref": f"#/{container}/{pointer}"}
            if draw(st.booleans()):
                node["description"] = "hoisted"
        return node

    definitions = {key: schema[key] for key in ("$defs", "definitions") if key in schema}
    root = rewrite({key: sub for key, sub in schema.items() if key not in definitions})
    for container, named in definitions.items():
        hoisted.setdefault(container, {}).update(named)
    root.update(hoisted)
    return root, value


def root_pairs():
    """(parameters schema, arguments): root objects, root unions, root `allOf`, `$ref` roots."""
    children = argument_pairs()
    objects = m3.object_pairs(children)
    return _with_refs(
        st.one_of(objects, _unions(objects), _tagged_unions(children), _split_objects(children), _recursive_roots())
    )


def calls(max_calls=2):
    """A list of (function name, parameters schema, arguments) with distinct names."""
    return st.lists(
        st.tuples(m3.names, root_pairs()), min_size=1, max_size=max_calls, unique_by=lambda entry: entry[0]
    ).map(lambda entries: [(name, schema, value) for name, (schema, value) in entries])


# ---- M3 text for argument values ------------------------------------------------------------


def _element(tag, body):
    return f"{NS}<{tag}>{body}{NS}</{tag}>"


def _members(value, repeat, separator):
    """Object members in order; an array of two or more under `repeat()` is written as the
    member repeated once per element instead of as `<item>`s."""
    written = ""
    for key, member in value.items():
        if isinstance(member, list) and len(member) > 1 and repeat():
            written += "".join(_element(key, written_value(each, repeat)) + separator for each in member)
        else:
            written += _element(key, written_value(member, repeat)) + separator
    return written


def written_value(value, repeat=lambda: False):
    """An argument value as M3 writes it; with the default `repeat` exactly as the chat
    template writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return _members(value, repeat, "")
    if isinstance(value, list):
        return "".join(_element("item", written_value(each, repeat)) for each in value)
    return json.dumps(value)


def written_block(generated_calls, repeat=lambda: False):
    """A tool-call block for (name, schema, arguments) triples, laid out as the template does."""
    invokes = "".join(
        f'{NS}<invoke name="{name}">' + ("\n" if arguments else "") + _members(arguments, repeat, "\n") + f"{NS}</invoke>\n"
        for name, _, arguments in generated_calls
    )
    return f"{NS}<tool_call>\n{invokes}{NS}</tool_call>"
