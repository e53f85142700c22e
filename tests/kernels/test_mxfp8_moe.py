"""The MXFP8 W8A16 MoE kernels (Triton interpreter, CPU) against the torch reference.

``msa_kernels.mxfp8_moe_reference`` dequantizes and runs each hit expert in fp32 from the same
bf16 inputs. The three GEMM paths accumulate in fp32 from exact operands (the fp16 path's e4m3 ->
fp16 weights and power-of-two prescaled fp16 activations are exact, see ``msa_kernels.mxfp8_gemm``),
then round intermediate results: the bf16 and widen paths three times to bf16 (the activation,
each slot's weighted expert output, the token sum; each a relative error of at most 2**-9), the
fp16 path the activation once to fp16 (its prescaled row: 2**-12) and the other two to bf16. The
GEMV path (``msa_kernels.mxfp8_gemv``) rounds twice to bf16: the activation and the token's sum
over its slots (kept in fp32 until then).
Measured relative Frobenius error 2.5e-3..3.1e-3 (widen path) and 2.5e-3..2.8e-3 (fp16 path),
largest element error 3.3e-3 and 4.3e-3 of the output's largest magnitude. Asserted: relative Frobenius error <= 6e-3 and every
element within 1e-2 of the output's largest magnitude, all finite: room for the rounding, while
a wrong scale group, expert, slot, routed weight or prescale moves results by O(1) relative.
Every comparison runs on every path (``path=``); the token-count dispatch between them is tested
on its own.

fp32 activations (W8A32, fp32 models) run the GEMV, bf16-core and widen paths with fp32 throughout
and are held to ``mxfp8_moe_reference.assert_fp32_close``: within summation-order noise of the
fp32 reference (every element within 2**-16 of the largest output, relative Frobenius error
<= 1e-5; the reference module states why), which any 16-bit rounding on the way would break.

Each test draws fresh inputs (its own seed). Intermediate buffers are allocated poisoned (NaN,
out-of-range indices) so a row or block the kernels forget to write cannot pass as zeros.
``tests/gpu/test_mxfp8_moe_gpu.py`` runs the same comparison compiled at M3's real shape.
"""

from __future__ import annotations

import pytest
import torch
from interpreter_only import INTERPRETER_ONLY

from msa_kernels import mxfp8_gemv
from msa_kernels.mxfp8_gemv import GemvTile, MoeGemvConfig, moe_config
from msa_kernels.mxfp8_moe_reference import assert_fp32_close, dequantize, reference_fused_experts
from msa_kernels.triton_mxfp8_moe import (
    CORE_DOT,
    CORE_PATH_MAX_TOKENS,
    GEMV_MAX_TOKENS,
    PATHS,
    TileConfig,
    align_tokens,
    gemm_path,
    mxfp8_fused_experts,
    num_blocks_bound,
    pick_config,
)

pytestmark = [
    INTERPRETER_ONLY,
    pytest.mark.usefixtures("poisoned_buffers"),
]

ALPHA, LIMIT = 1.702, 7.0
SMALL = TileConfig(block_m=16, block_n=32, block_k=64)


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
    got, want = got.double(), want.double()  # norms of tiny rows would underflow in fp32
    scale = want.abs().max().item()
    assert scale > 0
    rel = ((got - want).norm() / want.norm()).item()
    worst = (got - want).abs().max().item()
    assert rel <= 6e-3, f"relative Frobenius error {rel:.3e}"
    assert worst <= 1e-2 * scale, f"max |error| {worst:.3e} > 1e-2 x {scale:.3e}"


def assert_rows_close(got, want):
    """:func:`assert_close` row by row: rows of very different magnitudes each within the bound."""
    for row in range(want.shape[0]):
        assert_close(got[row : row + 1], want[row : row + 1])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, inter, config",
    [
        (1, 8, 2, 64, 64, None),  # decode: most experts empty
        (3, 8, 4, 128, 96, SMALL),  # intermediate not a multiple of BLOCK_N; core paths: 2-group K steps
        (17, 16, 4, 96, 64, SMALL),  # hidden not a multiple of BLOCK_K (widen path: K tail masks; core: 1-group steps)
        (70, 8, 2, 64, 160, TileConfig(block_m=32, block_n=64, block_k=128, group_m=4)),  # K tail on the down GEMM
        (5, 128, 4, 64, 32, SMALL),  # M3's expert count: 20 pairs over 128 experts
        (20, 8, 2, 64, 96, pick_config(8192)),  # the prefill tiles (128-row blocks, more rows than tokens)
        (4, 8, 2, 256, 128, None),  # core paths: 8-group (int64-word) K steps in gate/up, 4-group (int32) in down
    ],
)
def test_matches_reference(tokens, experts, top_k, hidden, inter, config, path):
    if path == "gemv" and tokens > GEMV_MAX_TOKENS:
        pytest.skip("the GEMV path serves decode batches; its own cases below route a few tokens")
    args = case(tokens, experts, top_k, hidden, inter, seed=tokens * 7 + experts)
    got = mxfp8_fused_experts(*args, ALPHA, LIMIT, config=config, path=path)
    assert_close(got, reference_fused_experts(*args, ALPHA, LIMIT))


@pytest.mark.parametrize("path", [path for path in PATHS if path != "gemv"])
def test_experts_with_many_tokens_span_several_blocks(path):
    """67 tokens over 3 of 8 experts: every hit expert fills several 16-row blocks (one partly;
    the GEMM paths' alignment: the GEMV path has no blocks)."""
    args = case(67, 8, 2, 64, 64, seed=11, concentrated=True)
    got = mxfp8_fused_experts(*args, ALPHA, LIMIT, config=SMALL, path=path)
    assert_close(got, reference_fused_experts(*args, ALPHA, LIMIT))


@pytest.mark.parametrize("path", PATHS)
def test_activation_rows_of_any_magnitude(path):
    """Token rows scaled by 2**20 (entries past fp16's 65504), 2**-40 and 2**-60 (past fp16's
    subnormals, as are their activations), and an all-zero row, among ordinary ones: the fp16 path's per-row power-of-two
    prescales (of the tokens and of the activations) keep each row exact, so every row is within
    the bound of its own magnitude."""
    x, w13, s13, w2, s2, weights, ids = case(6, 8, 2, 128, 64, seed=21)
    factors = torch.tensor([2.0**20, 1.0, 2.0**-40, 0.0, 2.0**-60, 1.0])
    x = (x.float() * factors[:, None]).to(torch.bfloat16)
    assert x[0].float().abs().max() > 65504 and x[4].float().abs().max() < 2.0**-60
    want = reference_fused_experts(x, w13, s13, w2, s2, weights, ids, ALPHA, LIMIT)
    got = mxfp8_fused_experts(x, w13, s13, w2, s2, weights, ids, ALPHA, LIMIT, config=SMALL, path=path)
    assert torch.equal(got[3].float(), torch.zeros(128))
    assert_rows_close(got[[0, 1, 2, 4, 5]], want[[0, 1, 2, 4, 5]])


@pytest.mark.parametrize("path", PATHS)
def test_subnormal_e4m3_weights(path):
    """Weights whose e4m3 elements are mostly subnormal (|v| < 2**-6: exponent field 0), with
    scales far from 1 (2**-40 and 2**30): they convert exactly to fp16 and bf16 alike."""
    x, w13, s13, w2, s2, weights, ids = case(5, 8, 2, 64, 64, seed=22)
    gen = torch.Generator().manual_seed(23)
    w13 = (torch.randn(w13.shape, generator=gen) * 2.0**-7).to(torch.float8_e4m3fn)
    w2 = (torch.randn(w2.shape, generator=gen) * 2.0**-7).to(torch.float8_e4m3fn)
    subnormal = (w13.view(torch.uint8) & 0x78) == 0
    assert subnormal.float().mean() > 0.5 and (w13.float() != 0).float().mean() > 0.5
    s13 = torch.full_like(s13, 127 - 40 + 5)
    s2 = torch.full_like(s2, 127 + 30 - 5)
    x = (x.float() * 2.0**40 / 64).to(torch.bfloat16)  # gate/up back to order 1
    args = (x, w13, s13, w2, s2, weights, ids)
    got = mxfp8_fused_experts(*args, ALPHA, LIMIT, config=SMALL, path=path)
    assert_close(got, reference_fused_experts(*args, ALPHA, LIMIT))


@pytest.mark.parametrize("path", PATHS)
def test_plain_silu_without_alpha_and_limit(path):
    args = case(9, 8, 2, 64, 64, seed=3)
    got = mxfp8_fused_experts(*args, None, None, config=SMALL, path=path)
    assert_close(got, reference_fused_experts(*args, None, None))


@pytest.mark.parametrize("path", PATHS)
def test_routed_weights_scale_the_output(path):
    """Doubling every routed weight doubles the output (the weights reach the down GEMM)."""
    x, w13, s13, w2, s2, weights, ids = case(6, 8, 2, 64, 64, seed=4)
    once = mxfp8_fused_experts(x, w13, s13, w2, s2, weights, ids, ALPHA, LIMIT, config=SMALL, path=path)
    twice = mxfp8_fused_experts(x, w13, s13, w2, s2, 2 * weights, ids, ALPHA, LIMIT, config=SMALL, path=path)
    assert torch.equal(twice.float(), 2 * once.float())


@pytest.mark.parametrize("path", PATHS)
def test_expert_parallel_ranks_sum_to_the_whole(path):
    """Two ranks each holding half the experts (``first_expert``) sum to the single-rank result;
    pairs routed to the other rank's experts contribute nothing on this one."""
    x, w13, s13, w2, s2, weights, ids = case(11, 8, 4, 64, 64, seed=5)
    whole = reference_fused_experts(x, w13, s13, w2, s2, weights, ids, ALPHA, LIMIT)
    total = torch.zeros_like(whole)
    for rank in range(2):
        held = slice(4 * rank, 4 * rank + 4)
        args = (x, w13[held], s13[held], w2[held], s2[held], weights, ids)
        part = mxfp8_fused_experts(*args, ALPHA, LIMIT, first_expert=4 * rank, config=SMALL, path=path)
        assert_close(part, reference_fused_experts(*args, ALPHA, LIMIT, first_expert=4 * rank))
        total += part.float()
    assert ((total - whole).norm() / whole.norm()).item() <= 6e-3


@pytest.mark.parametrize("path", PATHS)
def test_scale_bytes_decode_to_powers_of_two_and_zero(path):
    """Byte 0 is 0.0 (its group contributes nothing), bytes far from 127 are exact powers of two."""
    x, w13, s13, w2, s2, weights, ids = case(4, 4, 2, 128, 128, seed=6)
    s13[:, :, 0] = 0
    s2[:, :, 1] = 0
    s13[:, ::3, 3] = 90  # 2**-37: tiny but normal in bf16; the last byte of an int32 scale word
    assert torch.equal(dequantize(w13[:, :, :32], s13[:, :, :1]), torch.zeros(4, 256, 32))
    got = mxfp8_fused_experts(x, w13, s13, w2, s2, weights, ids, ALPHA, LIMIT, path=path)
    assert_close(got, reference_fused_experts(x, w13, s13, w2, s2, weights, ids, ALPHA, LIMIT))


def test_token_count_picks_the_path():
    """The GEMV up to GEMV_MAX_TOKENS tokens, the served core path up to CORE_PATH_MAX_TOKENS,
    widen beyond; an unknown path is refused."""
    assert CORE_DOT in ("fp16", "bf16") and set(PATHS) == {"gemv", "fp16", "bf16", "widen"}
    assert 1 <= GEMV_MAX_TOKENS < CORE_PATH_MAX_TOKENS
    assert gemm_path(1) == gemm_path(GEMV_MAX_TOKENS) == "gemv"
    assert gemm_path(GEMV_MAX_TOKENS + 1) == gemm_path(CORE_PATH_MAX_TOKENS) == CORE_DOT
    assert gemm_path(CORE_PATH_MAX_TOKENS + 1) == "widen"
    assert isinstance(pick_config(1, "gemv"), MoeGemvConfig) and isinstance(pick_config(1, CORE_DOT), TileConfig)
    with pytest.raises(ValueError, match="path must be one of"):
        mxfp8_fused_experts(*case(1, 4, 2, 64, 64, seed=0), ALPHA, LIMIT, path="fp8")


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
        mxfp8_fused_experts(x.double(), w13, s13, w2, s2, weights, ids, ALPHA, LIMIT)
    with pytest.raises(ValueError, match="w13 must be"):
        mxfp8_fused_experts(x, w13.to(torch.bfloat16), s13, w2, s2, weights, ids, ALPHA, LIMIT)
    with pytest.raises(ValueError, match="w2_scale must be uint8"):
        mxfp8_fused_experts(x, w13, s13, w2, s2[:, :, :1], weights, ids, ALPHA, LIMIT)
    with pytest.raises(ValueError, match="topk_ids"):
        mxfp8_fused_experts(x, w13, s13, w2, s2, weights, ids[:, :1], ALPHA, LIMIT)
    with pytest.raises(ValueError, match="alpha and limit"):
        mxfp8_fused_experts(x, w13, s13, w2, s2, weights, ids, ALPHA, None)


# ---------------------------------------------------------------- the GEMV path's own cases

GEMV_SMALL = MoeGemvConfig(gate_up=GemvTile(block_n=8, block_k=64), down=GemvTile(block_n=16, block_k=128))


def routed_with_repeats(tokens, experts, top_k, seed):
    """Random ids with repeats across tokens and within a token (token 0's last slot repeats its
    first: the kernels treat every slot on its own)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen, dtype=torch.int32)
    ids[0, -1] = ids[0, 0]
    return ids


@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, inter, config",
    [
        (1, 8, 4, 96, 96, None),  # decode; hidden and intermediate not multiples of the tiles (16, 8)
        (2, 4, 4, 128, 160, GEMV_SMALL),  # 8 slots on 4 experts: shared ones; 2-group K steps
        (5, 8, 3, 160, 64, GEMV_SMALL),  # top-3: the down kernel's fourth slot is padding; 1-group steps (160 = 5 x 32)
        (2, 16, 2, 256, 96, None),  # 8-group (int64) scale words in gate/up, 1-group in down
    ],
)
def test_gemv_matches_reference_with_repeated_experts(tokens, experts, top_k, hidden, inter, config):
    x, w13, s13, w2, s2, weights, _ = case(tokens, experts, top_k, hidden, inter, seed=40 + tokens)
    ids = routed_with_repeats(tokens, experts, top_k, seed=tokens)
    args = (x, w13, s13, w2, s2, weights, ids)
    got = mxfp8_fused_experts(*args, ALPHA, LIMIT, config=config, path="gemv")
    assert_close(got, reference_fused_experts(*args, ALPHA, LIMIT))
    assert torch.equal(mxfp8_fused_experts(*args, ALPHA, LIMIT, config=config, path="gemv"), got), "two runs differ"


def test_gemv_skips_slots_of_experts_held_elsewhere():
    """Expert parallelism on the GEMV path: slots routed outside the rank's experts read nothing and
    add nothing (their activation rows stay unwritten: poisoned NaN here), a token with none held
    gets zeros."""
    x, w13, s13, w2, s2, weights, _ = case(3, 8, 4, 64, 64, seed=41)
    ids = torch.tensor([[0, 5, 9, 1], [8, 9, 10, 11], [3, 3, 12, 2]], dtype=torch.int32)
    held = slice(0, 8)
    args = (x, w13[held], s13[held], w2[held], s2[held], weights, ids)
    got = mxfp8_fused_experts(*args, ALPHA, LIMIT, config=GEMV_SMALL, path="gemv")
    assert torch.equal(got[1].float(), torch.zeros(64))
    assert_rows_close(got[[0, 2]], reference_fused_experts(*args, ALPHA, LIMIT)[[0, 2]])


def test_gemv_config_narrows_gate_up_tiles_for_narrow_slices():
    """Few pairs over few intermediate columns (TP8: 384 per rank) leave SMs idle: the gate/up
    tile halves down to MIN_BLOCK_N rows until the programs reach MIN_PROGRAMS_PER_SM per SM; at
    TP1 (3072 columns) the table's tile stands, and the down tile never changes."""
    table = pick_config(1, "gemv")
    assert moe_config(1, 4, 3072, 132) == table
    narrow = moe_config(1, 4, 384, 132)
    assert narrow.down == table.down and narrow.gate_up.block_n == mxfp8_gemv.MIN_BLOCK_N
    for tokens in (1, 2, 8):
        block_n = moe_config(tokens, 4, 384, 132).gate_up.block_n
        programs = tokens * 4 * -(-384 // block_n)
        assert block_n == mxfp8_gemv.MIN_BLOCK_N or programs >= mxfp8_gemv.MIN_PROGRAMS_PER_SM * 132
        assert block_n == table.gate_up.block_n or tokens * 4 * -(-384 // (2 * block_n)) < mxfp8_gemv.MIN_PROGRAMS_PER_SM * 132


# ---------------------------------------------------------------- fp32 activations (W8A32)


@pytest.mark.parametrize("path", ["gemv", "bf16", "widen"])
@pytest.mark.parametrize(
    "tokens, hidden, inter",
    [
        (3, 128, 64),  # 2-group K steps (SMALL's block_k 64; the GEMV's 4 and 2 groups)
        (5, 96, 64),  # hidden not a multiple of BLOCK_K (widen: K tail masks; core and GEMV: 1-group steps)
    ],
)
def test_fp32_activations_match_the_fp32_reference(tokens, hidden, inter, path):
    """fp32 tokens (not bf16 values) through every path an fp32 model takes: an fp32 result within
    summation-order noise of the fp32 reference, so no intermediate went through 16 bits."""
    _, w13, s13, w2, s2, weights, ids = case(tokens, 8, 2, hidden, inter, seed=50 + tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(51)) * 3 / (dequantize(w13, s13).std() * hidden**0.5)
    args = (x, w13, s13, w2, s2, weights, ids)
    got = mxfp8_fused_experts(*args, ALPHA, LIMIT, config=None if path == "gemv" else SMALL, path=path)
    assert_fp32_close(got, reference_fused_experts(*args, ALPHA, LIMIT))


def test_fp32_activations_never_take_the_fp16_path():
    """fp32 tokens: the GEMV and widen bounds as for bf16, the core on the bf16 path (dots in the
    activations' dtype), since the fp16 path's prescale rounds rows to fp16; asking for it is refused."""
    for tokens in (1, GEMV_MAX_TOKENS, GEMV_MAX_TOKENS + 1, CORE_PATH_MAX_TOKENS, CORE_PATH_MAX_TOKENS + 1):
        want = "bf16" if gemm_path(tokens) == CORE_DOT else gemm_path(tokens)
        assert gemm_path(tokens, torch.float32) == want
    assert gemm_path(GEMV_MAX_TOKENS + 1, torch.bfloat16) == CORE_DOT
    x, *rest = case(2, 4, 2, 64, 64, seed=0)
    with pytest.raises(ValueError, match="fp16 path"):
        mxfp8_fused_experts(x.float(), *rest, ALPHA, LIMIT, path="fp16")


# ---------------------------------------------------------------- compiled form (no GPU needed)

#: the compile helper of the sm_90 scripts below
_SM90_COMPILER = """
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from msa_kernels import triton_mxfp8_moe as moe
from msa_kernels.mxfp8_gemm import PRESCALE_BLOCK, prescale_rows_kernel

POINTERS = {
    "x16_ptr": "*fp16", "x_ptr": "*bf16", "out_ptr": "*fp16", "y_ptr": "*bf16",
    "w_ptr": "*fp8e4nv", "weights_ptr": "*fp32", "alpha": "fp32", "limit": "fp32",
}
WORDS = {8: "*i64", 4: "*i32", 2: "*i16", 1: "*u8"}


def compile_for_sm90(kernel, consts, warps=4, stages=3):
    signature = {n: "constexpr" if n in consts else POINTERS.get(n, "*i32" if n.endswith("_ptr") else "i32") for n in kernel.arg_names}
    # as Triton specializes a launch at M3's shape: 16-byte aligned tensors, strides and K multiples of 16
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
               if n not in consts and (signature[n].startswith("*") or n.startswith(("stride", "K", "inter", "hidden")))}
    return triton.compile(ASTSource(kernel, signature, consts, aligned), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})
"""

_COMPILE_FOR_HOPPER = _SM90_COMPILER + """
config = moe.pick_config(1, "fp16")
tiles = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, GROUPS=config.block_k // 32, GROUP_M=config.group_m)
POINTERS["words_ptr"] = WORDS[config.block_k // 32]
for dot, x_type, act_type, name in ((tl.float16, "*fp16", "*fp32", "f16"), (tl.bfloat16, "*bf16", "*bf16", "bf16")):
    POINTERS.update(x_ptr=x_type, a_ptr=x_type, act_ptr=act_type)
    for kernel, extra in ((moe.gate_up_core_kernel, dict(TOP_K=4, SWIGLU_OAI=True)), (moe.down_core_kernel, {})):
        ptx = compile_for_sm90(kernel, {**tiles, **extra, "DOT_DTYPE": dot}, config.num_warps, config.num_stages).asm["ptx"]
        assert "mma.sync" in ptx and f".{name}.{name}" in ptx and "wgmma" not in ptx, f"{kernel.__name__}: not {name} mma.sync"
        assert "cvt.rn.f16x2.e4m3x2" in ptx, f"{kernel.__name__}: e4m3 -> fp16 not one conversion per pair"
        assert "cp.async" in ptx, f"{kernel.__name__}: weight loads not pipelined"
POINTERS["x_ptr"] = "*bf16"
compile_for_sm90(moe.align_kernel, dict(BLOCK_M=16, CHUNK=64, E_POW2=128, PRESCALE=True, BLOCK_H=PRESCALE_BLOCK))
compile_for_sm90(prescale_rows_kernel, dict(BLOCK=PRESCALE_BLOCK))
print("compiled")
"""


def compiles_for_hopper(script: str) -> None:
    """Runs ``script`` (Triton's compiler for sm_90, no GPU needed) outside the interpreter; it prints
    "compiled" at its end."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]


def test_core_paths_compile_for_hopper():
    """The interpreter does not run Triton's compiler: compile the core paths' kernels for sm_90
    with the decode tiles (no GPU needed) and check the instructions their design rests on (fp16 /
    bf16 mma.sync, no wgmma; the paired e4m3 -> fp16 conversion; cp.async weight loads)."""
    compiles_for_hopper(_COMPILE_FOR_HOPPER)


_FP32_FOR_HOPPER = _SM90_COMPILER + """
from msa_kernels import mxfp8_gemv as gemv
from msa_kernels import triton_mxfp8_linear as linear

#: shared memory one H100 block may use (227 KB): a launch asking for more fails
H100_SHARED = 232448
POINTERS.update(x_ptr="*fp32", a_ptr="*fp32", act_ptr="*fp32", y_ptr="*fp32", s_ptr="*u8")
for path, tokens, kernels in (
    ("bf16", moe.CORE_PATH_MAX_TOKENS, (moe.gate_up_core_kernel, moe.down_core_kernel)),
    ("widen", 8192, (moe.gate_up_kernel, moe.down_kernel)),
):
    config = moe.pick_config(tokens, path)
    tiles = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, GROUP_M=config.group_m, DOT_DTYPE=tl.float32)
    if path == "bf16":
        tiles["GROUPS"] = config.block_k // 32
        POINTERS["words_ptr"] = WORDS[config.block_k // 32]
    else:
        tiles.update(BLOCK_K=config.block_k, EVEN_K=True)
    for kernel in kernels:
        extra = dict(TOP_K=4, SWIGLU_OAI=True) if "gate_up" in kernel.__name__ else {}
        compiled = compile_for_sm90(kernel, {**tiles, **extra}, config.num_warps, config.num_stages)
        ptx = compiled.asm["ptx"]
        assert "mma" not in ptx and "tf32" not in ptx and "fma.rn.f32" in ptx, f"{kernel.__name__}: not IEEE fp32 FMA dots"
        assert compiled.metadata.shared <= H100_SHARED, f"{kernel.__name__}: {compiled.metadata.shared} bytes of shared memory"
POINTERS.update(partial_ptr="*fp32", words_ptr=WORDS[linear.BLOCK_K // 32])
linear_tiles = dict(BLOCK_M=linear.BLOCK_M, BLOCK_N=linear.BLOCK_N, GROUPS=linear.BLOCK_K // 32, DOT_DTYPE=tl.float32)
ptx = compile_for_sm90(linear.linear_kernel, linear_tiles, linear.NUM_WARPS, 3).asm["ptx"]
assert "mma" not in ptx and "tf32" not in ptx and "fma.rn.f32" in ptx, "linear_kernel: not IEEE fp32 FMA dots"
POINTERS.update(w_ptr="*i32", s_ptr="*i64", out_ptr="*fp32")
tile = gemv.MOE_GEMV_TABLE[0][1]
compile_for_sm90(gemv.moe_gate_up_kernel, dict(TOP_K=4, SWIGLU_OAI=True, ASM=False, BLOCK_N=tile.gate_up.block_n, GROUPS=8), 4, 1)
compile_for_sm90(gemv.moe_down_kernel, dict(TOP_K=4, SLOTS=4, ASM=False, BLOCK_N=tile.down.block_n, GROUPS=8), 4, 1)
tile = gemv.linear_gemv_tile(6144)
consts = dict(BLOCK_T=gemv.LINEAR_BLOCK_T, BLOCK_N=tile.block_n, GROUPS=tile.block_k // 32, ASM=False)
compile_for_sm90(gemv.linear_kernel, consts, tile.num_warps, 1)
print("compiled")
"""


def test_fp32_kernels_compile_for_hopper():
    """The kernels an fp32 model's MXFP8 layers run compile for sm_90 (the experts' GEMVs without the
    inline PTX, the bf16 core and widen with fp32 dots at the served tiles; the dense linear's GEMV
    and core): IEEE fp32 dots (FMAs: no MMA, no TF32), within an H100 block's shared memory (the
    widen prefill tiles hold fp32 operand tiles)."""
    compiles_for_hopper(_FP32_FOR_HOPPER)


_GEMV_FOR_HOPPER = """
import collections, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from msa_kernels import mxfp8_gemv as gemv

TYPES = {"x_ptr": "*bf16", "act_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*i64", "weights_ptr": "*fp32",
         "out_ptr": "*bf16", "y_ptr": "*bf16", "partial_ptr": "*fp32", "alpha": "fp32", "limit": "fp32"}
NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")


def loop_instructions(kernel, consts, warps):
    \"\"\"(ptx, SASS instructions of each loop body) of ``kernel`` compiled for sm_90 as a launch at
    M3's shapes is specialized (16-byte aligned pointers, strides and sizes multiples of 16).\"\"\"
    signature = {n: "constexpr" if n in consts else TYPES.get(n, "*i32" if n.endswith("_ptr") else "i32") for n in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
               if n not in consts and (signature[n].startswith("*") or n.startswith(("stride", "K", "inter", "hidden")))}
    compiled = triton.compile(ASTSource(kernel, signature, consts, aligned), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": 1})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([NVDISASM, "-c", cubin.name], capture_output=True, text=True, check=True).stdout
    labels, body = {}, []
    for line in sass.splitlines():
        label = re.match(r"^\\s*(\\.L_x_\\d+):", line)
        if label:
            labels[label.group(1)] = len(body)
        if re.search(r"/\\*[0-9a-f]{4}\\*/", line):
            body.append(line)
    loops = []
    for i, line in enumerate(body):
        target = re.search(r"BRA\\s+.*?(\\.L_x_\\d+)", line)
        if target and labels.get(target.group(1), i) < i:
            loops.append(i + 1 - labels[target.group(1)])
    return compiled.asm["ptx"], loops


GEMV = gemv.MOE_GEMV_TABLE[0][1]
# weight elements per thread and K step: rows x 256 columns over 32 * num_warps threads
for kernel, consts, tile, rows in (
    (gemv.moe_gate_up_kernel, dict(TOP_K=4, SWIGLU_OAI=True, ASM=True), GEMV.gate_up, 2 * GEMV.gate_up.block_n),
    (gemv.moe_down_kernel, dict(TOP_K=4, SLOTS=4, ASM=True), GEMV.down, 4 * GEMV.down.block_n),
):
    ptx, loops = loop_instructions(kernel, dict(consts, BLOCK_N=tile.block_n, GROUPS=tile.block_k // 32), tile.num_warps)
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "mma" not in ptx, kernel.__name__
    assert "ld.global.L1::evict_first.L2::cache_hint.v4.b32" in ptx, f"{kernel.__name__}: weights not 16-byte evict-first loads"
    per_element = loops[0] / (rows * tile.block_k / (32 * tile.num_warps))
    print(f"{kernel.__name__}: {per_element:.2f} instructions per weight element")
    assert len(loops) == 1 and per_element <= 6, (kernel.__name__, loops, per_element)
print("compiled")
"""


def test_gemv_kernels_compile_for_hopper_within_the_instruction_budget():
    """The GEMV path is worth having only if its K loop stays far under what an SM can issue per
    weight byte at full HBM bandwidth (about 9 instructions per element and lane on an H100):
    compile both MoE GEMV kernels for sm_90 with the table's tiles (no GPU needed) and count the
    SASS of their loops (4.4 and 5.2 per element with Triton 3.8; at most 6 asserted); check the inline
    e4m3 -> fp16 pair conversion, no MMA and 16-byte evict-first weight loads."""
    compiles_for_hopper(_GEMV_FOR_HOPPER)
