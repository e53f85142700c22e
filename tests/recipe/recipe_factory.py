"""Recipe documents for tests: a sound base and a way to change fields by dotted path."""

from __future__ import annotations

import copy
from pathlib import Path

from sglang_m3.recipe import parse_recipe

REPO = Path(__file__).resolve().parents[2]
LIBRARY = REPO / "recipes"
BROKEN = Path(__file__).resolve().parent / "broken"

#: MXFP8 at TP8 + EP8 on a full B200 node: sound, no findings.
BASE = {
    "apiVersion": "m3.sglang.io/v1alpha1",
    "kind": "M3Recipe",
    "metadata": {"name": "test-recipe"},
    "spec": {
        "provenance": {"source": "tests/recipe"},
        "model": {"path": "MiniMaxAI/MiniMax-M3-MXFP8", "variant": "mxfp8"},
        "hardware": {"profile": "b200"},
        "parallelism": {"tp": 8, "ep": 8},
        "contextLength": 131072,
        "serving": {"memFractionStatic": 0.8, "maxRunningRequests": 8},
    },
}


def recipe_document(**changes) -> dict:
    """BASE with ``changes`` applied; keys are dotted paths with '__' for '.', e.g.
    ``spec__parallelism__tp=4``; a value of None deletes the key."""
    document = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        keys = dotted.split("__")
        node = document
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = value
    return document


def make_recipe(**changes):
    return parse_recipe(recipe_document(**changes), source="<test>")


def library_files() -> list[Path]:
    return sorted(LIBRARY.glob("*.yaml"))


def flag_pairs(argv: list[str]) -> list[tuple[str, str | None]]:
    """``--flag value`` / bare ``--flag`` pairs of a rendered argv, in order."""
    pairs: list[tuple[str, str | None]] = []
    for token in argv:
        if token.startswith("--"):
            pairs.append((token, None))
        else:
            flag, value = pairs[-1]
            assert value is None, f"{flag} renders two values"
            pairs[-1] = (flag, token)
    return pairs
