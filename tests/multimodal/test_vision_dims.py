"""The vision tower's sizes come from ``vision_config`` (and the projector width from its own
fields), never from the text sizes; the shipped and transformers spellings both read."""

from __future__ import annotations

import pytest

from sglang_m3.config import M3ConfigError
from sglang_m3.models.vision import VisionDims

TEXT = {"hidden_size": 96, "intermediate_size": 48, "num_attention_heads": 6, "num_hidden_layers": 5}
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2}


def top(**extra):
    vision = {**VISION, **extra.pop("vision", {})}
    return {"text_config": dict(TEXT), "vision_config": vision, **extra}


def test_vision_sizes_come_from_vision_config_only():
    dims = VisionDims.from_config(top(projector_hidden_size=40))
    assert (dims.hidden_size, dims.intermediate_size, dims.num_heads, dims.num_layers) == (32, 64, 2, 2)
    assert dims.text_hidden_size == 96


@pytest.mark.parametrize(
    ("config", "width"),
    [(top(projector_hidden_size=40), 40), (top(vision={"projection_dim": 56}), 56), (top(projector_hidden_size=72, vision={"projection_dim": 72}), 72)],
    ids=["transformers layout", "shipped layout", "both agree"],
)
def test_projector_width_from_either_spelling(config, width):
    assert VisionDims.from_config(config).projector_hidden_size == width


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (top(projector_hidden_size=40, vision={"projection_dim": 56}), "'vision_config.projection_dim' (56) disagree"),
        (top(), "'projector_hidden_size' (or 'vision_config.projection_dim')"),
        (top(projector_hidden_size=40, vision={"intermediate_size": None}), "'vision_config.intermediate_size'"),
        (top(projector_hidden_size=40, vision={"hidden_act": "relu"}), "'vision_config.hidden_act'"),
    ],
    ids=["widths disagree", "no width", "missing vision size", "unsupported activation"],
)
def test_bad_vision_config_is_refused_naming_the_field(config, named):
    with pytest.raises(M3ConfigError) as caught:
        VisionDims.from_config(config)
    assert named in str(caught.value)
