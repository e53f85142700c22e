"""File format: loading, error reporting, JSON Schema and the Kubernetes CRD schema."""

from __future__ import annotations

import copy
import json
import typing

import jsonschema
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_m3.recipe import (
    CATALOG,
    RecipeLoadError,
    crd_openapi_schema,
    load_recipe,
    load_recipe_text,
    parse_recipe,
    recipe_json_schema,
    render_launch,
)
from sglang_m3.recipe.schema import HardwareSpec
from tests.recipe.recipe_factory import BROKEN, flag_pairs, library_files, recipe_document


def test_profile_names_in_the_schema_match_the_catalog():
    annotation = HardwareSpec.model_fields["profile"].annotation
    assert set(typing.get_args(annotation)) == set(CATALOG)


def test_yaml_round_trip_of_a_loaded_recipe_is_identical():
    for path in library_files():
        recipe = load_recipe(path)
        dumped = yaml.safe_dump(recipe.model_dump(by_alias=True, mode="json"))
        assert load_recipe_text(dumped) == recipe


def test_live_kubernetes_object_loads():
    document = recipe_document()
    document["metadata"].update(uid="1234", resourceVersion="7", generation=3,
                                managedFields=[{"manager": "kubectl"}])
    document["status"] = {"conditions": []}
    assert parse_recipe(document).metadata.name == "test-recipe"


def test_speculative_adaptive_is_a_boolean_rendered_as_a_bare_flag_when_true():
    """SGLang's --speculative-adaptive is store-true: it takes no value, and false is its absence."""
    chain = {"algorithm": "EAGLE3", "draftModel": {"path": "Inferact/MiniMax-M3-EAGLE3"}}
    fixed = parse_recipe(recipe_document(spec__speculative=chain))
    adaptive = parse_recipe(recipe_document(spec__speculative={**chain, "adaptive": True}))
    assert fixed.spec.speculative.adaptive is False and adaptive.spec.speculative.adaptive is True
    assert "--speculative-adaptive" not in render_launch(fixed).argv
    assert ("--speculative-adaptive", None) in flag_pairs(render_launch(adaptive).argv)
    speculative = crd_openapi_schema()["properties"]["spec"]["properties"]["speculative"]
    assert speculative["properties"]["adaptive"]["type"] == "boolean"


def test_error_names_file_and_every_field(tmp_path):
    path = tmp_path / "bad.yaml"
    document = recipe_document(spec__parallelism__tp="x", spec__contextLenght=5)
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(RecipeLoadError) as raised:
        load_recipe(path)
    error = raised.value
    assert error.source == str(path)
    assert {p.field for p in error.problems} == {"spec.parallelism.tp", "spec.contextLenght"}
    assert str(path) in str(error) and "spec.contextLenght: unknown field" in str(error)


def test_missing_or_undecodable_file_is_a_load_error(tmp_path):
    with pytest.raises(RecipeLoadError, match="no such file"):
        load_recipe(tmp_path / "absent.yaml")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00kind")
    with pytest.raises(RecipeLoadError, match="cannot read"):
        load_recipe(binary)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_arbitrary_text_is_either_a_recipe_or_a_load_error(text):
    try:
        load_recipe_text(text, source="fuzz")
    except RecipeLoadError as error:
        assert error.problems and str(error).startswith("fuzz: ")


SECTIONS = ["spec", "spec.model", "spec.hardware", "spec.parallelism", "spec.serving",
            "spec.provenance", "metadata"]


@settings(max_examples=100, deadline=None)
@given(section=st.sampled_from(SECTIONS[:-1]),
       key=st.from_regex(r"[a-z][a-zA-Z]{2,12}", fullmatch=True))
def test_unknown_keys_are_refused_at_their_path(section, key):
    document = recipe_document()
    node = document
    for part in section.split("."):
        node = node[part]
    if key in node or key in _known_fields(section):
        return
    node[key] = 1
    with pytest.raises(RecipeLoadError) as raised:
        parse_recipe(document)
    assert [p.field for p in raised.value.problems] == [f"{section}.{key}"]


def _known_fields(section: str) -> set[str]:
    properties = crd_openapi_schema()
    for part in section.split("."):
        properties = properties["properties"][part]
    return set(properties.get("properties", {}))


# --- generated schemas ------------------------------------------------------------------------

def walk(schema, path="$"):
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from walk(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}{{}}")


def test_crd_schema_is_structural():
    schema = crd_openapi_schema()
    text = json.dumps(schema)
    for forbidden in ('"$ref"', '"$defs"', '"anyOf"', '"oneOf"', '"allOf"', '"const"',
                      '"title"', '"default"'):
        assert forbidden not in text, forbidden
    for path, node in walk(schema):
        assert "type" in node, path
        assert not ("properties" in node and "additionalProperties" in node), path
        for flag in ("nullable", "exclusiveMinimum", "exclusiveMaximum"):
            assert isinstance(node.get(flag, True), bool), (path, flag)
    metadata = schema["properties"]["metadata"]  # Kubernetes allows constraints on the name only
    assert set(metadata) == {"type", "properties"} and set(metadata["properties"]) == {"name"}
    assert set(schema["required"]) == {"apiVersion", "kind", "metadata", "spec"}


def test_field_docs_become_crd_descriptions():
    schema = crd_openapi_schema()
    for path, node in walk(schema["properties"]["spec"], "spec"):
        if not path.endswith(("[]", "{}")):  # list items and map values are not fields
            assert node.get("description"), path
    tp = schema["properties"]["spec"]["properties"]["parallelism"]["properties"]["tp"]
    assert "--tp-size" in tp["description"]
    path = schema["properties"]["spec"]["properties"]["model"]["properties"]["path"]
    assert "sglang-m3:tiny" in path["description"]


def as_json_schema(openapi: dict) -> dict:
    """OpenAPI 3.0 -> JSON Schema for checking instances: ``nullable`` becomes a null type and
    boolean exclusive bounds become numeric ones."""
    node = copy.deepcopy(openapi)
    if node.pop("nullable", False):
        node["type"] = [node["type"], "null"]
    for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if node.pop(bound, False):
            node[bound] = node.pop(limit)
    for key in ("properties",):
        if key in node:
            node[key] = {name: as_json_schema(sub) for name, sub in node[key].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            node[key] = as_json_schema(node[key])
    return node


def library_documents():
    return [yaml.safe_load(path.read_text()) for path in library_files()]


def test_both_schemas_accept_every_library_recipe():
    crd = as_json_schema(crd_openapi_schema())
    for document in library_documents():
        jsonschema.validate(document, recipe_json_schema())
        jsonschema.validate(document, crd)


@pytest.mark.parametrize("name", ["wrong-type-tp", "zero-nodes", "unknown-profile",
                                  "unknown-variant", "missing-provenance", "missing-model-path",
                                  "mem-fraction-over-one", "extra-args-not-list", "wrong-kind"])
def test_crd_schema_refuses_what_the_api_server_should(name):
    document = yaml.safe_load((BROKEN / f"{name}.yaml").read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(document, as_json_schema(crd_openapi_schema()))


def test_crd_schema_is_valid_json_schema_props_for_kubernetes():
    """Wrapped in the smallest CRD, the schema passes Kubernetes' own CRD object schema."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "m3recipes.m3.sglang.io"},
        "spec": {
            "group": "m3.sglang.io", "scope": "Namespaced",
            "names": {"kind": "M3Recipe", "plural": "m3recipes"},
            "versions": [{"name": "v1alpha1", "served": True, "storage": True,
                          "schema": {"openAPIV3Schema": crd_openapi_schema()}}],
        },
    }
    kubernetes_validate.validate(crd, "1.33", strict=True)
