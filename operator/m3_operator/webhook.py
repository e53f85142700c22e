"""Optional validating admission webhook: refuse invalid recipes at ``kubectl apply`` time.

It runs the very checks the reconciler runs (``desired_state``'s problems: schema, recipe
rules, name and annotation checks), so a recipe the webhook admits is one the operator deploys.
Off by default in the chart; without it an invalid recipe is still stored and reported as
``Validated=False``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import kopf

from m3_operator.controller import Controller, plain
from m3_operator.desired import desired_state
from m3_operator.handlers import RECIPES
from m3_operator.options import OperatorConfig


def admission_problems(body: Mapping[str, Any], config: OperatorConfig,
                       old: Mapping[str, Any] | None = None) -> list[str]:
    """Every reason to refuse ``body``; empty when it would deploy.

    On an UPDATE, ``old`` is the stored object, and only problems it did not already have
    count (ratcheting, as the API server does for CRD schema validation): a recipe stored
    invalid, before the webhook was enabled or before an upgrade with stricter rules, must
    still take label and annotation edits, kopf's own annotation patches, and spec changes
    that fix some of its problems, while no update may add a problem."""
    problems = desired_state(plain(body), config).problems
    if old is None:
        return list(problems)
    stored = set(desired_state(plain(old), config).problems)
    return [problem for problem in problems if problem not in stored]


def installer(port: int, certfile: Path | None, keyfile: Path | None,
              config: OperatorConfig) -> Callable[[kopf.OperatorRegistry, Controller], None]:
    """A registry hook that adds the validation handler and the HTTPS server settings."""
    if certfile is None or keyfile is None:
        raise SystemExit("--webhook-port needs --webhook-cert and --webhook-key")

    def install(registry: kopf.OperatorRegistry, controller: Controller) -> None:
        @kopf.on.validate(*RECIPES, registry=registry, id="validate-recipe",
                          operations=["CREATE", "UPDATE"])
        def validate(body: kopf.Body, old: kopf.Body | None = None, **_: Any) -> None:
            problems = admission_problems(body, config, old)
            if problems:
                raise kopf.AdmissionError("; ".join(problems), code=422)

        @kopf.on.startup(registry=registry)
        def serve(settings: kopf.OperatorSettings, **_: Any) -> None:
            settings.admission.server = kopf.WebhookServer(
                port=port, certfile=str(certfile), pkeyfile=str(keyfile))

    return install
