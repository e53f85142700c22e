"""Typed readers of config fields: each refuses a bad value with the field's name in the message.

Defaults are passed explicitly by the caller and only for fields whose absence has one meaning
(the shipped value); a field that changes the math and has no agreed default is required.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from sglang_m3.config.errors import M3ConfigError

_MISSING = object()


def value(text: Mapping, key: str, default: Any = _MISSING, name: str | None = None) -> Any:
    """The raw value of ``key``; a missing (or null) field without a default is an error.

    Every reader takes ``name``, the field's full name where ``key`` is read from a nested
    mapping (``sparse_attention_config.use_sparse_attention``), for its messages.
    """
    found = text.get(key)
    if found is None:
        if default is _MISSING:
            raise M3ConfigError(f"config field '{name or key}' is missing")
        return default
    return found


def positive_int(text: Mapping, key: str, default: Any = _MISSING, name: str | None = None) -> int:
    found = value(text, key, default, name)
    if isinstance(found, bool) or not isinstance(found, int) or found < 1:
        raise M3ConfigError(f"config field '{name or key}' must be a positive integer, got {found!r}")
    return found


def non_negative_int(text: Mapping, key: str, default: Any = _MISSING, name: str | None = None) -> int:
    found = value(text, key, default, name)
    if isinstance(found, bool) or not isinstance(found, int) or found < 0:
        raise M3ConfigError(f"config field '{name or key}' must be an integer >= 0, got {found!r}")
    return found


def positive_float(text: Mapping, key: str, default: Any = _MISSING, name: str | None = None) -> float:
    found = value(text, key, default, name)
    if isinstance(found, bool) or not isinstance(found, (int, float)) or not 0 < found < math.inf:
        raise M3ConfigError(f"config field '{name or key}' must be a positive finite number, got {found!r}")
    return float(found)


def boolean(text: Mapping, key: str, default: Any = _MISSING, name: str | None = None) -> bool:
    found = value(text, key, default, name)
    if not isinstance(found, bool):
        raise M3ConfigError(f"config field '{name or key}' must be true or false, got {found!r}")
    return found


def choice(text: Mapping, key: str, accepted: Iterable[Any], default: Any = _MISSING, name: str | None = None) -> Any:
    """A value from ``accepted`` (the values the project implements), named in the refusal.
    A boolean never stands for a number (``True == 1.0`` in Python)."""
    accepted = tuple(accepted)
    found = value(text, key, default, name)
    if not any(_same(found, a) for a in accepted):
        names = ", ".join(repr(a) for a in accepted)
        raise M3ConfigError(f"config field '{name or key}' is {found!r}; sglang-m3 supports {names}")
    return found


def _same(found: Any, accepted: Any) -> bool:
    return isinstance(found, bool) == isinstance(accepted, bool) and found == accepted


def per_layer_flags(entries: Any, num_layers: int, field: str, true_names: set, false_names: set) -> tuple[bool, ...]:
    """A per-layer list (one entry per layer) mapped onto booleans."""
    if not isinstance(entries, (list, tuple)) or len(entries) != num_layers:
        raise M3ConfigError(f"config field '{field}' must list one entry per layer ({num_layers}), got {entries!r}")
    flags = []
    for i, entry in enumerate(entries):
        if isinstance(entry, bool):
            entry = int(entry)
        # a float, list or mapping is no layer kind (and may not be hashable)
        kind = entry if isinstance(entry, (int, str)) else None
        if kind is not None and kind in true_names:
            flags.append(True)
        elif kind is not None and kind in false_names:
            flags.append(False)
        else:
            accepted = ", ".join(repr(n) for n in sorted(true_names | false_names, key=str))
            raise M3ConfigError(f"config field '{field}[{i}]' has unknown value {entry!r}; accepted: {accepted}")
    return tuple(flags)


def agree(field_a: str, value_a: Any, field_b: str, value_b: Any) -> Any:
    """Two spellings of one setting: either may be absent (None), but they must not differ."""
    if value_a is not None and value_b is not None and value_a != value_b:
        raise M3ConfigError(f"config fields '{field_a}' ({value_a!r}) and '{field_b}' ({value_b!r}) disagree")
    return value_a if value_a is not None else value_b
