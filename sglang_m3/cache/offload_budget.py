"""How many tokens a server under sparse offload admits: device room and host room, per rank.

Under sparse offload every token slot costs memory in two tiers: on the device its index keys and
the dense layers' K/V (SGLang's cell size, minus the offloaded K/V), in the host store the sparse
layers' K/V. The per-layer block caches are device memory of a fixed size, taken off SGLang's KV
budget before it sizes its slot pool from what is left (and ``--max-total-tokens``); the host
budget ``SGLANG_M3_SPARSE_OFFLOAD_HOST_GB`` (GB of 1e9 bytes per rank, as ``--hicache-size``) caps
it further, so the pool never holds more tokens than the host store has room for. SGLang's own
admission then works on those slots: an input longer than the pool gets its "Input length ...
exceeds the maximum allowed length" error, concurrent requests that do not fit together wait in
the queue. A budget that cannot hold one request of ``--context-length`` is refused at start-up:
such a request would otherwise be cut short when the pool runs out mid-answer. So are block caches
that take the whole device budget, a host budget set while sparse offload is off, and SGLang's
post-capture KV sizing (``SGLANG_ENABLE_POST_CAPTURE_KV_SIZING``).
"""

from __future__ import annotations

import math

from sglang_m3.env_switch import env_number
from sglang_m3.recipe.render import SPARSE_OFFLOAD_BLOCKS_ENV, SPARSE_OFFLOAD_HOST_GB_ENV


def host_budget_bytes() -> int | None:
    """The host budget per rank in bytes, None when unset (the host store follows the slot pool)."""
    gigabytes = env_number(SPARSE_OFFLOAD_HOST_GB_ENV, float, lambda v: v > 0, "a positive number of GB (1e9 bytes) per rank")
    return None if gigabytes is None else int(gigabytes * 10**9)


def check_budget_has_offload(budget_bytes: int | None, cache_blocks: int) -> None:
    """Refuse a host budget while sparse offload is off: nothing would read it, and a server the
    operator believes capped to its host memory would size its pool from device memory alone."""
    if budget_bytes is not None and not cache_blocks:
        raise ValueError(
            f"{SPARSE_OFFLOAD_HOST_GB_ENV}={budget_bytes / 10**9:g} sizes the sparse-offload host store, but sparse "
            f"offload is off ({SPARSE_OFFLOAD_BLOCKS_ENV} is unset or 0): set {SPARSE_OFFLOAD_BLOCKS_ENV} as well, "
            f"or unset {SPARSE_OFFLOAD_HOST_GB_ENV}")


def check_block_caches_fit(cache_blocks: int, cache_bytes: int, budget_bytes: int) -> None:
    """Refuse block caches that leave no device memory for the slot pool (SGLang would only say
    "Not enough memory" and point at --mem-fraction-static)."""
    if cache_bytes >= budget_bytes:
        raise ValueError(
            f"{SPARSE_OFFLOAD_BLOCKS_ENV}={cache_blocks}: the block caches take {cache_bytes / 10**9:.3f} GB of device "
            f"memory, the whole KV budget of {max(budget_bytes, 0) / 10**9:.3f} GB; lower {SPARSE_OFFLOAD_BLOCKS_ENV} "
            "or raise --mem-fraction-static")


#: SGLang's switch (``sglang.srt.environ``) that sizes the KV pool a second time after CUDA-graph capture
POST_CAPTURE_KV_SIZING_ENV = "SGLANG_ENABLE_POST_CAPTURE_KV_SIZING"


def check_no_post_capture_sizing(cache_blocks: int, post_capture_active: bool) -> None:
    """Refuse SGLang's post-capture KV sizing under sparse offload. It sizes the pool again from the
    memory free after capture, where the block caches are allocated already, so they would come off
    the budget twice; and its pool backs every layer's K/V in device memory, bypassing the host store."""
    if post_capture_active:
        raise ValueError(
            f"{SPARSE_OFFLOAD_BLOCKS_ENV}={cache_blocks} cannot run with {POST_CAPTURE_KV_SIZING_ENV}=1: SGLang's "
            "post-capture resize sizes the KV pool again from the memory left once the block caches are allocated "
            "(they would come off the budget twice) and backs every layer's K/V in device memory, where sparse "
            "offload keeps the sparse layers' K/V in the host store; unset one of them")


def offloaded_bytes_per_token(sparse_layers: int, kv_heads: int, head_dim: int, v_head_dim: int, element_bytes: int) -> int:
    """Host-store bytes of one token: K and V of every sparse layer of the rank."""
    return sparse_layers * kv_heads * (head_dim + v_head_dim) * element_bytes


def check_host_room(cap_tokens: int, context_length: int, budget_bytes: int, bytes_per_token: int, page_size: int) -> None:
    """Refuse a host budget that cannot hold one full-length request."""
    if cap_tokens < context_length:
        needed_gb = math.ceil((context_length + 2 * page_size) * bytes_per_token / 10**7) / 100
        raise ValueError(
            f"{SPARSE_OFFLOAD_HOST_GB_ENV}={budget_bytes / 10**9:g}: the host store holds {cap_tokens:,} tokens "
            f"({bytes_per_token:,} bytes each), fewer than one request of --context-length {context_length:,}; "
            f"raise it to at least {needed_gb:g} or lower --context-length")
