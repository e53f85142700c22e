"""The dense layers' chunk-after-prefix attention on CUDA: two cuDNN calls merged by log-sum-exp.

``prefix_split_sdpa`` must give the chunk's causal attention over its prefix and itself, as the
single FlashAttention call with a lower-right causal mask does. Both run in bf16, so each is
compared with the same attention in fp32 (math kernel): the split's error may exceed the flash
call's only by bf16 output rounding (2^-8 of the output's magnitude, which is at most max |v|),
since the merge itself runs in fp32. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from sglang_m3.msa.dense_prefill import causal_sdpa, cudnn_takes, prefix_split_applies, prefix_split_sdpa

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _sdpa(q, keys, values, scale, backend, dtype):
    n, length = q.shape[0], keys.shape[0]
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(
            q.to(dtype).transpose(0, 1)[None], keys.to(dtype).transpose(0, 1)[None], values.to(dtype).transpose(0, 1)[None],
            attn_mask=causal_lower_right(n, length), scale=scale, enable_gqa=True,
        )
    return out[0].transpose(0, 1).float()


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(64, 4, 128), (16, 1, 128), (8, 8, 128), (4, 2, 32)])
@pytest.mark.parametrize("prefix, n", [(1, 1), (3, 200), (128, 1), (1000, 333), (8192, 2048)])
def test_split_matches_lower_right_causal_attention(heads, kv_heads, head_dim, prefix, n):
    """M3's widths (TP1, TP4, no GQA) and the tiny model's (head dim 32, the bf16 GPU tests)."""
    gen = torch.Generator(device="cuda").manual_seed(prefix + n)
    keys, values = (torch.randn(prefix + n, kv_heads, head_dim, device="cuda", generator=gen) for _ in range(2))
    q = torch.randn(n, heads, head_dim, device="cuda", generator=gen) * 2
    scale = head_dim**-0.5
    q16, k16, v16 = (t.to(torch.bfloat16) for t in (q, keys, values))
    exact = _sdpa(q16.float(), k16.float(), v16.float(), scale, SDPBackend.MATH, torch.float32)
    flash_error = (_sdpa(q16, k16, v16, scale, SDPBackend.FLASH_ATTENTION, torch.bfloat16) - exact).abs().max()
    assert prefix_split_applies(q16)
    split = prefix_split_sdpa(q16, k16, v16, scale)
    assert split.dtype == torch.bfloat16 and split.shape == (n, heads, head_dim)
    split_error = (split.float() - exact).abs().max()
    assert split_error <= flash_error + 2**-8 * v16.float().abs().max()
    # causal_sdpa routes a chunk after a prefix there where cuDNN takes the shape, else to the flash call
    routed = causal_sdpa(q16, k16, v16, scale)
    if cudnn_takes(n, prefix + n):
        torch.testing.assert_close(routed, split, rtol=0, atol=0)
    else:
        flash = _sdpa(q16, k16, v16, scale, SDPBackend.FLASH_ATTENTION, torch.bfloat16)
        torch.testing.assert_close(routed.float(), flash, rtol=0, atol=0)


def test_switch_off_keeps_the_flash_call(monkeypatch):
    monkeypatch.setenv("SGLANG_M3_DENSE_PREFIX_SPLIT", "0")
    q = torch.randn(5, 8, 128, device="cuda", dtype=torch.bfloat16)
    keys, values = (torch.randn(20, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    flash = _sdpa(q, keys, values, 0.1, SDPBackend.FLASH_ATTENTION, torch.bfloat16)
    torch.testing.assert_close(causal_sdpa(q, keys, values, 0.1).float(), flash, rtol=0, atol=0)


def test_prepared_cudnn_then_every_aligned_form():
    """After the server's start-up steps (the kernels, then the plans of 8K chunks up to a 24K
    prefix), each aligned form at M3's widths at TP4 (16 query heads over one KV head), on those
    plans and beyond them, keeps the bound of the test above."""
    from sglang_m3.msa.dense_prefill import prebuild_chunk_plans, prepare_cudnn

    assert prepare_cudnn(16, 1, 128, torch.bfloat16, torch.device("cuda")) > 0
    assert prebuild_chunk_plans(16, 1, 128, torch.bfloat16, torch.device("cuda"), chunk=8192, context=4 * 8192)[0] == 4
    gen = torch.Generator(device="cuda").manual_seed(3)
    for prefix, n in [(0, 1024), (0, 8192), (8192, 8192), (3 * 8192, 4096)]:
        keys, values = (torch.randn(prefix + n, 1, 128, device="cuda", generator=gen).bfloat16() for _ in range(2))
        q = torch.randn(n, 16, 128, device="cuda", generator=gen).bfloat16()
        exact = _sdpa(q.float(), keys.float(), values.float(), 128**-0.5, SDPBackend.MATH, torch.float32)
        flash_error = (_sdpa(q, keys, values, 128**-0.5, SDPBackend.FLASH_ATTENTION, torch.bfloat16) - exact).abs().max()
        assert (causal_sdpa(q, keys, values, 128**-0.5).float() - exact).abs().max() <= flash_error + 2**-8 * values.float().abs().max()


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(64, 4, 128), (32, 2, 128), (4, 2, 32)])
@pytest.mark.parametrize("prefix, n", [(128, 1), (1000, 333), (8192, 2048)])
def test_fused_merge_gives_the_torch_merges_bits(monkeypatch, heads, kv_heads, head_dim, prefix, n):
    """``SGLANG_M3_FUSED_LSE_MERGE=1`` (the default): the merge in one Triton pass (libdevice exp, no contraction,
    IEEE division) must give the torch ops' bf16 output bit for bit, at M3's TP1 and TP2 widths."""
    from sglang_m3.msa.dense_prefill import FUSED_MERGE_ENV

    gen = torch.Generator(device="cuda").manual_seed(prefix * 7 + n)
    keys, values = (torch.randn(prefix + n, kv_heads, head_dim, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    q = (torch.randn(n, heads, head_dim, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    scale = head_dim**-0.5
    monkeypatch.setenv(FUSED_MERGE_ENV, "0")
    torch_merged = prefix_split_sdpa(q, keys, values, scale)
    monkeypatch.setenv(FUSED_MERGE_ENV, "1")
    fused = prefix_split_sdpa(q, keys, values, scale)
    assert fused.is_contiguous()
    torch.testing.assert_close(fused, torch_merged, rtol=0, atol=0)
