"""Quantized tensors for the vision tower are refused by name, as the text model refuses them.

The tower is built unquantized in every checkpoint (SGLang builds it with ``quant_config=None``)
and its loader copies what it gets cast to the parameter's dtype: an e4m3 weight with no scale
used to load as its unscaled element values, silently. The VL model is built outside a server and
fed the tiny checkpoints' tensors, as SGLang's loader feeds ``load_weights``.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from fused_attn_cases import as_rank
from safetensors import safe_open
from torch import nn

import sglang_m3.models.minimax_m3 as minimax_m3
from sglang_m3.config import MXFP8Config
from sglang_m3.models.checkpoint_layout import CheckpointError
from sglang_m3.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration
from sglang_m3.quant.loading import VisionTensorCheck, checked_vision_tensors
from sglang_m3.tiny.checkpoint import build_tiny_checkpoint

VISION_Q = "vision_tower.vision_model.encoder.layers.1.self_attn.q_proj.weight"
TEXT_O_PROJ = "language_model.model.layers.0.self_attn.o_proj.weight"


def _tensors(model_dir: str) -> dict[str, torch.Tensor]:
    with safe_open(f"{model_dir}/model.safetensors", "pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def _load(model_dir: str, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """Build the VL model from ``model_dir``'s config (one rank) and load ``tensors`` into it."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    with pytest.MonkeyPatch.context() as patch, as_rank():
        patch.setattr(minimax_m3, "LogitsProcessor", lambda config: nn.Identity())
        model = MiniMaxM3SparseForConditionalGeneration(config)
        with torch.no_grad():
            model.load_weights(tensors.items())
    return model


@pytest.fixture(scope="module")
def mxfp8_vl_dir(tmp_path_factory):
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("vl") / "mxfp8"), vision=True, quantization="mxfp8")


@pytest.fixture(scope="module")
def mxfp8_vl_dir_vision_not_listed(mxfp8_vl_dir, tmp_path_factory):
    """The MXFP8 VL checkpoint with the vision modules taken off its ignore list."""
    directory = shutil.copytree(mxfp8_vl_dir, tmp_path_factory.mktemp("vl") / "not-listed")
    with open(directory / "config.json", encoding="utf-8") as handle:
        config = json.load(handle)
    listed = config["quantization_config"]["modules_to_not_convert"]
    config["quantization_config"]["modules_to_not_convert"] = [m for m in listed if not m.startswith("vision_tower")]
    with open(directory / "config.json", "w", encoding="utf-8") as handle:
        json.dump(config, handle)
    return str(directory)


def test_the_mxfp8_vl_checkpoint_keeps_its_vision_tower_plain_and_loads_it_as_stored(mxfp8_vl_dir):
    tensors = _tensors(mxfp8_vl_dir)
    vision = {name: t for name, t in tensors.items() if not name.startswith("language_model.")}
    assert vision and all(t.dtype == torch.float32 for t in vision.values())
    assert not any(name.endswith("_scale_inv") for name in vision)
    state = _load(mxfp8_vl_dir, tensors).state_dict()
    assert torch.equal(state["vision.layers.1.self_attn.q_proj.weight"], vision[VISION_Q])


def test_fp8_vision_weight_in_a_bf16_checkpoint_is_refused_as_a_text_weight_is(tiny_m3_vl_checkpoint):
    """A checkpoint without ``quantization_config``: the text model's message for either part."""
    for name in (VISION_Q, TEXT_O_PROJ):
        tensors = _tensors(tiny_m3_vl_checkpoint)
        tensors[name] = tensors[name].to(torch.float8_e4m3fn)
        refused = rf"'{re.escape(name)}' belongs to a quantized checkpoint \(torch.float8_e4m3fn weights\), but config.json declares no"
        with pytest.raises(CheckpointError, match=refused):
            _load(tiny_m3_vl_checkpoint, tensors)


def test_fp8_vision_weight_without_its_scale_is_refused_naming_the_scale(mxfp8_vl_dir_vision_not_listed):
    tensors = _tensors(mxfp8_vl_dir_vision_not_listed)
    tensors[VISION_Q] = tensors[VISION_Q].to(torch.float8_e4m3fn)
    scale = VISION_Q.removesuffix(".weight") + ".weight_scale_inv"
    refused = rf"'{re.escape(VISION_Q)}' is float8_e4m3fn, but the vision tower stays BF16 .*'{re.escape(scale)}' included\): its values would load unscaled"
    with pytest.raises(CheckpointError, match=refused):
        _load(mxfp8_vl_dir_vision_not_listed, tensors)


def test_fp8_vision_weight_of_a_module_listed_unquantized_is_refused_naming_the_entry(mxfp8_vl_dir):
    """The writer lists ``vision_tower``: an 8-bit weight contradicts the entry, and a cast would
    load its unscaled values, so it is refused there too (the text loader refuses an FP8 weight
    for a listed module alike)."""
    tensors = _tensors(mxfp8_vl_dir)
    tensors[VISION_Q] = tensors[VISION_Q].to(torch.float8_e4m3fn)
    module = re.escape(VISION_Q.removesuffix(".weight"))
    refused = (
        rf"'{re.escape(VISION_Q)}' is torch.float8_e4m3fn, but config field 'quantization_config.modules_to_not_convert' "
        rf"lists '{module}' as unquantized \(entry 'vision_tower'\)"
    )
    with pytest.raises(CheckpointError, match=refused):
        _load(mxfp8_vl_dir, tensors)


def test_mxfp8_scale_for_a_vision_weight_is_refused_as_the_router_gates_is(mxfp8_vl_dir_vision_not_listed):
    """A scale for a plain vision weight: the tower takes no MXFP8 scale, as the text model takes
    none for the modules SGLang builds unquantized (the router gate's message, by the same words)."""
    tensors = _tensors(mxfp8_vl_dir_vision_not_listed)
    tensors[VISION_Q + "_scale_inv"] = torch.full((tensors[VISION_Q].shape[0], 2), 127, dtype=torch.uint8)
    module = VISION_Q.removesuffix(".weight")
    refused = rf"'{re.escape(VISION_Q)}_scale_inv' quantizes '{re.escape(module)}', which stays BF16 in an MXFP8 M3 checkpoint"
    with pytest.raises(CheckpointError, match=refused):
        _load(mxfp8_vl_dir_vision_not_listed, tensors)


@pytest.mark.parametrize(
    "name, dtype, named",
    [
        (VISION_Q, torch.float8_e5m2, "is torch.float8_e5m2: only MXFP8 linear weights"),
        ("vision_tower.vision_model.post_layernorm.bias", torch.float8_e4m3fn, "is torch.float8_e4m3fn: only MXFP8 linear"),
        (VISION_Q.removesuffix(".weight") + ".input_scale", torch.float32, r"\(FP8 static activation scales\) is not part of"),
    ],
)
def test_other_quantized_vision_tensors_are_refused_naming_them(name, dtype, named):
    with pytest.raises(CheckpointError, match=rf"'{re.escape(name)}' {named}"):
        VisionTensorCheck(MXFP8Config()).refuse_quantized(name, torch.zeros(64, 48, dtype=dtype))


@pytest.mark.parametrize("config", [None, MXFP8Config(), MXFP8Config(ignored_modules=("vision_tower",))])
def test_plain_vision_tensors_pass_in_order_and_an_fp8_weight_never_reaches_the_tower(config):
    plain = [(f"vision_tower.vision_model.encoder.layers.{i}.mlp.fc1.weight", torch.zeros(8, 8, dtype=dtype))
             for i, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16))]
    passed = list(checked_vision_tensors(iter(plain), config))
    assert [name for name, _ in passed] == [name for name, _ in plain]
    assert all(got is sent for (_, got), (_, sent) in zip(passed, plain))
    reached = []
    with pytest.raises(CheckpointError, match=re.escape(VISION_Q)):
        for name, _ in checked_vision_tensors(iter([*plain, (VISION_Q, torch.zeros(8, 8, dtype=torch.float8_e4m3fn))]), config):
            reached.append(name)
    assert reached == [name for name, _ in plain]


def test_the_text_model_refuses_an_fp8_weight_without_its_scale_alike(mxfp8_vl_dir):
    """The same fault in the text half of the same checkpoint: refused at load by the same words."""
    tensors = _tensors(mxfp8_vl_dir)
    scale = TEXT_O_PROJ.removesuffix(".weight") + ".weight_scale_inv"
    del tensors[scale]
    refused = rf"'{re.escape(TEXT_O_PROJ)}' is float8_e4m3fn but its scale '{re.escape(scale)}' is missing"
    with pytest.raises(CheckpointError, match=refused):
        _load(mxfp8_vl_dir, tensors)
