"""The recipe library: every recipe loads, passes the rules, names its source, and renders
the flags the published recipes call for."""

from __future__ import annotations

import json

import pytest

from sglang_m3.recipe import (
    TINY_MODEL_PATH,
    get_profile,
    load_recipe,
    render_launch,
    validate_recipe,
)
from tests.recipe.cli_runner import run_cli
from tests.recipe.recipe_factory import LIBRARY, library_files

FILES = library_files()


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_library_has_the_required_recipes():
    assert len(FILES) >= 12
    recipes = [load_recipe(path) for path in FILES]
    profiles = {r.spec.hardware.profile for r in recipes}
    assert {"h100", "h200", "b200", "b300", "gb200", "mi300x", "mi355x", "cpu"} <= profiles
    assert any(r.spec.speculative and r.spec.speculative.algorithm == "EAGLE3" for r in recipes)
    assert any(r.spec.context_length == 1_048_576 for r in recipes)
    assert any(r.spec.hardware.nodes > 1 for r in recipes)
    assert any(r.spec.parallelism.ep > 1 and r.spec.hardware.profile in ("b200", "b300")
               for r in recipes)


@pytest.mark.parametrize("path", FILES, ids=lambda path: path.stem)
def test_library_recipe_is_sound_and_sourced(path):
    recipe = load_recipe(path)
    assert recipe.metadata.name == path.stem
    findings = validate_recipe(recipe)
    assert findings == [], [str(f) for f in findings]
    source = recipe.spec.provenance.source
    assert source.startswith(("https://", "sglang-m3 project", "/work/shared/")), source
    assert recipe.spec.provenance.notes


@pytest.mark.parametrize("path", FILES, ids=lambda path: path.stem)
def test_library_recipe_renders_hardware_appropriate_flags(path):
    recipe = load_recipe(path)
    profile = get_profile(recipe.spec.hardware.profile)
    argv = render_launch(recipe).argv
    assert flag_value(argv, "--model-path") == recipe.spec.model.path
    assert flag_value(argv, "--device") == profile.device
    if profile.is_gpu:
        assert flag_value(argv, "--page-size") == "128"
    if profile.is_amd:
        assert flag_value(argv, "--attention-backend") == "triton"
        assert flag_value(argv, "--ep-size") == flag_value(argv, "--tp-size")
    if recipe.spec.model.variant == "mxfp8":
        assert flag_value(argv, "--quantization") == "mxfp8"
    else:
        assert "--quantization" not in argv


def test_cpu_tiny_recipe_renders_the_reserved_model_on_cpu():
    launch = render_launch(load_recipe(LIBRARY / "cpu-tiny.yaml"))
    assert flag_value(launch.argv, "--model-path") == TINY_MODEL_PATH
    assert flag_value(launch.argv, "--device") == "cpu"
    assert flag_value(launch.argv, "--attention-backend") == "torch_native"
    assert int(flag_value(launch.argv, "--max-total-tokens")) <= 16384
    assert launch.env["SGLANG_PLATFORM"] == "sglang_m3_cpu"


def test_cpu_platform_name_matches_the_platform_plugin():
    from sglang_m3.platform import PLATFORM_NAME
    from sglang_m3.recipe.render import CPU_PLATFORM_NAME

    assert CPU_PLATFORM_NAME == PLATFORM_NAME


def test_validate_command_passes_the_library(capsys):
    code, out, _ = run_cli(capsys, "validate", str(LIBRARY))
    assert code == 0, out
    assert f"{len(FILES)} recipe(s), 0 with errors" in out
    code, out, _ = run_cli(capsys, "validate", str(LIBRARY), "--output", "json")
    assert code == 0
    results = json.loads(out)
    assert len(results) == len(FILES) and all(r["ok"] for r in results)
    assert all(r["findings"] == [] and r["problems"] == [] for r in results)


def test_readme_table_matches_the_fit():
    from sglang_m3.recipe import estimate_fit, fit_applies

    rows = {}
    for line in (LIBRARY / "README.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| `"):
            rows[cells[0].strip("`")] = cells
    assert sorted(rows) == [path.name for path in FILES]
    for path in FILES:
        recipe = load_recipe(path)
        cells = rows[path.name]
        assert cells[2] == recipe.spec.model.variant
        assert cells[4] == f"{recipe.spec.context_length:,}"
        if fit_applies(recipe):
            report = estimate_fit(recipe)
            assert cells[5:7] == [f"{report.pool_tokens:,}", str(report.max_concurrency_at_context)]
        else:
            assert cells[5:7] == ["-", "-"]
