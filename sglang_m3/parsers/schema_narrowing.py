"""A tool's JSON schema narrowed to what XGrammar's `minimax_m3_xml` style compiles.

M3's argument XML cannot be written without a schema to follow, so every tool is constrained by
a *narrowed* copy of its schema, whose values all satisfy the original but for the relaxations
listed last. XGrammar 0.2.7's M3 converter refuses unconstrained sub-schemas (`{}`, a bare
`{"type": "object"}`, `additionalProperties` schemas), an `allOf` of two branches or more and
`propertyNames`; it takes a one-branch `allOf` for the whole node and ignores the keywords
beside an `anyOf` / `oneOf`, a `$ref` or an `enum`. So:
- untyped values become strings; objects are closed to their declared and required members,
  each typed by all of `properties`, `patternProperties` and `additionalProperties` that
  apply to it; arrays without item schemas hold strings;
- a conjunction is merged into one node (`_merged`): the branches of an `allOf` and the target
  of a `$ref` beside other keywords, keyword by keyword (types and enums intersected, the
  tighter bounds kept, members and items conjoined by name and position). A bound-only branch
  (`{"minimum": 3}`) thus bounds its sibling's type instead of becoming a string. An `anyOf` /
  `oneOf` beside other constraints takes them into each branch. A conjunction met again
  inside itself (a recursive `$ref`) becomes a generated `$defs` entry;
- enum members the node's other keywords refuse are removed (string bounds aside: relaxed);
- an integer's fractional bounds become the whole bounds admitting the same integers;
- `propertyNames` goes, with the declared members whose names it refuses (`format` aside, which
  validators do not assert by default);
- what admits no value (a contradiction between branches, bounds that cross, a `false` schema,
  a closed object short of its `minProperties`) is left out where it is optional: a property,
  an `anyOf` branch, a tuple position (arrays end before it). Where it is not, the tool's
  arguments admit nothing and the request is refused.
Unions multiplied out past `MAX_BRANCHES` branches in all keep only their first branch.

Relaxations, where no subset XGrammar compiles would serve:
- `pattern`, a `format` it knows, `minLength` and `maxLength` of strings: a string runs up to
  the next namespace marker and XGrammar cannot combine that exclusion with them (its C++
  check fails the whole request). They are dropped, as SGLang's own XML response templates drop
  length bounds; a call may break them, and the client sees what was written;
- `oneOf` is read as `anyOf` (by XGrammar, as by the parser): a value may match two branches;
- keywords XGrammar ignores (`not`, `if` / `then` / `else`, `dependentRequired`, `contains`,
  `uniqueItems`, a `multipleOf` beside bounds, ...) are passed on unenforced, and a merge keeps
  the first branch's.
"""

import json
import math
from fractions import Fraction
from typing import Any, Dict, List, Optional, Set

from sglang_m3.parsers.schema_alternatives import SchemaIndex, enum_members, pattern_matches, same_json
from sglang_m3.parsers.schema_validation import SchemaValidator

UNTYPED = {"type": "string"}
MAX_BRANCHES = 256

_SCHEMA_LIST_KEYS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAP_KEYS = ("$defs", "definitions")
_UNIONS = ("anyOf", "oneOf")
# Keywords XGrammar's `minimax_m3_xml` style cannot compile, with why they may go.
_OPEN_ENDED_KEYS = ("additionalProperties", "patternProperties", "propertyNames")  # re-closed
_STRING_BOUND_KEYS = ("pattern", "format", "minLength", "maxLength")  # relaxed: see the docstring
_CONSTRAINING_KEYS = ("type", "properties", "items", "prefixItems", "anyOf", "oneOf", "allOf", "$ref", "enum", "const")
# Kept where they stand: what they say is no constraint on the value.
_ANNOTATIONS = (
    "title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly", "$comment", "$schema", "$id", *_SCHEMA_MAP_KEYS
)
_LOWER_BOUNDS = ("minimum", "exclusiveMinimum", "minItems", "minProperties")
_UPPER_BOUNDS = ("maximum", "exclusiveMaximum", "maxItems", "maxProperties")


def narrowed_schema(schema: Any) -> Any:
    """A schema XGrammar's `minimax_m3_xml` style compiles for a tool's parameters, accepting a
    subset of `schema` less the relaxations of the module docstring; False where none is left."""
    narrower = _Narrower(schema)
    narrowed = narrower.narrow(schema)
    if narrower.generated and isinstance(narrowed, dict):
        narrowed["$defs"] = {**narrowed.get("$defs", {}), **narrower.generated}
    return narrowed


class _Narrower:
    """Narrows the nodes of one tool's schema, resolving `$ref`s against its root."""

    def __init__(self, root: Any):
        index = SchemaIndex(root)
        self._target = index.target
        # Patterns are checked here: the values checked are the client's own.
        self._validator = SchemaValidator(index, check_patterns=True)
        self.generated: Dict[str, Any] = {}
        self._names: Dict[str, str] = {}  # text of a conjunction met inside itself -> its $defs name
        self._merging: Set[str] = set()
        self._branches_left = MAX_BRANCHES

    def narrow(self, schema: Any) -> Any:
        """The narrowed schema; False when it admits no value."""
        if schema is False:
            return False
        if not isinstance(schema, dict) or not any(key in schema for key in _CONSTRAINING_KEYS):
            return UNTYPED
        if _is_conjunction(schema):
            return self._conjunction(schema)
        return self._plain(schema)

    def _conjunction(self, schema: dict) -> Any:
        """`schema` merged (module docstring); a reference to a generated definition where the
        same conjunction is being merged already (a recursive `$ref`)."""
        text = json.dumps(schema, sort_keys=True, default=repr)
        if text in self._merging:
            name = self._names.setdefault(text, f"m3_conjunction_{len(self._names)}")
            return {"$ref": f"#/$defs/{name}"}
        self._merging.add(text)
        try:
            narrowed = self.narrow(self._rewritten(schema))
        finally:
            self._merging.discard(text)
        if text in self._names:
            self.generated[self._names[text]] = narrowed
        return narrowed

    def _rewritten(self, schema: dict) -> Any:
        """One node for the conjunction: merged, or an `anyOf` of the merges of each branch of its
        first union with everything else."""
        parts = _distinct(self._conjuncts(schema, frozenset()))
        annotations = {key: value for key, value in schema.items() if key in _ANNOTATIONS}
        for index, part in enumerate(parts):
            union = next((key for key in _UNIONS if isinstance(part, dict) and isinstance(part.get(key), list)), None)
            if union:
                others = [*parts[:index], _without(part, (union,)), *parts[index + 1 :]]
                branches = part[union][: max(1, self._branches_left)]
                self._branches_left -= len(branches) - 1
                return {**annotations, "anyOf": [{"allOf": _distinct([*others, branch])} for branch in branches]}
        node = _merged(parts)
        return node if node is False else {**node, **annotations}

    def _conjuncts(self, schema: Any, inlined: frozenset) -> List[Any]:
        """The schemas that all apply where `schema` does: its own keywords, its `allOf` branches
        and its `$ref` target, flattened. A `$ref` met again without descending into a member
        admits nothing (the least reading, as in `schema_alternatives`)."""
        if not isinstance(schema, dict):
            return [schema]
        parts = [_without(schema, ("allOf", "$ref", *_ANNOTATIONS))]
        ref = schema.get("$ref")
        if isinstance(ref, str):
            parts += [False] if ref in inlined else self._conjuncts(self._target(ref), inlined | {ref})
        for branch in schema.get("allOf") if isinstance(schema.get("allOf"), list) else ():
            parts += self._conjuncts(branch, inlined)
        return parts

    def _plain(self, schema: dict) -> Any:
        """A node with no conjunction left: keyword by keyword."""
        schema = _whole_bounds(schema)
        if _empty_range(schema):
            return False
        dropped = ("properties", *_OPEN_ENDED_KEYS, *_STRING_BOUND_KEYS)  # properties: see `_properties`
        narrowed = {key: value for key, value in schema.items() if key not in dropped}
        for key in _SCHEMA_MAP_KEYS:
            if isinstance(schema.get(key), dict):
                narrowed[key] = {name: self.narrow(sub) for name, sub in schema[key].items()}
        for key in _SCHEMA_LIST_KEYS:
            if isinstance(schema.get(key), list):
                narrowed[key] = [self.narrow(sub) for sub in schema[key]]
        for key in _UNIONS:
            if key in narrowed:
                narrowed[key] = [branch for sub in narrowed[key] for branch in _branches(sub)]
                if not narrowed[key]:
                    return False
        if _may_be(schema, "array") and "prefixItems" not in schema:
            narrowed["items"] = self.narrow(schema.get("items"))
        elif isinstance(schema.get("items"), (dict, bool)):  # the items after `prefixItems`
            narrowed["items"] = self.narrow(schema["items"])
        if False in narrowed.get("prefixItems", ()) and not _end_tuple(narrowed):
            return False
        members = enum_members(schema)
        admitted = None if members is None else self._admitted(members, schema)
        if admitted == []:
            return False
        if admitted is not None and len(admitted) < len(members):
            narrowed.pop("const", None)
            narrowed["enum"] = admitted
        if _may_be(schema, "object"):
            properties = self._properties(schema)
            if properties is None:
                return False
            narrowed["properties"] = properties
            narrowed["additionalProperties"] = False
        return narrowed

    def _admitted(self, members: list, schema: dict) -> list:
        """The enum members that the node's other keywords admit (XGrammar ignores them),
        its string bounds aside (relaxed as everywhere)."""
        others = _without(schema, ("enum", "const", *_STRING_BOUND_KEYS))
        return [member for member in members if self._validator.validates(member, others)]

    def _properties(self, schema: dict) -> Optional[Dict[str, Any]]:
        """The narrowed members of a closed object: the declared and required names
        `propertyNames` admits, those that admit no value left out. None when the object
        admits none: a required member cannot be written, or `minProperties` cannot be met."""
        declared = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = _required(schema)
        names = schema.get("propertyNames", True)
        properties = {}
        for name in dict.fromkeys([*declared, *required]):
            narrowed = self.narrow(_member_schema(schema, name)) if self._validator.validates(name, names) else False
            if narrowed is not False:
                properties[name] = narrowed
            elif name in required:
                return None
        least, most = schema.get("minProperties"), schema.get("maxProperties")
        if _is_number(least) and least > len(properties) or _is_number(most) and most < len(required):
            return None
        return properties


def _whole_bounds(schema: dict) -> dict:
    """An integer node's fractional bounds as the inclusive whole bounds admitting the same
    integers (XGrammar refuses them: "Integer constraint must be a whole number")."""
    if _kinds(schema.get("type")) != ["integer"]:
        return schema
    rounded = dict(schema)
    for inclusive, exclusive, from_inclusive, from_exclusive, tightest in _INTEGER_BOUNDS:
        bounds = {key: schema[key] for key in (inclusive, exclusive) if _is_number(schema.get(key)) and math.isfinite(schema[key])}
        if all(value == int(value) for value in bounds.values()):
            continue
        rounded.pop(exclusive, None)
        rounded[inclusive] = tightest((from_inclusive if key == inclusive else from_exclusive)(value) for key, value in bounds.items())
    return rounded


#: (inclusive key, exclusive key, the first whole value each admits, the tighter of two)
_INTEGER_BOUNDS = (
    ("minimum", "exclusiveMinimum", math.ceil, lambda bound: math.floor(bound) + 1, max),
    ("maximum", "exclusiveMaximum", math.floor, lambda bound: math.ceil(bound) - 1, min),
)


def _empty_range(schema: dict) -> bool:
    """Whether the bounds of a number, or the least and most items or properties, leave nothing
    between them (XGrammar refuses such a node)."""
    if "number" in _kinds(schema.get("type")) or "integer" in _kinds(schema.get("type")):
        lows = [(schema[key], key == "exclusiveMinimum") for key in ("minimum", "exclusiveMinimum") if _is_number(schema.get(key))]
        highs = [(schema[key], key == "exclusiveMaximum") for key in ("maximum", "exclusiveMaximum") if _is_number(schema.get(key))]
        if any(low > high or low == high and (open_low or open_high) for low, open_low in lows for high, open_high in highs):
            return True
    counts = (("minItems", "maxItems"), ("minProperties", "maxProperties"))
    return any(_is_number(schema.get(least)) and _is_number(schema.get(most)) and schema[least] > schema[most] for least, most in counts)


def _end_tuple(narrowed: dict) -> bool:
    """Arrays end before the first `prefixItems` position that admits nothing; False when
    `minItems` asks for that position."""
    end = narrowed["prefixItems"].index(False)
    least = narrowed.get("minItems")
    if _is_number(least) and least > end:
        return False
    narrowed["prefixItems"], narrowed["items"] = narrowed["prefixItems"][:end], False
    return True


def _branches(narrowed: Any) -> List[Any]:
    """The branches a narrowed union branch stands for: none for `false`, those of an `anyOf`
    with nothing beside it (distributing two unions nests them)."""
    if narrowed is False:
        return []
    if isinstance(narrowed, dict) and list(narrowed) == ["anyOf"]:
        return narrowed["anyOf"]
    return [narrowed]


def _is_conjunction(schema: dict) -> bool:
    """Whether XGrammar would lose part of `schema`: an `allOf`, or a `$ref` / union beside
    other constraints."""
    if "allOf" in schema:
        return True
    constraints = [key for key in schema if key not in _ANNOTATIONS]
    return len(constraints) > 1 and any(key in constraints for key in ("$ref", *_UNIONS))


def _merged(parts: List[Any]) -> Any:
    """One node admitting what all of `parts` admit (none holds `allOf`, `$ref` or a union);
    False when nothing is. Conflicting values of keywords XGrammar ignores keep the first."""
    if any(part is False for part in parts):
        return False
    nodes = [part for part in parts if isinstance(part, dict)]
    result: Dict[str, Any] = {}
    for node in nodes:
        for key, value in node.items():
            result[key] = value if key not in result or result[key] == value else _tighter(key, result[key], value)
    types = _common_types([node["type"] for node in nodes if "type" in node])
    members = _common_members([enum_members(node) for node in nodes if enum_members(node) is not None])
    if types == [] or members == []:
        return False
    if types is not None:
        result["type"] = types[0] if len(types) == 1 else types
    if members is not None:
        result.pop("const", None)
        result["enum"] = members
    required = list(dict.fromkeys(name for node in nodes for name in _required(node)))
    names = [*(name for node in nodes if isinstance(node.get("properties"), dict) for name in node["properties"]), *required]
    if names:
        result["properties"] = {name: _all_of([_member_schema(node, name) for node in nodes]) for name in dict.fromkeys(names)}
    if required:
        result["required"] = required
    for key in ("additionalProperties", "patternProperties"):  # every writable name is declared now
        result.pop(key, None)
    result.update(_merged_items(nodes))
    return result


def _tighter(key: str, mine: Any, theirs: Any) -> Any:
    """Both values of one keyword as one, where that has a meaning; else the first."""
    if _is_number(mine) and _is_number(theirs):
        if key in _LOWER_BOUNDS:
            return max(mine, theirs)
        if key in _UPPER_BOUNDS:
            return min(mine, theirs)
        if key == "multipleOf":
            return _common_multiple(mine, theirs)
    if key == "propertyNames":
        return _all_of([mine, theirs])
    return mine


def _common_multiple(mine: Any, theirs: Any) -> Any:
    """The least common multiple of two positive rationals (as their decimal texts say)."""
    a, b = Fraction(repr(mine)), Fraction(repr(theirs))
    multiple = Fraction(math.lcm(a.numerator, b.numerator), math.gcd(a.denominator, b.denominator))
    return int(multiple) if multiple.denominator == 1 else float(multiple)


def _common_types(declared: List[Any]) -> Optional[List[str]]:
    """The types every declaration admits; None when none declares any."""
    if not declared:
        return None
    admitted = [_kinds(types) for types in declared]
    common = [kind for kind in admitted[0] if all(kind in kinds for kinds in admitted[1:])]
    return [kind for kind in common if not (kind == "integer" and "number" in common)]


def _kinds(types: Any) -> List[str]:
    """A `type` value as a list, with `integer` wherever `number` is (an integer is a number)."""
    kinds = [types] if isinstance(types, str) else list(types) if isinstance(types, list) else []
    return kinds + ["integer"] if "number" in kinds and "integer" not in kinds else kinds


def _common_members(enums: List[list]) -> Optional[list]:
    if not enums:
        return None
    return [member for member in enums[0] if all(any(same_json(member, other) for other in enum) for enum in enums[1:])]


def _merged_items(nodes: List[dict]) -> Dict[str, Any]:
    """`prefixItems` and `items` of the conjunction, position by position."""
    length = max((len(node["prefixItems"]) for node in nodes if isinstance(node.get("prefixItems"), list)), default=0)
    merged_items: Dict[str, Any] = {}
    if length:
        merged_items["prefixItems"] = [_all_of([_item_schema(node, index) for node in nodes]) for index in range(length)]
    if length or any("items" in node for node in nodes):
        merged_items["items"] = _all_of([_item_schema(node, length) for node in nodes])
    return merged_items


def _item_schema(node: dict, index: int) -> Any:
    prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
    return prefix[index] if index < len(prefix) else node.get("items", True)


def _member_schema(node: dict, name: str) -> Any:
    """What applies to member `name` of an object under `node`: its `properties` entry and the
    `patternProperties` it matches, else `additionalProperties`."""
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    patterns = node.get("patternProperties") if isinstance(node.get("patternProperties"), dict) else {}
    found = [sub for pattern, sub in patterns.items() if pattern_matches(pattern, name)]
    if name in properties:
        found.insert(0, properties[name])
    return _all_of(found) if found else node.get("additionalProperties", True)


def _all_of(schemas: List[Any]) -> Any:
    """The conjunction of `schemas`, written plainly where one or none constrains."""
    kept = _distinct(schemas)
    if any(schema is False for schema in kept):
        return False
    if not kept:
        return True
    return kept[0] if len(kept) == 1 else {"allOf": kept}


def _distinct(parts: List[Any]) -> List[Any]:
    """`parts` without repeats and without those that say nothing (`{}`, `true`)."""
    kept: List[Any] = []
    for part in parts:
        if part is False or isinstance(part, dict) and part and part not in kept:
            kept.append(part)
    return kept


def _required(node: dict) -> List[str]:
    required = node.get("required")
    return [name for name in required if isinstance(name, str)] if isinstance(required, list) else []


def _without(schema: dict, keys: tuple) -> dict:
    return {key: value for key, value in schema.items() if key not in keys}


def _may_be(schema: dict, kind: str) -> bool:
    declared = schema.get("type")
    if isinstance(declared, str):
        return declared == kind
    if isinstance(declared, list):
        return kind in declared
    marker = "properties" if kind == "object" else "items"
    return marker in schema


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
