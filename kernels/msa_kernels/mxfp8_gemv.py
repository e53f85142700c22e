"""W8A16 (and W8A32) MXFP8 GEMVs for decode-sized batches: the MoE experts and the dense linears
without ``tl.dot``.

At one to a few tokens a step reads each chosen weight once and does two FLOPs per weight byte:
the time is the bytes over HBM bandwidth (M3's four experts at TP1, 226 MB of e4m3 plus 7 MB of
scales, about 78 us at 3 TB/s). The MMA cores of ``mxfp8_gemm`` and ``triton_mxfp8_moe`` pad the
few tokens to a 16-row tile and stage each weight tile for the dot; a GEMV needs neither. Each
program streams whole weight rows from HBM and multiplies them with the broadcast activation rows
on the FMA pipe, and the work per weight element has to stay under what a Hopper SM can issue at
full bandwidth (about 9 instructions per element and lane on an H100):

- The weights are read as int32 words of four e4m3 elements (a view of the same bytes) and each
  word becomes four fp32 values in two ``cvt.rn.f16x2.e4m3x2`` and four f16 -> f32 conversions
  (inline PTX, exact). Triton's own fp8 conversion of a loaded byte tile unpacks and repacks the
  bytes first: that loop compiled (sm_90, Triton 3.8) to 7.1 instructions per element against 4.3.
- The e8m0 scales are applied to the per-group partial sums, not to the weights: a K step of
  ``32 * groups`` columns reduces each row's products within every 32-column group (a within-thread
  sum plus one shuffle), multiplies by the group's factor ``2 ** (b - 127)`` (exact) and adds to an
  fp32 accumulator per (row, group) that is summed once at the end. The scale bytes of a step are
  one word per row (``mxfp8_gemm.scale_words``).
- The activation chunk of a step is loaded once per program as ``[rows, groups, 32]``, converted
  to fp32 and broadcast over the weight rows in shared memory, rather than loaded per weight row.
- Triton's pipeliner leaves loads that feed no dot in place, so every loop prefetches the next
  step's weights, scales and activations by hand (one step ahead, in registers). Weight loads are
  ``evict_first``: each is read once, while the activations are read by every program.

Counted in the SASS of an sm_90 compile (``tests/kernels/test_mxfp8_moe.py`` checks the MoE's):
4.4 instructions per weight element in the gate/up loop, 5.2 in the down loop (masked loads),
5.2 / 7.3 / 10.9 in the dense linear's at 1 / 2 / 4 tokens per program (every token costs its
FMAs, so the linear's GEMV is for the fewest tokens). ``benchmarks/mxfp8_moe.py --sweep-gemv``
and ``benchmarks/mxfp8_linear.py --sweep-gemv`` time the tile candidates; :data:`MOE_GEMV_TABLE`
and :func:`linear_gemv_tile` hold the H100 winners.

Kernels (each result equals an fp32 GEMM of the exact dequantized weights up to fp32 summation
order, then one rounding to the output's dtype):

- :func:`moe_gate_up_kernel`: one program per (token, slot) pair and ``BLOCK_N`` intermediate
  columns; it streams that expert's gate rows and the matching up rows (``w13[e, c]`` and
  ``w13[e, inter + c]``) as one ``2 * BLOCK_N``-row tile and stores ``act(gate, up)`` of the pair
  (:func:`act_dtype`). Pairs routed to an expert not held here (expert parallelism) return at once.
- :func:`moe_down_kernel`: one program per token and ``BLOCK_N`` hidden columns owns all of the
  token's top-k pairs: a ``[top_k, BLOCK_N]``-row tile of ``w2`` rows of the k experts against the
  k activation rows, each pair's sums times its routed weight, summed over the pairs in registers
  and stored once in the activations' dtype. So the combine over top-k needs no float atomics and
  no extra launch, and each weight row is read once per token (pairs of different tokens that
  share an expert read it again, from L2 at these token counts). Not-held pairs are masked (no
  bytes read).
- :func:`linear_kernel`: the dense linear ``y = x @ dequant(w).T`` for up to ``BLOCK_T`` tokens per
  program (each weight tile converted once, multiplied with every token's row), K split like
  ``triton_mxfp8_linear``'s GEMM when the row tiles alone are too few programs (the last split of a
  tile, by an atomic ticket it resets, sums the fp32 partials in split order: deterministic).

The MoE needs no K split: its down projection has M3's hidden size (6144) rows per token, and the
gate/up tiles narrow (:func:`moe_config`) when few pairs and few intermediate columns (tensor
parallel slices) would leave SMs idle. Grids depend on the token count only and nothing is read on
the host, so the calls can be captured in CUDA graphs. Under the Triton interpreter (CPU tests)
the inline PTX cannot run: the words' bytes go through Triton's own fp8 conversion instead
(``ASM=False``), with the same data flow around it.

Activations are bf16 or fp16 (W8A16: the output in their dtype, the MoE's activation between the
GEMVs bf16) or fp32 (W8A32, an fp32 model: every intermediate and the output fp32, so the result
is the fp32 GEMM of the dequantized weights up to summation order). fp32 activations take Triton's
own e4m3 -> fp32 conversion (``ASM=False``) on CUDA too (:func:`uses_asm`): exact like the paired
conversion, and off the path whose instruction budget the tiles were tuned for.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch
import triton
import triton.language as tl

from msa_kernels.mxfp8_gemm import scale_words, store_split
from msa_kernels.triton_cast import round_cast


@dataclass(frozen=True)
class GemvTile:
    """One GEMV's tiles: ``block_n`` weight rows per program (the gate/up GEMV: intermediate
    columns, each with its gate and its up row), ``block_k`` columns per K step (a multiple of 32
    up to 256: one scale word per row; less where K is not a multiple), ``num_warps``."""

    block_n: int
    block_k: int = 256
    num_warps: int = 4


@dataclass(frozen=True)
class MoeGemvConfig:
    """Tiles of the MoE GEMV path: the gate/up GEMV and the down GEMV (with the top-k combine)."""

    gate_up: GemvTile
    down: GemvTile


#: Tiles of the MoE GEMV path: (largest token count, config), first match wins. From the H100 sweep
#: at 4b5f448 (``benchmarks/mxfp8_moe.py --sweep-gemv``, M3's TP1 experts): at one token 16
#: gate/up rows with 16 down rows per program 89.6 us, against 97.9 with 8 down rows and 96.2-109.8
#: for the other gate/up tiles; at 8 tokens every candidate within 588-628 us.
MOE_GEMV_TABLE: tuple[tuple[int, MoeGemvConfig], ...] = (
    (1 << 62, MoeGemvConfig(gate_up=GemvTile(block_n=16), down=GemvTile(block_n=16))),
)
#: Tiles of the dense linear's GEMV, by input width: measured at T=1 on the H100 at 40dba2e
#: (``benchmarks/mxfp8_linear.py --sweep-gemv``), 8-row tiles win where K is short (M3's o / down
#: projections at TP8: K 1024 4.9 vs 5.9 us, K 384 3.5 vs 4.8, K 1536 6.6 vs 7.1), 16-row tiles
#: where K is the hidden size (q/k/v and gate/up at K 6144: 6.7 vs 7.2, 11.0 vs 11.8)
LINEAR_GEMV_TILE = GemvTile(block_n=16)
LINEAR_GEMV_TILE_SHORT_K = GemvTile(block_n=8)
LINEAR_SHORT_K = 2048


def linear_gemv_tile(in_features: int) -> GemvTile:
    return LINEAR_GEMV_TILE_SHORT_K if in_features <= LINEAR_SHORT_K else LINEAR_GEMV_TILE
#: most tokens one linear program multiplies with its weight tile (registers: one fp32 accumulator
#: per token, row and group; FMAs per weight element grow with it)
LINEAR_BLOCK_T = 4
#: programs per SM below which the MoE gate/up tiles narrow, and the linear's K split aims for
MIN_PROGRAMS_PER_SM = 4
#: narrowest gate/up tile (rows per program) :func:`moe_config` goes down to
MIN_BLOCK_N = 4


def act_dtype(x_dtype: torch.dtype) -> torch.dtype:
    """dtype of the MoE activation between the two GEMVs for activations ``x_dtype``: bf16 for 16-bit
    ones (the down GEMV reads it from L2 once per hidden tile: bf16 halves those bytes; its
    rounding is the bf16 core path's), fp32 for fp32 ones (W8A32 rounds nothing in between)."""
    return torch.float32 if x_dtype == torch.float32 else torch.bfloat16


def uses_asm(x: torch.Tensor) -> bool:
    """Whether the GEMVs convert e4m3 with the inline-PTX pairs (:func:`e4m3_words_to_f32`): on CUDA
    for 16-bit activations (the decode fast path); fp32 activations and the interpreter take
    Triton's own e4m3 -> fp32 conversion."""
    return x.is_cuda and x.dtype != torch.float32


@lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """SMs of ``device`` (an H100's 132 off CUDA: the interpreter tests plan K splits as for one)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def moe_config(tokens: int, top_k: int, inter: int, sms: int = 132) -> MoeGemvConfig:
    """The :data:`MOE_GEMV_TABLE` config for ``tokens``, its gate/up tile halved (down to
    :data:`MIN_BLOCK_N` rows) while ``tokens * top_k`` pairs times the column tiles would be fewer
    than :data:`MIN_PROGRAMS_PER_SM` programs per SM (narrow intermediate slices under tensor
    parallelism: 384 columns per rank at TP8)."""
    config = next(config for bound, config in MOE_GEMV_TABLE if tokens <= bound)
    block_n = config.gate_up.block_n
    while block_n > MIN_BLOCK_N and tokens * top_k * triton.cdiv(inter, block_n) < MIN_PROGRAMS_PER_SM * sms:
        block_n //= 2
    return replace(config, gate_up=replace(config.gate_up, block_n=block_n))


# ---------------------------------------------------------------------------------------------
# the shared streaming loop
# ---------------------------------------------------------------------------------------------


@triton.jit
def expert_activation(gate, up, alpha, limit, SWIGLU_OAI: tl.constexpr):
    """M3's swiglu-oai ``(clamp(up) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``, or
    plain gated silu (``triton_mxfp8_moe``'s GEMM paths use it too)."""
    if SWIGLU_OAI:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        out = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    else:
        out = gate * tl.sigmoid(gate) * up
    return out


@triton.jit
def e4m3_words_to_f32(words, ASM: tl.constexpr):
    """int32 words of four e4m3 elements (little-endian) ``[..., n]`` -> fp32 ``[..., n, 2, 2]``,
    element ``4 c + p`` of the words' row at ``[..., c, p // 2, p % 2]`` (so a reshape to
    ``[..., 4 n]`` restores the element order). ``ASM``: two ``cvt.rn.f16x2.e4m3x2`` and four
    f16 -> f32 per word (CUDA); otherwise the bytes through Triton's own fp8 conversion (the
    interpreter, where inline PTX cannot run; it reads the NaN bytes 0x7F/0xFF as +-480)."""
    if ASM:
        e0, e1, e2, e3 = tl.inline_asm_elementwise(
            """{
            .reg .b16 lo, hi;
            .reg .b32 h01, h23;
            .reg .f16 f0, f1, f2, f3;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 h01, lo;
            cvt.rn.f16x2.e4m3x2 h23, hi;
            mov.b32 {f0, f1}, h01;
            mov.b32 {f2, f3}, h23;
            cvt.f32.f16 $0, f0;
            cvt.f32.f16 $1, f1;
            cvt.f32.f16 $2, f2;
            cvt.f32.f16 $3, f3;
            }""",
            "=r,=r,=r,=r,r", [words], dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1,
        )
        return tl.join(tl.join(e0, e2), tl.join(e1, e3))
    else:
        bytes = tl.join(tl.join(words, words >> 16), tl.join(words >> 8, words >> 24)) & 0xFF
        return bytes.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _group_sums(w, scales, x, A: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, ASM: tl.constexpr):
    """One K step: ``[max(A, B), BLOCK_N, GROUPS]`` fp32 sums over each 32-column group of weight rows
    ``w`` (int32 words ``[A, BLOCK_N, GROUPS, 8]``) times activation rows ``x`` (``[B, GROUPS, 32]``,
    broadcast against the weights' ``A`` axis: A or B is 1, or both equal), each times its group's
    factor from ``scales`` (``[A, BLOCK_N]`` words, byte ``g`` for group ``g``)."""
    g = tl.arange(0, GROUPS)
    factors = (((scales[:, :, None] >> (8 * g[None, None, :])) & 0xFF).to(tl.int32) << 23).to(tl.float32, bitcast=True)
    weights = tl.reshape(e4m3_words_to_f32(w, ASM), (A, BLOCK_N, GROUPS, 32))
    return tl.sum(weights * x.to(tl.float32)[:, None, :, :], axis=3) * factors


@triton.jit
def _stream(
    w_ptrs, s_ptrs, x_ptrs, K, w_mask, x_mask,
    A: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, ASM: tl.constexpr,
):
    """``[M, BLOCK_N, GROUPS]`` fp32 group sums over all of K (:func:`_group_sums` per step)
    from the pointers of the first step: ``w_ptrs`` int32 words ``[A, BLOCK_N, GROUPS, 8]``,
    ``s_ptrs`` scale words ``[A, BLOCK_N]`` (one per step and row, consecutive), ``x_ptrs``
    activations ``[M, GROUPS, 32]`` (``A`` is ``M``, or 1: one set of weight rows for every
    activation row). ``w_mask`` (``[A, 1]`` or None) masks rows of the first two
    (zeros), ``x_mask`` (``[M, 1, 1]`` or None) the third. The next step's loads are issued before
    this step's arithmetic (module docstring)."""
    STEP: tl.constexpr = 32 * GROUPS
    # (the loads are spelled out per mask case: each nested call costs the interpreter tests time)
    if w_mask is None:
        scales = tl.load(s_ptrs)
        w = tl.load(w_ptrs, eviction_policy="evict_first")
    else:
        scales = tl.load(s_ptrs, mask=w_mask, other=0)
        w = tl.load(w_ptrs, mask=w_mask[:, :, None, None], other=0, eviction_policy="evict_first")
    if x_mask is None:
        x = tl.load(x_ptrs)
    else:
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
    acc = tl.zeros((M, BLOCK_N, GROUPS), dtype=tl.float32)
    for k0 in range(STEP, K, STEP):
        if w_mask is None:
            next_scales = tl.load(s_ptrs + k0 // STEP)
            next_w = tl.load(w_ptrs + k0 // 4, eviction_policy="evict_first")
        else:
            next_scales = tl.load(s_ptrs + k0 // STEP, mask=w_mask, other=0)
            next_w = tl.load(w_ptrs + k0 // 4, mask=w_mask[:, :, None, None], other=0, eviction_policy="evict_first")
        if x_mask is None:
            next_x = tl.load(x_ptrs + k0)
        else:
            next_x = tl.load(x_ptrs + k0, mask=x_mask, other=0.0)
        acc += _group_sums(w, scales, x, A, BLOCK_N, GROUPS, ASM)
        scales, w, x = next_scales, next_w, next_x
    return acc + _group_sums(w, scales, x, A, BLOCK_N, GROUPS, ASM)


@triton.jit
def _tile_pointers(w_ptr, s_ptr, w_rows, s_rows, GROUPS: tl.constexpr):
    """First-step pointers of the weight rows that start at int64 offsets ``w_rows`` (int32 words
    from ``w_ptr``) and ``s_rows`` (scale words from ``s_ptr``), both ``[A, BLOCK_N]``: words
    ``[A, BLOCK_N, GROUPS, 8]`` and scale words ``[A, BLOCK_N]``."""
    g = tl.arange(0, GROUPS)
    c = tl.arange(0, 8)
    return w_ptr + w_rows[:, :, None, None] + g[None, None, :, None] * 8 + c[None, None, None, :], s_ptr + s_rows


@triton.jit
def _x_pointers(x_ptr, rows, stride_xm, GROUPS: tl.constexpr):
    """First-step pointers ``[B, GROUPS, 32]`` of activation rows ``rows`` (``[B]``)."""
    g = tl.arange(0, GROUPS)
    k = tl.arange(0, 32)
    return x_ptr + rows[:, None, None].to(tl.int64) * stride_xm + g[None, :, None] * 32 + k[None, None, :]


# ---------------------------------------------------------------------------------------------
# the MoE experts
# ---------------------------------------------------------------------------------------------


@triton.jit
def moe_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, act_ptr, ids_ptr,
    inter, K, first_expert, num_experts, alpha, limit,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_am,
    TOP_K: tl.constexpr, SWIGLU_OAI: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, ASM: tl.constexpr,
):
    """``act[pair, c] = act(x[token] . gate[e, c], x[token] . up[e, c])`` for pair
    ``program_id(0)`` (token ``pair // TOP_K``, expert ``e = ids[pair] - first_expert``) and
    ``BLOCK_N`` intermediate columns ``c``. ``w_ptr``: ``w13`` as int32 words (strides in words)."""
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int32) - first_expert
    if (expert < 0) | (expert >= num_experts):
        return
    rows = tl.arange(0, 2 * BLOCK_N)
    cols = tl.minimum(tl.program_id(1) * BLOCK_N + rows % BLOCK_N, inter - 1)  # a partial tile re-reads its last row
    rows = (cols + (rows // BLOCK_N) * inter)[None, :].to(tl.int64)  # the gate rows, then their up rows
    w_ptrs, s_ptrs = _tile_pointers(
        w_ptr + expert.to(tl.int64) * stride_we, s_ptr + expert.to(tl.int64) * stride_se, rows * stride_wn, rows * stride_sn, GROUPS,
    )
    x_ptrs = _x_pointers(x_ptr, tl.zeros([1], dtype=tl.int32) + pair // TOP_K, stride_xm, GROUPS)
    sums = _stream(w_ptrs, s_ptrs, x_ptrs, K, None, None, 1, 1, 2 * BLOCK_N, GROUPS, ASM)
    sums = tl.sum(tl.reshape(sums, (2 * BLOCK_N, GROUPS)), axis=1)
    gate, up = tl.split(tl.permute(tl.reshape(sums, (2, BLOCK_N)), (1, 0)))
    out = expert_activation(gate, up, alpha, limit, SWIGLU_OAI)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(act_ptr + pair.to(tl.int64) * stride_am + cols, round_cast(out, act_ptr.dtype.element_ty), mask=cols < inter)


@triton.jit
def moe_down_kernel(
    act_ptr, w_ptr, s_ptr, out_ptr, ids_ptr, weights_ptr,
    hidden, K, first_expert, num_experts,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, ASM: tl.constexpr,
):
    """``out[t, c] = sum_j weights[t, j] * (act[t * TOP_K + j] . w2[e_j, c])`` over token
    ``program_id(0)``'s held pairs ``j`` (``SLOTS``: ``TOP_K`` rounded up to a power of two) for
    ``BLOCK_N`` hidden columns ``c``, summed in fp32 and rounded once to ``out``'s dtype."""
    token = tl.program_id(0)
    slots = tl.arange(0, SLOTS)
    pairs = token * TOP_K + tl.minimum(slots, TOP_K - 1)
    experts = tl.load(ids_ptr + pairs).to(tl.int32) - first_expert
    held = (slots < TOP_K) & (experts >= 0) & (experts < num_experts)
    experts = tl.where(held, experts, 0)
    routed = tl.load(weights_ptr + pairs, mask=held, other=0.0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    experts = experts[:, None].to(tl.int64)
    rows = tl.minimum(cols, hidden - 1)[None, :].to(tl.int64)
    w_ptrs, s_ptrs = _tile_pointers(w_ptr, s_ptr, experts * stride_we + rows * stride_wn, experts * stride_se + rows * stride_sn, GROUPS)
    x_ptrs = _x_pointers(act_ptr, pairs, stride_am, GROUPS)
    sums = _stream(w_ptrs, s_ptrs, x_ptrs, K, held[:, None], held[:, None, None], SLOTS, SLOTS, BLOCK_N, GROUPS, ASM)
    out = tl.sum(tl.sum(sums, axis=2) * routed[:, None], axis=0)
    tl.store(out_ptr + token.to(tl.int64) * stride_om + cols, round_cast(out, out_ptr.dtype.element_ty), mask=cols < hidden)


def moe_gemv(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    alpha: float | None,
    limit: float | None,
    first_expert: int = 0,
    config: MoeGemvConfig | None = None,
) -> torch.Tensor:
    """``triton_mxfp8_moe.mxfp8_fused_experts`` on the GEMV path (two launches), same arguments
    and result (``[T, H]`` in ``x``'s dtype), which that function has checked; ``topk_ids``
    contiguous, ``topk_weights`` fp32 contiguous. ``config`` overrides :func:`moe_config`."""
    tokens, hidden = x.shape
    experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    # (the interpreter tests run the table's tiles: narrower ones would only cost them time)
    config = config or moe_config(tokens, top_k, inter, sm_count(x.device) if x.is_cuda else 0)
    asm = uses_asm(x)
    act = torch.empty((tokens * top_k, inter), dtype=act_dtype(x.dtype), device=x.device)
    words13 = w13.view(torch.int32)
    w13_scales, groups = scale_words(w13_scale, config.gate_up.block_k)
    tile = config.gate_up
    moe_gate_up_kernel[(tokens * top_k, triton.cdiv(inter, tile.block_n))](
        x, words13, w13_scales, act, topk_ids,
        inter, hidden, first_expert, experts, 0.0 if alpha is None else alpha, 0.0 if limit is None else limit,
        x.stride(0), words13.stride(0), words13.stride(1), w13_scales.stride(0), w13_scales.stride(1), act.stride(0),
        TOP_K=top_k, SWIGLU_OAI=alpha is not None, BLOCK_N=tile.block_n, GROUPS=groups, ASM=asm, num_warps=tile.num_warps,
    )
    words2 = w2.view(torch.int32)
    w2_scales, groups = scale_words(w2_scale, config.down.block_k)
    tile = config.down
    moe_down_kernel[(tokens, triton.cdiv(hidden, tile.block_n))](
        act, words2, w2_scales, out, topk_ids, topk_weights,
        hidden, inter, first_expert, experts,
        act.stride(0), words2.stride(0), words2.stride(1), w2_scales.stride(0), w2_scales.stride(1), out.stride(0),
        TOP_K=top_k, SLOTS=triton.next_power_of_2(top_k), BLOCK_N=tile.block_n, GROUPS=groups, ASM=asm,
        num_warps=tile.num_warps,
    )
    return out


# ---------------------------------------------------------------------------------------------
# the dense linear
# ---------------------------------------------------------------------------------------------


@triton.jit
def linear_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, partial_ptr, ticket_ptr,
    T, N, K, steps_per_split, splits,
    stride_xm, stride_wn, stride_sn, stride_ym,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, ASM: tl.constexpr,
):
    """Program ``(m, s, n)``: tokens ``[m * BLOCK_T, ...)`` times weight rows ``[n * BLOCK_N, ...)``
    over K split ``s`` (``w_ptr`` int32 words, strides in words). Token blocks vary fastest, so the
    programs of one weight tile run together (L2)."""
    pid_m, pid_s, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    STEP: tl.constexpr = 32 * GROUPS
    k0 = pid_s * steps_per_split * STEP
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = pid_m * BLOCK_T + tl.arange(0, BLOCK_T)
    w_rows = tl.minimum(rows, N - 1)[None, :].to(tl.int64)  # a partial tile re-reads its last row
    w_ptrs, s_ptrs = _tile_pointers(w_ptr + k0 // 4, s_ptr + k0 // STEP, w_rows * stride_wn, w_rows * stride_sn, GROUPS)
    x_ptrs = _x_pointers(x_ptr + k0, tl.minimum(tokens, T - 1), stride_xm, GROUPS)
    k_split = tl.minimum(steps_per_split * STEP, K - k0)
    sums = _stream(w_ptrs, s_ptrs, x_ptrs, k_split, None, None, 1, BLOCK_T, BLOCK_N, GROUPS, ASM)
    acc = tl.sum(sums, axis=2)  # [BLOCK_T, BLOCK_N]
    y_ptrs = y_ptr + tokens[:, None].to(tl.int64) * stride_ym + rows[None, :]
    y_mask = (tokens < T)[:, None] & (rows < N)[None, :]
    cells = tl.arange(0, BLOCK_T)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tile = pid_n * tl.num_programs(0) + pid_m
    store_split(acc, cells, y_ptrs, y_mask, partial_ptr, ticket_ptr, tile, pid_s, splits, BLOCK_T * BLOCK_N)


def linear_block_t(tokens: int) -> int:
    """Tokens per program of :func:`linear_kernel` for a batch of ``tokens`` (a power of two)."""
    return min(LINEAR_BLOCK_T, triton.next_power_of_2(max(tokens, 1)))
