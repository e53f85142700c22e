"""The recipe layer: schema, hardware catalog, rules, memory fit and launch renderer.

Pure data (pydantic + pyyaml): the CLI, ``sglang-m3 serve`` and the Kubernetes operator all
import it, and none of them should pull torch or SGLang to check a recipe.

Typical use::

    recipe = load_recipe("recipes/h200-bf16-tp8.yaml")   # RecipeLoadError names file + field
    findings = validate_recipe(recipe)                    # [] when the recipe is sound
    launch = render_launch(recipe)                        # argv + env for sglang.launch_server
"""

from .catalog import CATALOG, HardwareProfile, get_profile
from .crd import crd_openapi_schema, recipe_json_schema
from .errors import Problem, RecipeLoadError
from .findings import Finding, has_errors
from .fit import FitReport, estimate_fit, fit_applies
from .loader import dump_recipe, load_recipe, load_recipe_text, parse_recipe, read_recipe_document, read_recipe_file
from .model_geometry import MAX_CONTEXT_LENGTH, TINY_MODEL_PATH
from .render import LaunchSpec, render_launch
from .rules import validate_recipe
from .schema import API_VERSION, GROUP, KIND, PLURAL, VERSION, Recipe, RecipeSpec

__all__ = [
    "API_VERSION",
    "CATALOG",
    "GROUP",
    "KIND",
    "MAX_CONTEXT_LENGTH",
    "PLURAL",
    "TINY_MODEL_PATH",
    "VERSION",
    "Finding",
    "FitReport",
    "HardwareProfile",
    "LaunchSpec",
    "Problem",
    "Recipe",
    "RecipeLoadError",
    "RecipeSpec",
    "crd_openapi_schema",
    "dump_recipe",
    "estimate_fit",
    "fit_applies",
    "get_profile",
    "has_errors",
    "load_recipe",
    "load_recipe_text",
    "parse_recipe",
    "read_recipe_document",
    "read_recipe_file",
    "recipe_json_schema",
    "render_launch",
    "validate_recipe",
]
