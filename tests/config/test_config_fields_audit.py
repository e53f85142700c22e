"""Config fields found unchecked or lost in a field-by-field audit (M3_FACTS s.1).

``vision_config``: its sizes were read with ``int()`` / ``float()`` and never checked, so a zero,
negative, fractional or boolean size (or heads that do not divide the width, or a ``head_dim``
that transformers' axial RoPE honours and this tower did not) started a server that failed or
answered differently at the first image. ``max_position_embeddings``: absent from the text
config, the spec read the documented 1,048,576 while SGLang derived its context length from the
config object (2,048 for the shipped ``minimax_m2`` text type) and refused a longer
``--context-length``.
"""

from __future__ import annotations

import copy
import functools
import json

import pytest
from conftest import write_checkpoint_copy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_m3.config import M3ConfigError, M3TextSpec
from sglang_m3.models.vision import VisionDims

#: vision sizes that must be positive integers when present (each has a shipped default)
VISION_COUNTS = ("num_channels", "patch_size", "temporal_patch_size", "spatial_merge_size", "vision_segment_max_frames")


@pytest.fixture
def vl_top(shipped_top) -> dict:
    """A valid VL config (the tiny text part, vision sizes unlike the text's) with a projector width."""
    top = copy.deepcopy(shipped_top)
    top["vision_config"]["projection_dim"] = top["text_config"]["hidden_size"]
    return top


def _with_vision(top: dict, **changes) -> dict:
    top = copy.deepcopy(top)
    top["vision_config"].update(changes)
    return top


def _refusal(top: dict) -> str:
    with pytest.raises(M3ConfigError) as refused:
        VisionDims.from_config(top)
    return str(refused.value)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])  # only read
@given(
    key=st.sampled_from(VISION_COUNTS),
    junk=st.one_of(
        st.booleans(),
        st.integers(-3, 0),
        st.sampled_from([14.5, 2.0, float("nan"), -1.5]),
        st.sampled_from(["14", "two"]),
        st.lists(st.integers(1, 3), max_size=2),
    ),
)
def test_vision_count_that_is_no_positive_integer_is_refused_naming_it(vl_top, key, junk):
    message = _refusal(_with_vision(vl_top, **{key: junk}))
    assert f"'vision_config.{key}'" in message and repr(junk) in message


@pytest.mark.parametrize("eps", [0, -1e-5, float("nan"), float("inf"), True, "1e-5"])
def test_vision_layer_norm_eps_must_be_positive_and_finite(vl_top, eps):
    assert "'vision_config.layer_norm_eps'" in _refusal(_with_vision(vl_top, layer_norm_eps=eps))


@pytest.mark.parametrize("key", VISION_COUNTS)
def test_vision_count_present_is_read_and_absent_is_the_shipped_default(vl_top, key):
    shipped = {"num_channels": 3, "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2, "vision_segment_max_frames": None}
    attr = {"vision_segment_max_frames": "segment_max_frames"}.get(key, key)
    assert getattr(VisionDims.from_config(vl_top), attr) == shipped[key]
    assert getattr(VisionDims.from_config(_with_vision(vl_top, **{key: 5})), attr) == 5


def test_vision_heads_must_divide_the_width(vl_top):
    top = _with_vision(vl_top, num_attention_heads=6)  # 40 wide: 6 heads of 6 channels leave 4 over
    top["vision_config"].pop("head_dim")
    message = _refusal(top)
    assert "'vision_config.hidden_size' (40)" in message and "'vision_config.num_attention_heads' (6)" in message


def test_vision_head_dim_other_than_width_over_heads_is_refused(vl_top):
    """transformers' axial RoPE takes its bands from ``vision_config.head_dim`` while its attention
    heads are ``hidden_size // num_attention_heads`` wide: a disagreeing head_dim rotates other
    channels there (or fails), and this tower ignored it."""
    assert VisionDims.from_config(vl_top).head_dim == vl_top["vision_config"]["head_dim"] == 8
    message = _refusal(_with_vision(vl_top, head_dim=10))
    assert "'vision_config.head_dim' (10)" in message and "8" in message


def test_vision_rope_theta_spellings_must_agree(vl_top):
    agreeing = _with_vision(vl_top, rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
    assert VisionDims.from_config(agreeing).rope_theta == 10000.0
    message = _refusal(_with_vision(vl_top, rope_parameters={"rope_type": "axial", "rope_theta": 500.0}))
    assert "'vision_config.rope_theta'" in message and "'vision_config.rope_parameters.rope_theta'" in message


def _sglang_model_config(model_dir: str, monkeypatch, **kwargs):
    """SGLang's ``ModelConfig`` with the plugin's ``get_config`` hook around its config parsing."""
    import sglang.srt.configs.model_config as model_config

    from sglang_m3.integration import hooks

    monkeypatch.setattr(model_config, "get_config", functools.partial(hooks.read_m3_config_first, model_config.get_config))
    return model_config.ModelConfig(model_dir, **kwargs)


@pytest.fixture(params=["text", "vl", "flat"])
def checkpoint(request) -> tuple[str, bool]:
    """(tiny checkpoint, whether its text settings move to the top level): SGLang keeps a nested
    text_config a dict, and parses a flat one (text type ``minimax_m2``) into a config object."""
    fixture = "tiny_m3_vl_checkpoint" if request.param == "vl" else "tiny_m3_checkpoint"
    return request.getfixturevalue(fixture), request.param == "flat"


def _checkpoint_with_text(checkpoint: tuple[str, bool], target: str, **changes) -> str:
    source, flat = checkpoint
    with open(f"{source}/config.json", encoding="utf-8") as handle:
        top = json.load(handle)
    if flat:
        top = {**top.pop("text_config"), "architectures": top["architectures"]}
    text = top if flat else top["text_config"]
    for key, value in changes.items():
        if value is None:
            text.pop(key, None)
        else:
            text[key] = value
    return write_checkpoint_copy(source, target, top)


def test_absent_max_position_embeddings_gives_sglang_the_documented_context(checkpoint, tmp_path, monkeypatch):
    model_dir = _checkpoint_with_text(checkpoint, str(tmp_path / "no-max"), max_position_embeddings=None)
    spec = M3TextSpec.from_config(None, model_dir)
    assert spec.max_position_embeddings == 1_048_576
    assert _sglang_model_config(model_dir, monkeypatch).context_len == spec.max_position_embeddings
    longest = _sglang_model_config(model_dir, monkeypatch, context_length=spec.max_position_embeddings)
    assert longest.context_len == spec.max_position_embeddings


def test_present_max_position_embeddings_is_sglang_context(checkpoint, tmp_path, monkeypatch):
    model_dir = _checkpoint_with_text(checkpoint, str(tmp_path / "max"), max_position_embeddings=8192)
    assert M3TextSpec.from_config(None, model_dir).max_position_embeddings == 8192
    assert _sglang_model_config(model_dir, monkeypatch).context_len == 8192


@pytest.mark.parametrize("section", ["rope_scaling", "rope_parameters"])
def test_a_factor_on_plain_rope_does_not_stretch_sglang_context(checkpoint, tmp_path, monkeypatch, section):
    """A ``factor`` beside rope type "default" means nothing to plain RoPE (transformers ignores
    it, and so does the model), but SGLang multiplies its context length by any ``rope_scaling``
    factor: the server would admit prompts past the positions the checkpoint was built for."""
    rope = {"rope_type": "default", "factor": 4.0}
    if section == "rope_parameters":
        rope["rope_theta"] = 5_000_000.0
    model_dir = _checkpoint_with_text(checkpoint, str(tmp_path / "factor"), max_position_embeddings=8192, **{section: rope})
    spec = M3TextSpec.from_config(None, model_dir)
    assert spec.max_position_embeddings == 8192
    assert _sglang_model_config(model_dir, monkeypatch).context_len == 8192
