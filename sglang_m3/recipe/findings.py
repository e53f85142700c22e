"""What the rules report: one finding per problem, naming the field and the fix."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Finding:
    """One problem with a recipe. Errors stop a deployment; warnings do not."""

    severity: Severity
    field: str
    """Dotted path in YAML spelling, e.g. ``spec.parallelism.tp``."""
    message: str
    """What is wrong and how to fix it."""
    rule: str
    """Stable id of the rule that fired, e.g. ``parallelism.gpu-count``."""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.severity}: {self.field}: {self.message} [{self.rule}]"


def has_errors(findings: list[Finding]) -> bool:
    return any(finding.severity == "error" for finding in findings)
