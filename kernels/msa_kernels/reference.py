"""Torch reference of MiniMax Sparse Attention (MSA): the project's single statement of its semantics.

Every other MSA path (the CPU path inside SGLang, the Triton kernels) is tested against these
functions, so they favour obviousness over speed: dense fp32 tensors, one request at a time.

Shapes, for one request whose key/value sequence has ``L`` tokens and which asks ``n`` queries:
    q   [n, Hq, D]     main-branch queries (already normed and rotated)
    k,v [L, Hkv, D]    main-branch keys and values for positions 0 .. L-1; may be float8 (an fp8 KV
                       cache, SGLang's convention: stored = value / scale, one scale per layer), whose
                       values are ``k * k_scale`` and ``v * v_scale`` (both 1.0 by default)
    iq  [n, Hkv, Di]   index queries, one head per KV group
    ik  [L, Di]        index keys, one head shared by every group
    ik_scale [L]       optional: ``ik`` holds fp8 e4m3 keys and this their per-token scales
                       (:func:`quantize_index_keys`); the scores use the dequantized keys
    q_pos [n]          absolute position of every query (each < L)

Semantics (per query at position p, index head r, block size B):
  * visible blocks are 0 .. p // B; the own block may be partial;
  * block score = max over tokens j <= p of the block of dot(iq[p, r], ik[j]), in fp32 (fp64 for fp64 inputs);
  * the newest ``local_blocks`` visible blocks and the first ``init_blocks`` blocks are forced in
    and occupy slots of the top-k; a forced block that would also rank is counted once;
  * the top-k blocks are chosen (all visible ones when fewer than k are visible);
  * query heads of group r attend exactly the keys of the chosen blocks with j <= p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MSAParams:
    """The sparse-selection knobs of one MSA layer (M3: block 128, top-16, 1 local, 0 init)."""

    block_size: int
    topk: int
    local_blocks: int = 1
    init_blocks: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.topk < 1:
            raise ValueError(f"topk must be >= 1, got {self.topk}")
        if self.local_blocks < 0 or self.init_blocks < 0:
            raise ValueError("local_blocks and init_blocks must be >= 0")
        if self.local_blocks + self.init_blocks > self.topk:
            raise ValueError(
                f"local_blocks ({self.local_blocks}) + init_blocks ({self.init_blocks}) "
                f"exceed topk ({self.topk}): forced blocks must fit in the top-k slots"
            )


def _acc(x: torch.Tensor) -> torch.Tensor:
    """Accumulation dtype: fp32 for 8- and 16-bit inputs, the input's own for fp32/fp64 (exact oracles).

    torch refuses to promote float8 types, so 8-bit inputs are widened to fp32 directly (exact).
    """
    if x.dtype.itemsize == 1:
        return x.float()
    return x.to(torch.promote_types(x.dtype, torch.float32))


#: Largest finite float8_e4m3fn value.
E4M3_MAX = 448.0
# Smallest |key| row maximum a scale is computed from: keeps 1/scale a finite fp32 power of two.
_MIN_ROW_AMAX = 2.0**-90


def quantize_index_keys(ik: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index keys ``[..., Di]`` -> (float8_e4m3fn keys, fp32 per-token scales ``[...]``).

    Per token, the scale is the smallest power of two that brings the row's largest |value| to
    at most 448 (e4m3's largest finite value); values are divided by it (exact) and rounded to
    nearest-even. Why this form:

    * per token, not per block: a token's key is written once, alone (decode writes one token of a
      block at a time), and every cache operation (radix sharing, slot moves, host offload) works
      on slots; a per-block scale would have to be fixed before the block's later tokens exist, or
      rewrite the block's earlier keys. Accuracy would not gain either: e4m3's relative step is the
      same at every magnitude, a scale only decides where values go subnormal, and index keys leave
      an RMSNorm with similar magnitudes per token.
    * fp32, one per token: the scan reads it as one contiguous 512-byte vector per 128-token block
      beside the block's 16 KiB of fp8 keys (3% more bytes), and applies it as one multiply per
      score, ``dot(iq, k8) * scale``, after the MMA on the fp8 keys widened in registers.
    * a power of two: dividing by it and multiplying back are exact, so kernels that scale scores
      and the reference that scales keys differ only in summation order, as the bf16 paths do; and
      the exponent comes from integer bits, identical on the GPU and the CPU.
    """
    x = ik.float()
    amax = x.abs().amax(dim=-1).clamp_min(_MIN_ROW_AMAX)
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2**exponent, mantissa in [0.5, 1)
    # smallest e with amax <= 448 * 2**e; 448 = 0.875 * 2**9
    e = exponent - 9 + (mantissa > 0.875).to(exponent.dtype)
    one = torch.ones_like(amax)
    keys = (x * torch.ldexp(one, -e)[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return keys, torch.ldexp(one, e)


def dequantize_index_keys(ik: torch.Tensor, ik_scale: torch.Tensor) -> torch.Tensor:
    """fp8 keys ``[..., Di]`` and their per-token scales ``[...]`` -> fp32 keys."""
    if ik.dtype != torch.float8_e4m3fn:
        raise ValueError(f"ik_scale is given, so ik must hold float8_e4m3fn keys, got {ik.dtype}")
    if ik_scale.shape != ik.shape[:-1]:
        raise ValueError(f"ik_scale must be one scale per key {tuple(ik.shape[:-1])}, got {tuple(ik_scale.shape)}")
    return ik.float() * ik_scale.float()[..., None]


def num_blocks(length: int, block_size: int) -> int:
    return (length + block_size - 1) // block_size


def block_scores(
    iq: torch.Tensor, ik: torch.Tensor, q_pos: torch.Tensor, block_size: int, ik_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal block-max scores ``[n, Hkv, num_blocks]`` in fp32; -inf marks invisible blocks.

    With ``ik_scale`` the keys are fp8 and score as their dequantized values.
    """
    length = ik.shape[0]
    nb = num_blocks(length, block_size)
    keys = _acc(ik) if ik_scale is None else dequantize_index_keys(ik, ik_scale).to(_acc(iq).dtype)
    scores = torch.einsum("nhd,ld->nhl", _acc(iq), keys)
    token_pos = torch.arange(length, device=ik.device)
    causal = token_pos[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~causal[:, None, :], float("-inf"))
    pad = nb * block_size - length
    if pad:
        scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
    return scores.view(scores.shape[0], scores.shape[1], nb, block_size).amax(dim=-1)


def select_blocks(scores: torch.Tensor, q_pos: torch.Tensor, params: MSAParams) -> torch.Tensor:
    """Chosen block ids ``[n, Hkv, topk]`` (int64), ascending, padded with -1 at the end."""
    n, heads, nb = scores.shape
    own_block = (q_pos // params.block_size)[:, None]
    block_ids = torch.arange(nb, device=scores.device)[None, :]
    visible = block_ids <= own_block
    forced = visible & ((block_ids > own_block - params.local_blocks) | (block_ids < params.init_blocks))
    ranking = scores.masked_fill(forced[:, None, :], float("inf"))
    ranking = ranking.masked_fill(~visible[:, None, :], float("-inf"))
    k = min(params.topk, nb)
    values, chosen = ranking.topk(k, dim=-1)
    chosen = chosen.masked_fill(values == float("-inf"), nb)  # invisible: sort past every real id
    chosen = chosen.sort(dim=-1).values
    chosen = chosen.masked_fill(chosen == nb, -1)
    if k < params.topk:
        chosen = torch.nn.functional.pad(chosen, (0, params.topk - k), value=-1)
    return chosen


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selected: torch.Tensor,
    q_pos: torch.Tensor,
    block_size: int,
    scale: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """GQA over the chosen blocks only, token-causal inside them; returns ``[n, Hq, Dv]``.

    The keys and values are ``k * k_scale`` and ``v * v_scale`` (an fp8 KV cache's per-layer scales).
    """
    n, hq, d = q.shape
    length, hkv, dv = v.shape
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    nb = num_blocks(length, block_size)
    chosen = torch.zeros(n, hkv, nb + 1, dtype=torch.bool, device=q.device)
    chosen.scatter_(2, selected.masked_fill(selected < 0, nb), True)
    token_pos = torch.arange(length, device=q.device)
    allowed = chosen[:, :, token_pos // block_size] & (token_pos[None, None, :] <= q_pos[:, None, None])
    logits = torch.einsum("ngqd,lgd->ngql", _acc(q).view(n, hkv, group, d), _acc(k) * k_scale) * scale
    logits = logits.masked_fill(~allowed[:, :, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("ngql,lgd->ngqd", probs, (_acc(v) * v_scale).to(probs.dtype))
    return out.reshape(n, hq, dv).to(q.dtype)


def msa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    iq: torch.Tensor,
    ik: torch.Tensor,
    q_pos: torch.Tensor,
    params: MSAParams,
    scale: float | None = None,
    ik_scale: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    attend=sparse_attention,
    score=block_scores,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's MSA: returns (output ``[n, Hq, Dv]``, selected blocks ``[n, Hkv, topk]``).

    ``ik_scale``: per-token scales of fp8 index keys (see :func:`quantize_index_keys`), or None.
    ``k_scale`` / ``v_scale``: per-layer scales of an fp8 main KV cache (see :func:`sparse_attention`).
    ``attend``: the sparse attention's implementation, :func:`sparse_attention`'s signature and
    result (the CPU serving path passes ``torch_gathered.sparse_attention_gathered``); ``score``
    likewise for :func:`block_scores` (the serving path passes ``torch_gathered.block_scores_by_rows``).
    """
    if iq.shape[1] != k.shape[1]:
        raise ValueError(f"index heads ({iq.shape[1]}) must equal KV heads ({k.shape[1]})")
    if q_pos.numel() and int(q_pos.max()) >= k.shape[0]:
        raise ValueError(f"query position {int(q_pos.max())} has no key (kv length {k.shape[0]})")
    scores = score(iq, ik, q_pos, params.block_size, ik_scale)
    selected = select_blocks(scores, q_pos, params)
    return attend(q, k, v, selected, q_pos, params.block_size, scale, k_scale, v_scale), selected
