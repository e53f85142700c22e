"""The M3Recipe CRD: spec schema from the recipe models, status schema from the operator,
structural (every node typed, as Kubernetes requires), and printer columns that point at
fields that exist."""

from __future__ import annotations

from pathlib import Path

import yaml

from m3_operator.crd import CONDITION_TYPES, recipe_crd
from m3_operator.recipe_api import crd_openapi_schema
from m3_operator.status import Observation, compute_status

HERE = Path(__file__).parent


def schema() -> dict:
    return recipe_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def untyped_nodes(node: dict, path: str = "") -> list[str]:
    """Paths of schema nodes without a type (a structural schema has none)."""
    found = [] if "type" in node or node.get("x-kubernetes-preserve-unknown-fields") else [path]
    for name, child in (node.get("properties") or {}).items():
        found += untyped_nodes(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        found += untyped_nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        found += untyped_nodes(node["additionalProperties"], f"{path}{{}}")
    return found


def test_spec_schema_is_the_recipe_layers_and_status_is_declared():
    generated = crd_openapi_schema()
    assert schema()["properties"]["spec"] == generated["properties"]["spec"]
    assert set(schema()["properties"]["status"]["properties"]) >= {
        "observedGeneration", "appliedGeneration", "renderedArgs", "conditions"}
    assert untyped_nodes(schema()) == []


def test_every_status_the_operator_writes_fits_the_declared_schema():
    status = compute_status(Observation(generation=1), None, "2026-01-01T00:00:00Z")
    declared = schema()["properties"]["status"]["properties"]
    assert set(status) <= set(declared)
    assert {c["type"] for c in status["conditions"]} == set(CONDITION_TYPES)


def test_crd_names_scope_and_printer_columns():
    crd = recipe_crd()
    assert crd["spec"]["scope"] == "Namespaced"
    assert crd["spec"]["names"]["shortNames"] == ["m3r"]
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert {"Hardware", "Variant", "TP", "EP", "Context", "Ready", "Age"} <= set(columns)
    recipe = yaml.safe_load((HERE / "cases" / "h200-two-node-lws.yaml").read_text())
    for name in ("Hardware", "Variant", "TP", "EP", "Context"):
        node = recipe
        for part in columns[name].strip(".").split("."):
            node = node[part]
        assert node is not None, name
