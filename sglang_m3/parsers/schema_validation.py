"""Does a JSON value satisfy a schema? Used only to choose between readings of M3 text.

When several schema alternatives can read what the model wrote, the reading that validates
wins (`schema_values`), so a `const` discriminator, `required`, `additionalProperties: false`
or a bound picks the branch the model meant. The check covers the keywords that tell
branches apart: `type`, `enum` / `const`, `nullable`, `$ref`, `allOf` / `anyOf` / `oneOf`
(read as anyOf, as in `schema_alternatives`) / `not`, numeric bounds, string and array
lengths, `items` / `prefixItems`, `required`, `properties`, `patternProperties`,
`additionalProperties` and property counts.

Deliberately left out: `pattern` and `format`. Every text is a string whatever its pattern,
so they never change a reading, and running a request's regular expression over model output
in the server process invites catastrophic backtracking. `check_patterns` adds `pattern` for
values the client wrote itself (`schema_narrowing` checks the property names it declares).

A `$ref` cycle that returns to the same value without descending (`A = anyOf[A, integer]`)
adds nothing that holds, matching the least reading `schema_alternatives` gives it.
"""

from typing import Any, Dict, Tuple

from sglang_m3.parsers.schema_alternatives import (
    SchemaIndex,
    declared_kinds,
    enum_members,
    is_kind,
    item_parts,
    kind_of,
    pattern_matches,
    same_json,
)


class SchemaValidator:
    def __init__(self, index: SchemaIndex, check_patterns: bool = False):
        self._index = index
        self._check_patterns = check_patterns
        # (id(value), id(schema), refs) -> (value, schema, verdict): the objects are held so
        # their ids stay unique while the memo lives (one tool call).
        self._memo: Dict[Tuple[int, int, frozenset], Tuple[Any, Any, bool]] = {}

    def validates(self, value: Any, schema: Any) -> bool:
        return self._check(value, schema, frozenset())

    def _check(self, value: Any, schema: Any, following: frozenset) -> bool:
        if schema is False:
            return False
        if not isinstance(schema, dict):
            return True
        key = (id(value), id(schema), following)
        if key not in self._memo:
            self._memo[key] = (value, schema, self._uncached(value, schema, following))
        return self._memo[key][2]

    def _uncached(self, value: Any, schema: dict, following: frozenset) -> bool:
        if value is None and schema.get("nullable") is True:
            return True
        ref = schema.get("$ref")
        if isinstance(ref, str):
            if ref in following:
                return False
            target = self._index.target(ref)
            if not self._check(value, target, following | {ref}):
                return False
        kinds = declared_kinds(schema)
        if kinds is not None and not any(is_kind(value, kind) for kind in kinds):
            return False
        members = enum_members(schema)
        if members is not None and not any(same_json(value, member) for member in members):
            return False
        if not self._combinators(value, schema, following):
            return False
        kind = kind_of(value)
        if kind in ("integer", "number"):
            return _within_bounds(value, schema)
        if kind == "string":
            pattern = schema.get("pattern") if self._check_patterns else None
            if pattern is not None and not pattern_matches(pattern, value):
                return False
            return _length_within(len(value), schema, "minLength", "maxLength")
        if kind == "array":
            return self._array(value, schema)
        if kind == "object":
            return self._object(value, schema)
        return True

    def _combinators(self, value: Any, schema: dict, following: frozenset) -> bool:
        all_of = schema.get("allOf")
        if isinstance(all_of, list) and not all(self._check(value, part, following) for part in all_of):
            return False
        for keyword in ("anyOf", "oneOf"):
            branches = schema.get(keyword)
            if isinstance(branches, list) and branches:
                if not any(self._check(value, branch, following) for branch in branches):
                    return False
        negated = schema.get("not")
        return not (isinstance(negated, (dict, bool)) and self._check(value, negated, following))

    def _array(self, value: list, schema: dict) -> bool:
        if not _length_within(len(value), schema, "minItems", "maxItems"):
            return False
        return all(
            self._check(element, sub, frozenset())
            for index, element in enumerate(value)
            for sub in item_parts((schema,), index)
        )

    def _object(self, value: dict, schema: dict) -> bool:
        if not _length_within(len(value), schema, "minProperties", "maxProperties"):
            return False
        required = schema.get("required")
        if isinstance(required, list) and not all(name in value for name in required if isinstance(name, str)):
            return False
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        patterns = schema.get("patternProperties") if isinstance(schema.get("patternProperties"), dict) else {}
        extra = schema.get("additionalProperties")
        for name, member in value.items():
            subs = [sub for pattern, sub in patterns.items() if pattern_matches(pattern, name)]
            if name in properties:
                subs.append(properties[name])
            elif not subs and extra is not None:
                subs.append(extra)
            if not all(self._check(member, sub, frozenset()) for sub in subs):
                return False
        return True


def _number(bound: Any) -> bool:
    return isinstance(bound, (int, float)) and not isinstance(bound, bool)


def _within_bounds(value: Any, schema: dict) -> bool:
    """`minimum` / `maximum`, and `exclusiveMinimum` / `exclusiveMaximum` both as numbers
    (draft 6 on) and as draft 4's booleans qualifying the inclusive bound."""
    low, high = schema.get("minimum"), schema.get("maximum")
    if _number(low) and (value < low or schema.get("exclusiveMinimum") is True and value == low):
        return False
    if _number(high) and (value > high or schema.get("exclusiveMaximum") is True and value == high):
        return False
    exclusive_low, exclusive_high = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if _number(exclusive_low) and value <= exclusive_low:
        return False
    return not (_number(exclusive_high) and value >= exclusive_high)


def _length_within(length: int, schema: dict, low_keyword: str, high_keyword: str) -> bool:
    low, high = schema.get(low_keyword), schema.get(high_keyword)
    return not (_number(low) and length < low or _number(high) and length > high)
