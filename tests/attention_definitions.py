"""Attention computed from its definition, for tests that stand it in for a CUDA-only kernel."""

from __future__ import annotations

import torch


def math_attention_with_lse(q, keys, values, scale, causal):
    """What ``dense_prefill._cudnn_attention_with_lse`` returns: ``(out [n, Hq, D], lse [n, Hq, 1])``
    of ``q [n, Hq, D]`` over ``keys`` / ``values [L, Hkv, D]`` (grouped-query), top-left causal when asked."""
    group = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.einsum("hnl,lhd->nhd", torch.softmax(scores, -1), v)
    return out, lse.transpose(0, 1)[..., None]
