"""The MoE router's 16-bit GEMM on CUDA against the fp32 router it replaces.

The fp32 router weight is written as at most three bf16 (or fp16) parts summing to it exactly (one
for a bf16 checkpoint's router, three for a random fp32 one); with activations in that dtype every
product of an activation and a part is exact in fp32, so the GEMM's fp32 logits differ from the
fp32 linear's only in how the fp32 sums round: a few ulps of the logits' magnitude, and the same
top-k experts except where two scores tie within that. A weight the parts cannot hold keeps the
fp32 path. Also: the path inside a captured CUDA graph. Skipped without CUDA.

At up to ``MAX_GEMV_ROWS`` rows ``router_logits`` runs the Triton GEMV of
``sglang_m3.models.router_gemv`` instead of the GEMM: checked here against the GEMM over the parts
and the fp32 linear (same tolerance), bit for bit against ``c * w`` for rows with one nonzero power
of two ``c`` (the parts summed to the fp32 weight exactly), bit-identical from call to call, and
replayed in a CUDA graph. ``tests/kernels/test_router_gemv.py`` runs it under the interpreter.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sglang_m3.models.moe_routing import add_router_parameters, prepare_half_router, router_logits, sigmoid_topk_route
from sglang_m3.models.router_gemv import MAX_GEMV_ROWS, router_logits_gemv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

EXPERTS, HIDDEN, TOP_K = 128, 6144, 4


def _block(dtype: torch.dtype, exact: bool) -> nn.Module:
    block = nn.Module()
    add_router_parameters(block, SimpleNamespace(num_experts=EXPERTS, hidden_size=HIDDEN, use_routing_bias=True))
    block.cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(EXPERTS, HIDDEN, device="cuda", generator=gen) * HIDDEN**-0.5
    with torch.no_grad():
        block.gate.weight.copy_(weight.to(dtype).float() if exact else weight)
        block.e_score_correction_bias.copy_(torch.rand(EXPERTS, device="cuda", generator=gen) * 1e-2)
    return block


@pytest.mark.parametrize(("dtype", "exact"), [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float16, True)],
                         ids=["bf16-one-part", "bf16-split-fp32", "fp16-one-part"])
@pytest.mark.parametrize("tokens", [1, 4, 16, 8192])
def test_half_router_equals_the_fp32_router_up_to_summation_order(dtype, tokens, exact):
    block = _block(dtype, exact=exact)
    assert prepare_half_router(block, dtype)
    assert block.gate_half.shape[0] == (1 if exact else 3) * EXPERTS
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=torch.Generator(device="cuda").manual_seed(tokens)).to(dtype)
    fp32 = router_logits(block.gate, x)
    half = router_logits(block.gate, x, block.gate_half)
    assert half.dtype == torch.float32
    # |logit| is O(1) here; fp32 sums of 6144 (or 3 x 6144) exact products rounded otherwise differ by ~1e-6
    assert (half - fp32).abs().max().item() <= 2e-5 * fp32.abs().max().item()
    _, chosen32, _ = sigmoid_topk_route(block.gate, block.e_score_correction_bias, x, TOP_K)
    _, chosen16, _ = sigmoid_topk_route(block.gate, block.e_score_correction_bias, x, TOP_K, block.gate_half)
    same = (chosen32.sort(-1).values == chosen16.sort(-1).values).all(-1)
    assert same.float().mean().item() >= 0.999, f"{(~same).sum().item()} of {tokens} tokens chose other experts"


def test_a_weight_that_fp16_parts_cannot_hold_keeps_the_fp32_router():
    """A random fp32 weight of magnitude ~0.01 has bits below fp16's smallest subnormal (2**-24)."""
    block = _block(torch.float16, exact=False)
    assert not prepare_half_router(block, torch.float16)
    assert block.gate_half is None


@pytest.mark.parametrize("exact", [True, False], ids=["one-part", "split-fp32"])
def test_half_router_replays_in_a_cuda_graph(exact):
    block = _block(torch.bfloat16, exact=exact)
    assert prepare_half_router(block, torch.bfloat16)
    x = torch.zeros(16, HIDDEN, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        router_logits(block.gate, x, block.gate_half)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = router_logits(block.gate, x, block.gate_half)
    x.copy_(torch.randn(16, HIDDEN, device="cuda").bfloat16())
    graph.replay()
    torch.testing.assert_close(out, router_logits(block.gate, x, block.gate_half), rtol=0, atol=0)


def _parts_gemm(x: torch.Tensor, gate_half: torch.Tensor) -> torch.Tensor:
    """The GEMM over the parts that ``router_logits`` runs past ``MAX_GEMV_ROWS`` rows, called directly."""
    logits = torch.mm(x, gate_half.t(), out_dtype=torch.float32)
    parts = gate_half.shape[0] // EXPERTS
    return logits if parts == 1 else logits.view(-1, parts, EXPERTS).sum(1)


def _rows(tokens: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)).to(dtype)


@pytest.mark.parametrize(("dtype", "exact"), [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float16, True)],
                         ids=["bf16-one-part", "bf16-split-fp32", "fp16-one-part"])
@pytest.mark.parametrize("tokens", [1, 4, MAX_GEMV_ROWS])
def test_gemv_equals_the_gemm_over_the_parts_and_the_fp32_linear(dtype, exact, tokens):
    block = _block(dtype, exact=exact)
    assert prepare_half_router(block, dtype)
    x = _rows(tokens, dtype, seed=tokens)
    gemv = router_logits_gemv(x, block.gate_half, EXPERTS)
    assert gemv.dtype == torch.float32 and gemv.shape == (tokens, EXPERTS)
    assert torch.equal(router_logits(block.gate, x, block.gate_half), gemv)  # router_logits takes the GEMV here
    fp32 = router_logits(block.gate, x)
    gemm = _parts_gemm(x, block.gate_half)
    reference = x.double() @ block.gate.weight.double().t()
    scale = reference.abs().max().item()
    # as above: fp32 sums of 6144 terms, exact products (the parts summed to the fp32 weight exactly)
    # rounded otherwise, differ by ~1e-6 of the logits' magnitude
    assert (gemv - fp32).abs().max().item() <= 2e-5 * scale
    assert (gemv - gemm).abs().max().item() <= 2e-5 * scale
    assert (gemv.double() - reference).abs().max().item() <= 1e-5 * scale


@pytest.mark.parametrize(("dtype", "exact"), [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float16, True)],
                         ids=["bf16-one-part", "bf16-split-fp32", "fp16-one-part"])
def test_gemv_of_one_hot_rows_is_the_fp32_weight_exactly(dtype, exact):
    """Row t is a power of two ``c_t`` at column ``k_t``, zero elsewhere: the logit's only nonzero
    term is ``c_t * w[e, k_t]``, so the GEMV must give exactly that (a dropped or misplaced part,
    row or K step would not)."""
    block = _block(dtype, exact=exact)
    assert prepare_half_router(block, dtype)
    cols = [0, 1000, HIDDEN // 2 + 7, HIDDEN - 1, 5]
    scales = [1.0, -2.0, 0.5, 4.0, -0.25]
    x = torch.zeros(len(cols), HIDDEN, device="cuda", dtype=dtype)
    for t, (k, c) in enumerate(zip(cols, scales)):
        x[t, k] = c
    weight = block.gate.weight.detach()
    want = torch.stack([c * weight[:, k] for k, c in zip(cols, scales)])
    assert torch.equal(router_logits_gemv(x, block.gate_half, EXPERTS), want)


@pytest.mark.parametrize("tokens", [1, 4, MAX_GEMV_ROWS])
def test_gemv_is_bit_identical_from_call_to_call(tokens):
    block = _block(torch.bfloat16, exact=False)
    assert prepare_half_router(block, torch.bfloat16)
    x = _rows(tokens, torch.bfloat16, seed=7)
    first = router_logits_gemv(x, block.gate_half, EXPERTS)
    for _ in range(20):
        assert torch.equal(router_logits_gemv(x, block.gate_half, EXPERTS), first)


@pytest.mark.parametrize("exact", [True, False], ids=["one-part", "split-fp32"])
@pytest.mark.parametrize("tokens", [1, 4, MAX_GEMV_ROWS])
def test_gemv_replays_in_a_cuda_graph(exact, tokens):
    block = _block(torch.bfloat16, exact=exact)
    assert prepare_half_router(block, torch.bfloat16)
    x = torch.zeros(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        router_logits_gemv(x, block.gate_half, EXPERTS)  # compile outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = router_logits(block.gate, x, block.gate_half)
    for seed in (1, 2):
        x.copy_(_rows(tokens, torch.bfloat16, seed=seed))
        graph.replay()
        torch.testing.assert_close(out, router_logits_gemv(x, block.gate_half, EXPERTS), rtol=0, atol=0)
