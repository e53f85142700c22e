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
