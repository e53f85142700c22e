"""A tool's JSON schema narrowed to what XGrammar's `minimax_m3_xml` style compiles and enforces.

M3's argument XML cannot be written without a schema to follow, so every tool is constrained by
a *narrowed* copy of its schema. What XGrammar 0.2.7's M3 converter does with each keyword, and
what the narrowing makes of it (each probed by compiling and sampling; tests/parsers/
test_structural_tag.py holds the regression cases):

Rewritten to an equivalent or a subset (every value accepted also satisfies the original):
- `allOf` (refused as "unconstrained schemas" with two branches or more), `anyOf` / `oneOf`
  with sibling keywords (refused likewise), `$ref` with sibling keywords (siblings ignored),
  `nullable: true`: the schema is multiplied out into alternatives (disjunctive normal form),
  each the conjunction of its parts merged keyword by keyword (types intersected, enums
  intersected, bounds tightened, properties and items merged position by position, `required`
  united), and emitted as one `anyOf` of plain schemas. A bound-only part (`{"minimum": 3}`)
  thus narrows its sibling's type instead of becoming a string. Past `MAX_TERMS` /
  `MAX_ALTERNATIVES` the first alternatives are kept: a subset.
- `$ref`: inlined (a `$ref` into `properties` or with escaped names broke XGrammar's lookup;
  an unresolvable one says nothing); a recursive one becomes a generated `$defs` entry.
- `if` / `then` / `else` (ignored by XGrammar): `anyOf[if ∧ then, then ∧ else]`; both branches
  satisfy the conditional whatever `if` says of the value.
- `dependentRequired` / `dependentSchemas` / draft-7 `dependencies` (ignored): exactly
  `anyOf[trigger absent, trigger present ∧ its requirement]`.
- `propertyNames` (refused): closed objects take only declared names, so names it refuses
  are removed from the object.
- untyped schemas: `{}`, `true`, a bare `{"type": "object"}` and `additionalProperties`
  schemas were refused. Untyped values become strings (numbers where only numeric keywords
  are given); objects take only their declared properties, a required but undeclared one
  typed by `additionalProperties` / `patternProperties` / `unevaluatedProperties`; arrays
  without item schemas hold strings; `false` properties and items are left out.
- draft-4 tuple `items` (refused) becomes `prefixItems`; draft-4 boolean `exclusiveMinimum`
  / `exclusiveMaximum` (refused) the numeric form.
- `enum` / `const`: members outside the declared type, or failing the schema's other keywords
  (as `schema_validation` checks them), are removed; a member holding the namespace marker
  (refused) cannot be written and goes; scalars are given as the text the parser matches
  (XGrammar wrote `1e10` as `10000000000`, `-0.0` as `-0`, which then read as strings).
  Booleans and null are treated as enums of their values, so `not` and `if` on them hold.
- integers: fractional bounds (refused) are rounded inwards, bounds beyond int64 (refused)
  clamped, `multipleOf` p/q becomes p; with a bound (XGrammar drops `multipleOf` beside a
  range: "not yet supported") it becomes the enum of the `MAX_MULTIPLES` multiples in range
  nearest 0, a subset. `number` with `multipleOf` (ignored) becomes an
  integer multiple of p: a subset. `minimum > maximum` (refused) is impossible anyway.
- `contains` (ignored): the first `minContains` (default 1) items must satisfy it.
- `minProperties` beyond the declared properties of a closed object (refused): all declared
  properties become required and the bound goes (the one relaxation here besides those
  below, only where the original needed undeclared properties).
- `not` of types only: those types are taken away (where some remain).

Kept, as XGrammar enforces them: `type` (one or a list), `properties`, `required`,
`minItems` / `maxItems`, `minProperties` / `maxProperties`, `minimum` / `maximum` /
`exclusive*` (number and integer), integer `multipleOf`, `anyOf`, `enum`, `description`,
`title`.

Dropped, with the relaxation documented (no subset XGrammar compiles keeps them useful):
- `pattern`, `format`, `minLength`, `maxLength`: a string runs up to the next namespace
  marker and XGrammar cannot combine that exclusion with them (its C++ check fails the
  request); SGLang's own XML templates drop length bounds too;
- `uniqueItems`: XGrammar ignores it, and the only subset form (`maxItems: 1`) would cripple
  every list argument; a call may repeat an item;
- `oneOf` exclusivity: read as `anyOf` (as XGrammar and the parser do); a value may match two
  overlapping branches;
- `not` other than of types (values cannot be excluded from a grammar this way), `maxContains`;
- keywords inside an `if` that are themselves relaxed.
Annotations (`examples`, `default`, `$schema`, ...) say nothing and are left out.

A schema with no value at all never comes from a satisfiable one; at the root (the arguments
object) it is constrained to an empty object, so the request still runs.
"""

import json
import math
from fractions import Fraction
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from sglang_m3.parsers.m3_format import NAMESPACE
from sglang_m3.parsers.schema_alternatives import SchemaIndex, declared_kinds, enum_members, is_kind, pattern_matches, same_json
from sglang_m3.parsers.schema_validation import SchemaValidator
from sglang_m3.parsers.schema_values import render_scalar

MAX_TERMS = 64  # conjunctions multiplied out per schema node
MAX_ALTERNATIVES = 16  # plain schemas kept per node
INT_LIMIT = 10**18  # XGrammar refuses integer bounds beyond int64
MAX_MULTIPLES = 256  # bounded `multipleOf` is given as the multiples nearest 0
UNTYPED = {"type": "string"}
EMPTY_OBJECT = {"type": "object", "properties": {}, "additionalProperties": False}
_ANNOTATIONS = ("description", "title")
_NUMERIC_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_OBJECT_KEYS = ("properties", "required", "additionalProperties", "patternProperties", "minProperties", "maxProperties")
_ARRAY_KEYS = ("items", "prefixItems", "minItems", "maxItems", "contains")
_TYPE_ONLY_KEYS = {"type", "$comment", *_ANNOTATIONS}

Term = Tuple[dict, ...]  # schema nodes that all apply to one value


def narrowed_schema(schema: Any) -> Dict[str, Any]:
    """A schema XGrammar's `minimax_m3_xml` style compiles for the arguments object of a tool,
    accepting a subset of `schema` less the relaxations of the module docstring."""
    narrower = _Narrower(schema)
    root = narrower.narrow({"allOf": [schema, {"type": "object"}]}) or EMPTY_OBJECT
    if narrower.defs:
        root = {**root, "$defs": narrower.defs}
    return root


class _Narrower:
    """Narrows the nodes of one schema; recursive `$ref` cycles become `$defs` entries."""

    def __init__(self, root: Any):
        self._index = SchemaIndex(root)
        self._validator = SchemaValidator(self._index)
        self.defs: Dict[str, Any] = {}
        self._names: Dict[str, str] = {}  # node key -> $defs name, for nodes met inside themselves
        self._done: Dict[str, Optional[dict]] = {}
        self._active: Set[str] = set()
        self._unguarded: Set[str] = set()  # active without an object / array level since

    def narrow(self, node: Any) -> Optional[dict]:
        """The narrowed node; None when it (or the subset kept of it) admits no value."""
        text = json.dumps(node, sort_keys=True, default=repr)
        if '"$ref"' not in text:
            return self._alternatives(node)
        if text in self._done:
            return self._done[text]
        if text in self._active:  # a cycle: through a property or item, else the least reading
            if text in self._unguarded:
                return None
            name = self._names.setdefault(text, f"m3_{len(self._names)}")
            return {"$ref": f"#/$defs/{name}"}
        self._active.add(text)
        self._unguarded.add(text)
        try:
            result = self._alternatives(node)
        finally:
            self._active.discard(text)
            self._unguarded.discard(text)
        if text in self._names:
            # Only an impossible cycle (a required self-reference) narrows to None; any
            # compilable schema serves its references.
            self.defs[self._names[text]] = result or {"type": "null"}
        self._done[text] = result
        return result

    def descend(self, subs: Sequence[Any]) -> Optional[dict]:
        """A property's or item's schema: the conjunction of `subs` (none: untyped)."""
        saved, self._unguarded = self._unguarded, set()
        try:
            return self.narrow(subs[0] if len(subs) == 1 else {"allOf": list(subs)})
        finally:
            self._unguarded = saved

    def _alternatives(self, node: Any) -> Optional[dict]:
        found: List[dict] = []
        for term in self._terms(node, frozenset()):
            narrowed = _PlainNarrowing(self, term).narrowed()
            for alternative in (narrowed or {}).get("anyOf", [narrowed] if narrowed else []):
                if alternative not in found:
                    found.append(alternative)
            if len(found) >= MAX_ALTERNATIVES:
                break
        if not found:
            return None
        return found[0] if len(found) == 1 else {"anyOf": found[:MAX_ALTERNATIVES]}

    def _terms(self, node: Any, expanding: frozenset) -> List[Term]:
        """`node` in disjunctive normal form (see `schema_alternatives`, which reads the
        parser's side the same way), with the rewrites of the module docstring."""
        if node is False:
            return []
        if not isinstance(node, dict):
            return [()]
        terms: List[Term] = [(node,)]
        ref = node.get("$ref")
        if isinstance(ref, str) and self._index.target(ref) is not None:
            if ref in expanding:
                return []
            terms = _product(terms, self._terms(self._index.target(ref), expanding | {ref}))
        for part in node.get("allOf") if isinstance(node.get("allOf"), list) else ():
            terms = _product(terms, self._terms(part, expanding))
        for keyword in ("anyOf", "oneOf"):
            if isinstance(node.get(keyword), list) and node[keyword]:
                terms = _product(terms, [t for branch in node[keyword] for t in self._terms(branch, expanding)])
        for alternatives in _conditional_alternatives(node):
            terms = _product(terms, [t for branch in alternatives for t in self._terms(branch, expanding)])
        if node.get("nullable") is True:
            terms = [({"type": "null"},), *terms]
        return terms[:MAX_TERMS]

    def admits(self, value: Any, term: Term) -> bool:
        return all(self._validator.validates(value, part) for part in term) and _multiple_of_all(value, term)


def _product(left: List[Term], right: List[Term]) -> List[Term]:
    return [a + tuple(p for p in b if not any(p is q for q in a)) for a in left for b in right][:MAX_TERMS]


def _conditional_alternatives(node: dict) -> Iterable[List[Any]]:
    """The disjunctions that `if`/`then`/`else` and the dependency keywords amount to."""
    if "if" in node:
        then, otherwise = node.get("then", True), node.get("else", True)
        yield [{"allOf": [node["if"], then]}, {"allOf": [then, otherwise]}]
    dependencies = {}
    for keyword in ("dependencies", "dependentRequired", "dependentSchemas"):
        if isinstance(node.get(keyword), dict):
            dependencies.update(node[keyword])
    for trigger, needs in dependencies.items():
        present = {"required": [trigger, *needs]} if isinstance(needs, list) else {"allOf": [{"required": [trigger]}, needs]}
        yield [present, {"properties": {trigger: False}}]


def _multiple_of_all(value: Any, term: Term) -> bool:
    if not is_kind(value, "number") or isinstance(value, bool):
        return True
    return all(_is_multiple(value, step) for step in _values(term, "multipleOf") if _positive(step))


def _is_multiple(value: Any, step: Any) -> bool:
    return (_exact(value) / _exact(step)).denominator == 1


def _exact(number: Any) -> Fraction:
    return Fraction(repr(number)) if isinstance(number, float) else Fraction(number)


def _positive(number: Any) -> bool:
    return _is_number(number) and number > 0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _values(term: Term, key: str) -> List[Any]:
    return [part[key] for part in term if key in part]


def writable_name(name: str) -> bool:
    """An element name XGrammar's M3 style can write (it refuses others)."""
    return bool(name) and not name.startswith("/") and ">" not in name


def m3_literal(value: Any) -> Any:
    """An enum member as given to XGrammar: scalars as the text the parser matches them by."""
    rendered = render_scalar(value)
    return value if rendered is None else rendered


def _writable_value(value: Any) -> bool:
    if isinstance(value, str):
        return NAMESPACE not in value
    if isinstance(value, dict):
        return all(writable_name(k) and _writable_value(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_writable_value(v) for v in value)
    return not isinstance(value, float) or math.isfinite(value)


class _PlainNarrowing:
    """One conjunction of schema nodes, merged keyword by keyword into plain schemas."""

    def __init__(self, narrower: _Narrower, term: Term):
        self.narrower, self.term = narrower, term
        self.annotations = {key: v for key in _ANNOTATIONS for v in _values(term, key)[:1] if isinstance(v, str)}

    def narrowed(self) -> Optional[dict]:
        kinds = self._kinds()
        members = self._members(kinds)
        if members is not None:
            return {"enum": [m3_literal(m) for m in members], **self.annotations} if members else None
        emitters = {"string": self._string, "integer": self._integer, "number": self._number, "boolean": self._finite,
                    "null": self._finite, "object": self._object, "array": self._array}
        found = [schema for kind in kinds for schema in [emitters[kind](kind)] if schema is not None]
        if not found:
            return None
        return found[0] if len(found) == 1 else {"anyOf": found}

    # ---- kinds and enums ----------------------------------------------------------------

    def _kinds(self) -> List[str]:
        kinds: Optional[List[str]] = None
        for part in self.term:
            own = declared_kinds(part)
            if own is not None:
                kinds = own if kinds is None else _intersect(kinds, own)
        negated = self._negated_kinds()
        if kinds is None:
            inferred = self._inferred_kind()
            # Untyped and not a string: the first other kind the `not` leaves.
            fallbacks = ("number", "boolean", "null", "object", "array") if inferred == "string" else ()
            kinds = [next((kind for kind in (inferred, *fallbacks) if kind not in negated), inferred)]
        if "number" in kinds and "integer" in kinds:
            kinds.remove("integer")
        remaining = [kind for kind in kinds if kind not in negated]
        return remaining or kinds  # `not` that would leave nothing is relaxed, not made impossible

    def _inferred_kind(self) -> str:
        members = self._enum()
        member_kinds = {"number" if is_kind(m, "number") else next(k for k in ("null", "boolean", "string", "object", "array") if is_kind(m, k)) for m in members or ()}
        if len(member_kinds) == 1:
            return member_kinds.pop()
        if members is not None:
            return "any"
        for kind, keys in (("object", _OBJECT_KEYS), ("array", _ARRAY_KEYS), ("number", _NUMERIC_KEYS)):
            if any(key in part for part in self.term for key in keys):
                return kind
        return "string"

    def _negated_kinds(self) -> Set[str]:
        negated: Set[str] = set()
        for negation in _values(self.term, "not"):
            if isinstance(negation, dict) and set(negation) <= _TYPE_ONLY_KEYS and declared_kinds(negation):
                negated.update(declared_kinds(negation))
                if "number" in negated:
                    negated.add("integer")
        return negated

    def _enum(self) -> Optional[list]:
        members: Optional[list] = None
        for part in self.term:
            own = enum_members(part)
            if own is not None:
                members = list(own) if members is None else [m for m in members if any(same_json(m, o) for o in own)]
        return members

    def _members(self, kinds: List[str]) -> Optional[list]:
        """The enum members admitted (None: no enum). Booleans and null alone are enums of
        their values, so `not` / `if` on them hold exactly."""
        members = self._enum()
        if members is None and set(kinds) <= {"boolean", "null"}:
            members = [value for kind, values in (("boolean", [False, True]), ("null", [None])) if kind in kinds for value in values]
            admitted = [m for m in members if self.narrower.admits(m, self.term)]
            return None if len(admitted) == len(members) else admitted
        if members is None:
            return None
        kept: list = []
        for member in members:
            if (kinds == ["any"] or any(is_kind(member, k) for k in kinds)) and _writable_value(member) \
                    and self.narrower.admits(member, self.term) and m3_literal(member) not in map(m3_literal, kept):
                kept.append(member)
        return kept

    # ---- scalars --------------------------------------------------------------------------

    def _string(self, kind: str) -> dict:
        return {"type": "string", **self.annotations}

    def _finite(self, kind: str) -> dict:
        return {"type": kind, **self.annotations}

    def _bounds(self) -> Tuple[Optional[Tuple[Any, bool]], Optional[Tuple[Any, bool]]]:
        """The tightest (value, exclusive) lower and upper bounds of the term."""
        low = high = None
        for part in self.term:
            for key, draft4, sign in (("minimum", "exclusiveMinimum", 1), ("maximum", "exclusiveMaximum", -1)):
                candidates = []
                if _is_number(part.get(key)):
                    candidates.append((part[key], part.get(draft4) is True))
                if _is_number(part.get(draft4)):
                    candidates.append((part[draft4], True))
                for bound in candidates:
                    current = low if sign == 1 else high
                    if current is None or sign * bound[0] > sign * current[0] or (bound[0] == current[0] and bound[1]):
                        if sign == 1:
                            low = bound
                        else:
                            high = bound
        return low, high

    def _number(self, kind: str) -> Optional[dict]:
        if any(_positive(step) for step in _values(self.term, "multipleOf")):
            return self._integer("integer")  # multiples of p/q that are integers: a subset
        low, high = self._bounds()
        if low and high and (low[0] > high[0] or low[0] == high[0] and (low[1] or high[1])):
            return None
        schema = {"type": "number"}
        for bound, inclusive, exclusive in ((low, "minimum", "exclusiveMinimum"), (high, "maximum", "exclusiveMaximum")):
            if bound:
                schema[exclusive if bound[1] else inclusive] = bound[0]
        return {**schema, **self.annotations}

    def _integer(self, kind: str) -> Optional[dict]:
        low, high = self._bounds()
        lowest = None if low is None else math.floor(_exact(low[0])) + 1 if low[1] else math.ceil(_exact(low[0]))
        highest = None if high is None else math.ceil(_exact(high[0])) - 1 if high[1] else math.floor(_exact(high[0]))
        step = 1
        for multiple in _values(self.term, "multipleOf"):
            if _positive(multiple):
                numerator = _exact(multiple).numerator
                step = step * numerator // math.gcd(step, numerator)
        if lowest is not None:
            lowest = -(-lowest // step) * step
        if highest is not None:
            highest = highest // step * step
        if lowest is not None and highest is not None and lowest > highest:
            return None
        if lowest is not None and lowest > INT_LIMIT or highest is not None and highest < -INT_LIMIT:
            return {"enum": [m3_literal(lowest if lowest is not None else highest)], **self.annotations}
        if step > 1 and (lowest is not None or highest is not None):
            return {"enum": _multiples_near_zero(lowest, highest, step), **self.annotations}
        schema: Dict[str, Any] = {"type": "integer"}  # bounds clamped into int64: a subset
        if lowest is not None:
            schema["minimum"] = max(lowest, -(INT_LIMIT // step) * step)
        if highest is not None:
            schema["maximum"] = min(highest, INT_LIMIT // step * step)
        if step > 1:
            schema["multipleOf"] = step
        return {**schema, **self.annotations}

    # ---- objects --------------------------------------------------------------------------

    def _object(self, kind: str) -> Optional[dict]:
        required = [name for part in self.term for name in part.get("required") or [] if isinstance(name, str)]
        required = list(dict.fromkeys(required))
        declared = [name for part in self.term if isinstance(part.get("properties"), dict) for name in part["properties"]]
        properties: Dict[str, Any] = {}
        for name in dict.fromkeys(declared + required):
            narrowed = self._property(name)
            if narrowed is not None:
                properties[name] = narrowed
            elif name in required and writable_name(name):
                return None
        required = [name for name in required if name in properties]  # unwritable names: relaxed
        low = max([0, *[n for n in _values(self.term, "minProperties") if _is_number(n)]])
        highs = [n for n in _values(self.term, "maxProperties") if _is_number(n)]
        if highs and min(highs) < max(len(required), low):
            return None
        schema: Dict[str, Any] = {"type": "object", "properties": properties}
        if low > len(properties):
            required = list(properties)  # closed objects cannot reach it: see the docstring
        elif low > len(required):
            schema["minProperties"] = low
        if highs and min(highs) < len(properties):
            schema["maxProperties"] = min(highs)
        if required:
            schema["required"] = required
        return {**schema, "additionalProperties": False, **self.annotations}

    def _property(self, name: str) -> Optional[dict]:
        """The narrowed schema of member `name`; None when it may not be written."""
        if not writable_name(name) or not all(self._name_admitted(name, names) for names in _values(self.term, "propertyNames")):
            return None
        subs: List[Any] = []
        declared = False
        for part in self.term:
            own = _declared_member(part, name)
            declared = declared or own is not None
            subs.extend(own if own is not None else _undeclared_member(part, "additionalProperties"))
        if not declared:
            for part in self.term:
                subs.extend(_undeclared_member(part, "unevaluatedProperties"))
        if any(sub is False for sub in subs):
            return None
        return self.narrower.descend(subs)

    def _name_admitted(self, name: str, names: Any) -> bool:
        """`propertyNames`: its keywords as the validator checks them, and its `pattern`
        (a declared name, short: the client's own pattern over its own names)."""
        pattern = names.get("pattern") if isinstance(names, dict) else None
        return self.narrower.admits(name, (names,)) and (not isinstance(pattern, str) or pattern_matches(pattern, name))

    # ---- arrays ---------------------------------------------------------------------------

    def _array(self, kind: str) -> Optional[dict]:
        lows = [n for n in _values(self.term, "minItems") if _is_number(n)]
        highs = [n for n in _values(self.term, "maxItems") if _is_number(n)]
        low, high = max([0, *lows]), min(highs) if highs else None
        contains = [c for c in _values(self.term, "contains") if c is not True]
        needed = max([1, *[n for n in _values(self.term, "minContains") if _is_number(n)]]) if contains else 0
        if contains and any(n == 0 for n in _values(self.term, "minContains")):
            contains, needed = [], 0
        low = max(low, needed)
        positions = max([needed, *[len(_tuple(part)[0]) for part in self.term]])
        prefix: List[dict] = []
        for index in range(positions):
            subs = [_item(part, index) for part in self.term] + (contains if index < needed else [])
            narrowed = None if any(sub is False for sub in subs) else self.narrower.descend([s for s in subs if s is not None])
            if narrowed is None:
                high = index if high is None else min(high, index)
                break
            prefix.append(narrowed)
        rest_subs = [_tuple(part)[1] for part in self.term]
        rest = None if any(sub is False for sub in rest_subs) else self.narrower.descend([s for s in rest_subs if s is not None])
        if rest is None:
            high = len(prefix) if high is None else min(high, len(prefix))
        if high is not None and low > high:
            return None
        schema: Dict[str, Any] = {"type": "array"}
        if prefix:
            schema["prefixItems"] = prefix
        schema["items"] = rest if rest is not None else False if prefix else UNTYPED
        if low:
            schema["minItems"] = low
        if high is not None:
            schema["maxItems"] = high
        return {**schema, **self.annotations}


def _multiples_near_zero(lowest: Optional[int], highest: Optional[int], step: int) -> List[str]:
    """Up to `MAX_MULTIPLES` multiples of `step` within the bounds, those nearest 0 first."""
    low = -INT_LIMIT if lowest is None else lowest
    high = INT_LIMIT if highest is None else highest
    center = -(-min(max(0, low), high) // step) * step
    found: List[int] = []
    for offset in range(MAX_MULTIPLES):
        for value in (center + offset * step, center - (offset + 1) * step):
            if low <= value <= high and len(found) < MAX_MULTIPLES:
                found.append(value)
    return [m3_literal(value) for value in sorted(found)]


def _tuple(part: dict) -> Tuple[list, Any]:
    """(the per-position item schemas, the schema of the items after them) of one node."""
    items = part.get("items")
    if isinstance(items, list):  # draft 4
        return items, part.get("additionalItems")
    prefix = part.get("prefixItems")
    return (prefix if isinstance(prefix, list) else []), items


def _item(part: dict, index: int) -> Any:
    prefix, rest = _tuple(part)
    return prefix[index] if index < len(prefix) else rest


def _declared_member(part: dict, name: str) -> Optional[list]:
    """What `properties` / `patternProperties` of one node say of member `name`."""
    properties = part.get("properties")
    patterns = part.get("patternProperties")
    found = [sub for pattern, sub in patterns.items() if pattern_matches(pattern, name)] if isinstance(patterns, dict) else []
    if isinstance(properties, dict) and name in properties:
        found.append(properties[name])
    return found or None


def _undeclared_member(part: dict, keyword: str) -> list:
    extra = part.get(keyword)
    return [extra] if extra is False or isinstance(extra, dict) else []


def _intersect(kinds: List[str], others: List[str]) -> List[str]:
    narrowed = [kind for kind in kinds if kind in others or kind == "integer" and "number" in others]
    if "number" in kinds and "integer" in others and "integer" not in narrowed:
        narrowed.append("integer")
    return narrowed
