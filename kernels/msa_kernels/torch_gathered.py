"""MSA in torch the way the CPU serving path runs it: block scores by row blocks, attention over
the chosen blocks' keys only.

The reference (:func:`msa_kernels.reference.sparse_attention`) states the semantics over every key
of the request: ``[n, Hq, L]`` logits, masked to the chosen blocks. That is its job, and it makes a
long prompt's prefill quadratic: serving the tiny M3 on a 2-core CPU, an 8K-token prompt took
47.7 s to its first token, 93% of the forward inside that call (py-spy). Each query attends at
most ``topk * block_size`` keys, so this form gathers exactly those (the chosen blocks' tokens,
token-causal, the same mask) and computes the same softmax over them, in row blocks that bound
its memory. The kept terms and the accumulation dtype are the reference's; only the order of the
sums differs.

The reference's block scores (:func:`msa_kernels.reference.block_scores`) score every query
against every key and mask the whole ``[n, Hkv, L]`` matrix by position; at a 16K-token prompt
that masking and the scores took 5.6 of the forward's 12.7 s (py-spy, same setting).
:func:`block_scores_by_rows` scores a row block of queries against the keys up to its newest
position only and masks only the blocks that a row's position can cut: the same products, fewer.
"""

from __future__ import annotations

import math

import torch

from msa_kernels.reference import _acc, dequantize_index_keys, num_blocks

#: queries per step: bounds the gathered ``[rows, Hkv, topk * block_size, D]`` keys
ROW_BLOCK = 256


def sparse_attention_gathered(
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
    """What :func:`msa_kernels.reference.sparse_attention` returns, for the same arguments:
    ``q [n, Hq, D]``, ``k / v [L, Hkv, D / Dv]``, ``selected [n, Hkv, topk]`` (ascending block ids,
    -1 padded), ``q_pos [n]``; returns ``[n, Hq, Dv]`` in ``q``'s dtype."""
    n, hq, d = q.shape
    length, hkv, dv = v.shape
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = q.new_empty(n, hq, dv)
    if n == 0:
        return out
    offsets = torch.arange(block_size, device=q.device)
    head = torch.arange(hkv, device=q.device)[None, :, None]
    keys = (_acc(k) * k_scale).transpose(0, 1)  # [Hkv, L, D]
    values = (_acc(v) * v_scale).transpose(0, 1)
    for start in range(0, n, ROW_BLOCK):
        rows = slice(start, min(start + ROW_BLOCK, n))
        blocks = selected[rows]
        tokens = (blocks[..., None] * block_size + offsets).flatten(-2)  # [r, Hkv, topk * B]
        chosen = (blocks[..., None] >= 0).expand(-1, -1, -1, block_size).flatten(-2)
        allowed = chosen & (tokens < length) & (tokens <= q_pos[rows, None, None])
        index = tokens.clamp(0, length - 1)
        picked_k, picked_v = keys[head, index], values[head, index]  # [r, Hkv, T, D]
        logits = torch.einsum("rgqd,rgtd->rgqt", _acc(q[rows]).view(-1, hkv, group, d), picked_k) * scale
        logits = logits.masked_fill(~allowed[:, :, None, :], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        attended = torch.einsum("rgqt,rgtd->rgqd", probs, picked_v.to(probs.dtype))
        out[rows] = attended.reshape(-1, hq, dv).to(q.dtype)
    return out


def block_scores_by_rows(
    iq: torch.Tensor, ik: torch.Tensor, q_pos: torch.Tensor, block_size: int, ik_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """What :func:`msa_kernels.reference.block_scores` returns, for the same arguments: causal
    block-max scores ``[n, Hkv, num_blocks]`` (-inf for invisible blocks), ``ROW_BLOCK`` queries at
    a time. Keys before the row block's oldest position's block are visible to each of its rows
    (unmasked); keys past its newest position are never scored."""
    n, heads = iq.shape[0], iq.shape[1]
    queries = _acc(iq)
    keys = _acc(ik) if ik_scale is None else dequantize_index_keys(ik, ik_scale).to(queries.dtype)
    out = torch.full((n, heads, num_blocks(ik.shape[0], block_size)), float("-inf"), dtype=queries.dtype, device=iq.device)
    for start in range(0, n, ROW_BLOCK):
        rows = slice(start, min(start + ROW_BLOCK, n))
        pos = q_pos[rows]
        span = int(pos.max()) + 1
        blocks = num_blocks(span, block_size)
        scores = torch.einsum("nhd,ld->nhl", queries[rows], keys[:span])
        cut = int(pos.min()) // block_size * block_size  # the first key some row of the block may not see
        tail = torch.arange(cut, span, device=iq.device)
        scores[..., cut:].masked_fill_((tail[None, :] > pos[:, None])[:, None, :], float("-inf"))
        scores = torch.nn.functional.pad(scores, (0, blocks * block_size - span), value=float("-inf"))
        out[rows, :, :blocks] = scores.view(scores.shape[0], heads, blocks, block_size).amax(dim=-1)
    return out
