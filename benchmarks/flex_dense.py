"""Dense causal GQA through torch's FlexAttention: a dense anchor for speculative verify rows.

SDPA has no fast path for a few queries under a lower-right causal mask. On the H200 (bca5572 run,
``results/msa_kernels_h200.json``) B=8 L=32K q_len 4 took 2.56 ms with cuDNN and 3.15 ms with
FlashAttention, 20-25x their one-query decode time over the same K/V, so a verify row's
``dense/ours`` said 38x where a decoder that reads the K/V once would be near its decode time.
FlexAttention turns the mask into a block mask and, for short query blocks, compiles its split-KV
decoding kernel: one pass over the K/V for all of a request's queries.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

#: compiled once per shape; a benchmark run holds a few dozen of them
_RECOMPILE_LIMIT = 64


@functools.cache
def compiled_flex_attention():
    """``flex_attention`` under ``torch.compile``: uncompiled it materialises the scores and is no anchor."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, _RECOMPILE_LIMIT)
    return torch.compile(flex_attention, dynamic=False)


def lower_right_causal_mask(q_len: int, kv_len: int, device) -> BlockMask:
    """Query ``t`` of ``q_len`` sees keys ``0 .. kv_len - q_len + t``: the last query sees every key."""
    if not 0 < q_len <= kv_len:
        raise ValueError(f"a lower-right causal mask needs 0 < q_len <= kv_len, got q_len {q_len}, kv_len {kv_len}")
    offset = kv_len - q_len

    def visible(batch, head, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return create_block_mask(visible, B=None, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=device)


class FlexDense:
    """Causal GQA of ``q_len`` queries over ``kv_len`` keys, the last query aligned to the last key.

    Called with SDPA's benchmark layout, ``q [B, q_len, HQ, D]`` and ``k/v [B, kv_len, HKV, D]``
    (views, no copies); returns ``[B, HQ, q_len, D]`` as SDPA does.
    """

    def __init__(self, q_len: int, kv_len: int, device, compiled: bool = True):
        self.shape = (q_len, kv_len)
        self.block_mask = lower_right_causal_mask(q_len, kv_len, device)
        self.attention = compiled_flex_attention() if compiled else flex_attention

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if (q.shape[1], k.shape[1]) != self.shape:
            raise ValueError(f"FlexDense built for (q_len, kv_len) {self.shape}, called with {(q.shape[1], k.shape[1])}")
        return self.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=self.block_mask, enable_gqa=True)
