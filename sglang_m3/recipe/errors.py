"""Errors raised while reading a recipe file: each names the file and the field at fault."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One reason a recipe could not be read."""

    field: str
    """Dotted path in YAML spelling (``spec.parallelism.tp``, ``spec.serving.extraArgs[2]``),
    or ``<file>`` / ``<yaml>`` for problems with the file as a whole."""
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class RecipeLoadError(ValueError):
    """A recipe file that is missing, not YAML, or does not match the schema."""

    def __init__(self, source: str, problems: list[Problem]):
        self.source = source
        self.problems = list(problems)
        super().__init__(self._describe())

    def _describe(self) -> str:
        if len(self.problems) == 1:
            return f"{self.source}: {self.problems[0]}"
        lines = [f"{self.source}: {len(self.problems)} problems"]
        lines += [f"  {problem}" for problem in self.problems]
        return "\n".join(lines)
