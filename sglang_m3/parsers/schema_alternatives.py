"""The readings a tool's JSON schema allows for one value, flattened into alternatives.

A schema can say what a value is in many ways at once: `type` (a name or a list), `enum` /
`const`, OpenAPI's `nullable`, `$ref` into `$defs` / `definitions`, and `allOf` / `anyOf` /
`oneOf` nested at will. Typing M3's raw text needs the flat answer: the alternatives, in
schema order, each a conjunction of schema nodes that all apply (`parts`), the one JSON kind
the value is read as (None: untyped, read by content) and the enum members it admits.

- `allOf` multiplies out, `anyOf` / `oneOf` add alternatives (oneOf is read as anyOf: the
  parser types what the model wrote; exclusivity is the client's check);
- a type list or `nullable: true` gives one alternative per kind; types declared by several
  parts intersect (`integer` lies inside `number`); unknown type names say nothing;
- with no declared type the kind is inferred: object keywords make an object, array keywords
  an array, enum members all of one kind that kind.

Cycles: a `$ref` already being expanded for the same value adds no alternative (the least
reading: `A = anyOf[A, integer]` is `integer`, `A = {$ref: A}` has none). Sub-schemas under
`properties` / `items` are expanded only when a child value is read, so recursive schemas
(trees, linked lists) type values of any depth. A schema that multiplies out to more than
`MAX_ALTERNATIVES` keeps the first ones in schema order, and one nested deeper than
`MAX_NESTING` combinators stops adding constraints there.
"""

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

MAX_ALTERNATIVES = 64
MAX_NESTING = 64

KINDS = ("null", "boolean", "integer", "number", "string", "object", "array")
_TYPE_ALIASES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}
_OBJECT_KEYWORDS = ("properties", "patternProperties", "additionalProperties")
_ARRAY_KEYWORDS = ("items", "prefixItems")
NULL_SCHEMA = {"type": "null"}

# Schema nodes that all apply to one value; () says nothing (untyped).
Parts = Tuple[Any, ...]


@dataclass(frozen=True)
class Alternative:
    parts: Parts
    kind: Optional[str]
    members: Optional[tuple]  # the enum / const values admitted, None when unrestricted


class SchemaIndex:
    """Alternatives and sub-schemas of one tool's parameters schema (the root of its `$ref`s)."""

    def __init__(self, root: Any):
        self.root = root
        self._expanded: Dict[Tuple[int, ...], Tuple[Parts, List[Alternative]]] = {}

    def target(self, ref: str) -> Any:
        """The node a local JSON pointer (`#/$defs/Name`) names; None when it names nothing."""
        if ref == "#":
            return self.root
        if not ref.startswith("#/"):
            return None
        node: Any = self.root
        for token in ref[2:].split("/"):
            token = token.replace("~1", "/").replace("~0", "~")
            if isinstance(node, list) and token.isdigit() and int(token) < len(node):
                node = node[int(token)]
            elif isinstance(node, dict) and token in node:
                node = node[token]
            else:
                return None
        return node

    def alternatives(self, parts: Parts) -> List[Alternative]:
        """The alternatives of a conjunction of schema nodes, in schema order."""
        key = tuple(id(part) for part in parts)
        if key not in self._expanded:  # `parts` is kept with the result so its ids stay unique
            terms: List[Parts] = [()]
            for part in parts:
                terms = _product(terms, self._terms(part, frozenset(), 0))
            found = [alternative for term in terms for alternative in _by_kind(term)]
            self._expanded[key] = (parts, found[:MAX_ALTERNATIVES])
        return self._expanded[key][1]

    def _terms(self, node: Any, expanding: frozenset, nesting: int) -> List[Parts]:
        """`node` in disjunctive normal form: conjunctions of nodes, one per alternative."""
        if node is False:
            return []
        if not isinstance(node, dict) or nesting > MAX_NESTING:
            return [()]
        terms: List[Parts] = [(node,)]
        ref = node.get("$ref")
        if isinstance(ref, str):
            if ref in expanding:
                return []
            terms = _product(terms, self._terms(self.target(ref), expanding | {ref}, nesting + 1))
        all_of = node.get("allOf")
        for part in all_of if isinstance(all_of, list) else ():
            terms = _product(terms, self._terms(part, expanding, nesting + 1))
        for keyword in ("anyOf", "oneOf"):
            branches = node.get(keyword)
            if isinstance(branches, list) and branches:
                union = [term for branch in branches for term in self._terms(branch, expanding, nesting + 1)]
                terms = _product(terms, union[:MAX_ALTERNATIVES])
        if node.get("nullable") is True:
            terms = [(NULL_SCHEMA,), *terms]
        return terms[:MAX_ALTERNATIVES]


def _product(left: List[Parts], right: List[Parts]) -> List[Parts]:
    return [a + b for a in left for b in right][:MAX_ALTERNATIVES]


def declared_kinds(node: Any) -> Optional[List[str]]:
    """The known kinds a node's `type` names, in its order; None when it names none."""
    declared = node.get("type") if isinstance(node, dict) else None
    if isinstance(declared, str):
        declared = [declared]
    if not isinstance(declared, list):
        return None
    kinds: List[str] = []
    for name in declared:
        if isinstance(name, str):
            kind = _TYPE_ALIASES.get(name.lower(), name.lower())
            if kind in KINDS and kind not in kinds:
                kinds.append(kind)
    return kinds or None


def enum_members(node: Any) -> Optional[list]:
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return [node["const"]]
    members = node.get("enum")
    return members if isinstance(members, list) else None


# bool before int: a JSON boolean is a Python int.
_KIND_OF_CLASS = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (dict, "object"), (list, "array"))


def kind_of(value: Any) -> Optional[str]:
    if value is None:
        return "null"
    return next((kind for cls, kind in _KIND_OF_CLASS if isinstance(value, cls)), None)


def is_kind(value: Any, kind: str) -> bool:
    """JSON Schema's type test: integers are numbers, integral numbers are integers."""
    actual = kind_of(value)
    if kind == "number":
        return actual in ("integer", "number")
    if kind == "integer" and actual == "number":
        return value.is_integer()
    return actual == kind


def same_json(left: Any, right: Any) -> bool:
    """JSON equality: 1 and 1.0 are equal, `true` and 1 are not."""
    if isinstance(left, bool) or isinstance(right, bool):
        return type(left) is type(right) and left == right
    if isinstance(left, dict) and isinstance(right, dict):
        return left.keys() == right.keys() and all(same_json(left[key], right[key]) for key in left)
    if isinstance(left, list) and isinstance(right, list):
        return len(left) == len(right) and all(same_json(a, b) for a, b in zip(left, right))
    kinds = {kind_of(left), kind_of(right)}
    return (len(kinds) == 1 or kinds == {"integer", "number"}) and left == right


def _intersect(kinds: List[str], others: List[str]) -> List[str]:
    def admitted(kind: str, pool: List[str]) -> bool:
        return kind in pool or kind == "integer" and "number" in pool

    narrowed = [kind for kind in kinds if admitted(kind, others)]
    if "number" in kinds and "integer" in others and "integer" not in narrowed:
        narrowed.append("integer")
    return narrowed


def _by_kind(term: Parts) -> List[Alternative]:
    """One alternative per kind the conjunction admits; none when it admits nothing."""
    members: Optional[list] = None
    for part in term:
        own = enum_members(part)
        if own is not None:
            members = own if members is None else [m for m in members if any(same_json(m, o) for o in own)]
    kinds: Optional[List[str]] = None
    for part in term:
        own_kinds = declared_kinds(part)
        if own_kinds is not None:
            kinds = own_kinds if kinds is None else _intersect(kinds, own_kinds)
    if kinds is None:
        kinds = [_inferred_kind(term, members)]
    alternatives = []
    for kind in kinds:
        admitted = None if members is None else tuple(m for m in members if kind is None or is_kind(m, kind))
        if admitted != ():
            alternatives.append(Alternative(term, kind, admitted))
    return alternatives


def _inferred_kind(term: Parts, members: Optional[list]) -> Optional[str]:
    if any(keyword in part for part in term if isinstance(part, dict) for keyword in _OBJECT_KEYWORDS):
        return "object"
    if any(keyword in part for part in term if isinstance(part, dict) for keyword in _ARRAY_KEYWORDS):
        return "array"
    member_kinds = {kind_of(member) for member in members or ()}
    return member_kinds.pop() if len(member_kinds) == 1 else None


def property_parts(parts: Parts, key: str) -> Parts:
    """What the parts say of the member `key`: `properties`, else matching
    `patternProperties`, else a schema-valued `additionalProperties`, from every part."""
    found: List[Any] = []
    for part in parts:
        if not isinstance(part, dict):
            continue
        properties = part.get("properties")
        if isinstance(properties, dict) and key in properties:
            found.append(properties[key])
            continue
        patterns = part.get("patternProperties")
        matched = [sub for pattern, sub in patterns.items() if pattern_matches(pattern, key)] if isinstance(patterns, dict) else []
        if matched:
            found.extend(matched)
        elif isinstance(part.get("additionalProperties"), dict):
            found.append(part["additionalProperties"])
    return tuple(found)


def item_parts(parts: Parts, index: int) -> Parts:
    """What the parts say of array element `index`: `prefixItems` (or draft-4 tuple `items`),
    then `items` / `additionalItems` for the elements after them."""
    found: List[Any] = []
    for part in parts:
        if not isinstance(part, dict):
            continue
        prefix = part.get("prefixItems")
        items = part.get("items")
        rest = items
        if isinstance(items, list):
            prefix, rest = items, part.get("additionalItems")
        if isinstance(prefix, list) and index < len(prefix):
            found.append(prefix[index])
        elif isinstance(rest, dict):
            found.append(rest)
    return tuple(found)


def pattern_matches(pattern: Any, key: str) -> bool:
    """`patternProperties` semantics (an unanchored search over a member name, a short tag);
    a pattern Python cannot compile matches nothing rather than failing the call."""
    try:
        return isinstance(pattern, str) and re.search(pattern, key) is not None
    except re.error:
        return False
