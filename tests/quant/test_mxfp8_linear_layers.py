"""MXFP8 dense linears (CUDA's layers for MXFP8 checkpoints) on the CPU, kernels interpreted.

SGLang's own linear classes built with the project's quantization config hold e4m3 weights and
e8m0 scales; loaded through SGLang's tensor-parallel loaders, every rank's slice dequantizes to
exactly the slice the BF16 linear of the dequantized twin holds (dequantization is exact in bf16),
and their outputs agree within one bf16 rounding (``tests/kernels/test_mxfp8_linear.py`` states
the kernel's bound; asserted here: relative Frobenius error <= 4e-3), and in fp32 (an fp32 model's
W8A32 linears) within fp32 summation-order noise. The whole tiny model built
with the config keeps exactly the linears the checkpoint stores in MXFP8 and the loader hands
them their pairs as stored.
"""

from __future__ import annotations

import types

import pytest
import torch
from interpreter_only import INTERPRETER_ONLY
from fused_attn_cases import as_rank
from msa_kernels.mxfp8_moe_reference import assert_fp32_close
from safetensors import safe_open
from torch import nn

from sglang_m3.config import M3TextSpec, MXFP8Config
from sglang_m3.quant.loading import MXFP8Weight
from sglang_m3.quant.mxfp8 import dequantize, quantize
from sglang_m3.quant.mxfp8_linear import M3Mxfp8LinearConfig, Mxfp8LinearMethod, holds_mxfp8
from sglang_m3.tiny.checkpoint import build_tiny_checkpoint

pytestmark = INTERPRETER_ONLY


@pytest.fixture
def bf16_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    yield
    torch.set_default_dtype(previous)


def test_which_linears_hold_mxfp8():
    """All parts quantized and none ignored; a packed linear with one part ignored stays BF16."""
    plain = MXFP8Config()
    for module in ("model.layers.3.self_attn.qkv_proj", "model.layers.3.self_attn.o_proj", "model.layers.0.mlp.gate_up_proj",
                   "model.layers.0.mlp.down_proj", "model.layers.5.mlp.shared_experts.gate_up_proj",
                   "model.layers.5.mlp.shared_experts.down_proj"):
        assert holds_mxfp8(plain, module), module
    assert holds_mxfp8(plain, "model.layers.3.self_attn.index_q_proj")  # quantizable; M3 builds it without the config
    assert not holds_mxfp8(MXFP8Config(("model.layers.3.self_attn.k_proj",)), "model.layers.3.self_attn.qkv_proj")
    assert not holds_mxfp8(MXFP8Config(("layers.5.block_sparse_moe.shared_experts",)), "model.layers.5.mlp.shared_experts.down_proj")
    # a dense layer's MLP may be listed under the block_sparse_moe spelling the loader accepts
    assert not holds_mxfp8(MXFP8Config(("model.layers.0.block_sparse_moe.up_proj",)), "model.layers.0.mlp.gate_up_proj")
    assert not holds_mxfp8(plain, "model.layers.3.block_sparse_moe.gate") and not holds_mxfp8(plain, "lm_head")


def _qkv(config, prefix="model.layers.3.self_attn.qkv_proj"):
    from sglang.srt.layers.linear import QKVParallelLinear

    return QKVParallelLinear(64, 32, 8, 2, bias=False, quant_config=config, prefix=prefix)


def _gate_up(config, prefix="model.layers.0.mlp.gate_up_proj"):
    from sglang.srt.layers.linear import MergedColumnParallelLinear

    return MergedColumnParallelLinear(64, [96, 96], bias=False, quant_config=config, prefix=prefix)


def _down(config, prefix="model.layers.0.mlp.down_proj"):
    from sglang.srt.layers.linear import RowParallelLinear

    return RowParallelLinear(128, 64, bias=False, quant_config=config, reduce_results=False, prefix=prefix)


#: linear builder, checkpoint parts (shard id, full shape)
KINDS = {
    "qkv": (_qkv, [("q", (256, 64)), ("k", (64, 64)), ("v", (64, 64))]),
    "gate_up": (_gate_up, [(0, (96, 64)), (1, (96, 64))]),
    "down": (_down, [(None, (64, 128))]),
}


def _load(layer, parts, quantized: bool):
    for shard, pair in parts:
        values = (pair.elements, pair.scales) if quantized else (dequantize(pair.elements, pair.scales, torch.bfloat16),)
        params = (layer.weight, layer.weight_scale_inv) if quantized else (layer.weight,)
        for param, value in zip(params, values):
            if shard is None:
                param.weight_loader(param, value)
            else:
                param.weight_loader(param, value, shard)


@pytest.mark.parametrize("kind, tp", [("qkv", 1), ("qkv", 2), ("qkv", 4), ("gate_up", 1), ("gate_up", 2), ("down", 1), ("down", 2)])
def test_each_ranks_slice_and_output_match_the_bf16_linear(kind, tp, bf16_default):
    """QKV at tp 4 replicates the 2 KV heads; the down projection (row parallel) cuts K and the
    scale columns with it, and its ranks' partial outputs sum to the whole."""
    build, shapes = KINDS[kind]
    gen = torch.Generator().manual_seed(tp)
    parts = [(shard, MXFP8Weight(*quantize(torch.randn(shape, generator=gen) * 0.05))) for shard, shape in shapes]
    x = torch.randn(5, shapes[0][1][1], generator=gen).to(torch.bfloat16)
    outputs, wanted = [], []
    for rank in range(tp):
        with as_rank(tp, rank), torch.no_grad():
            mxfp8, twin = build(M3Mxfp8LinearConfig(MXFP8Config())), build(None)
            assert isinstance(mxfp8.quant_method, Mxfp8LinearMethod) and mxfp8.weight.dtype == torch.float8_e4m3fn
            _load(mxfp8, parts, quantized=True)
            _load(twin, parts, quantized=False)
            assert torch.equal(dequantize(mxfp8.weight.data, mxfp8.weight_scale_inv.data, torch.bfloat16), twin.weight.data)
            x_rank = x.chunk(tp, dim=1)[rank] if kind == "down" else x
            outputs.append(mxfp8(x_rank)[0].float())
            wanted.append(x_rank.float() @ twin.weight.float().T)
    got, want = (sum(outputs), sum(wanted)) if kind == "down" else (torch.cat(outputs, 1), torch.cat(wanted, 1))
    assert ((got - want).norm() / want.norm()).item() <= 4e-3


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_dummy_load_gives_unit_scales_and_finite_outputs(kind, bf16_default):
    """``--load-format dummy`` (benchmarks) fills floating-point parameters only: the uint8 scales
    keep what the layer put there, which must be e8m0 127 (2^0), not an allocation's bytes (255 is NaN)."""
    from sglang.srt.model_loader.weight_utils import initialize_dummy_weights

    build, shapes = KINDS[kind]
    with as_rank(), torch.no_grad():
        layer = build(M3Mxfp8LinearConfig(MXFP8Config()))
        initialize_dummy_weights(layer)
        assert torch.all(layer.weight_scale_inv.data == 127)
        out = layer(torch.randn(3, shapes[0][1][1]).to(torch.bfloat16))[0]
    assert torch.isfinite(out).all() and out.abs().max() > 0


def test_row_parallel_input_slices_must_hold_whole_scale_groups(bf16_default):
    with as_rank(8, 0), pytest.raises(ValueError, match="not a multiple of the scale group.*--tp-size"):
        _down(M3Mxfp8LinearConfig(MXFP8Config()))


@pytest.fixture(scope="module")
def tiny_mxfp8(tmp_path_factory):
    path = build_tiny_checkpoint(str(tmp_path_factory.mktemp("mxfp8-linears") / "m"), quantization="mxfp8")
    with safe_open(f"{path}/model.safetensors", "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    return M3TextSpec.from_config(None, path), tensors


def test_tiny_model_keeps_the_checkpoints_mxfp8_linears(tiny_mxfp8, bf16_default):
    """The text model built with the config holds float8 parameters for exactly the linears the
    checkpoint quantizes (not the ignored index projections), loaded byte for byte; the routed
    experts of the CPU's loop block still dequantize at load."""
    from sglang_m3.models.minimax_m3 import M3TextModel, TextWeightLoader

    spec, tensors = tiny_mxfp8
    with as_rank(), torch.no_grad():
        holder = nn.Module()
        holder.spec, holder.model = spec, M3TextModel(spec, M3Mxfp8LinearConfig(spec.quantization), prefix="model")
        loader = TextWeightLoader(holder)
        for name, tensor in tensors.items():
            if "lm_head" not in name:  # the holder has no lm head
                loader.load_one(name, tensor)
        loader.dequantizer.finish()
    params = dict(holder.named_parameters())
    float8 = {name for name, p in params.items() if p.dtype == torch.float8_e4m3fn}
    layers = range(spec.num_layers)
    expected = {f"model.layers.{i}.self_attn.{proj}.weight" for i in layers for proj in ("qkv_proj", "o_proj")}
    expected |= {f"model.layers.{i}.mlp.{'shared_experts.' if spec.moe_layers[i] else ''}{proj}.weight" for i in layers for proj in ("gate_up_proj", "down_proj")}
    assert float8 == expected
    assert loader.dequantizer.kept_quantized == sum(name.endswith("_scale_inv") and ".experts." not in name and "index_" not in name for name in tensors)
    assert loader.dequantizer.kept_experts == 0
    source = {name.removeprefix("language_model."): t for name, t in tensors.items()}
    q, k, v = (source[f"model.layers.2.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(params["model.layers.2.self_attn.qkv_proj.weight"].view(torch.uint8), torch.cat([q, k, v]).view(torch.uint8))
    scales = (source[f"model.layers.2.self_attn.{p}_proj.weight_scale_inv"] for p in "qkv")
    assert torch.equal(params["model.layers.2.self_attn.qkv_proj.weight_scale_inv"], torch.cat(list(scales)))
    down = holder.model.layers[1].mlp.shared_experts.down_proj
    x = torch.randn(3, down.input_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    want = x.float() @ dequantize(down.weight.data, down.weight_scale_inv.data).T
    with as_rank():
        got = down(x)[0].float()
        got32 = down(x.float())[0]
    assert ((got - want).norm() / want.norm()).item() <= 4e-3
    assert_fp32_close(got32, want)  # an fp32 model's activations through the same layer: W8A32


def _model_config(dtype, architecture="MiniMaxM3SparseForConditionalGeneration", path=None):
    hf_config = types.SimpleNamespace(architectures=[architecture], _name_or_path=path)
    return types.SimpleNamespace(hf_config=hf_config, quantization="mxfp8", dtype=dtype)


def test_quantization_hook_picks_mxfp8_linears_on_cuda_only(tiny_mxfp8, tmp_path, monkeypatch):
    """CUDA and a bf16, fp16 or fp32 model (W8A32): the project's config; the CPU: none (dequantize
    at load); another architecture: SGLang's own."""
    import sglang.srt.platforms as platforms

    from sglang_m3.quant.serving import m3_mxfp8_quantization

    spec, _ = tiny_mxfp8
    path = build_tiny_checkpoint(str(tmp_path / "m"), quantization="mxfp8")

    def original(model_config, load_config):
        return "sglang's"

    assert m3_mxfp8_quantization(original, _model_config(torch.bfloat16, path=path), None) is None  # this CPU machine
    assert m3_mxfp8_quantization(original, _model_config(torch.bfloat16, "LlamaForCausalLM"), None) == "sglang's"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(platforms, "_current_platform", types.SimpleNamespace(device_type="cuda"))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        config = m3_mxfp8_quantization(original, _model_config(dtype, path=path), None)
        assert isinstance(config, M3Mxfp8LinearConfig) and config.checkpoint == spec.quantization
        assert dtype in config.get_supported_act_dtypes()
