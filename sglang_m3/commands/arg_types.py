"""argparse value types shared by the commands: a bad value is refused by argparse itself (exit 2,
the option named in the message) before anything is written."""

from __future__ import annotations

import argparse

#: the largest seed ``torch.manual_seed`` takes as a non-negative 64-bit integer
MAX_SEED = 2**63 - 1


def _whole_number(text: str, expected: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes {expected}, got {text!r}") from None


def seed(text: str) -> int:
    """A seed of random weights, 0 to ``MAX_SEED``: torch raises "Overflow when unpacking long
    long" for a larger one, naming neither the option nor the range."""
    expected = "a whole number from 0 to 2**63 - 1"
    value = _whole_number(text, expected)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"takes {expected}, got {value}")
    return value


def module_count(text: str) -> int:
    """A count of modules, 0 or more. A negative count would otherwise be accepted: the builder
    adds no module for it and the command reports "-1 MTP module(s)" as a success."""
    count = _whole_number(text, "a whole number of modules")
    if count < 0:
        raise argparse.ArgumentTypeError(f"takes 0 or more modules, got {count}")
    return count


def token_count(text: str) -> int:
    """A number of tokens, 1 or more (a context length)."""
    count = _whole_number(text, "a whole number of tokens, 1 or more")
    if count < 1:
        raise argparse.ArgumentTypeError(f"takes a whole number of tokens, 1 or more, got {count}")
    return count
