"""Compile every extend-batch kernel variant before a server takes requests.

An extend batch launches one of a few fixed kernel variants: the indexer in one pass or split over
programs (plus its merge), and the attention query-major or KV-block-major (plus its merge). Which
one depends on the batch (a short chunk after a long prefix splits the indexer; a long one turns
block-major), so a server met each variant first inside some user's request, and Triton compiled
it there: 0.5-1 s per kernel on the H200, in a request's time to first token
(``benchmarks/results/first_prompt_h200/``). Decode and verify kernels are compiled by the CUDA
graph capture at start-up; these are not captured (prefill runs eagerly).

:func:`prepare_prefill` runs each variant once on a small synthetic batch over the server's own
caches, so its kernels are built with the dtypes, strides and alignments real batches have
(nothing is written to the caches). With a warm Triton cache it costs a few launches.
"""

from __future__ import annotations

import time

import torch

from msa_kernels.api import run_prefill
from msa_kernels.plan import plan_prefill
from msa_kernels.reference import MSAParams

#: The synthetic batch: one request whose new tokens follow a cached prefix, so the indexer has
#: blocks to split and the attention a prefix to read.
_PREFIX_TOKENS = 128
_NEW_TOKENS = 16


def prepare_prefill(
    params: MSAParams,
    q_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ik_cache: torch.Tensor,
    ik_scale: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    dtype: torch.dtype = torch.bfloat16,
    num_sms: int = 132,
) -> float:
    """Run the indexer unsplit and split and the attention query- and block-major once each over
    these caches (``[slots, kv_heads, dim]`` K/V and ``[slots, (1,) index_dim]`` index keys, as a
    server's pool holds them, with ``q_heads`` query heads of ``dtype``); returns the seconds taken.

    The synthetic request reads the caches' first pages (whatever they hold) and nothing is
    stored, so a server's pool is unchanged.
    """
    block = params.block_size
    total = _PREFIX_TOKENS + _NEW_TOKENS
    pages = -(-total // block)
    if k_cache.shape[0] < pages * block:
        raise ValueError(f"the caches hold {k_cache.shape[0]} slots, the synthetic batch reads {pages * block}")
    device = k_cache.device
    began = time.perf_counter()
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    page_table = torch.arange(pages, dtype=torch.int32, device=device)[None, :]
    q = torch.randn(_NEW_TOKENS, q_heads, head_dim, device=device).to(dtype)
    iq = torch.randn(_NEW_TOKENS, kv_heads, ik_cache.shape[-1], device=device).to(dtype)
    for index_splits, block_major in ((1, False), (2, False), (1, True)):
        plan = plan_prefill(params, page_table, [total], [_NEW_TOKENS], num_index_heads=kv_heads,
                            index_splits=index_splits, num_sms=num_sms, block_major=block_major)
        run_prefill(plan, q, k_cache, v_cache, iq, ik_cache, ik_scale=ik_scale, k_scale=k_scale, v_scale=v_scale)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - began
