"""Turn parsed M3 argument elements into JSON values, typed by the tool's JSON schema.

M3 writes every scalar as raw text, so the schema decides what the text means. The schema is
first flattened into alternatives of one kind each (`schema_alternatives`: type lists,
`nullable`, `$ref`, `allOf` / `anyOf` / `oneOf`, at the root as anywhere else); each
alternative then reads the element:
- `string`: the text verbatim (whitespace included);
- `integer` / `number` / `boolean` / `null`: JSON literals (surrounding whitespace ignored);
  `null` also reads blank text, but only where no string may be meant (see below);
- `object`: child elements by name, typed by `properties`, `patternProperties`,
  `additionalProperties`; `array`: repeated `<item>` elements, typed by `prefixItems` /
  `items`; either may also be inline JSON text;
- `enum` / `const`: the member whose rendering equals the text;
- untyped (missing, `{}`, a bare `true`): by content. JSON literals become numbers, booleans,
  null, objects or arrays; anything else stays a string; children all named `item` form an
  array, other children an object.

Ties: when several alternatives can read an element, the reading kept is
1. one that validates against its alternative (`schema_validation`), so discriminators,
   `required`, `additionalProperties: false` and bounds pick the branch the model meant;
2. then the most specific kind: null, boolean, integer, number, object, array, untyped,
   string last, so `5` under `anyOf: [string, integer]` is the integer 5 whatever the listed
   order, and text stays a string only where nothing more specific reads it (a parameter that
   can only be a string always stays one);
3. then the first in schema order.

Repeated elements: children of an object that share a name become one JSON array under that
name (`<tag>a</tag><tag>b</tag>` -> `{"tag": ["a", "b"]}`), typed as an array by the key's
schema; `<item>` remains M3's own array form. Where the key's schema allows no array (a
scalar or an object), the call is kept all the same and the key holds the array of its values,
each read by that schema: like any value the schema rejects, it reaches the client as the
model wrote it, with a debug log line.

A value no alternative reads (say `five` for an integer) is kept as the verbatim string rather
than dropped: the client sees exactly what the model wrote. That includes number-like text that
JSON cannot carry: digits other than ASCII ones (`2０２4`, `1٢`), numbers beyond a double
(`1e400`: JSON has no infinity) and integers past Python's conversion limit.

Blank text: the chat template writes None as `null`, a string as its text and an empty array or
object as an empty element, so blank text is never a rendered None. Where the schema allows a
string (a `string` or untyped alternative), an array or an object, it is that string (`""` or
`"  "`) or the empty container (`Optional[list]` is Pydantic's `anyOf: [array, null]`), and no
null reading is tried; elsewhere (`[integer, null]`) it still reads as null.
"""

import json
import logging
import math
import re
from typing import Any, Callable, Dict, List, NoReturn, Sequence, Tuple

from sglang_m3.parsers.m3_format import ARRAY_ITEM_TAG
from sglang_m3.parsers.schema_alternatives import (
    Alternative,
    Parts,
    SchemaIndex,
    item_parts,
    property_parts,
    same_json,
)
from sglang_m3.parsers.schema_validation import SchemaValidator
from sglang_m3.parsers.xml_elements import Element

logger = logging.getLogger(__name__)

# ASCII digits only: `\d` also matches other scripts' digits, which JSON does not allow.
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_JSON_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]*)")

# Alternatives that read blank text as a value the chat template writes blank (module docstring).
_BLANK_READERS = ("string", None, "array", "object")

# Lower rank wins a tie between valid readings: specific readings before the catch-all string.
_KIND_RANK = {"null": 0, "boolean": 1, "integer": 2, "number": 3, "object": 4, "array": 5, None: 6, "string": 7}


class _Mismatch(Exception):
    """This alternative cannot read the element; try the next one."""


def arguments_from_elements(children: Sequence[Element], parameters_schema: Any) -> Dict[str, Any]:
    """JSON arguments of one invoke: its top-level elements read as an object."""
    return _SchemaTyper(parameters_schema).arguments(children)


class _SchemaTyper:
    """Types the elements of one invoke; its memo lives as long as that invoke's parse."""

    def __init__(self, parameters_schema: Any):
        self._index = SchemaIndex(parameters_schema)
        self._validator = SchemaValidator(self._index)
        self._root: Parts = (parameters_schema,) if isinstance(parameters_schema, dict) else ()
        # (id(element), ids of parts) -> (element, parts, value); the objects are held so
        # their ids stay unique while the memo lives.
        self._memo: Dict[Tuple[int, ...], Tuple[Element, Parts, Any]] = {}

    def arguments(self, children: Sequence[Element]) -> Dict[str, Any]:
        """The root schema's object (or untyped) alternatives read the invoke body; a root
        that allows no object at all types nothing."""
        readers = [alt for alt in self._index.alternatives(self._root) if alt.kind in ("object", None) and alt.members is None]
        return self._best(
            readers,
            lambda alt: self._object(children, alt.parts),
            lambda: self._object(children, ()),
        )

    def value(self, element: Element, parts: Parts) -> Any:
        key = (id(element), *map(id, parts))
        if key not in self._memo:
            value = self._best(
                self._alternatives_reading(element, parts),
                lambda alt: self._read(element, alt),
                lambda: element.text if element.is_leaf else self._untyped(element),
            )
            self._memo[key] = (element, parts, value)
        return self._memo[key][2]

    def _alternatives_reading(self, element: Element, parts: Parts) -> List[Alternative]:
        """The alternatives that may read `element`: no null reading of blank text where a string
        or an empty container may be meant (module docstring), as null outranks them in the tie
        rules."""
        alternatives = self._index.alternatives(parts)
        if element.is_leaf and not element.text.strip() and any(alt.kind in _BLANK_READERS for alt in alternatives):
            return [alt for alt in alternatives if alt.kind != "null"]
        return alternatives

    def _best(self, alternatives: List[Alternative], read: Callable[[Alternative], Any], fallback: Callable[[], Any]) -> Any:
        """The reading the module docstring's tie rules keep; `fallback()` when none reads."""
        best_rank, best = None, None
        for order, alternative in enumerate(alternatives):
            try:
                reading = read(alternative)
            except _Mismatch:
                continue
            rank = (not self._validates(reading, alternative), _KIND_RANK[alternative.kind], order)
            if best_rank is None or rank < best_rank:
                best_rank, best = rank, reading
        return fallback() if best_rank is None else best

    def _validates(self, reading: Any, alternative: Alternative) -> bool:
        return all(self._validator.validates(reading, part) for part in alternative.parts)

    def _read(self, element: Element, alternative: Alternative) -> Any:
        if alternative.members is not None:
            return self._enum_member(element, alternative.members)
        kind = alternative.kind
        if kind is None:
            return self._untyped(element)
        if kind == "object":
            return _json_text(element.text, dict) if element.is_leaf else self._object(element.children, alternative.parts)
        if kind == "array":
            if element.is_leaf:
                return _json_text(element.text, list)
            if any(child.tag != ARRAY_ITEM_TAG for child in element.children):
                raise _Mismatch()
            return self._items(element.children, alternative.parts)
        if not element.is_leaf:
            raise _Mismatch()
        return _scalar(element.text, kind)

    def _enum_member(self, element: Element, members: tuple) -> Any:
        if not element.is_leaf:
            value = self._untyped(element)
            if any(same_json(value, member) for member in members):
                return value
            raise _Mismatch()
        for candidate in (element.text, element.text.strip()):
            for member in members:
                if _render_scalar(member) == candidate:
                    return member
        raise _Mismatch()

    def _object(self, children: Sequence[Element], parts: Parts) -> Dict[str, Any]:
        groups: Dict[str, List[Element]] = {}
        for child in children:
            groups.setdefault(child.tag, []).append(child)
        return {
            tag: self.value(elements[0], property_parts(parts, tag))
            if len(elements) == 1
            else self._repeated(tag, elements, property_parts(parts, tag))
            for tag, elements in groups.items()
        }

    def _repeated(self, tag: str, elements: List[Element], parts: Parts) -> List[Any]:
        """Same-named siblings: the items of an array under their key's schema."""
        readers = [alt for alt in self._index.alternatives(parts) if alt.kind in ("array", None) and alt.members is None]
        return self._best(
            readers,
            lambda alt: self._items(elements, alt.parts),
            lambda: self._repeated_without_array(tag, elements, parts),
        )

    def _repeated_without_array(self, tag: str, elements: List[Element], parts: Parts) -> List[Any]:
        logger.debug("argument <%s> repeats but its schema allows no array; kept as the array of its values", tag)
        return [self.value(element, parts) for element in elements]

    def _items(self, elements: Sequence[Element], parts: Parts) -> List[Any]:
        return [self.value(element, item_parts(parts, index)) for index, element in enumerate(elements)]

    def _untyped(self, element: Element) -> Any:
        if element.is_leaf:
            return _untyped_text(element.text)
        if element.children and all(child.tag == ARRAY_ITEM_TAG for child in element.children):
            return [self._untyped(child) for child in element.children]
        return self._object(element.children, ())


def _render_scalar(value: Any) -> Any:
    """How the chat template writes a scalar; None for containers."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    return None


def _scalar(text: str, kind: str) -> Any:
    stripped = text.strip()
    if kind == "string":
        return text
    if (kind == "integer" and _JSON_INTEGER.fullmatch(stripped)) or (kind == "number" and _JSON_NUMBER.fullmatch(stripped)):
        try:
            return _json_loads(stripped)
        except ValueError:
            raise _Mismatch() from None
    if kind == "boolean" and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    if kind == "null" and stripped in ("null", ""):
        return None
    raise _Mismatch()


def _json_text(text: str, expected: type) -> Any:
    """An object or array written as inline JSON text, or empty."""
    stripped = text.strip()
    if not stripped:
        return expected()
    try:
        value = _json_loads(stripped)
    except ValueError:
        raise _Mismatch() from None
    if not isinstance(value, expected):
        raise _Mismatch()
    return value


def _untyped_text(text: str) -> Any:
    stripped = text.strip()
    if stripped in ("true", "false", "null") or _JSON_NUMBER.fullmatch(stripped) or stripped[:1] in ("{", "["):
        try:
            return _json_loads(stripped)
        except ValueError:
            return text
    return text


def _json_loads(text: str) -> Any:
    """`json.loads`, refusing (ValueError) what the arguments' JSON could not carry.

    Python reads `NaN` / `Infinity` and numbers beyond a double (`1e400` -> inf), which
    `json.dumps` would write back as invalid JSON; it refuses integers past its digit limit
    itself (ValueError too).
    """
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is beyond a double")
    return value
