"""Read recipe files: YAML text -> ``Recipe``, or a ``RecipeLoadError`` that names the field.

Loading is all-or-nothing: a recipe object exists only when the whole file is valid, and every
schema problem of the file is reported at once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from .errors import Problem, RecipeLoadError
from .schema import API_VERSION, KIND, Recipe

#: Top-level keys a live Kubernetes object carries that are not part of the recipe.
_SERVER_OWNED_KEYS = ("status",)


class _UniqueKeyLoader(yaml.SafeLoader):
    """Safe YAML loader that refuses repeated keys, which plain YAML silently lets the last
    one win (a recipe with two ``tp:`` lines would deploy whichever came second)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_recipe_file(path: str | os.PathLike) -> str:
    """The text of a recipe file; a file that cannot be read is a :class:`RecipeLoadError` on
    ``<file>``, worded alike wherever a recipe file is opened."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeLoadError(str(path), [Problem("<file>", "no such file")]) from None
    except (OSError, UnicodeDecodeError) as error:
        raise RecipeLoadError(str(path), [Problem("<file>", f"cannot read: {error}")]) from None


def load_recipe(path: str | os.PathLike) -> Recipe:
    """Read and check one recipe file."""
    return load_recipe_text(read_recipe_file(path), source=str(path))


def load_recipe_text(text: str, source: str = "<string>") -> Recipe:
    """Parse recipe YAML held in memory; ``source`` names it in errors."""
    try:
        documents = [doc for doc in yaml.load_all(text, Loader=_UniqueKeyLoader)
                     if doc is not None]
    except yaml.YAMLError as error:
        raise RecipeLoadError(source, [Problem("<yaml>", _describe_yaml_error(error))]) from None
    if not documents:
        raise RecipeLoadError(
            source, [Problem("<file>", f"empty file: expected one {KIND} document")]
        )
    if len(documents) > 1:
        raise RecipeLoadError(
            source,
            [Problem("<file>", f"{len(documents)} YAML documents: put one recipe in each file")],
        )
    return parse_recipe(documents[0], source=source)


def parse_recipe(data: Any, source: str = "<object>") -> Recipe:
    """Check an already-decoded object (e.g. a custom resource from the Kubernetes API)."""
    if not isinstance(data, dict):
        raise RecipeLoadError(
            source,
            [Problem("<file>", f"expected a mapping with apiVersion, kind, metadata and spec, "
                               f"got {type(data).__name__}")],
        )
    envelope_problems = _check_envelope(data)
    if envelope_problems:
        raise RecipeLoadError(source, envelope_problems)
    payload = {key: value for key, value in data.items() if key not in _SERVER_OWNED_KEYS}
    try:
        return Recipe.model_validate(payload)
    except ValidationError as error:
        raise RecipeLoadError(source, _problems_from(error)) from None


def _check_envelope(data: dict) -> list[Problem]:
    """Say plainly when the file is not an M3 recipe at all, before field-level noise."""
    problems = []
    if data.get("apiVersion") != API_VERSION:
        problems.append(Problem(
            "apiVersion", f"must be {API_VERSION!r}, got {data.get('apiVersion')!r}"))
    if data.get("kind") != KIND:
        problems.append(Problem("kind", f"must be {KIND!r}, got {data.get('kind')!r}"))
    return problems


def _problems_from(error: ValidationError) -> list[Problem]:
    return [Problem(format_location(item["loc"]), _describe_item(item)) for item in error.errors()]


def format_location(loc: tuple) -> str:
    """pydantic's location tuple -> ``spec.serving.extraArgs[2]``."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or "<root>"


def _describe_item(item: dict) -> str:
    if item["type"] == "extra_forbidden":
        return "unknown field (check the spelling; fields are camelCase)"
    if item["type"] == "missing":
        return "required field is missing"
    shown = repr(item["input"])
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"{item['msg']} (got {shown})"


def _describe_yaml_error(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    if mark is None:
        return f"not valid YAML: {problem}"
    return f"not valid YAML at line {mark.line + 1}, column {mark.column + 1}: {problem}"
