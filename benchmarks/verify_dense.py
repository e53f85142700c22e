"""Dense anchors for speculative verify rows: a few queries over many keys, lower-right causal.

SDPA has no fast path for that mask. On the H200 (bca5572 run, ``results/msa_kernels_h200_bca5572.json``)
B=8 L=32K q_len 4 took 2.56 ms with cuDNN and 3.15 ms with FlashAttention, 20-25x their one-query
decode time over the same K/V, so a verify row's ``dense/ours`` said 38x. Three dense forms that
read the K/V once:

* :class:`FlexDense`: FlexAttention with the mask as a block mask; for short query blocks it
  compiles its split-KV decoding kernel (349 us on that row, c70c4e9).
* :class:`CudnnPrefixSplitDense`: the serving path's own :func:`prefix_split_sdpa` (cuDNN over
  the keys every query sees, unmasked, and over the queries' own keys, causally, merged by
  log-sum-exp), with the batch folded into the heads so each part is one cuDNN call.
* :class:`MsaDenseDecode`: the MSA decode kernels reading every block
  (``decode_attention(dense=True)``, what ``SGLANG_M3_DENSE_VERIFY=msa`` serves M3's dense layers
  with), over each request's K/V as consecutive pages. It is the project's own kernel, so it is
  listed beside the others rather than in place of them; the anchor is the fastest dense form.
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


def fold_batch_into_heads(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, H, D]`` -> ``[T, B * H, D]`` (a copy): request ``b``'s head ``h`` becomes head ``b * H + h``.

    Folding queries and keys alike keeps grouped-query attention's pairing: query head
    ``b * HQ + h`` reads key head ``(b * HQ + h) // G = b * HKV + h // G`` with ``G = HQ / HKV``.
    """
    batch, tokens, heads, dim = x.shape
    return x.permute(1, 0, 2, 3).reshape(tokens, batch * heads, dim)


class CudnnPrefixSplitDense:
    """:func:`prefix_split_sdpa` over every input set of a row, folded once outside the timing.

    ``sets`` holds ``(q [B, q_len, HQ, D], k, v [B, kv_len, HKV, D])``; calling with a set's index
    returns its output as ``[B, HQ, q_len, D]`` (SDPA's layout). CUDA, 16-bit, as in serving.
    """

    def __init__(self, sets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
        self.batch, _, self.heads, dim = sets[0][0].shape
        self.scale = dim**-0.5
        self.folded = [tuple(fold_batch_into_heads(x) for x in inputs) for inputs in sets]

    def __call__(self, index: int) -> torch.Tensor:
        from sglang_m3.msa.dense_prefill import prefix_split_sdpa  # the plugin (SGLang) only where this anchor runs

        q, k, v = self.folded[index]
        out = prefix_split_sdpa(q, k, v, self.scale)  # [q_len, B * HQ, D]
        return out.view(out.shape[0], self.batch, self.heads, out.shape[-1]).permute(1, 2, 0, 3)


class MsaDenseDecode:
    """:func:`msa_kernels.api.decode_attention` with ``dense=True`` over every input set of a row.

    ``sets`` as :class:`CudnnPrefixSplitDense` takes them; request ``b``'s K/V rows are its
    ``kv_len / block`` consecutive pages of the flattened set, and its ``q_len`` queries the last
    positions, as a verify batch's plan holds them. Calling with a set's index returns
    ``[B, HQ, q_len, D]`` (SDPA's layout).
    """

    def __init__(self, sets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], params, num_sms: int):
        from msa_kernels.plan import plan_decode

        batch, q_len, self.heads, dim = sets[0][0].shape
        kv_len, kv_heads = sets[0][1].shape[1], sets[0][1].shape[2]
        block = params.block_size
        if kv_len % block:
            raise ValueError(f"kv_len {kv_len} is not a whole number of {block}-token pages")
        device = sets[0][0].device
        pages = kv_len // block
        table = torch.arange(batch * pages, dtype=torch.int32, device=device).view(batch, pages)
        lengths = torch.full((batch,), kv_len, dtype=torch.int32, device=device)
        self.plan = plan_decode(params, table, lengths, q_len=q_len, num_kv_heads=kv_heads, num_sms=num_sms)
        self.shape = (batch, q_len, self.heads, dim)
        self.flat = [(q.reshape(batch * q_len, self.heads, dim), k.reshape(-1, kv_heads, dim), v.reshape(-1, kv_heads, dim))
                     for q, k, v in sets]

    def __call__(self, index: int) -> torch.Tensor:
        from msa_kernels.api import decode_attention

        q, k, v = self.flat[index]
        out = decode_attention(self.plan, q, k, v, None, dense=True)
        return out.view(self.shape).transpose(1, 2)

