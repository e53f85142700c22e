"""The MSA attention backend for sparse layers (torch path; runs on any device torch supports).

Each call stores the layer's new K/V and index keys at the batch's cache slots, then runs the
reference MSA semantics per request on the keys gathered from the pool (the sparse attention in
its gathered form, :mod:`msa_kernels.torch_gathered`, which reads only the chosen blocks' keys).
The per-request loop is the CPU path: correctness first; the CUDA kernels in ``msa_kernels``
replace it on GPUs.

An fp8 main KV cache (``--kv-cache-dtype fp8_e4m3``) follows SGLang's convention: the pool stores
``k / layer.k_scale`` and ``v / layer.v_scale`` in fp8 (scales from a checkpoint's KV-cache
quantization, none otherwise), and attention reads the stored values times those scales. The index
keys keep their own dtype (:mod:`sglang_m3.cache.index_kv_pool`).
"""

from __future__ import annotations

import torch
from msa_kernels.reference import MSAParams, msa_attention
from msa_kernels.torch_gathered import block_scores_by_rows, sparse_attention_gathered
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_m3.cache.index_kv_pool import M3IndexedKVPool
from sglang_m3.config import M3TextSpec
from sglang_m3.models.fused_attn_ops import fused_attn_ops_on
from sglang_m3.msa.plan import MSABatchPlan, plan_forward_batch


def attend_paged(
    plan: MSABatchPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index_q: torch.Tensor,
    index_k_cache: torch.Tensor,
    params: MSAParams,
    scale: float,
    index_k_scale: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """MSA for a planned batch over a slot-indexed cache: ``[queries, Hq, Dv]``.

    ``index_k_scale [slots]``: per-slot scales when ``index_k_cache`` holds fp8 keys;
    ``k_scale`` / ``v_scale``: what the cached K / V are multiplied by to read their values.
    """
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    for req in plan.requests:
        rows = slice(req.query_start, req.query_start + req.query_len)
        slots = req.kv_slots
        out[rows], _ = msa_attention(
            q[rows], k_cache[slots], v_cache[slots], index_q[rows], index_k_cache[slots],
            req.query_positions, params, scale=scale,
            ik_scale=None if index_k_scale is None else index_k_scale[slots], k_scale=k_scale, v_scale=v_scale,
            attend=sparse_attention_gathered, score=block_scores_by_rows,
        )
    return out


def stored_kv_scales(layer, q: torch.Tensor, k_cache: torch.Tensor) -> tuple[float, float]:
    """(k_scale, v_scale) that turn this layer's cached K / V back into values.

    SGLang's ``set_kv_buffer`` divides K and V by the layer's scales when it casts them into a
    cache of another dtype (fp8) and the layer has scales; otherwise it stores the values (1.0).
    """
    if layer.k_scale is None or layer.v_scale is None or k_cache.dtype == q.dtype:
        return 1.0, 1.0
    return float(layer.k_scale_float), float(layer.v_scale_float)


def store_kv(pool, layer, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``layer``'s K and V at cache slots ``loc``, cast (and divided by its scales) as SGLang's pool does."""
    if layer.k_scale is None:
        pool.set_kv_buffer(layer, KVWriteLoc(loc, None), k, v)
    else:  # the pool divides by the scales in place: the model's k and v stay intact
        pool.set_kv_buffer(layer, KVWriteLoc(loc, None), k.clone(), v.clone(), layer.k_scale, layer.v_scale)


def msa_params_of(spec: M3TextSpec) -> MSAParams:
    """The kernels' selection knobs from the model's MSA settings."""
    return MSAParams(
        block_size=spec.index_block_size,
        topk=spec.index_topk_blocks,
        local_blocks=spec.index_local_blocks,
        init_blocks=spec.index_init_blocks,
    )


class MSATorchBackend(AttentionBackend):
    def __init__(self, model_runner, spec: M3TextSpec):
        super().__init__()
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.params = msa_params_of(spec)
        self.plan: MSABatchPlan | None = None

    def init_forward_metadata(self, forward_batch) -> None:
        self.plan = plan_forward_batch(forward_batch, self.req_to_token_pool.req_to_token)

    def takes_dense_layer(self, layer, forward_batch, extra: dict) -> bool:
        """Whether this backend attends a dense layer's call itself: never here (see the Triton backend)."""
        return False

    def computes_dense_layer(self, layer) -> bool:
        """Whether this backend can attend that dense layer in the batches it takes: never here."""
        return False

    def takes_dense_batch(self, forward_batch) -> bool:
        """Whether this backend attends the dense layers of this batch (those it can): never here."""
        return False

    def _store(self, layer, forward_batch, k, v, index_k) -> None:
        loc = forward_batch.out_cache_loc
        pool = self.token_to_kv_pool
        # On CUDA one Triton launch writes K, V and the index key (sglang_m3.models.fused_attn_ops).
        if fused_attn_ops_on(k) and isinstance(pool, M3IndexedKVPool) and pool.store_fused(layer.layer_id, loc, k, v, index_k):
            return
        store_kv(pool, layer, loc, k, v)
        pool.set_index_k(layer.layer_id, loc, index_k)

    def _attend(self, q, layer, index_q) -> torch.Tensor:
        pool = self.token_to_kv_pool
        # fp8 index keys (and their scales) exist only in the project's pool
        scales = pool.get_index_k_scale_buffer(layer.layer_id) if isinstance(pool, M3IndexedKVPool) else None
        q = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        k_cache = pool.get_key_buffer(layer.layer_id)
        out = self._run(
            q,
            k_cache,
            pool.get_value_buffer(layer.layer_id),
            index_q,
            pool.get_index_k_buffer(layer.layer_id),
            layer.scaling,
            scales,
            *stored_kv_scales(layer, q, k_cache),
        )
        return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    def _run(
        self, q, k_cache, v_cache, index_q, index_k_cache, scale, index_k_scale=None, k_scale=1.0, v_scale=1.0
    ) -> torch.Tensor:
        """One sparse layer over the planned batch; subclasses swap in other kernels."""
        return attend_paged(
            self.plan, q, k_cache, v_cache, index_q, index_k_cache, self.params, scale, index_k_scale, k_scale, v_scale
        )

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, index_q=None, index_k=None, **kwargs):
        # SGLang's breakable prefill graphs run attention eagerly on the real tokens of a padded
        # batch: q, k, v and out_cache_loc arrive narrowed to them, keyword operands it does not
        # know (the index branch's) at the padded length. Narrow those the same way.
        if index_q is not None:
            index_q = index_q[: q.shape[0]]
        if index_k is not None and k is not None:
            index_k = index_k[: k.shape[0]]
        if save_kv_cache:
            self._store(layer, forward_batch, k, v, index_k)
        return self._attend(q, layer, index_q)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, index_q=None, index_k=None, **kwargs):
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, index_q, index_k)
