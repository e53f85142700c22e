"""Schema validation of emitted objects: Kubernetes kinds against the pinned Kubernetes
version's schemas (``kubernetes-validate``, strict: unknown fields fail), LeaderWorkerSets
against ``schemas/leaderworkerset-v1.schema.json`` whose pod templates resolve to the same
pinned Kubernetes definitions."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
from referencing import Registry, Resource

#: Kubernetes version the emitted objects must be valid for.
PINNED_KUBERNETES = "1.33.0"
LWS_SCHEMA = Path(__file__).parent / "schemas" / "leaderworkerset-v1.schema.json"


@cache
def _lws_validator() -> jsonschema.Draft202012Validator:
    definitions_path = (resources.files("kubernetes_validate") / "kubernetes-json-schema"
                        / f"v{PINNED_KUBERNETES}-local-strict" / "_definitions.json")
    definitions = json.loads(definitions_path.read_text())
    schema = json.loads(LWS_SCHEMA.read_text())
    registry = Registry().with_resources([
        (definitions["$id"], Resource.from_contents(definitions)),
        (schema["$id"], Resource.from_contents(schema)),
    ])
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate(obj: dict[str, Any]) -> None:
    """Raise a ``jsonschema.ValidationError`` (or kubernetes-validate's) if ``obj`` is invalid."""
    if obj["kind"] == "LeaderWorkerSet":
        _lws_validator().validate(obj)
    else:
        kubernetes_validate.validate(obj, PINNED_KUBERNETES, strict=True)
