"""The MXFP8 W8A16 dense linear compiled on CUDA, at M3's shapes.

One rank's slices at TP8 (qkv 1280 x 6144: K split across SMs; o 6144 x 1024; shared expert down
6144 x 384) and the whole qkv (9216 x 6144), against an fp32 matmul of the exactly dequantized
weight (TF32 off), on the GEMM path (1, 16, 100 tokens) and dequantize + matmul (300 tokens); the
tolerance of the interpreter tests (``tests/kernels/test_mxfp8_linear.py``). Then what only a GPU
shows: the split-K call captured in a CUDA graph and replayed on new activations with its tickets
back at zero, and two runs bit-identical (the last split sums the partials in split order).
fp32 activations (W8A32) at every shape on each path, and in a split-K graph, within
summation-order noise of the fp32 reference (``mxfp8_moe_reference.assert_fp32_close``).
Skipped without CUDA. Run on the lent GPU with ``scripts/gpu/run.sh tests``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPES = {"qkv_tp8": (1280, 6144), "o_tp8": (6144, 1024), "shared_down_tp8": (6144, 384), "qkv_tp1": (9216, 6144)}


def weight(rows, cols, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    values = torch.randn(rows, cols, generator=gen, device="cuda", dtype=torch.bfloat16) * 64
    scales = torch.randint(113, 117, (rows, cols // 32), generator=gen, device="cuda", dtype=torch.uint8)
    return values.clamp(-448, 448).to(torch.float8_e4m3fn), scales


def reference(x, w, s):
    from msa_kernels.mxfp8_moe_reference import dequantize

    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return x.float() @ dequantize(w, s).T
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def assert_close(got, want):
    assert torch.isfinite(got).all()
    got, want = got.double(), want.double()
    rel = ((got - want).norm() / want.norm()).item()
    bound = 2.0**-8 * want.abs() + 2.0**-16 * want.abs().max()
    print(f"[mxfp8 linear gpu] {tuple(got.shape)}: relative error {rel:.2e}")
    assert ((got - want).abs() <= bound).all() and rel <= 4e-3


@pytest.mark.parametrize("tokens", [1, 16, 100, 300])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_m3_shapes_match_reference(shape, tokens):
    from msa_kernels.triton_mxfp8_linear import mxfp8_linear, ticket_count

    w, s = weight(*SHAPES[shape], seed=tokens)
    x = torch.randn(tokens, SHAPES[shape][1], device="cuda").to(torch.bfloat16)
    tickets = torch.zeros(ticket_count(SHAPES[shape][0]), dtype=torch.int32, device="cuda")
    got = mxfp8_linear(x, w, s, tickets)
    assert_close(got, reference(x, w, s))
    assert torch.count_nonzero(tickets).item() == 0, "split tickets not back at zero"
    assert torch.equal(mxfp8_linear(x, w, s, tickets), got), "two runs differ"


def assert_split_k_graph_replays(tokens: int, weight_seed: int, replay_seeds, dtype=torch.bfloat16):
    """Capture one qkv_tp8 call at ``tokens`` tokens of ``dtype`` (the path its count takes), replay
    it on new inputs: each replay matches the reference (bf16: :func:`assert_close`; fp32:
    ``assert_fp32_close``) and leaves the split tickets at zero."""
    from msa_kernels.mxfp8_moe_reference import assert_fp32_close
    from msa_kernels.triton_mxfp8_linear import mxfp8_linear, ticket_count

    check = assert_close if dtype == torch.bfloat16 else assert_fp32_close
    w, s = weight(*SHAPES["qkv_tp8"], seed=weight_seed)
    tickets = torch.zeros(ticket_count(w.shape[0]), dtype=torch.int32, device="cuda")
    x = torch.randn(tokens, w.shape[1], device="cuda").to(dtype)
    mxfp8_linear(x, w, s, tickets)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mxfp8_linear(x, w, s, tickets)
    for seed in replay_seeds:
        x.copy_(torch.randn(x.shape, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda").to(dtype))
        graph.replay()
        torch.cuda.synchronize()
        check(out, reference(x, w, s))
        assert torch.count_nonzero(tickets).item() == 0


def test_split_k_captured_in_a_cuda_graph_and_replayed():
    assert_split_k_graph_replays(2, weight_seed=1, replay_seeds=(2, 3))


# ---------------------------------------------------------------- the GEMV (msa_kernels.mxfp8_gemv)


@pytest.mark.parametrize("tokens", [1, 2, 4])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gemv_m3_shapes_match_reference(shape, tokens):
    """The GEMV path (inline-PTX e4m3 conversion, K split by the plan) at every shape."""
    from msa_kernels.triton_mxfp8_linear import mxfp8_linear, ticket_count

    w, s = weight(*SHAPES[shape], seed=10 + tokens)
    x = torch.randn(tokens, SHAPES[shape][1], device="cuda").to(torch.bfloat16)
    tickets = torch.zeros(ticket_count(SHAPES[shape][0]), dtype=torch.int32, device="cuda")
    got = mxfp8_linear(x, w, s, tickets, path="gemv")
    assert_close(got, reference(x, w, s))
    assert torch.count_nonzero(tickets).item() == 0, "split tickets not back at zero"
    assert torch.equal(mxfp8_linear(x, w, s, tickets, path="gemv"), got), "two runs differ"


@pytest.mark.parametrize("tokens", [1, 4])
def test_gemv_split_k_captured_in_a_cuda_graph_and_replayed(tokens):
    from msa_kernels.triton_mxfp8_linear import linear_path

    assert linear_path(tokens) == "gemv"
    assert_split_k_graph_replays(tokens, weight_seed=4, replay_seeds=(5, 6))


# ---------------------------------------------------------------- fp32 activations (W8A32)


@pytest.mark.parametrize("tokens, path", [(1, "gemv"), (4, "gemv"), (16, "gemm"), (100, "gemm"), (300, "dequantize")])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp32_m3_shapes_match_fp32_reference(shape, tokens, path):
    """fp32 tokens at every shape on the path their count takes (the GEMV with Triton's e4m3 -> fp32
    conversion, the core's fp32 IEEE dots, dequantize + fp32 matmul): within summation-order noise
    of the fp32 reference; tickets back at zero, two runs identical."""
    from msa_kernels.mxfp8_moe_reference import assert_fp32_close
    from msa_kernels.triton_mxfp8_linear import linear_path, mxfp8_linear, ticket_count

    assert linear_path(tokens) == path
    w, s = weight(*SHAPES[shape], seed=20 + tokens)
    x = torch.randn(tokens, SHAPES[shape][1], device="cuda")
    tickets = torch.zeros(ticket_count(SHAPES[shape][0]), dtype=torch.int32, device="cuda")
    got = mxfp8_linear(x, w, s, tickets)
    worst, rel = assert_fp32_close(got, reference(x, w, s))
    print(f"[mxfp8 linear gpu fp32] {shape} T={tokens} {path}: relative error {rel:.2e}, max {worst:.2e} of scale")
    assert torch.count_nonzero(tickets).item() == 0, "split tickets not back at zero"
    assert torch.equal(mxfp8_linear(x, w, s, tickets), got), "two runs differ"


@pytest.mark.parametrize("tokens", [1, 16])
def test_fp32_split_k_captured_in_a_cuda_graph_and_replayed(tokens):
    """fp32 decode (the GEMV) and a verify-sized batch (the core), split K, as graphs replay them."""
    assert_split_k_graph_replays(tokens, weight_seed=7, replay_seeds=(8, 9), dtype=torch.float32)
