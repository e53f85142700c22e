"""The MSA Triton backend under sparse offload (CUDA): the sparse layers' K/V in pinned host memory.

The pool (:class:`sglang_m3.cache.offload_pool.M3SparseOffloadKVPool`, ``uses_kernels``) keeps every
sparse layer's main K/V in a page-locked host store and one device :class:`SparseBlockCache` per
layer; the index keys stay in device memory. Per sparse layer:

* **decode / target verify** (graph-safe: fixed shapes, nothing read on the host): the index scan
  and top-k run as in :class:`MSATritonBackend` on the device index keys (``decode_select``, the
  pool's page table); the batch then runs in rounds of ``requests_per_round`` requests (as many as
  the cache holds at their worst-case selection, a start-up constant, so a graph of a given batch
  size replays a fixed number of rounds). A round turns its selection into host pages
  (``page_table[request, block]``, -1 for unselected slots: static length), plans the fetch on the
  device (:func:`plan_fetch`: hits, misses, LRU victims), copies the misses with one gather kernel
  that reads the pinned store through its device address, and runs the existing sparse attention
  kernel over the cache pages with the page table remapped to cache entries
  (:meth:`SparseBlockCache.entry_table`). A round's entries are never evicted before its attention
  has run (stream order); the next round may evict them.
* **extend** (prefill, chunked prefill, radix hits; eager): the selection runs on the device index
  keys; the K/V every request of the batch attends (its prefix and this chunk, whole pages) are
  gathered from the host store into a staging buffer (one kernel per layer), and the prefill
  attention (query-major or block-major, as planned) reads them through a page table remapped to
  staging pages. The chunk's own K/V were stored just before (SGLang writes before attention), so
  the staging copy holds them.
* **writes** of new tokens (``set_kv_buffer``) are one kernel that stores into the host store and
  into the resident cache entry of the token's page (write-through), so a resident page never goes
  stale; the index keys are written to the device pool as always.

Exactness: the same selection kernels on the same index keys, the same attention kernels over the
same K/V bytes (only their addresses differ), the same split partition of each request's blocks
(:func:`msa_kernels.api.decode_attention` over a subset of the tiles computes each tile as the whole
batch would), so outputs equal :class:`MSATritonBackend`'s bit for bit. Radix prefix sharing is
untouched: the host store keeps SGLang's slot layout and the cache is keyed by page.

Not served under offload (refused at start-up or per batch): EAGLE draft trees (their attention
reads each draft's K/V from its pool slot, which lives in the host store), the hierarchical cache
and HiSparse (``sglang_m3.cache.offload_settings``). Fetches are not overlapped with compute (the
next layer's selection depends on its input; rounds run one after the other); the fetch granularity
is a whole page (every KV head of a block), so heads that choose different blocks fetch each
other's K/V too.

Counters: the block caches count hits, misses and host->device bytes on the device; the backend
logs their totals every ``SGLANG_M3_SPARSE_OFFLOAD_LOG_STEPS`` decode / verify steps, counted out of
the graphs (before every replay or eager step), so the line after N steps holds exactly N steps'
fetches (plus any from graph warm-up runs). The staging copies of extend batches are counted apart
(``staged_bytes``, host arithmetic, no sync).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from msa_kernels.api import decode_attention, decode_select, prefill_attention, prefill_select
from msa_kernels.plan import DecodePlan, PrefillPlan
from msa_kernels.triton_offload import gather_pages

from sglang_m3.cache.offload_pool import M3SparseOffloadKVPool
from sglang_m3.cache.offload_settings import offload_log_steps
from sglang_m3.msa.backend import stored_kv_scales
from sglang_m3.msa.batch_shape import uniform_query_shape
from sglang_m3.msa.offload_backend import OffloadCounterLog
from sglang_m3.msa.triton_backend import MSATritonBackend, is_verify_of_trees, plan_kernels

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillStaging:
    """Where an extend batch's attended pages go in the staging buffer (one layout per forward)."""

    src_pages: torch.Tensor  # [pages] int64: host page of each staging page
    dst_pages: torch.Tensor  # [pages] int64: 0 .. pages-1
    page_table: torch.Tensor  # [batch, max_blocks] int32: staging page of every (request, block)

    @property
    def pages(self) -> int:
        return self.src_pages.shape[0]


def plan_staging(page_table: torch.Tensor, seq_lens: list[int], block_size: int) -> PrefillStaging:
    """Request ``b``'s blocks ``0 .. ceil(seq_lens[b] / block) - 1`` packed request after request.

    ``page_table [batch, max_blocks]`` (the prefill plan's, int32 on the device). Blocks past a
    request's tokens map to staging page 0: never selected, never read.
    """
    counts = [-(-length // block_size) for length in seq_lens]
    if any(n > page_table.shape[1] for n in counts):
        raise ValueError(f"a request needs {max(counts)} blocks, the page table has {page_table.shape[1]}")
    total = sum(counts)
    rows = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.long))
    cols = torch.cat([torch.arange(n) for n in counts]) if counts else torch.zeros(0, dtype=torch.long)
    table = torch.zeros(tuple(page_table.shape), dtype=torch.int32)
    table[rows, cols] = torch.arange(total, dtype=torch.int32)
    device = page_table.device
    rows, cols = rows.to(device), cols.to(device)
    return PrefillStaging(
        src_pages=page_table[rows, cols].long(),
        dst_pages=torch.arange(total, dtype=torch.long, device=device),
        page_table=table.to(device),
    )


def round_pages(page_table: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """Host pages of a round's chosen blocks, -1 where a slot chose nothing: ``[n * q_len * heads * topk]``.

    ``page_table [n, max_blocks]`` the round's rows; ``selected [n * q_len, heads, topk]`` their
    choices (request-major rows, -1 padded). Fixed length for a fixed batch shape.
    """
    n = page_table.shape[0]
    chosen = selected.reshape(n, -1).long()
    pages = page_table.long().gather(1, chosen.clamp(min=0))
    return torch.where(chosen >= 0, pages, -1).flatten()


class MSAOffloadTritonBackend(MSATritonBackend):
    """Sparse layers through ``msa_kernels`` with their K/V read through the block caches (see module docstring)."""

    def __init__(self, model_runner, spec):
        super().__init__(model_runner, spec)
        pool = self.token_to_kv_pool
        if not isinstance(pool, M3SparseOffloadKVPool):
            raise TypeError(f"sparse offload needs the M3 offload KV pool, the server built {type(pool).__name__}")
        if not pool.uses_kernels:
            raise ValueError("the MSA Triton offload backend needs the pool's kernel copies (a CUDA device)")
        self.requests_per_round = pool.offload_shape.requests_per_round
        self.counter_log = OffloadCounterLog(pool, offload_log_steps())
        self.staging: PrefillStaging | None = None
        logger.info("M3 sparse offload: MSA Triton path, decode/verify in fetch rounds of %d request(s), "
                    "extend through a staging buffer", self.requests_per_round)

    def _prepare_prefill_kernels(self, spec, q_heads: int, dtype: torch.dtype) -> None:
        """Nothing: this backend's extends read K/V through staging pages, not the pool's buffers
        the preparation would read (its first long prompt still compiles them)."""

    def takes_dense_layer(self, layer, forward_batch, extra: dict) -> bool:
        """Never: under sparse offload the dense layers keep SGLang's backend whatever
        ``SGLANG_M3_DENSE_VERIFY`` / ``SGLANG_M3_DENSE_DECODE`` say (not tested with fetch rounds)."""
        return False

    def takes_dense_batch(self, forward_batch) -> bool:
        return False  # as takes_dense_layer: SGLang's backend plans every batch

    # -- metadata ---------------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch) -> None:
        shape = uniform_query_shape(forward_batch, trees=True)
        if shape is None:  # extend: every request on the prefill kernels, through staging pages
            self.kernel_plan = plan_kernels(
                forward_batch, self.req_to_token_pool.req_to_token, self.params, self.num_kv_heads, self.num_sms
            )
            on_host = forward_batch.seq_lens_cpu
            seq_lens = (forward_batch.seq_lens.cpu() if on_host is None else on_host).tolist()
            self.staging = plan_staging(self.kernel_plan.page_table, seq_lens, self.params.block_size)
            return
        refuse_trees(forward_batch)
        self.staging = None
        self.counter_log.before_step()
        super().init_forward_metadata(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        refuse_trees(forward_batch)
        super().init_forward_metadata_out_graph(forward_batch, in_capture)
        self.staging = None
        if not in_capture:
            self.counter_log.before_step()

    # -- attention --------------------------------------------------------------------------------

    def _attend(self, q, layer, index_q) -> torch.Tensor:
        pool, layer_id = self.token_to_kv_pool, layer.layer_id
        q = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        index_k = pool.get_index_k_buffer(layer_id)
        index_scale = pool.get_index_k_scale_buffer(layer_id)
        plan = self.kernel_plan
        if isinstance(plan, DecodePlan):
            out = self._decode(plan, q, layer, index_q, index_k, index_scale)
        elif isinstance(plan, PrefillPlan):
            out = self._extend(plan, q, layer, index_q, index_k, index_scale)
        else:
            raise RuntimeError(f"no MSA plan for this forward (got {type(plan).__name__})")
        return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    def _decode(self, plan: DecodePlan, q, layer, index_q, index_k, index_scale) -> torch.Tensor:
        pool, layer_id = self.token_to_kv_pool, layer.layer_id
        cache = pool.block_cache(layer_id)
        k_rows, v_rows = pool.cached_kv(layer_id)
        k_scale, v_scale = stored_kv_scales(layer, q, k_rows)
        out = q.new_empty(plan.num_tokens, q.shape[1], v_rows.shape[-1])
        batch, q_len = plan.tiles.count, plan.tiles.max_tokens
        if batch == 0:
            return out
        selected = decode_select(plan, index_q, index_k, index_scale)
        for first in range(0, batch, self.requests_per_round):
            last = min(batch, first + self.requests_per_round)
            pool.fetch_pages(layer_id, round_pages(plan.page_table[first:last], selected[first * q_len : last * q_len]))
            entries = cache.entry_table(plan.page_table).to(torch.int32)
            decode_attention(plan, q, k_rows, v_rows, selected, out, layer.scaling, k_scale, v_scale,
                             page_table=entries, requests=(first, last))
        return out

    def _extend(self, plan: PrefillPlan, q, layer, index_q, index_k, index_scale) -> torch.Tensor:
        pool, layer_id = self.token_to_kv_pool, layer.layer_id
        staging = self.staging
        if staging is None:
            raise RuntimeError("an extend plan without its staging layout")
        selected = prefill_select(plan, index_q, index_k, index_scale)
        cache = pool.block_cache(layer_id)
        host_k, host_v = pool.host_kv(layer_id)
        k_pages = host_k.new_empty((staging.pages, *cache.k_pages.shape[1:]), device=cache.k_pages.device)
        v_pages = host_v.new_empty((staging.pages, *cache.v_pages.shape[1:]), device=cache.v_pages.device)
        gather_pages(cache.as_pages(host_k), cache.as_pages(host_v), k_pages, v_pages, staging.src_pages, staging.dst_pages)
        pool.staged_bytes += staging.pages * cache.page_bytes
        k_rows, v_rows = pool.as_attention_dtype(k_pages.flatten(0, 1), v_pages.flatten(0, 1))
        k_scale, v_scale = stored_kv_scales(layer, q, k_rows)
        return prefill_attention(plan, q, k_rows, v_rows, selected, None, layer.scaling, k_scale, v_scale,
                                 page_table=staging.page_table)


def refuse_trees(forward_batch) -> None:
    if is_verify_of_trees(forward_batch):
        raise ValueError(
            "EAGLE draft trees are not verified under sparse offload (their attention reads each draft's K/V "
            "from its pool slot, which lives in the host store): run with --speculative-eagle-topk 1"
        )
