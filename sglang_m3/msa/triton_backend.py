"""The MSA backend on CUDA: the same cache handling as the torch backend, the Triton kernels for attention.

``init_forward_metadata`` (eager) makes one ``msa_kernels`` plan per forward (page table from
``req_to_token`` with page = block = 128, tiles of query tokens); ``_attend`` runs every sparse
layer against it: decode and speculative verification (the drafts of each request, outside
SGLang's ``seq_lens``: see :mod:`sglang_m3.msa.batch_shape`) on the decode kernels, extend /
chunked prefill on the prefill kernels. Verify drafts form a chain (EAGLE top-k 1) or a draft
tree (top-k > 1): then the plan carries each token's depth, ancestors and slot, read from
SGLang's tree mask on the device (:mod:`sglang_m3.msa.verify_tree`), and every token selects
and attends as the decode query at the end of its own root-to-token path.

CUDA graphs (SGLang's decode and target-verify graph runners) use static plans from
:mod:`sglang_m3.msa.graph_plan`: ``init_cuda_graph_state`` sizes them for the largest captured
batch and the model's context; ``init_forward_metadata_out_graph`` (host, before capture and
before every replay) checks the batch and picks the plan of its shape;
``init_forward_metadata_in_graph`` (recorded in the graph) gathers page ids and query positions
from the runner's input buffers into it. Every request of a graphed verify batch has the
captured draft width (SGLang replays only uniform widths). A graphed draft tree's rows are
copied into the plan out of the graph, before every replay: the runner keeps no copy of the
tree mask in its input buffers, the real ``spec_info`` holds it. Extend batches are never
graphed here: their plans depend on host-side lengths.

The model's dense-attention layers of verify and decode batches run here too (unless
``SGLANG_M3_DENSE_VERIFY`` / ``SGLANG_M3_DENSE_DECODE`` say ``sglang``), over every block of the
same plan (:mod:`sglang_m3.msa.dense_decode`).

Extend requests that hold at most ``topk * block_size`` tokens (2,048 on M3) select every
visible block, so their MSA is dense causal attention: they run SDPA per request
(:mod:`sglang_m3.msa.full_selection`, ``SGLANG_M3_FULL_SELECTION_DENSE=0`` turns it off) and
``kernel_plan`` covers the batch's other requests only (None when there are none), their rows of
``q`` gathered and packed; the cache writes are the same either way.
"""

from __future__ import annotations

import logging

import torch
from msa_kernels.api import run_decode, run_prefill
from msa_kernels.plan import (
    DecodePlan,
    draft_tree,
    page_table_from_req_to_token,
    plan_decode,
    plan_prefill,
    verify_window_slots,
)
from msa_kernels.prepare import prepare_prefill
from sglang.srt.runtime_context import get_parallel

from sglang_m3.cache.index_kv_pool import M3IndexedKVPool
from sglang_m3.msa import dense_decode
from sglang_m3.msa.backend import MSATorchBackend
from sglang_m3.msa.batch_shape import attended_lens, host_extend_lens, is_target_verify, uniform_query_shape
from sglang_m3.msa.dense_prefill import serves_batch
from sglang_m3.msa.full_selection import (
    ENV as FULL_SELECTION_ENV,
    FullSelectionPlan,
    full_selection_dense_enabled,
    full_selection_limit,
    plan_full_selection,
)
from sglang_m3.msa.graph_plan import GraphDecodePlans, graph_context_tokens
from sglang_m3.msa.verify_tree import draft_visibility_rows, is_draft_tree, tree_mask_qlen_only

logger = logging.getLogger(__name__)


def _blocks_for(max_seq_len: int, block_size: int, limit: int) -> int:
    """Page-table width: the next power of two of the blocks needed (few kernel variants), capped."""
    need = max(1, -(-max_seq_len // block_size))
    return min(limit, 1 << (need - 1).bit_length())


class MSATritonBackend(MSATorchBackend):
    """Sparse layers through ``msa_kernels`` (requires page size == MSA block size)."""

    def __init__(self, model_runner, spec):
        super().__init__(model_runner, spec)
        page_size = getattr(model_runner, "page_size", None)
        if page_size != self.params.block_size:
            raise ValueError(
                f"the MSA Triton kernels address one block as one KV page: run with --page-size "
                f"{self.params.block_size} (the MSA block size), got page size {page_size}"
            )
        device = torch.device(model_runner.device)
        self.num_sms = sm_count(device)
        self.num_kv_heads = self.token_to_kv_pool.head_num  # per rank
        self.device = device
        self.context_len = model_runner.model_config.context_len
        self.model_runner = model_runner  # its attention backend names the tree-mask layout
        self.kernel_plan = None
        self.graph_plans: GraphDecodePlans | None = None
        # extend requests attended densely (every block selected), None when the batch has none
        self.full_selection: FullSelectionPlan | None = None
        self.full_selection_dense = full_selection_dense_enabled()
        self.dense_batch_kinds = dense_decode.enabled_batch_kinds()  # whose dense layers run here too
        self._dense_kinds_logged: set[str] = set()  # each kind's first use, so a server log says the switch took
        self._full_selection_logged = [False, False]  # the switch, its first use
        if device.type == "cuda":
            self._prepare_prefill_kernels(spec, spec.num_heads // get_parallel().attn_tp_size, model_runner.dtype)

    def _prepare_prefill_kernels(self, spec, q_heads: int, dtype: torch.dtype) -> None:
        """Every extend kernel variant compiled now (``msa_kernels.prepare``), over the caches of
        this rank's first sparse layer, rather than inside the first request that needs it."""
        pool = self.token_to_kv_pool
        first, last = getattr(pool, "start_layer", 0), getattr(pool, "end_layer", None)
        local = [i for i in spec.sparse_layer_ids if i >= first and (last is None or i <= last)]
        if not local:  # a pipeline stage without sparse layers launches none of these kernels
            return
        layer_id = local[0]
        seconds = prepare_prefill(
            self.params, q_heads,
            pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id), pool.get_index_k_buffer(layer_id),
            pool.get_index_k_scale_buffer(layer_id) if isinstance(pool, M3IndexedKVPool) else None,
            dtype=dtype, num_sms=self.num_sms,
        )
        logger.info("sglang-m3: MSA extend kernels prepared in %.2f s", seconds)

    def takes_dense_layer(self, layer, forward_batch, extra: dict) -> bool:
        """Whether this backend attends a dense layer's call (``sglang_m3.msa.dense_decode``)."""
        return self.takes_dense_batch(forward_batch) and dense_decode.computes_call(layer, self.kernel_plan, extra)

    def computes_dense_layer(self, layer) -> bool:
        return dense_decode.computes_layer(layer, self.num_kv_heads)

    def takes_dense_batch(self, forward_batch) -> bool:
        return dense_decode.batch_kind(forward_batch.forward_mode) in self.dense_batch_kinds

    def forward_dense_layer(self, q, k, v, layer, forward_batch, save_kv_cache=True) -> torch.Tensor:
        kind = dense_decode.batch_kind(forward_batch.forward_mode)
        if kind not in self._dense_kinds_logged:
            self._dense_kinds_logged.add(kind)
            switch = dense_decode.VERIFY_ENV if kind == "verify" else dense_decode.DECODE_ENV
            logger.info("a %s batch's dense layer %d runs on the MSA decode kernels (%s=sglang keeps SGLang's backend)",
                        kind, layer.layer_id, switch)
        return dense_decode.attend(self.token_to_kv_pool, self.kernel_plan, q, k, v, layer, forward_batch, save_kv_cache)

    def _draft_trees(self, forward_batch, q_len: int):
        """``(visible rows, slots)`` of a verify batch's draft trees, None for any other batch."""
        if not is_verify_of_trees(forward_batch):
            return None
        qlen_only = tree_mask_qlen_only(getattr(self.model_runner, "attn_backend", None))
        return draft_tree_rows(forward_batch, self.req_to_token_pool.req_to_token, q_len, qlen_only)

    def init_forward_metadata(self, forward_batch) -> None:
        shape = uniform_query_shape(forward_batch, trees=True)
        self.full_selection = None
        if shape is None and self._plan_full_selection(forward_batch):
            return
        trees = None if shape is None else self._draft_trees(forward_batch, shape[0])
        self.kernel_plan = plan_kernels(
            forward_batch, self.req_to_token_pool.req_to_token, self.params, self.num_kv_heads, self.num_sms, trees
        )

    def _plan_full_selection(self, forward_batch) -> bool:
        """Plan an extend batch of which some requests select every block (False: none do, or off).

        Those requests go to ``full_selection``; ``kernel_plan`` covers the others (None if none).
        Reads the host-side lengths the prefill plan reads; the extend plan needs them anyway.
        """
        self._log_full_selection()
        if not (self.full_selection_dense and serves_batch(forward_batch) and forward_batch.seq_lens_cpu is not None):
            return False
        req_to_token, pool_indices = self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices
        seq_lens, extend_lens = forward_batch.seq_lens_cpu.tolist(), host_extend_lens(forward_batch)
        plan = plan_full_selection(self.params, req_to_token, pool_indices, seq_lens, extend_lens)
        if plan is None:
            return False
        self.full_selection, self.kernel_plan, keep = plan, None, list(plan.sparse)
        if keep:
            self.kernel_plan = plan_extend(
                req_to_token, select_requests(pool_indices, keep), [seq_lens[b] for b in keep],
                [extend_lens[b] for b in keep], self.params, self.num_kv_heads, self.num_sms,
            )
        self._log_full_selection(len(seq_lens) - len(keep), len(seq_lens))
        return True

    def _log_full_selection(self, dense: int = 0, requests: int = 0) -> None:
        """Once per server, at its first extend batch: the switch; at the first batch that takes it: that batch."""
        logged = self._full_selection_logged
        if not logged[0]:
            logged[0] = True
            logger.info(
                "M3 MSA: extend requests of at most %d tokens attend densely (MSA selects every block): %s (%s)",
                full_selection_limit(self.params), "on" if self.full_selection_dense else "off", FULL_SELECTION_ENV,
            )
        if dense and not logged[1]:
            logged[1] = True
            logger.info("M3 MSA: first extend batch attended densely (every block selected): %d of %d requests", dense, requests)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Static plan buffers for graphs of up to ``max_bs`` requests (re-allocated on every call),
        of :func:`graph_context_tokens` tokens each."""
        width = self.req_to_token_pool.req_to_token.shape[1]
        max_tokens = graph_context_tokens(width, self.context_len, max_bs, max_num_tokens)
        self.graph_plans = GraphDecodePlans(self.params, max_bs, max_tokens, self.num_kv_heads, self.num_sms, self.device)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Pick the static plan of this batch's shape; the same one at capture and at every replay."""
        self.full_selection = None
        if self.graph_plans is None:
            raise RuntimeError("init_forward_metadata_out_graph before init_cuda_graph_state: no static MSA plan buffers")
        q_len, queries_in_seq_lens = graph_query_shape(forward_batch)
        on_host = forward_batch.seq_lens_cpu
        longest = None
        if on_host is not None and on_host.numel():
            longest = int(attended_lens(on_host, q_len, queries_in_seq_lens).max())
        trees = self._draft_trees(forward_batch, q_len)
        self.kernel_plan = self.graph_plans.plan(forward_batch.seq_lens.shape[0], q_len, longest, tree=trees is not None)
        if trees is not None:
            self.graph_plans.refresh_tree(self.kernel_plan, *trees)

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """Refresh the picked plan from the runner's buffers: the device work the graph replays."""
        q_len, queries_in_seq_lens = graph_query_shape(forward_batch)
        self.graph_plans.refresh(
            self.graph_plans.plan(forward_batch.seq_lens.shape[0], q_len, tree=is_verify_of_trees(forward_batch)),
            self.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            queries_in_seq_lens,
        )

    def _run(
        self, q, k_cache, v_cache, index_q, index_k_cache, scale, index_k_scale=None, k_scale=1.0, v_scale=1.0
    ) -> torch.Tensor:
        """The batch's attention: its dense requests through SDPA, the rest on the MSA kernels."""
        dense = self.full_selection
        if dense is None:
            return self._run_kernels(q, k_cache, v_cache, index_q, index_k_cache, scale, index_k_scale, k_scale, v_scale)
        out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
        dense.attend(q, k_cache, v_cache, out, scale, k_scale, v_scale)
        if dense.sparse_rows is not None:
            rows = dense.sparse_rows
            out[rows] = self._run_kernels(
                q[rows], k_cache, v_cache, index_q[rows], index_k_cache, scale, index_k_scale, k_scale, v_scale
            )
        return out

    def _run_kernels(
        self, q, k_cache, v_cache, index_q, index_k_cache, scale, index_k_scale=None, k_scale=1.0, v_scale=1.0
    ) -> torch.Tensor:
        """The MSA kernels over ``kernel_plan`` (``q`` / ``index_q`` rows packed as it plans them)."""
        run = run_decode if isinstance(self.kernel_plan, DecodePlan) else run_prefill
        out, _ = run(
            self.kernel_plan, q, k_cache, v_cache, index_q, index_k_cache,
            sm_scale=scale, ik_scale=index_k_scale, k_scale=k_scale, v_scale=v_scale,
        )
        return out


def graph_query_shape(forward_batch) -> tuple[int, bool]:
    """(query tokens per request, whether ``seq_lens`` counts them) of a batch a graph may run."""
    shape = uniform_query_shape(forward_batch, trees=True)
    if shape is None:
        raise ValueError(f"MSA CUDA graphs cover DECODE and TARGET_VERIFY batches only, got forward_mode {forward_batch.forward_mode}")
    return shape


def is_verify_of_trees(forward_batch) -> bool:
    return is_target_verify(forward_batch.forward_mode) and is_draft_tree(forward_batch.spec_info)


def draft_tree_rows(forward_batch, req_to_token: torch.Tensor, q_len: int, qlen_only: bool):
    """``(visible [batch * q_len, q_len], slots [batch * q_len])`` of a verify batch of draft trees.

    Device work only: the tree mask of ``spec_info`` (QLEN_ONLY or FULL_MASK layout) and the
    drafts' slots, which follow each request's ``seq_lens`` tokens in ``req_to_token``.
    """
    seq_lens = forward_batch.seq_lens
    mask = getattr(forward_batch.spec_info, "custom_mask", None)
    if mask is None:
        raise ValueError("a verify batch of draft trees without spec_info.custom_mask: each draft's ancestors are unknown")
    visible = draft_visibility_rows(mask, seq_lens, q_len, qlen_only)
    return visible, verify_window_slots(req_to_token, forward_batch.req_pool_indices, seq_lens, q_len)


def plan_kernels(forward_batch, req_to_token: torch.Tensor, params, num_kv_heads: int, num_sms: int = 132, trees=None):
    """The ``msa_kernels`` plan of one SGLang forward batch (decode, verify or extend).

    Decode and verify run the decode kernels with every request's attended length (SGLang's
    ``seq_lens`` plus the drafts in verify, see :mod:`sglang_m3.msa.batch_shape`); extend runs
    the prefill kernels from host-side lengths. ``trees``: :func:`draft_tree_rows` of a verify
    batch of draft trees.
    """
    block = params.block_size
    shape = uniform_query_shape(forward_batch, trees=True)
    on_host = forward_batch.seq_lens_cpu
    host_lens = forward_batch.seq_lens if on_host is None else on_host
    if shape is not None:
        host_lens = attended_lens(host_lens, *shape)
    if shape is None:
        return plan_extend(
            req_to_token, forward_batch.req_pool_indices, host_lens.tolist(), host_extend_lens(forward_batch),
            params, num_kv_heads, num_sms,
        )
    longest = int(host_lens.max()) if host_lens.numel() else 0
    table = page_table_for(req_to_token, forward_batch.req_pool_indices, longest, block)
    q_len, queries_in_seq_lens = shape
    kv_lens = attended_lens(forward_batch.seq_lens, q_len, queries_in_seq_lens)
    return plan_decode(
        params, table, kv_lens, q_len=q_len, num_kv_heads=num_kv_heads, num_sms=num_sms,
        tree=None if trees is None else draft_tree(*trees),
    )


def plan_extend(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: list[int], extend_lens: list[int],
    params, num_kv_heads: int, num_sms: int = 132,
):
    """The prefill-kernel plan of extend requests (host lengths; ``q`` rows packed request after request)."""
    table = page_table_for(req_to_token, req_pool_indices, max(seq_lens, default=0), params.block_size)
    return plan_prefill(params, table, seq_lens, extend_lens, num_index_heads=num_kv_heads, num_sms=num_sms)


def select_requests(req_pool_indices: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """``req_pool_indices`` of the requests ``keep`` (batch indices, ascending), without a host sync."""
    if keep == list(range(len(keep))):
        return req_pool_indices[: len(keep)]
    index = torch.tensor(keep, dtype=torch.int64).to(req_pool_indices.device, non_blocking=True)
    return req_pool_indices.index_select(0, index)


def sm_count(device: torch.device) -> int:
    """The device's SM count, which only sizes grids; off CUDA (the Triton interpreter in CI) any value works."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def page_table_for(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, longest: int, block: int) -> torch.Tensor:
    """Page table of the requests wide enough for ``longest`` tokens (see :func:`_blocks_for`); the
    page is the MSA block."""
    if longest > req_to_token.shape[1]:
        raise ValueError(f"a request attends to {longest} tokens, more than a req_to_token row holds ({req_to_token.shape[1]})")
    width = _blocks_for(longest, block, -(-req_to_token.shape[1] // block))
    max_context = min(width * block, req_to_token.shape[1])
    return page_table_from_req_to_token(req_to_token, req_pool_indices, max_context, block)


def msa_backend_for(model_runner, spec) -> MSATorchBackend:
    """The Triton kernels on CUDA, the torch reference path anywhere else (the CPU platform)."""
    if torch.device(model_runner.device).type == "cuda":
        return MSATritonBackend(model_runner, spec)
    return MSATorchBackend(model_runner, spec)
