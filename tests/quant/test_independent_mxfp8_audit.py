"""MXFP8 checkpoints written by an independent quantizer, loaded through the real path.

The project's own writer (``sglang_m3.quant.checkpoint_writer``) and its quantizer are not used
here: the tiny checkpoint (with two MTP modules) is cast to bf16 and quantized by the OCP rule
this file spells out (shared exponent ``floor(log2(amax)) - 8``, elements clamped to the e4m3
range, unlike the project's round-up rule), written as two shards with an index json, the
dense MLP of layer 0 and the index projections left in bf16 and named on the ignore list with
every other unquantized linear, MTP modules included. The oracle is transformers' M3 on the
weights this file's own dequantizer produces (exp2 of the byte, not the project's bit shift).
Scales come in both dtypes a quantizer may write: ``uint8`` bytes and ``float8_e8m0fnu``
(the same bits, torch's e8m0 type).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sglang_m3.config import M3TextSpec
from sglang_m3.models.checkpoint_layout import CheckpointError
from sglang_m3.quant.loading import MXFP8Weight
from tests.quant.test_mxfp8_loading import _edited, _load_with_mxfp8_blocks, _Recording

QUANTIZED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "shared_experts.", ".experts.")
SHARDS = 2
W1 = "language_model.model.layers.2.block_sparse_moe.experts.3.w1.weight"
INDEX_K = "language_model.model.layers.1.self_attn.index_k_proj.weight"


def _quantized(name: str) -> bool:
    return name.endswith(".weight") and ".mtp." not in name and any(part in name for part in QUANTIZED)


def ocp_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [N, K], e8m0 bytes [N, K/32]) by the OCP MX rule: exponent floor(log2 amax) - 8, saturating."""
    n, k = weight.shape
    blocks = weight.float().reshape(n, k // 32, 32)
    amax = blocks.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 8, torch.full_like(amax, -127)).clamp(-127, 127)
    elements = (blocks / torch.exp2(exponent)[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return elements.reshape(n, k), (exponent + 127).to(torch.uint8)


def ocp_dequantize(elements: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    n, k = elements.shape
    factors = torch.exp2(scale_bytes.float() - 127)[..., None]
    return (elements.float().reshape(n, k // 32, 32) * factors).reshape(n, k)


def write_independent_mxfp8(source: str, target: str, twin: str, scale_dtype: torch.dtype, suffix: str) -> None:
    """``target``: the sharded MXFP8 checkpoint; ``twin``: its dequantized fp32 weights (one file)."""
    tensors = load_file(os.path.join(source, "model.safetensors"))
    for directory in (target, twin):
        shutil.copytree(source, directory, ignore=shutil.ignore_patterns("*.safetensors"))
    stored, plain = {}, {}
    for name, tensor in tensors.items():
        tensor = tensor.to(torch.bfloat16)
        if _quantized(name):
            elements, scale_bytes = ocp_quantize(tensor)
            stored[name], stored[name + suffix] = elements, scale_bytes.view(scale_dtype)
            plain[name] = ocp_dequantize(elements, scale_bytes)
        else:
            stored[name], plain[name] = tensor, tensor.float()
    _write_shards(stored, target)
    save_file(plain, os.path.join(twin, "model.safetensors"), metadata={"format": "pt"})
    ignored = sorted(n[: -len(".weight")] for n, t in tensors.items() if t.dim() == 2 and not _quantized(n))
    with open(os.path.join(target, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    config["torch_dtype"] = "bfloat16"
    config["quantization_config"] = {
        "quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, 32], "ignored_layers": ignored,
    }
    with open(os.path.join(target, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2)


def _write_shards(tensors: dict[str, torch.Tensor], directory: str) -> None:
    """Shards in reverse name order, so a weight and its scale land in different files."""
    names = sorted(tensors, reverse=True)
    per_shard = -(-len(names) // SHARDS)
    weight_map = {}
    for index in range(SHARDS):
        file = f"model-{index + 1:05d}-of-{SHARDS:05d}.safetensors"
        part = {name: tensors[name].contiguous() for name in names[index * per_shard : (index + 1) * per_shard]}
        save_file(part, os.path.join(directory, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w", encoding="utf-8") as handle:
        json.dump({"metadata": {}, "weight_map": weight_map}, handle)


def stream(directory: str):
    for file in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with safe_open(file, "pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


VARIANTS = {"uint8": (torch.uint8, "_scale_inv"), "e8m0fnu": (torch.float8_e8m0fnu, "_scale_inv"), "e8m0fnu-weight_scale": (torch.float8_e8m0fnu, "_scale")}


@pytest.fixture(scope="module")
def independent(tiny_checkpoint_factory, tmp_path_factory):
    """variant -> (MXFP8 dir, dequantized twin dir), from the tiny checkpoint with 2 MTP modules."""
    source = tiny_checkpoint_factory(mtp_modules=2)
    base = tmp_path_factory.mktemp("independent-mxfp8")
    built = {}
    for variant, (dtype, suffix) in VARIANTS.items():
        built[variant] = (str(base / variant), str(base / f"{variant}-twin"))
        write_independent_mxfp8(source, *built[variant], dtype, suffix)
    return built


def _load(directory: str, weights=None, spec=None) -> _Recording:
    loader = _Recording(spec or M3TextSpec.from_config(None, directory))
    loader.load(weights if weights is not None else stream(directory))
    return loader


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_independent_checkpoint_loads_as_its_dequantized_weights(independent, variant):
    mxfp8, twin = independent[variant]
    loaded, reference = _load(mxfp8), _load(twin)
    assert loaded.dequantizer.dequantized == 3 * (4 + 8 * 3 + 3) + 4  # 3 MoE layers, layer 0's attention
    assert loaded.copied.keys() == reference.copied.keys()
    for name, value in reference.copied.items():
        assert torch.equal(loaded.copied[name].float(), value), name


def test_kept_pairs_hold_the_e8m0fnu_scales_as_their_bytes(independent):
    """Where the experts stay MXFP8 (CUDA), a float8_e8m0fnu scale reaches the uint8 parameter as
    its bytes: a value cast would turn every factor below 1 into 0."""
    mxfp8, _ = independent["e8m0fnu"]
    weights = dict(stream(mxfp8))
    loader = _load_with_mxfp8_blocks(M3TextSpec.from_config(None, mxfp8), weights.items(), layers=(2,))
    kept = loader.copied[W1.removeprefix("language_model.")]
    assert isinstance(kept, MXFP8Weight) and kept.scales.dtype == torch.uint8
    assert torch.equal(kept.scales, weights[W1 + "_scale_inv"].view(torch.uint8))


def test_nan_scale_byte_is_refused_naming_the_tensor(independent):
    mxfp8, _ = independent["e8m0fnu"]
    weights = dict(stream(mxfp8))
    scale = weights[W1 + "_scale_inv"].view(torch.uint8).clone()
    scale[0, 0] = 255
    with pytest.raises(CheckpointError, match=rf"byte 255 is NaN.*'{W1}_scale_inv'"):
        _load(mxfp8, _edited(weights.items(), replace={W1 + "_scale_inv": scale.view(torch.float8_e8m0fnu)}))


def test_scale_of_another_float_type_is_refused_naming_the_tensor(independent):
    mxfp8, _ = independent["uint8"]
    weights = dict(stream(mxfp8))
    as_factors = torch.exp2(weights[W1 + "_scale_inv"].float() - 127)  # fp32 factors, not e8m0 bytes
    with pytest.raises(CheckpointError, match=rf"scales must be uint8 or float8_e8m0fnu.*'{W1}_scale_inv'"):
        _load(mxfp8, _edited(weights.items(), replace={W1 + "_scale_inv": as_factors}))


def test_transposed_scale_is_refused_naming_the_tensor(independent):
    mxfp8, _ = independent["e8m0fnu"]
    weights = dict(stream(mxfp8))
    transposed = weights[W1 + "_scale_inv"].view(torch.uint8).t().contiguous().view(torch.float8_e8m0fnu)
    with pytest.raises(CheckpointError, match=rf"'{W1}': scale shape \(4, 64\).*expected \(64, 4\).*'{W1}_scale_inv'"):
        _load(mxfp8, _edited(weights.items(), replace={W1 + "_scale_inv": transposed}))


def test_quantized_index_projection_on_the_ignore_list_is_refused(independent):
    """The ignore list names ``language_model.model.layers.1.self_attn.index_k_proj``; a quantized
    tensor for it is refused, and loads once the config no longer excludes it."""
    mxfp8, _ = independent["e8m0fnu"]
    weights = dict(stream(mxfp8))
    elements, scale_bytes = ocp_quantize(weights[INDEX_K])
    quantized = _edited(weights.items(), replace={INDEX_K: elements}, add={INDEX_K + "_scale_inv": scale_bytes})
    with pytest.raises(CheckpointError, match=rf"'{INDEX_K}(_scale_inv)?' quantizes .*which config field 'quantization_config.ignored_layers' lists"):
        _load(mxfp8, quantized)
    spec = M3TextSpec.from_config(None, mxfp8)
    kept = tuple(m for m in spec.quantization.ignored_modules if m != INDEX_K[: -len(".weight")])
    spec = dataclasses.replace(spec, quantization=dataclasses.replace(spec.quantization, ignored_modules=kept))
    assert _load(mxfp8, quantized, spec).dequantizer.dequantized == 3 * (4 + 8 * 3 + 3) + 4 + 1


@pytest.mark.server
def test_served_independent_checkpoint_matches_transformers_on_its_dequantized_weights(independent, server_log_dir):
    """The sharded e8m0fnu checkpoint through SGLang's own weight iterator (index json, pairs split
    across shards, MTP tensors skipped) against transformers on the twin, at the e2e tolerances."""
    from server_harness import TINY_PREFILL_CHUNK, launch_cpu_server
    from transformers_oracle import random_prompt

    from tests.e2e.served_vs_reference import assert_matches_reference

    mxfp8, twin = independent["e8m0fnu"]
    with launch_cpu_server(mxfp8, server_log_dir, "--chunked-prefill-size", str(TINY_PREFILL_CHUNK)) as server:
        for seed, length in ((5, 47), (6, 233)):
            assert_matches_reference(server, twin, random_prompt(seed, length), f"independent mxfp8 len {length}")
        with open(server.log_path, encoding="utf-8", errors="replace") as handle:
            log = handle.read()
    assert "dequantized 97 MXFP8 weight(s) at load" in log
    assert "skipped 16 multi-token-prediction tensor(s)" in log
