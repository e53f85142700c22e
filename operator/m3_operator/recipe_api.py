"""The one place the operator touches the recipe layer (``sglang_m3.recipe``).

Keeping every import here makes the dependency explicit and small: the operator needs the
parser, the validator, the launch renderer, the hardware catalog and the CRD's OpenAPI schema,
nothing else from the project.
"""

from __future__ import annotations

from sglang_m3.recipe import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    Finding,
    HardwareProfile,
    LaunchSpec,
    Recipe,
    RecipeLoadError,
    TINY_MODEL_PATH,
    crd_openapi_schema,
    dump_recipe,
    get_profile,
    has_errors,
    parse_recipe,
    read_recipe_document,
    read_recipe_file,
    render_launch,
    validate_recipe,
)
from sglang_m3.recipe.fit import DRAFT_WEIGHT_BYTES
from sglang_m3.recipe.model_geometry import WEIGHT_BYTES
from sglang_m3.recipe.schema import MAX_RECIPE_NAME, SHORT_NAMES, SINGULAR

__all__ = [
    "API_VERSION",
    "DRAFT_WEIGHT_BYTES",
    "GROUP",
    "KIND",
    "MAX_RECIPE_NAME",
    "PLURAL",
    "SHORT_NAMES",
    "SINGULAR",
    "TINY_MODEL_PATH",
    "VERSION",
    "WEIGHT_BYTES",
    "Finding",
    "HardwareProfile",
    "LaunchSpec",
    "Recipe",
    "RecipeLoadError",
    "crd_openapi_schema",
    "dump_recipe",
    "get_profile",
    "has_errors",
    "parse_recipe",
    "read_recipe_document",
    "read_recipe_file",
    "render_launch",
    "validate_recipe",
]
