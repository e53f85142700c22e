"""The MXFP8 W8A16 MoE kernels (Triton interpreter, CPU) against the torch reference.

``msa_kernels.mxfp8_moe_reference`` dequantizes and runs each hit expert in fp32 from the same
bf16 inputs. The kernels accumulate in fp32 too, but round three intermediate results to bf16 (the
activation, each slot's weighted expert output, the token sum), each a relative error of at most
2**-9: measured relative Frobenius error 2.5e-3..3.1e-3, largest element error 3.3e-3 of the
output's largest magnitude. Asserted: relative Frobenius error <= 6e-3 and every element within
1e-2 of the output's largest magnitude, all finite. A wrong scale group,
expert, slot or routed weight moves results by O(1) relative.

Each test draws fresh inputs (its own seed). Intermediate buffers are allocated poisoned (NaN,
out-of-range indices) so a row or block the kernels forget to write cannot pass as zeros.
``tests/gpu/test_mxfp8_moe_gpu.py`` runs the same comparison compiled at M3's real shape.
"""

from __future__ import annotations

import pytest
import torch

from msa_kernels import triton_mxfp8_moe as moe
from msa_kernels.mxfp8_moe_reference import dequantize, reference_fused_experts
from msa_kernels.triton_mxfp8_moe import TileConfig, align_tokens, mxfp8_fused_experts, num_blocks_bound, pick_config

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter tests run on CPU machines; tests/gpu covers CUDA"
)

ALPHA, LIMIT = 1.702, 7.0
SMALL = TileConfig(block_m=16, block_n=32, block_k=64)


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    """``torch.empty`` inside the kernel module returns NaN floats / huge ints."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        tensor = real_empty(*args, **kwargs)
        return tensor.fill_(float("nan") if tensor.is_floating_point() else 0x3FFFFFF0)

    monkeypatch.setattr(moe.torch, "empty", empty)


def quantized_experts(experts, rows, cols, gen, exponents=(112, 124)):
    """Random e4m3 elements and e8m0 scale bytes drawn from ``exponents`` (so the groups' scales
    span 2**-15..2**-3 and a wrong group shows), ``[experts, rows, cols]``."""
    elements = (torch.randn(experts, rows, cols, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.randint(exponents[0], exponents[1] + 1, (experts, rows, cols // 32), generator=gen, dtype=torch.uint8)
    return elements, scales


def case(tokens, experts, top_k, hidden, inter, seed, concentrated=False):
    gen = torch.Generator().manual_seed(seed)
    w13, s13 = quantized_experts(experts, 2 * inter, hidden, gen)
    w2, s2 = quantized_experts(experts, hidden, inter, gen)
    # gate/up of standard deviation ~3: some beyond the swiglu-oai clamp (7), most inside it.
    x_scale = 3 / (dequantize(w13, s13).std().item() * hidden**0.5)
    x = (torch.randn(tokens, hidden, generator=gen) * x_scale).to(torch.bfloat16)
    pool = min(experts, top_k + 1) if concentrated else experts
    ids = torch.rand(tokens, pool, generator=gen).argsort(dim=1)[:, :top_k].to(torch.int32)
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return x, w13, s13, w2, s2, weights, ids


def assert_close(got, want):
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.isfinite(got).all(), "non-finite output"
    got = got.float()
    scale = want.abs().max().item()
    assert scale > 0
    rel = ((got - want).norm() / want.norm()).item()
    worst = (got - want).abs().max().item()
    assert rel <= 6e-3, f"relative Frobenius error {rel:.3e}"
    assert worst <= 1e-2 * scale, f"max |error| {worst:.3e} > 1e-2 x {scale:.3e}"


@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, inter, config",
    [
        (1, 8, 2, 64, 64, None),  # decode: most experts empty
        (3, 8, 4, 128, 96, SMALL),  # intermediate not a multiple of BLOCK_N
        (17, 16, 4, 96, 64, SMALL),  # hidden not a multiple of BLOCK_K (K tail masks)
        (70, 8, 2, 64, 160, TileConfig(block_m=32, block_n=64, block_k=128, group_m=4)),  # K tail on the down GEMM
        (5, 128, 4, 64, 32, SMALL),  # M3's expert count: 20 pairs over 128 experts
        (20, 8, 2, 64, 96, pick_config(8192)),  # the prefill tiles (128-row blocks, more rows than tokens)
    ],
)
def test_matches_reference(tokens, experts, top_k, hidden, inter, config):
    args = case(tokens, experts, top_k, hidden, inter, seed=tokens * 7 + experts)
    got = mxfp8_fused_experts(*args, ALPHA, LIMIT, config=config)
    assert_close(got, reference_fused_experts(*args, ALPHA, LIMIT))


def test_experts_with_many_tokens_span_several_blocks():
    """67 tokens over 3 of 8 experts: every hit expert fills several 16-row blocks (one partly)."""
    args = case(67, 8, 2, 64, 64, seed=11, concentrated=True)
    got = mxfp8_fused_experts(*args, ALPHA, LIMIT, config=SMALL)
    assert_close(got, reference_fused_experts(*args, ALPHA, LIMIT))


def test_plain_silu_without_alpha_and_limit():
    args = case(9, 8, 2, 64, 64, seed=3)
    got = mxfp8_fused_experts(*args, None, None, config=SMALL)
    assert_close(got, reference_fused_experts(*args, None, None))


def test_routed_weights_scale_the_output():
    """Doubling every routed weight doubles the output (the weights reach the down GEMM)."""
    x, w13, s13, w2, s2, weights, ids = case(6, 8, 2, 64, 64, seed=4)
    once = mxfp8_fused_experts(x, w13, s13, w2, s2, weights, ids, ALPHA, LIMIT, config=SMALL)
    twice = mxfp8_fused_experts(x, w13, s13, w2, s2, 2 * weights, ids, ALPHA, LIMIT, config=SMALL)
    assert torch.equal(twice.float(), 2 * once.float())


def test_expert_parallel_ranks_sum_to_the_whole():
    """Two ranks each holding half the experts (``first_expert``) sum to the single-rank result;
    pairs routed to the other rank's experts contribute nothing on this one."""
    x, w13, s13, w2, s2, weights, ids = case(11, 8, 4, 64, 64, seed=5)
    whole = reference_fused_experts(x, w13, s13, w2, s2, weights, ids, ALPHA, LIMIT)
    total = torch.zeros_like(whole)
    for rank in range(2):
        held = slice(4 * rank, 4 * rank + 4)
        args = (x, w13[held], s13[held], w2[held], s2[held], weights, ids)
        part = mxfp8_fused_experts(*args, ALPHA, LIMIT, first_expert=4 * rank, config=SMALL)
        assert_close(part, reference_fused_experts(*args, ALPHA, LIMIT, first_expert=4 * rank))
        total += part.float()
    assert ((total - whole).norm() / whole.norm()).item() <= 6e-3


def test_scale_bytes_decode_to_powers_of_two_and_zero():
    """Byte 0 is 0.0 (its group contributes nothing), bytes far from 127 are exact powers of two."""
    x, w13, s13, w2, s2, weights, ids = case(4, 4, 2, 64, 64, seed=6)
    s13[:, :, 0] = 0
    s2[:, :, 1] = 0
    s13[:, ::3, 1] = 90  # 2**-37: tiny but normal in bf16
    assert torch.equal(dequantize(w13[:, :, :32], s13[:, :, :1]), torch.zeros(4, 128, 32))
    got = mxfp8_fused_experts(x, w13, s13, w2, s2, weights, ids, ALPHA, LIMIT, config=SMALL)
    assert_close(got, reference_fused_experts(x, w13, s13, w2, s2, weights, ids, ALPHA, LIMIT))


def test_no_tokens():
    x, w13, s13, w2, s2, weights, ids = case(1, 4, 2, 64, 64, seed=0)
    out = mxfp8_fused_experts(x[:0], w13, s13, w2, s2, weights[:0], ids[:0], ALPHA, LIMIT)
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "tokens, top_k, experts, block_m, first_expert",
    [(1, 4, 128, 16, 0), (3, 2, 8, 16, 0), (17, 4, 16, 16, 8), (70, 4, 8, 32, 0), (40, 2, 200, 16, 100)],
)
def test_alignment_is_a_stable_sort_into_expert_blocks(tokens, top_k, experts, block_m, first_expert):
    """Each held pair appears once, in a block of its local expert, in slot order; padding rows
    hold the sentinel; unused blocks come last with expert -1; the block count is the static bound."""
    gen = torch.Generator().manual_seed(tokens + experts)
    ids = torch.randint(0, experts + 2 * first_expert, (tokens, top_k), generator=gen, dtype=torch.int64)
    sorted_slots, block_expert = align_tokens(ids, experts, block_m, first_expert)
    n = tokens * top_k
    blocks = num_blocks_bound(n, experts, block_m)
    assert block_expert.shape == (blocks,) and sorted_slots.shape == (blocks * block_m,)
    local = (ids.flatten() - first_expert).tolist()
    expected_rows = []
    for expert in range(experts):
        slots = [s for s in range(n) if local[s] == expert]
        if slots:
            expected_rows += [(expert, slots + [n] * (-len(slots) % block_m))]
    rows = sorted_slots.view(blocks, block_m).tolist()
    owners = block_expert.tolist()
    position = 0
    for expert, slots in expected_rows:
        for start in range(0, len(slots), block_m):
            assert owners[position] == expert
            assert rows[position] == slots[start : start + block_m]
            position += 1
    assert owners[position:] == [-1] * (blocks - position)


def test_refusals_name_the_argument():
    x, w13, s13, w2, s2, weights, ids = case(2, 4, 2, 64, 64, seed=1)
    with pytest.raises(ValueError, match="x must be"):
        mxfp8_fused_experts(x.float(), w13, s13, w2, s2, weights, ids, ALPHA, LIMIT)
    with pytest.raises(ValueError, match="w13 must be"):
        mxfp8_fused_experts(x, w13.to(torch.bfloat16), s13, w2, s2, weights, ids, ALPHA, LIMIT)
    with pytest.raises(ValueError, match="w2_scale must be uint8"):
        mxfp8_fused_experts(x, w13, s13, w2, s2[:, :, :1], weights, ids, ALPHA, LIMIT)
    with pytest.raises(ValueError, match="topk_ids"):
        mxfp8_fused_experts(x, w13, s13, w2, s2, weights, ids[:, :1], ALPHA, LIMIT)
    with pytest.raises(ValueError, match="alpha and limit"):
        mxfp8_fused_experts(x, w13, s13, w2, s2, weights, ids, ALPHA, None)
