"""The plugin's environment switches (A/B paths such as ``SGLANG_M3_MOE_OVERLAP``) read one way.

Each switch takes a fixed set of values; anything else is refused with the variable named, so a
value like ``false`` or ``off`` never silently leaves a path on.
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


def env_tokens(name: str, default: int) -> int:
    """The non-negative whole number of tokens in environment variable ``name``, ``default`` when
    unset; anything else is refused with the variable named."""
    value = os.environ.get(name)
    if value is None:
        return default
    if not value.strip().isdigit():
        raise ValueError(f"{name}={value!r}: expected a whole number of tokens (0 or more)")
    return int(value)
