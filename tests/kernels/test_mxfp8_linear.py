"""The MXFP8 W8A16 dense linear (Triton interpreter, CPU) against an fp32 matmul of the exactly
dequantized weight.

Every path of ``msa_kernels.triton_mxfp8_linear`` (the GEMV of ``msa_kernels.mxfp8_gemv``, the
MMA core, dequantize + matmul) multiplies exact operands (every e4m3 element times
its power-of-two scale is a bf16 value) and accumulate in fp32, so they differ from the fp32
reference by summation order and the one rounding of the output to bf16 (relative 2**-9 per
element). Asserted per element: ``|got - want| <= 2**-8 * |want| + 2**-16 * max |want|`` (the
second term covers outputs that cancel to near zero, where summation order shows), and the
relative Frobenius error <= 4e-3; a wrong group, scale byte, split or row moves outputs by O(1).
fp32 activations (W8A32) keep fp32 on every path and are held to
``mxfp8_moe_reference.assert_fp32_close`` (summation-order noise only: every element within 2**-16
of the largest output, relative Frobenius error <= 1e-5).
Intermediate buffers come poisoned (NaN / huge ints) so an unwritten output cannot pass as zero.
"""

from __future__ import annotations

import pytest
import torch
from interpreter_only import INTERPRETER_ONLY

from msa_kernels import mxfp8_gemm
from msa_kernels import triton_mxfp8_linear as linear
from msa_kernels.mxfp8_gemv import GemvTile
from msa_kernels.mxfp8_moe_reference import assert_fp32_close
from msa_kernels.mxfp8_moe_reference import dequantize as reference_dequantize
from msa_kernels.triton_mxfp8_linear import linear_path, mxfp8_linear, split_plan, ticket_count

pytestmark = [
    INTERPRETER_ONLY,
    pytest.mark.usefixtures("poisoned_buffers"),
]


def weight(rows, cols, seed, exponents=(112, 124)):
    gen = torch.Generator().manual_seed(seed)
    elements = (torch.randn(rows, cols, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.randint(exponents[0], exponents[1] + 1, (rows, cols // 32), generator=gen, dtype=torch.uint8)
    return elements, scales


def activations(tokens, cols, seed, dtype=torch.bfloat16):
    return torch.randn(tokens, cols, generator=torch.Generator().manual_seed(seed)).to(dtype)


def reference(x, w, s):
    return x.float() @ reference_dequantize(w, s).T


def assert_close(got, want):
    assert got.shape == want.shape and torch.isfinite(got).all()
    got, want = got.double(), want.double()
    bound = 2.0**-8 * want.abs() + 2.0**-16 * want.abs().max()
    assert ((got - want).abs() <= bound).all(), f"max excess {((got - want).abs() - bound).max().item():.3e}"
    assert ((got - want).norm() / want.norm()).item() <= 4e-3


@pytest.mark.parametrize(
    "tokens, rows, cols, splits",
    [
        (1, 64, 256, 1),  # decode, one tile, 4-group K steps
        (3, 80, 192, 1),  # rows not a multiple of BLOCK_N, 2-group K steps
        (5, 64, 96, 1),  # 1-group K steps
        (17, 64, 128, 1),  # two token blocks
        (2, 96, 512, 2),  # K split in 2: the last split to finish sums the partials
        (4, 64, 384, 3),  # K split in 3
        (18, 80, 640, 4),  # split with two token blocks and a partial row tile
    ],
)
def test_matches_reference(tokens, rows, cols, splits):
    """The MMA core (``path="gemm"``: the GEMV serves the smallest of these token counts)."""
    w, s = weight(rows, cols, seed=rows + cols)
    x = activations(tokens, cols, seed=tokens)
    tickets = torch.zeros(ticket_count(rows), dtype=torch.int32)
    got = mxfp8_linear(x, w, s, tickets, splits=splits, path="gemm")
    assert got.dtype == torch.bfloat16
    assert_close(got, reference(x, w, s))
    assert torch.equal(tickets, torch.zeros_like(tickets)), "tickets not back at zero"
    assert torch.equal(mxfp8_linear(x, w, s, tickets, splits=splits, path="gemm"), got), "a second call with the same tickets differs"


@pytest.mark.parametrize(
    "tokens, rows, cols, splits, tile",
    [
        (1, 64, 256, 1, None),  # decode, 8-group (int64 scale word) K steps
        (2, 72, 192, 1, None),  # rows not a multiple of the tile (16), 2-group K steps
        (3, 48, 96, 1, GemvTile(block_n=8, block_k=64)),  # three tokens in a 4-token program, 1-group steps
        (4, 96, 512, 2, None),  # K split in 2: the last split to finish sums the partials
        (5, 64, 384, 3, None),  # two token blocks (4 + 1), K split in 3
        (2, 40, 640, None, GemvTile(block_n=8, block_k=128, num_warps=2)),  # the planned split (132 SMs off CUDA)
    ],
)
def test_gemv_matches_reference(tokens, rows, cols, splits, tile):
    """The GEMV (``mxfp8_gemv.linear_kernel``): every token of a program against each weight tile
    converted once, K split with the same tickets as the MMA core."""
    w, s = weight(rows, cols, seed=rows + cols + 1)
    x = activations(tokens, cols, seed=tokens + 1)
    tickets = torch.zeros(ticket_count(rows), dtype=torch.int32)
    got = mxfp8_linear(x, w, s, tickets, splits=splits, path="gemv", gemv_tile=tile)
    assert got.dtype == torch.bfloat16
    assert_close(got, reference(x, w, s))
    assert torch.equal(tickets, torch.zeros_like(tickets)), "tickets not back at zero"
    assert torch.equal(mxfp8_linear(x, w, s, tickets, splits=splits, path="gemv", gemv_tile=tile), got), "a second call differs"


def test_token_count_picks_the_path():
    """The GEMV up to GEMV_MAX_TOKENS tokens, the MMA core up to GEMM_MAX_TOKENS, dequantize + matmul beyond."""
    assert set(linear.PATHS) == {"gemv", "gemm", "dequantize"} and 1 <= linear.GEMV_MAX_TOKENS < linear.GEMM_MAX_TOKENS
    assert linear_path(1) == linear_path(linear.GEMV_MAX_TOKENS) == "gemv"
    assert linear_path(linear.GEMV_MAX_TOKENS + 1) == linear_path(linear.GEMM_MAX_TOKENS) == "gemm"
    assert linear_path(linear.GEMM_MAX_TOKENS + 1) == "dequantize"
    with pytest.raises(ValueError, match="path must be one of"):
        mxfp8_linear(activations(1, 64, seed=0), *weight(32, 64, seed=0), path="mma")


@pytest.mark.parametrize("path", ["gemv", "gemm"])
def test_fp16_activations_and_leading_dims(path):
    w, s = weight(64, 128, seed=1)
    x = activations(6, 128, seed=2, dtype=torch.float16).reshape(2, 3, 128)
    got = mxfp8_linear(x, w, s, path=path)
    assert got.shape == (2, 3, 64) and got.dtype == torch.float16
    assert_close(got.reshape(6, 64), reference(x.reshape(6, 128), w, s))


@pytest.mark.parametrize("path", ["gemv", "gemm"])
def test_rows_of_any_magnitude_and_subnormal_weights(path):
    """Activation rows past fp16's range and far below it, weights of mostly subnormal e4m3
    elements with scales far from 1: the bf16 dot (and the GEMV's fp32 FMAs) need no prescale,
    every row stays exact."""
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(64, 128, generator=gen) * 2.0**-7).to(torch.float8_e4m3fn)
    assert ((w.view(torch.uint8) & 0x78) == 0).float().mean() > 0.5
    s = torch.full((64, 4), 127 - 30, dtype=torch.uint8)
    x = activations(4, 128, seed=4) * torch.tensor([2.0**40, 1.0, 2.0**-60, 0.0])[:, None].to(torch.bfloat16)
    got = mxfp8_linear(x, w, s, path=path)
    want = reference(x, w, s)
    assert torch.equal(got[3].float(), torch.zeros(64))
    for row in (0, 1, 2):
        assert_close(got[row : row + 1], want[row : row + 1])


@pytest.mark.parametrize(
    "tokens, rows, cols, splits, path",
    [
        (3, 80, 192, 1, "gemv"),  # three tokens in a 4-token program, a partial row tile
        (4, 96, 512, 2, "gemv"),  # K split: the fp32 partials summed by the last split
        (17, 64, 128, 1, "gemm"),  # two token blocks
        (18, 80, 640, 4, "gemm"),  # K split with a partial row tile
        (9, 48, 96, None, "dequantize"),
    ],
)
def test_fp32_activations_match_the_fp32_reference(tokens, rows, cols, splits, path):
    """fp32 tokens (not bf16 values) on every path: an fp32 result within summation-order noise of
    the fp32 reference (no TF32, no 16-bit step), tickets back at zero."""
    w, s = weight(rows, cols, seed=rows + cols + 2)
    x = activations(tokens, cols, seed=tokens + 2, dtype=torch.float32)
    tickets = torch.zeros(ticket_count(rows), dtype=torch.int32)
    assert_fp32_close(mxfp8_linear(x, w, s, tickets, splits=splits, path=path), reference(x, w, s))
    assert torch.equal(tickets, torch.zeros_like(tickets)), "tickets not back at zero"


def test_many_tokens_take_dequantize_and_matmul(monkeypatch):
    """Past GEMM_MAX_TOKENS the weight is dequantized (exactly) and multiplied by torch."""
    w, s = weight(48, 96, seed=5)
    x = activations(9, 96, seed=6)
    assert_close(mxfp8_linear(x, w, s, path="dequantize"), reference(x, w, s))
    monkeypatch.setattr(linear, "GEMM_MAX_TOKENS", 4)
    calls = []
    monkeypatch.setattr(linear, "dequantize", lambda *args: calls.append(args) or mxfp8_gemm.dequantize(*args))
    assert_close(mxfp8_linear(x, w, s), reference(x, w, s))
    assert len(calls) == 1


def test_device_dequantize_equals_the_reference():
    w, s = weight(40, 160, seed=7, exponents=(1, 140))
    s[:, 0] = 0  # byte 0 decodes to 0.0
    assert torch.equal(mxfp8_gemm.dequantize(w, s, torch.bfloat16), reference_dequantize(w, s).to(torch.bfloat16))


def test_prescale_rows_scales_each_row_by_an_exact_power_of_two():
    """``mxfp8_gemm.prescale_rows`` (the fp16 dots' activations): x16 = x * 2**s exactly for bf16
    rows of any magnitude, the largest entry in [2**14, 2**15), an all-zero row left at zero."""
    factors = torch.tensor([1.0, 2.0**40, 2.0**-60, 0.0, 2.0**100])
    x = (activations(5, 2500, seed=9) * factors[:, None]).to(torch.bfloat16)
    x16, shifts = mxfp8_gemm.prescale_rows(x)
    assert x16.dtype == torch.float16 and shifts.dtype == torch.int32
    assert torch.equal(x16.float(), x.float() * torch.pow(2.0, shifts.float())[:, None])
    largest = x16.float().abs().amax(dim=1)
    assert ((largest[[0, 1, 2, 4]] >= 2**14) & (largest[[0, 1, 2, 4]] < 2**15)).all()
    assert shifts[3] == 126 and not x16[3].any()


def test_split_plan_fills_the_gpu():
    """Tiles alone when they cover the SMs; otherwise K split into whole steps, none empty, for
    about PROGRAMS_PER_SM programs per SM (within a factor of two: steps are whole)."""
    assert split_plan(600, 48, 132) == (1, 48)
    for tiles, steps in ((20, 48), (96, 8), (12, 48), (96, 3), (1, 1)):
        splits, per_split = split_plan(tiles, steps, 132)
        assert (splits - 1) * per_split < steps <= splits * per_split
        target = linear.PROGRAMS_PER_SM * 132
        assert tiles * splits < 2 * target and (splits == steps or tiles * splits >= target / 2)


def test_refusals():
    w, s = weight(64, 128, seed=8)
    with pytest.raises(ValueError, match="x must be"):
        mxfp8_linear(activations(2, 128, seed=0).double(), w, s)
    with pytest.raises(ValueError, match="scales must be"):
        mxfp8_linear(activations(2, 128, seed=0), w, s[:, :2])
    w, s = weight(64, 512, seed=8)
    with pytest.raises(ValueError, match="tickets"):
        mxfp8_linear(activations(2, 512, seed=0), w, s, torch.zeros(0, dtype=torch.int32), splits=2)


_COMPILE_FOR_HOPPER = """
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from msa_kernels import mxfp8_gemv
from msa_kernels.mxfp8_gemm import dequantize_kernel
from msa_kernels.triton_mxfp8_linear import BLOCK_K, BLOCK_M, BLOCK_N, NUM_WARPS, linear_kernel

TYPES = {"x_ptr": "*bf16", "y_ptr": "*bf16", "w_ptr": "*fp8e4nv", "words_ptr": "*i64", "partial_ptr": "*fp32", "out_ptr": "*bf16"}


def compile_for_sm90(kernel, consts, stages, warps=NUM_WARPS):
    signature = {n: "constexpr" if n in consts else TYPES.get(n, "*i32" if n.endswith("_ptr") else "i32") for n in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
               if n not in consts and (signature[n].startswith("*") or n.startswith(("stride", "K")))}
    return triton.compile(ASTSource(kernel, signature, consts, aligned), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages}).asm["ptx"]


ptx = compile_for_sm90(linear_kernel, dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, GROUPS=BLOCK_K // 32, DOT_DTYPE=tl.bfloat16), 3)
assert "mma.sync" in ptx and ".bf16.bf16" in ptx and "wgmma" not in ptx, "not bf16 mma.sync"
assert "cp.async" in ptx, "weight loads not pipelined"
assert "atom.global.gpu.acq_rel.add" in ptx, "split ticket not acquire-release"
compile_for_sm90(dequantize_kernel, dict(BLOCK_N=32, GROUPS=8), 1, warps=4)
TYPES.update(w_ptr="*i32", s_ptr="*i64")
tile = mxfp8_gemv.linear_gemv_tile(6144)
consts = dict(BLOCK_T=mxfp8_gemv.LINEAR_BLOCK_T, BLOCK_N=tile.block_n, GROUPS=tile.block_k // 32, ASM=True)
ptx = compile_for_sm90(mxfp8_gemv.linear_kernel, consts, 1, warps=tile.num_warps)
assert "cvt.rn.f16x2.e4m3x2" in ptx and "mma" not in ptx, "GEMV: not the paired e4m3 conversion without MMA"
assert "atom.global.gpu.acq_rel.add" in ptx, "GEMV split ticket not acquire-release"
print("compiled")
"""


def test_kernels_compile_for_hopper():
    """The interpreter does not run Triton's compiler: compile for sm_90 (no GPU needed) and
    check the bf16 mma.sync, the pipelined weight loads and the acquire-release split ticket; the
    GEMV's paired e4m3 conversion (inline PTX, which the interpreter never runs) and its ticket."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
