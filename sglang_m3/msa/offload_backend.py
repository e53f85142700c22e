"""The MSA torch backend under sparse offload: decode / verify read K/V through the block cache.

Per decode / verify step and sparse layer:

1. every query selects its blocks as usual, from the index keys in the device pool;
2. the selected blocks become host pages through the request's page table (page size == MSA block
   size, so block ``b`` is the page of slot ``req_to_token[b * block]``);
3. the layer's block cache fetches the missing pages in one batched copy
   (:meth:`SparseBlockCache.fetch`, a static-shape plan);
4. attention reads K/V only from the cache, through the page table remapped to cache entries.

The batch runs in rounds of ``requests_per_round`` requests (as many as the cache holds at their
worst-case selection, a start-up constant), so one round's entries are never evicted before its
attention has run; a CUDA graph of a given batch size replays a fixed number of rounds.

Extend batches (prefill, chunked prefill) attend the host store directly: on the CPU platform it
is the same memory. K/V writes go through the pool (host store + write-through to the cache).

On CUDA the same structure runs on the Triton path: :mod:`sglang_m3.msa.offload_triton_backend`
(``decode_select`` on the device index keys, ``page_table[req, selected]`` as the round's wanted
pages, the same :func:`plan_fetch`, one gather kernel per round reading the pinned host store
through its device address, the sparse attention kernel over the cache pages with the page table
remapped to entries; writes are one kernel into the host store and the resident entries; extend
batches read their pages through a staging buffer).

This path computes exactly what :class:`MSATorchBackend` computes: the same selection functions
on the same index keys, and the same sparse attention (its gathered form, which reads the selected
blocks alone) over a key sequence whose selected blocks hold the same values (unselected blocks
come from whatever entry or the scratch entry the table points at, and are never read).
"""

from __future__ import annotations

import logging

import torch
from msa_kernels.reference import select_blocks
from msa_kernels.torch_gathered import block_scores_by_rows, sparse_attention_gathered

from sglang_m3.cache.offload_pool import M3SparseOffloadKVPool
from sglang_m3.cache.offload_settings import offload_log_steps
from sglang_m3.msa.backend import MSATorchBackend, stored_kv_scales
from sglang_m3.msa.batch_shape import uniform_query_shape
from sglang_m3.msa.plan import RequestPlan

logger = logging.getLogger(__name__)


class MSAOffloadTorchBackend(MSATorchBackend):
    def __init__(self, model_runner, spec):
        super().__init__(model_runner, spec)
        pool = self.token_to_kv_pool
        if not isinstance(pool, M3SparseOffloadKVPool):
            raise TypeError(f"sparse offload needs the M3 offload KV pool, the server built {type(pool).__name__}")
        shape = pool.offload_shape
        self.requests_per_round = shape.requests_per_round
        self.wanted_per_round = shape.requests_per_round * shape.pages_per_request
        self.last_sparse_layer = max(pool.local_sparse_layer_ids())
        self.counter_log = OffloadCounterLog(pool, offload_log_steps())
        self.page_rows: list[torch.Tensor] | None = None  # per request of a decode / verify batch

    def init_forward_metadata(self, forward_batch) -> None:
        super().init_forward_metadata(forward_batch)
        if uniform_query_shape(forward_batch, trees=True) is None:
            self.page_rows = None
            return
        block = self.params.block_size
        self.page_rows = [(req.kv_slots[::block] // block).long() for req in self.plan.requests]

    def _attend(self, q, layer, index_q) -> torch.Tensor:
        if self.page_rows is None:
            return super()._attend(q, layer, index_q)
        q = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        out = self._attend_through_cache(q, layer, index_q)
        if layer.layer_id == self.last_sparse_layer:
            self.counter_log.step()
        return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    def _attend_through_cache(self, q, layer, index_q) -> torch.Tensor:
        pool, layer_id = self.token_to_kv_pool, layer.layer_id
        index_k = pool.get_index_k_buffer(layer_id)
        index_scale = pool.get_index_k_scale_buffer(layer_id)
        requests = self.plan.requests
        selections = [self._select(req, index_q, index_k, index_scale) for req in requests]
        cache = pool.block_cache(layer_id)
        k_rows, v_rows = pool.cached_kv(layer_id)
        k_scale, v_scale = stored_kv_scales(layer, q, k_rows)
        out = q.new_empty(q.shape[0], q.shape[1], v_rows.shape[-1])
        for first in range(0, len(requests), self.requests_per_round):
            group = range(first, min(first + self.requests_per_round, len(requests)))
            pool.fetch_pages(layer_id, self._wanted_pages(group, selections))
            for i in group:
                req = requests[i]
                rows = slice(req.query_start, req.query_start + req.query_len)
                positions = torch.arange(req.kv_slots.shape[0], device=q.device)
                cached = cache.rows(cache.entry_table(self.page_rows[i]), positions)
                out[rows] = sparse_attention_gathered(
                    q[rows], k_rows[cached], v_rows[cached], selections[i], req.query_positions,
                    self.params.block_size, layer.scaling, k_scale, v_scale)
        return out

    def _select(self, req: RequestPlan, index_q, index_k, index_scale) -> torch.Tensor:
        """The request's chosen blocks ``[queries, kv_heads, topk]`` (-1 padded), scored as the
        device torch path scores them (``block_scores_by_rows``)."""
        rows = slice(req.query_start, req.query_start + req.query_len)
        slots = req.kv_slots
        scores = block_scores_by_rows(index_q[rows], index_k[slots], req.query_positions, self.params.block_size,
                                      None if index_scale is None else index_scale[slots])
        return select_blocks(scores, req.query_positions, self.params)

    def _wanted_pages(self, group: range, selections: list[torch.Tensor]) -> torch.Tensor:
        """Host pages of a round's selected blocks, -1 padded to the round's fixed length."""
        pages = torch.cat([
            self.page_rows[i][selections[i].clamp(min=0)].masked_fill(selections[i] < 0, -1).flatten() for i in group
        ])
        if pages.numel() > self.wanted_per_round:
            raise ValueError(f"a round selects {pages.numel()} blocks, more than the {self.wanted_per_round} the "
                             "block cache was sized for (more query tokens per request than at start-up)")
        wanted = torch.full((self.wanted_per_round,), -1, dtype=torch.int64, device=pages.device)
        wanted[: pages.numel()] = pages
        return wanted


class OffloadCounterLog:
    """Logs the block caches' totals every ``every`` decode / verify steps (reading the counters syncs).

    The torch path calls :meth:`step` after a step's fetches; the Triton path, whose steps may be
    graph replays (no Python runs inside them), calls :meth:`before_step` out of the graph before
    each one: reading the counters then waits for every step queued so far.
    """

    def __init__(self, pool: M3SparseOffloadKVPool, every: int):
        self.pool = pool
        self.every = every
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        self._maybe_log()

    def before_step(self) -> None:
        self._maybe_log()
        self.steps += 1

    def _maybe_log(self) -> None:
        if self.every and self.steps and self.steps % self.every == 0:
            totals = self.pool.offload_counters()
            looked_up = totals["hits"] + totals["misses"]
            logger.info(
                "M3 sparse offload after %d decode/verify steps: block-cache hits %d, misses %d (hit rate %.3f), "
                "host->device %d bytes (%.0f per step); extend staging %d bytes", self.steps, totals["hits"],
                totals["misses"], totals["hits"] / looked_up if looked_up else 0.0, totals["h2d_bytes"],
                totals["h2d_bytes"] / self.steps, totals.get("staged_bytes", 0))
