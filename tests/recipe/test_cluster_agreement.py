"""A recipe ``recipe validate`` accepts deploys as it was validated.

- ``metadata.name`` becomes the name of every child and, with suffixes, pod labels of at most
  63 characters: a name the operator cannot use (longer than ``MAX_RECIPE_NAME``, or not a
  DNS-1035 label, which the Service needs) is refused at validate, naming the field, its length,
  the limit and the reason. The CRD carries the same limit, so the API server refuses it too.
- ``kubectl apply`` drops null fields (client-side apply deletes them, server-side apply takes
  null for removal), so a null the CLI read as anything other than "left out" would deploy
  differently. Wherever a recipe accepts null, it means what leaving the field out means; the
  nulls that used to switch a default off are refused, naming the field and what to write.
- ``provenance.verified.date`` is a day written YYYY-MM-DD, the CRD's ``format: date``: a number or
  a date-time, which pydantic's lax mode converted, is refused at validate as at ``kubectl apply``.
"""

from __future__ import annotations

import datetime
import json
import types
import typing

import jsonschema
import pytest
import yaml
from pydantic import BaseModel

from sglang_m3.recipe import RecipeLoadError, crd_openapi_schema, parse_recipe, render_launch, validate_recipe
from sglang_m3.recipe.schema import MAX_RECIPE_NAME, NO_PARSER, Recipe
from tests.recipe.cli_runner import run_cli
from tests.recipe.recipe_factory import recipe_document
from tests.recipe.test_schema import as_json_schema


def load_problems(document: dict) -> list[tuple[str, str]]:
    with pytest.raises(RecipeLoadError) as refused:
        parse_recipe(document, source="<agreement>")
    return [(p.field, p.message) for p in refused.value.problems]


def named(name: str) -> dict:
    return recipe_document(metadata={"name": name})


# --- metadata.name -------------------------------------------------------------------------------

@pytest.mark.parametrize("length", [MAX_RECIPE_NAME + 1, 63])
def test_a_name_too_long_for_the_operator_is_refused_at_validate(capsys, tmp_path, length):
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(named("m" * length)))
    code, out, _ = run_cli(capsys, "validate", str(path))
    assert code == 1
    [(field, message)] = load_problems(named("m" * length))
    assert field == "metadata.name" and f"metadata.name: {message}" in out
    assert f"{length} characters" in message and f"at most {MAX_RECIPE_NAME}" in message
    assert "pod label" in message and "63" in message


def test_the_longest_name_the_operator_can_use_passes():
    recipe = parse_recipe(named("m" * MAX_RECIPE_NAME))
    assert [f for f in validate_recipe(recipe) if f.severity == "error"] == []


@pytest.mark.parametrize("name", ["9lives", "-lead", "trail-", "Upper", "dot.ted"])
def test_a_name_that_cannot_name_the_service_is_refused_at_validate(name):
    [(field, message)] = load_problems(named(name))
    assert field == "metadata.name" and "Service" in message


def test_the_crd_carries_the_name_limit():
    """Kubernetes lets a CRD constrain metadata.name (and generateName) and nothing else of
    metadata: the API server refuses the name at ``kubectl apply``, webhook or not."""
    crd = as_json_schema(crd_openapi_schema())
    assert crd["properties"]["metadata"]["properties"]["name"]["maxLength"] == MAX_RECIPE_NAME
    jsonschema.validate(named("m" * MAX_RECIPE_NAME), crd)
    for name in ("m" * (MAX_RECIPE_NAME + 1), "9lives"):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(named(name), crd)


# --- explicit nulls ------------------------------------------------------------------------------

def recipe_models(model: type[BaseModel] = Recipe) -> set[type[BaseModel]]:
    """``model`` and every model its fields hold."""
    found = {model}
    for field in model.model_fields.values():
        for kind in typing.get_args(field.annotation) or (field.annotation,):
            if isinstance(kind, type) and issubclass(kind, BaseModel) and kind not in found:
                found |= recipe_models(kind)
    return found


def admits_null(annotation) -> bool:
    unions = (typing.Union, types.UnionType)
    return typing.get_origin(annotation) in unions and type(None) in typing.get_args(annotation)


def test_null_means_left_out_wherever_a_recipe_accepts_null():
    meaningful = [f"{model.__name__}.{name} (default {field.default!r})"
                  for model in recipe_models() for name, field in model.model_fields.items()
                  if admits_null(field.annotation) and field.default is not None]
    assert meaningful == []


@pytest.mark.parametrize("section, key, instead", [
    ("parsers", "reasoning", f"write {NO_PARSER}"),
    ("parsers", "toolCall", f"write {NO_PARSER}"),
    ("serving", "chunkedPrefillSize", "-1"),
])
def test_a_null_kubectl_would_drop_is_refused_naming_the_field(section, key, instead):
    document = recipe_document()
    document["spec"].setdefault(section, {})[key] = None
    [(field, message)] = load_problems(document)
    assert field == f"spec.{section}.{key}"
    assert "kubectl apply" in message and instead in message and "leave the field out" in message


def test_none_turns_a_parser_off():
    parsers = {"reasoning": NO_PARSER, "toolCall": NO_PARSER}
    recipe = parse_recipe(recipe_document(spec__parsers=parsers))
    argv = render_launch(recipe).argv
    assert "--reasoning-parser" not in argv and "--tool-call-parser" not in argv
    assert "parsers.reasoning" in {f.rule for f in validate_recipe(recipe)}
    assert [f for f in validate_recipe(recipe) if f.rule == "parsers.unknown"] == []


def test_the_crd_stores_no_null_the_cli_refuses():
    """Not nullable in the CRD, the API server prunes such a null, and the operator sees the
    field left out: what the CLI would have deployed had the null been left out."""
    spec = crd_openapi_schema()["properties"]["spec"]["properties"]
    for section, key in (("parsers", "reasoning"), ("parsers", "toolCall"),
                         ("serving", "chunkedPrefillSize")):
        assert "nullable" not in spec[section]["properties"][key], (section, key)



# --- provenance.verified.date --------------------------------------------------------------------

def verified_on(day) -> dict:
    return recipe_document(spec__provenance={"source": "tests", "verified": {
        "hardware": "8x H200", "sglangVersion": "0.5.23", "date": day}})


def applied(document: dict) -> dict:
    """The object kubectl sends: YAML as JSON (a YAML date or date-time becomes its ISO text)."""
    return json.loads(json.dumps(document, default=lambda value: value.isoformat()))


def crd_accepts(document: dict) -> bool:
    checker = jsonschema.Draft202012Validator(as_json_schema(crd_openapi_schema()),
                                              format_checker=jsonschema.FormatChecker())
    return checker.is_valid(applied(document))


def test_the_crd_types_the_verified_date_as_a_day():
    verified = crd_openapi_schema()["properties"]["spec"]["properties"]["provenance"]["properties"]["verified"]
    assert {key: verified["properties"]["date"][key] for key in ("type", "format")} == {"type": "string", "format": "date"}


@pytest.mark.parametrize("day", [1735689600, "1735689600", "2025-01-01T00:00:00Z",
                                 datetime.datetime(2025, 1, 1), "2025-1-1", 2025.5, True])
def test_a_verified_date_the_crd_refuses_is_refused_at_validate(day):
    """pydantic's lax date took seconds since 1970 and date-times; the CRD refuses both."""
    assert not crd_accepts(verified_on(day))
    [(field, message)] = load_problems(verified_on(day))
    assert field == "spec.provenance.verified.date" and "YYYY-MM-DD" in message


@pytest.mark.parametrize("day", [datetime.date(2025, 1, 1), "2025-01-01"])
def test_a_day_is_accepted_by_both(day):
    assert crd_accepts(verified_on(day))
    assert parse_recipe(verified_on(day)).spec.provenance.verified.date == datetime.date(2025, 1, 1)


def test_the_cli_and_the_crd_agree_on_a_date_time_in_yaml(tmp_path, capsys):
    """Unquoted in YAML, a date-time is read as one (a date alone as a date)."""
    path = tmp_path / "dated.yaml"
    text = yaml.safe_dump(verified_on("DAY")).replace("DAY", "2025-01-01T00:00:00Z")
    path.write_text(text)
    assert not crd_accepts(yaml.safe_load(text))
    code, out, _ = run_cli(capsys, "validate", str(path), "--output", "json")
    [result] = json.loads(out)
    assert code == 1 and [p["field"] for p in result["problems"]] == ["spec.provenance.verified.date"]
    path.write_text(text.replace("2025-01-01T00:00:00Z", "2025-01-01"))
    assert crd_accepts(yaml.safe_load(path.read_text()))
    code, _, _ = run_cli(capsys, "validate", str(path), "--output", "json")
    assert code == 0
