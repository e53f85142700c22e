"""The MoE block's expert paths agree: the CPU's per-hit-expert ``loop`` and the graph-safe
``static`` path (every expert on every row, masked) that serves fp32 models on CUDA; and the
path each platform and dtype gets."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch


def _random_block(spec, dtype, seed):
    from sglang_m3.models.moe import M3SparseMoeBlock

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        block = M3SparseMoeBlock(spec)
    finally:
        torch.set_default_dtype(previous)
    e, h, inter = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(e, h) / h**0.5)
        if block.e_score_correction_bias is not None:
            block.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, e))
        for i in range(e):
            block.load_expert_weight(i, "w1", torch.randn(inter, h, dtype=dtype) / h**0.5)
            block.load_expert_weight(i, "w3", torch.randn(inter, h, dtype=dtype) / h**0.5)
            block.load_expert_weight(i, "w2", torch.randn(h, inter, dtype=dtype) / inter**0.5)
        for param in block.shared_experts.parameters():
            param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
    return block


def assert_close_to_scale(got, want, tol):
    """Max abs difference within ``tol`` of the output's scale (its max magnitude): the GEMM of
    all rows and the GEMM of a row subset may block their sums differently, so the two paths
    agree to rounding, not bit for bit."""
    assert got.dtype == want.dtype
    scale = want.abs().max().item()
    diff = (got - want).abs().max().item()
    assert diff <= tol * scale, f"max |diff| {diff:.3e} > {tol:g} x scale {scale:.3e}"


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
@pytest.mark.parametrize("routing_bias", [True, False])
@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_static_path_matches_loop(tiny_spec, single_rank, dtype, tol, routing_bias, tokens):
    spec = dataclasses.replace(tiny_spec, use_routing_bias=routing_bias)
    block = _random_block(spec, dtype, seed=tokens)
    x = torch.randn(tokens, spec.hidden_size, dtype=dtype) * 2  # gates beyond the swiglu-oai clamp too
    weights, chosen = block.route(x)
    loop = block.routed_loop(x, weights, chosen)
    static = block.routed_static(x, weights, chosen)
    assert loop.dtype == dtype
    assert_close_to_scale(static, loop, tol)
    # The whole block (router, shared expert, scaling) through either path.
    block.experts_path = "loop"
    full_loop = block(x)
    block.experts_path = "static"
    assert_close_to_scale(block(x), full_loop, tol)


def test_static_path_ignores_unchosen_experts(tiny_spec, single_rank):
    """An expert no row chose contributes nothing, even if its output is not finite."""
    block = _random_block(tiny_spec, torch.float32, seed=7)
    x = torch.randn(4, tiny_spec.hidden_size)
    weights, chosen = block.route(x)
    unused = sorted(set(range(tiny_spec.num_experts)) - set(chosen.flatten().tolist()))
    assert unused, "the tiny spec has more experts than 4 tokens x top-k can choose"
    expected = block.routed_loop(x, weights, chosen)
    with torch.no_grad():
        block.w2.data[unused[0]].fill_(float("inf"))
    assert_close_to_scale(block.routed_static(x, weights, chosen), expected, 1e-6)


def test_static_path_reads_nothing_on_the_host(tiny_spec, single_rank, monkeypatch):
    """No ``.tolist()``/``.item()``/``torch.unique`` in the static path: what CUDA graphs need."""
    block = _random_block(tiny_spec, torch.float32, seed=3)
    x = torch.randn(6, tiny_spec.hidden_size)
    weights, chosen = block.route(x)

    def refuse(*args, **kwargs):
        raise AssertionError("host read in the static path")

    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    monkeypatch.setattr(torch.Tensor, "item", refuse)
    monkeypatch.setattr(torch.Tensor, "__bool__", refuse)
    monkeypatch.setattr(torch, "unique", refuse)
    block.routed_static(x, weights, chosen)


def test_unknown_expert_path_is_refused(tiny_spec, single_rank):
    from sglang_m3.models.moe import M3SparseMoeBlock

    with pytest.raises(ValueError, match="experts_path"):
        M3SparseMoeBlock(tiny_spec, experts_path="fused")


@pytest.fixture
def cuda_platform(monkeypatch):
    import sglang.srt.platforms as platforms

    monkeypatch.setattr(platforms, "_current_platform", types.SimpleNamespace(device_type="cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("SGLANG_M3_MOE_OVERLAP", "0")  # the blocks would take a CUDA stream otherwise


@pytest.mark.parametrize(
    "dtype, expected", [(torch.float32, "static"), (torch.float64, "static"), (torch.bfloat16, "fused"), (torch.float16, "fused")]
)
def test_cuda_platform_picks_by_dtype(cuda_platform, monkeypatch, dtype, expected):
    from sglang_m3.models.fused_moe import MOE_IMPL_ENV, moe_impl

    monkeypatch.delenv(MOE_IMPL_ENV, raising=False)
    assert moe_impl(dtype) == expected


def test_cpu_platform_takes_the_loop_and_env_overrides(monkeypatch, tiny_spec, single_rank):
    from sglang_m3.models.fused_moe import MOE_IMPL_ENV, make_moe_block, moe_impl

    monkeypatch.delenv(MOE_IMPL_ENV, raising=False)
    assert moe_impl(torch.bfloat16) == "loop"
    layer = tiny_spec.moe_layers.index(True)
    assert make_moe_block(tiny_spec, layer).experts_path == "loop"
    monkeypatch.setenv(MOE_IMPL_ENV, "static")
    assert make_moe_block(tiny_spec, layer).experts_path == "static"
    monkeypatch.setenv(MOE_IMPL_ENV, "torch")
    assert moe_impl() == "loop"
    monkeypatch.setenv(MOE_IMPL_ENV, "triton")
    with pytest.raises(ValueError, match=MOE_IMPL_ENV):
        moe_impl()


@pytest.mark.parametrize(
    "dtype, expected", [(torch.bfloat16, "mxfp8"), (torch.float16, "fused"), (torch.float32, "static")]
)
def test_cuda_platform_keeps_mxfp8_experts_for_bf16_models(cuda_platform, monkeypatch, dtype, expected):
    """MXFP8 experts stay quantized where the W8A16 kernels serve them (bf16 activations); other
    dtypes take their usual path with the experts dequantized at load."""
    from sglang_m3.models.fused_moe import MOE_IMPL_ENV, moe_impl

    monkeypatch.delenv(MOE_IMPL_ENV, raising=False)
    assert moe_impl(dtype, mxfp8_experts=True) == expected


def test_mxfp8_env_switch_and_cpu_platform(monkeypatch):
    """``fused`` on CUDA is the dequantized-bf16 A/B; ``mxfp8`` needs MXFP8 experts; the CPU keeps
    its loop (dequantized at load) for MXFP8 checkpoints."""
    from sglang_m3.models.fused_moe import MOE_IMPL_ENV, moe_impl

    monkeypatch.delenv(MOE_IMPL_ENV, raising=False)
    assert moe_impl(torch.bfloat16, mxfp8_experts=True) == "loop"
    monkeypatch.setenv(MOE_IMPL_ENV, "fused")
    assert moe_impl(torch.bfloat16, mxfp8_experts=True) == "fused"
    monkeypatch.setenv(MOE_IMPL_ENV, "mxfp8")
    assert moe_impl(torch.bfloat16, mxfp8_experts=True) == "mxfp8"
    with pytest.raises(ValueError, match=f"{MOE_IMPL_ENV}=mxfp8 needs a checkpoint with MXFP8 routed experts"):
        moe_impl(torch.bfloat16)


def test_make_moe_block_builds_the_mxfp8_block_unless_the_layer_is_ignored(cuda_platform, monkeypatch, tiny_spec, single_rank):
    from sglang_m3.config import MXFP8Config
    from sglang_m3.models.fused_moe import MOE_IMPL_ENV, has_mxfp8_experts, make_moe_block
    from sglang_m3.models.mxfp8_moe import M3Mxfp8MoeBlock

    monkeypatch.delenv(MOE_IMPL_ENV, raising=False)
    layer = tiny_spec.moe_layers.index(True)
    ignored = MXFP8Config(ignored_modules=(f"model.layers.{layer}.block_sparse_moe.experts",))
    assert not has_mxfp8_experts(tiny_spec, layer)
    assert has_mxfp8_experts(dataclasses.replace(tiny_spec, quantization=MXFP8Config()), layer)
    assert not has_mxfp8_experts(dataclasses.replace(tiny_spec, quantization=ignored), layer)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        block = make_moe_block(dataclasses.replace(tiny_spec, quantization=MXFP8Config()), layer, prefix="m")
    finally:
        torch.set_default_dtype(previous)
    assert isinstance(block, M3Mxfp8MoeBlock) and block.layer_id == layer and block.w2.dtype == torch.float8_e4m3fn


def test_the_fused_layer_holds_the_shared_expert_only_where_it_can(tiny_spec, single_rank, monkeypatch):
    """Unquantized, as wide as a routed expert, no expert parallelism, and the switch on."""
    from sglang_m3.models.fused_moe import FUSE_SHARED_ENV, fuses_shared_expert

    monkeypatch.delenv(FUSE_SHARED_ENV, raising=False)
    assert tiny_spec.shared_intermediate_size == tiny_spec.moe_intermediate_size
    assert fuses_shared_expert(tiny_spec, None)
    assert not fuses_shared_expert(tiny_spec, object()), "a quantized shared expert cannot join the bf16 experts"
    wider = dataclasses.replace(tiny_spec, shared_intermediate_size=2 * tiny_spec.moe_intermediate_size)
    assert not fuses_shared_expert(wider, None)
    from sglang.srt.runtime_context import get_parallel

    two_ranks = types.SimpleNamespace(world_size=2, rank_in_group=0)
    with get_parallel().override(tp_group=two_ranks, tp_size=2, tp_rank=0, moe_ep_size=2, moe_ep_rank=0, moe_tp_size=1, moe_tp_rank=0):
        assert not fuses_shared_expert(tiny_spec, None), "each expert-parallel rank would add the whole shared expert"
    monkeypatch.setenv(FUSE_SHARED_ENV, "0")
    assert not fuses_shared_expert(tiny_spec, None)
    monkeypatch.setenv(FUSE_SHARED_ENV, "off")
    with pytest.raises(ValueError, match=FUSE_SHARED_ENV):
        fuses_shared_expert(tiny_spec, None)
