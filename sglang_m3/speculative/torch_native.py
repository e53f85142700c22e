"""EAGLE on SGLang's torch-native attention (the CPU platform's backend), chains and trees.

SGLang 0.5.23's ``TorchNativeAttnBackend`` serves prefill and decode but neither speculative
mode it would meet: a TARGET_VERIFY batch (``seq_lens`` excludes the drafts and
``extend_seq_lens`` is None, see :mod:`sglang_m3.msa.batch_shape`) and the draft's multi-step
decode, for which ``DraftBackendFactory`` knows no torch-native backend. This module supplies
both. The drafts' slots follow ``seq_lens`` in ``req_to_token``. For chains (EAGLE top-k 1)
verify attends the prefix and the drafts causally, and draft step ``i`` attends the prefix and
its own ``i + 1`` drafts. For trees (top-k > 1) verify attends the prefix and each token's tree
ancestors (SGLang's tree mask, :mod:`sglang_m3.msa.verify_tree`), and draft step ``i`` of branch
``t`` attends the prefix and the branch's slots ``t * num_steps .. t * num_steps + i``, the read
plan of SGLang's own draft backends (``generate_draft_decode_kv_indices``). The draft-extend
modes are ordinary extend batches there and need nothing new.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_m3.msa.batch_shape import verify_q_len
from sglang_m3.msa.verify_tree import draft_visibility, is_draft_tree


def verify_extend(backend: TorchNativeAttnBackend, q, k, v, layer, forward_batch, save_kv_cache: bool = True):
    """Attention of a TARGET_VERIFY batch: each request's drafts after its ``seq_lens`` prefix,
    causally for a chain, along their tree paths for a tree."""
    q_len = verify_q_len(forward_batch.spec_info, trees=True)
    q, out, caches = _store_and_operands(backend, q, k, v, layer, forward_batch, save_kv_cache)
    if is_draft_tree(forward_batch.spec_info):
        _tree_verify_sdpa(q, out, *caches, forward_batch, q_len, layer.scaling)
        return out.view(out.shape[0], -1)
    prefix = forward_batch.seq_lens
    backend._run_sdpa_forward_extend(
        q,
        out,
        *caches,
        forward_batch.req_pool_indices,
        prefix + q_len,
        prefix,
        torch.full_like(prefix, q_len),
        scaling=layer.scaling,
        enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
        causal=True,
    )
    return out.view(out.shape[0], -1)


def _sdpa_rows(q, keys, values, mask, scaling) -> torch.Tensor:
    """SDPA of ``q [n, Hq, D]`` over ``keys/values [L, Hkv, D]`` (cast to q's dtype) under a bool ``mask [n, L]``."""
    attended = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        keys.to(q.dtype).transpose(0, 1),
        values.to(q.dtype).transpose(0, 1),
        attn_mask=mask,
        scale=scaling,
        enable_gqa=q.shape[1] != keys.shape[1],
    )
    return attended.transpose(0, 1)


def _tree_verify_sdpa(q, out, k_cache, v_cache, req_to_token, forward_batch, q_len: int, scaling) -> None:
    """Each request's verify tokens attend its prefix and, among the drafts, their tree paths."""
    prefix_lens = forward_batch.seq_lens.tolist()
    visibilities = draft_visibility(forward_batch.spec_info.custom_mask, prefix_lens, q_len)
    for b, (pool_index, prefix, visibility) in enumerate(zip(forward_batch.req_pool_indices.tolist(), prefix_lens, visibilities)):
        slots = req_to_token[pool_index, : prefix + q_len]
        mask = torch.cat((visibility.new_ones(q_len, prefix), visibility), dim=1).to(q.device)
        rows = slice(b * q_len, (b + 1) * q_len)
        out[rows] = _sdpa_rows(q[rows], k_cache[slots], v_cache[slots], mask, scaling)


def _store_and_operands(backend: TorchNativeAttnBackend, q, k, v, layer, forward_batch, save_kv_cache: bool):
    """Write the batch's new K/V, then ``(q [T, H, D], out [T, H, Dv], (k cache, v cache, req_to_token))``."""
    if save_kv_cache and k is not None and v is not None:
        backend.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc), k, v)
    q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
    out = q.new_empty(q.shape[0], layer.tp_q_head_num, layer.v_head_dim)
    pool = backend.token_to_kv_pool
    caches = (pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id), backend.req_to_token_pool.req_to_token)
    return q, out, caches


class TorchNativeDraftStepBackend(TorchNativeAttnBackend):
    """Draft decode step ``step``: ``topk`` queries per request at position ``seq_len + step``,
    query ``t`` attending the prefix and its branch's drafts of steps ``0 .. step`` (slots
    ``seq_len + t * num_steps + 0 .. step`` with pages of one slot, written by this and the
    earlier steps)."""

    def __init__(self, model_runner, step: int, topk: int = 1, num_steps: int = 1):
        super().__init__(model_runner)
        self.step = step
        self.topk = topk
        self.num_steps = num_steps
        self.page_size = getattr(model_runner, "page_size", 1)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        q, out, caches = _store_and_operands(self, q, k, v, layer, forward_batch, save_kv_cache)
        if self.topk > 1:
            self._branches(q, out, *caches, forward_batch, layer.scaling)
            return out.view(out.shape[0], -1)
        self._run_sdpa_forward_decode(
            q,
            out,
            *caches,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens + self.step + 1,
            scaling=layer.scaling,
            enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
        )
        return out.view(out.shape[0], -1)

    def _branches(self, q, out, k_cache, v_cache, req_to_token, forward_batch, scaling) -> None:
        """Tree drafting: query ``b * topk + t`` over request ``b``'s prefix and branch ``t``'s slots."""
        if q.shape[0] != forward_batch.seq_lens.numel() * self.topk:
            raise ValueError(
                f"a draft step of top-{self.topk} trees has {q.shape[0]} queries for "
                f"{forward_batch.seq_lens.numel()} requests (forward_batch.seq_lens); expected topk per request"
            )
        steps = torch.arange(self.step + 1)
        page = self.page_size
        for b, (pool_index, prefix) in enumerate(zip(forward_batch.req_pool_indices.tolist(), forward_batch.seq_lens.tolist())):
            row = req_to_token[pool_index]
            # SGLang's branch layout: with pages of more than one slot each branch owns whole pages and
            # starts at the prefix's offset in its last page (branch stride num_steps for pages of 1)
            branch_stride = (prefix % page + self.num_steps + page - 1) // page * page
            for t in range(self.topk):
                slots = torch.cat((row[:prefix], row[prefix + t * branch_stride + steps.to(row.device)]))
                query = slice(b * self.topk + t, b * self.topk + t + 1)
                out[query] = _sdpa_rows(q[query], k_cache[slots], v_cache[slots], None, scaling)


class TorchNativeMultiStepDraftBackend:
    """The per-step backends of one EAGLE draft pass, in the container form SGLang's draft worker
    uses (``attn_backends[i]`` serves step ``i``; the last step only samples)."""

    def __init__(self, model_runner, topk: int, speculative_num_steps: int):
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.attn_backends = [
            TorchNativeDraftStepBackend(model_runner, i, topk, speculative_num_steps) for i in range(speculative_num_steps - 1)
        ]

    def init_forward_metadata(self, forward_batch) -> None:
        for backend in self.attn_backends:
            backend.init_forward_metadata(forward_batch)
