"""Dequantize-at-load without a server: the MXFP8 tiny checkpoint through TextWeightLoader.

The loader's name/shape checks and the pairing run for real; only the final parameter copy is
replaced by a record of what would be copied, so the values can be compared with the twin.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors import safe_open
from torch import nn

from sglang_m3.config import M3TextSpec, MXFP8Config
from sglang_m3.models.checkpoint_layout import CheckpointError
from sglang_m3.models.minimax_m3 import TextWeightLoader
from sglang_m3.quant.loading import MXFP8Weight
from sglang_m3.quant.mxfp8 import quantize
from sglang_m3.tiny.checkpoint import build_tiny_checkpoint

from names_only_loader import whole_model_stage

GATE = "language_model.model.layers.1.block_sparse_moe.gate.weight"
INDEX_Q = "language_model.model.layers.2.self_attn.index_q_proj.weight"
W2 = "language_model.model.layers.3.block_sparse_moe.experts.1.w2.weight"


class _Mxfp8Experts(nn.Module):
    """Stands in for an MoE block that keeps its routed experts in MXFP8 (``M3Mxfp8MoeBlock``)."""

    holds_mxfp8_experts = True

    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id


class _Recording(TextWeightLoader):
    def __init__(self, spec, mxfp8_expert_layers=()):
        holder = nn.Module()
        holder.spec = spec
        holder.model = whole_model_stage(spec)
        holder.blocks = nn.ModuleList(_Mxfp8Experts(layer) for layer in mxfp8_expert_layers)
        super().__init__(holder)
        self.copied: dict[str, torch.Tensor] = {}

    def _copy(self, name, tensor):
        self.copied[name] = tensor


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    base = tmp_path_factory.mktemp("mxfp8-loading")
    paths = {mode: build_tiny_checkpoint(str(base / mode), quantization=mode) for mode in ("mxfp8", "mxfp8-dequantized")}
    tensors = {}
    for mode, path in paths.items():
        with safe_open(f"{path}/model.safetensors", "pt") as handle:
            tensors[mode] = [(name, handle.get_tensor(name)) for name in handle.keys()]
    return M3TextSpec.from_config(None, paths["mxfp8"]), tensors


def _load(spec, weights):
    loader = _Recording(spec)
    loader.load(weights)
    return loader


def test_every_pair_loads_as_the_twins_weight(built):
    spec, tensors = built
    loaded = _load(spec, tensors["mxfp8"])
    twin = _load(dataclasses.replace(spec, quantization=None), tensors["mxfp8-dequantized"])
    assert loaded.dequantizer.dequantized == sum(n.endswith("_scale_inv") for n, _ in tensors["mxfp8"]) == 100
    assert loaded.copied.keys() == twin.copied.keys()
    for name, value in twin.copied.items():
        assert torch.equal(loaded.copied[name].to(value.dtype), value), name


def test_scale_before_weight_and_the_weight_scale_spelling_load_too(built):
    spec, tensors = built
    renamed = [(n.replace("_scale_inv", "_scale"), t) for n, t in reversed(tensors["mxfp8"])]
    assert _load(spec, renamed).dequantizer.dequantized == 100


def _edited(tensors, drop=(), replace=None, add=None):
    out = [(n, replace[n] if replace and n in replace else t) for n, t in tensors if n not in drop]
    return out + list((add or {}).items())


def test_missing_scale_is_refused_naming_the_weight(built):
    spec, tensors = built
    with pytest.raises(CheckpointError, match=rf"'{W2}' is float8_e4m3fn but its scale '{W2}_scale_inv' is missing"):
        _load(spec, _edited(tensors["mxfp8"], drop={W2 + "_scale_inv"}))


def test_missing_weight_of_a_scale_is_refused(built):
    spec, tensors = built
    with pytest.raises(CheckpointError, match=rf"'{W2}_scale_inv' is an MXFP8 scale but its weight '{W2}' is missing"):
        _load(spec, _edited(tensors["mxfp8"], drop={W2}))


def test_wrong_scale_shape_is_refused_naming_both_tensors(built):
    spec, tensors = built
    bad = {W2 + "_scale_inv": torch.zeros(128, 4, dtype=torch.uint8)}  # w2's input is 64 wide: 2 scales
    with pytest.raises(CheckpointError, match=rf"'{W2}': scale shape \(128, 4\).*expected \(128, 2\).*'{W2}_scale_inv'"):
        _load(spec, _edited(tensors["mxfp8"], replace=bad))


def test_scale_for_the_router_gate_is_refused(built):
    spec, tensors = built
    gate = dict(tensors["mxfp8"])[GATE]
    elements, scales = quantize(gate)
    with pytest.raises(CheckpointError, match=rf"'{GATE}(_scale_inv)?' quantizes .*block_sparse_moe.gate', which stays BF16"):
        _load(spec, _edited(tensors["mxfp8"], replace={GATE: elements}, add={GATE + "_scale_inv": scales}))


def test_scale_for_an_ignored_module_is_refused_and_accepted_when_not_ignored(built):
    spec, tensors = built
    index_q = dict(tensors["mxfp8"])[INDEX_Q]
    elements, scales = quantize(index_q)
    weights = _edited(tensors["mxfp8"], replace={INDEX_Q: elements}, add={INDEX_Q + "_scale_inv": scales})
    with pytest.raises(CheckpointError, match="modules_to_not_convert"):
        _load(spec, weights)
    # SGLang builds the index projections quantizable: without the ignore entry they load
    not_ignored = MXFP8Config(tuple(m for m in spec.quantization.ignored_modules if "index_q_proj" not in m))
    assert _load(dataclasses.replace(spec, quantization=not_ignored), weights).dequantizer.dequantized == 101


def test_plain_weight_with_a_scale_is_refused(built):
    spec, tensors = built
    plain = dict(tensors["mxfp8-dequantized"])[W2]
    with pytest.raises(CheckpointError, match=rf"'{W2}' is torch.float32, but its module has the MXFP8 scale"):
        _load(spec, _edited(tensors["mxfp8"], replace={W2: plain}))


def _load_with_mxfp8_blocks(spec, weights, layers):
    loader = _Recording(spec, mxfp8_expert_layers=layers)
    loader.load(weights)
    return loader


def test_routed_experts_of_mxfp8_blocks_pass_through_as_pairs(built):
    """Layers whose MoE block keeps MXFP8 experts get each expert's (e4m3, e8m0) pair as stored;
    everything else (other layers' experts, shared experts, attention) is dequantized as before."""
    spec, tensors = built
    stored = dict(tensors["mxfp8"])
    loader = _load_with_mxfp8_blocks(spec, tensors["mxfp8"], layers=(1, 3))
    twin = _load(dataclasses.replace(spec, quantization=None), tensors["mxfp8-dequantized"])
    experts_per_layer = 3 * spec.num_experts
    assert loader.dequantizer.kept_quantized == 2 * experts_per_layer
    assert loader.dequantizer.dequantized == 100 - 2 * experts_per_layer
    assert loader.copied.keys() == twin.copied.keys()
    for name, value in loader.copied.items():
        if isinstance(value, MXFP8Weight):
            assert ".layers.2." not in name and ".experts." in name, name
            source = next(n for n in stored if n.endswith(name.removeprefix("model.")))
            assert value.elements is stored[source] and value.scales is stored[source + "_scale_inv"]
        else:
            assert not (".experts." in name and (".layers.1." in name or ".layers.3." in name)), name
            assert torch.equal(value.to(twin.copied[name].dtype), twin.copied[name]), name


def test_plain_weight_for_a_module_kept_in_mxfp8_is_refused(built):
    """A routed expert of a block that keeps MXFP8 experts, stored unquantized and without a
    scale: refused (copied into the e4m3 parameter it would be cast, its scale never loaded);
    the same tensor loads where the block dequantizes."""
    spec, tensors = built
    plain = dict(tensors["mxfp8-dequantized"])[W2]
    weights = _edited(tensors["mxfp8"], drop={W2 + "_scale_inv"}, replace={W2: plain})
    with pytest.raises(CheckpointError, match=rf"'{W2}' is torch.float32, but '{W2.removesuffix('.weight')}' is served as MXFP8"):
        _load_with_mxfp8_blocks(spec, weights, layers=(3,))
    assert torch.equal(_load_with_mxfp8_blocks(spec, weights, layers=(1,)).copied[W2.removeprefix("language_model.")], plain)


def test_kept_pair_with_a_wrong_scale_shape_is_refused_naming_both_tensors(built):
    spec, tensors = built
    bad = {W2 + "_scale_inv": torch.zeros(128, 4, dtype=torch.uint8)}
    with pytest.raises(CheckpointError, match=rf"'{W2}': scale shape \(128, 4\).*expected \(128, 2\).*'{W2}_scale_inv'"):
        _load_with_mxfp8_blocks(spec, _edited(tensors["mxfp8"], replace=bad), layers=(3,))


def test_a_waiting_half_is_copied_only_from_device_memory():
    """SGLang's fastsafetensors reader frees a shard's device buffer once the shard is read, so a
    half that waits for its partner from the next shard is copied; mmap'd host tensors are kept."""
    from sglang_m3.quant.loading import held_past_the_reader

    class DeviceTensor:
        is_cuda = True

        def __init__(self, values: torch.Tensor):
            self.values = values

        def clone(self):
            return DeviceTensor(self.values.clone())

    device = DeviceTensor(torch.arange(4.0))
    held = held_past_the_reader(device)
    device.values.fill_(float("nan"))  # the reader frees and reuses the buffer
    assert held is not device and torch.equal(held.values, torch.arange(4.0))
    host = torch.arange(4.0)
    assert held_past_the_reader(host) is host


def _with_nan_elements(weight: torch.Tensor, positions) -> torch.Tensor:
    """``weight`` (e4m3) with float8_e4m3fn's two NaN bytes, 0x7F and 0xFF, alternating at ``positions``."""
    raw = weight.view(torch.uint8).clone()
    for i, (row, col) in enumerate(positions):
        raw[row, col] = (0x7F, 0xFF)[i % 2]
    return raw.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("kept_layers", [(), (3,)], ids=["dequantized", "kept-in-mxfp8"])
def test_nan_weight_elements_are_refused_naming_the_tensor_the_count_and_the_first(built, kept_layers):
    """A NaN element would load silently: dequantized it is a NaN weight, kept it is a NaN byte the
    kernels read. Refused on both paths, naming the checkpoint key, how many and the first (row-major)."""
    spec, tensors = built
    nan = _with_nan_elements(dict(tensors["mxfp8"])[W2], [(5, 7), (0, 3), (127, 63)])
    with pytest.raises(CheckpointError, match=rf"'{W2}' has 3 NaN element\(s\) of 8192 \(float8_e4m3fn bytes 0x7F/0xFF\), first at \(0, 3\)"):
        _load_with_mxfp8_blocks(spec, _edited(tensors["mxfp8"], replace={W2: nan}), layers=kept_layers)


@pytest.mark.parametrize("kept_layers", [(), (3,)], ids=["dequantized", "kept-in-mxfp8"])
def test_nan_scale_bytes_are_refused_naming_the_tensor_the_count_and_the_first(built, kept_layers):
    spec, tensors = built
    scale = dict(tensors["mxfp8"])[W2 + "_scale_inv"].clone()
    scale[9, 0] = scale[2, 1] = 255
    with pytest.raises(CheckpointError, match=rf"byte 255 is NaN in e8m0: 2 of 256 scales, first at \(2, 1\) \(scale tensor '{W2}_scale_inv'\)"):
        _load_with_mxfp8_blocks(spec, _edited(tensors["mxfp8"], replace={W2 + "_scale_inv": scale}), layers=kept_layers)
