"""Recipe media limits reach the M3 media processor, under names it accepts."""

from __future__ import annotations

import json

import pytest
from tests.recipe.recipe_factory import LIBRARY, recipe_document

from sglang_m3.multimodal.limits import MediaLimits
from sglang_m3.multimodal.preprocessor import PreprocessConfig
from sglang_m3.recipe import load_recipe, parse_recipe, render_launch


def mm_process_config(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--mm-process-config") + 1])


def test_library_recipe_media_limits_are_processor_limits():
    argv = render_launch(load_recipe(LIBRARY / "b200-mxfp8-tp4.yaml")).argv
    config = mm_process_config(argv)
    limits = PreprocessConfig.from_settings(None, config).limits
    assert limits == MediaLimits(
        max_images=8, max_videos=1, max_image_bytes=16 * 1024 * 1024,
        max_video_seconds=600.0, max_video_frames=512, video_fps=1.0,
    )


def test_no_media_section_renders_no_process_config():
    argv = render_launch(parse_recipe(recipe_document())).argv
    assert "--mm-process-config" not in argv


def test_zero_images_is_left_to_sglangs_count_limit():
    recipe = parse_recipe(recipe_document(spec__multimodal={"limitPerRequest": {"image": 0, "video": 2}}))
    argv = render_launch(recipe).argv
    assert json.loads(argv[argv.index("--limit-mm-data-per-request") + 1]) == {"image": 0, "video": 2}
    assert mm_process_config(argv) == {"limits": {"max_videos": 2}}


def test_media_limits_in_extra_args_are_refused():
    from sglang_m3.recipe import validate_recipe

    recipe = parse_recipe(recipe_document(spec__serving__extraArgs=["--mm-process-config", "{}"]))
    messages = [f.message for f in validate_recipe(recipe)]
    assert any("spec.multimodal.media" in m for m in messages), messages


@pytest.mark.parametrize("field", ["maxImageMegabytes", "maxVideoFrames"])
def test_non_positive_media_limits_are_rejected(field):
    from sglang_m3.recipe import RecipeLoadError

    with pytest.raises((RecipeLoadError, ValueError), match=field):
        parse_recipe(recipe_document(spec__multimodal={"media": {field: 0}}))
