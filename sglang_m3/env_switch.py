"""The plugin's environment switches (A/B paths such as ``SGLANG_M3_MOE_OVERLAP``) read one way.

Each switch takes a fixed set of values, and each number its range; anything else is refused with
the variable named, so a value like ``false`` or ``off`` never silently leaves a path on.
"""

from __future__ import annotations

import os


def env_choice(name: str, choices: tuple[str, ...], meaning: str = "") -> str:
    """The value of environment variable ``name``, the first of ``choices`` when unset.

    ``meaning`` (e.g. ``"'1' on, '0' off"``) is added to the refusal of any other value."""
    value = os.environ.get(name, choices[0])
    if value not in choices:
        expected = meaning or " or ".join(repr(choice) for choice in choices)
        raise ValueError(f"{name}={value!r}: expected {expected}")
    return value


def env_number(name: str, convert, accept, expected: str):
    """The environment variable ``name`` as ``convert`` reads it, None when unset; a value that does
    not convert or that ``accept`` rejects is refused naming the variable and ``expected``."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = convert(raw)
    except ValueError:
        value = None
    if value is None or not accept(value):
        raise ValueError(f"{name}={raw!r}: expected {expected}")
    return value


def env_non_negative_int(name: str, default: int) -> int:
    """A whole number >= 0 from ``name``, ``default`` when unset (refused otherwise, as above)."""
    value = env_number(name, int, lambda v: v >= 0, "a whole number >= 0")
    return default if value is None else value
