"""The server options of the pinned SGLang, for checking ``serving.extraArgs`` without SGLang.

``data/sglang_options.json`` lists every option ``python -m sglang.launch_server`` accepts (its
``ServerArgs.add_cli_args`` parser; help left out, since it prints and exits instead of serving)
with how many values each takes. The recipe layer cannot import SGLang, so it reads this record;
``tests/recipe/test_sglang_options.py`` keeps it equal to the installed SGLang's parser.

SGLang parses with argparse, which also accepts an unambiguous prefix of an option
(``--max-prefill`` for ``--max-prefill-tokens``) and ``--option=value``; ``resolve`` follows the
same rules, so an extra argument is judged the way SGLang will judge it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

OPTIONS_PATH = Path(__file__).parent / "data" / "sglang_options.json"

#: How many values an option takes: ``none`` (a switch), ``one``, ``optional`` (zero or one),
#: ``many`` (any number, at least one for ``+`` options: argparse counts them, this record
#: does not need to).
Arity = Literal["none", "one", "optional", "many"]

_RECORD = json.loads(OPTIONS_PATH.read_text(encoding="utf-8"))
#: SGLang version the record was taken from.
SGLANG_VERSION: str = _RECORD["sglang_version"]
#: Every option string (``--tp-size``, ``--tensor-parallel-size``, ...) with its arity.
OPTIONS: dict[str, Arity] = _RECORD["options"]

#: What argparse takes for a negative number rather than an option (SGLang registers no option
#: that looks like one, so ``--chunked-prefill-size -1`` reads -1 as the value).
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


@dataclass(frozen=True)
class Resolved:
    """What SGLang's parser makes of one command-line token that looks like an option."""

    flag: str
    """The token up to any ``=``."""
    matches: tuple[str, ...]
    """The options it spells: itself, or every option it abbreviates (more than one: ambiguous)."""
    inline_value: bool
    """The token carries its value after ``=``."""


def is_option_token(token: str) -> bool:
    """Whether argparse reads ``token`` as an option rather than a value."""
    return token.startswith("-") and token != "-" and not _NEGATIVE_NUMBER.match(token)


def resolve(token: str) -> Resolved:
    flag, equals, _ = token.partition("=")
    if flag in OPTIONS:
        matches: tuple[str, ...] = (flag,)
    elif flag.startswith("--"):
        matches = tuple(option for option in OPTIONS if option.startswith(flag))
    else:
        matches = ()
    return Resolved(flag=flag, matches=matches, inline_value=bool(equals))
