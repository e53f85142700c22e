"""EAGLE on SGLang's torch-native attention (the CPU platform's backend), chains only.

SGLang 0.5.23's ``TorchNativeAttnBackend`` serves prefill and decode but neither speculative
mode it would meet: a TARGET_VERIFY batch (``seq_lens`` excludes the drafts and
``extend_seq_lens`` is None, see :mod:`sglang_m3.msa.batch_shape`) and the draft's multi-step
decode, for which ``DraftBackendFactory`` knows no torch-native backend. This module supplies
both for chains of drafts (EAGLE top-k 1), whose slots SGLang lays out contiguously after
``seq_lens`` in ``req_to_token``: verify attends the prefix and the drafts causally, and draft
step ``i`` attends the prefix and its own ``i + 1`` drafts. The draft-extend modes are ordinary
extend batches there and need nothing new.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_m3.msa.batch_shape import verify_q_len


def verify_extend(backend: TorchNativeAttnBackend, q, k, v, layer, forward_batch, save_kv_cache: bool = True):
    """Attention of a TARGET_VERIFY batch: each request's drafts after its ``seq_lens`` prefix, causally."""
    q_len = verify_q_len(forward_batch.spec_info)
    q, out, caches = _store_and_operands(backend, q, k, v, layer, forward_batch, save_kv_cache)
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
    """Draft decode step ``step``: one query per request at position ``seq_len + step``, attending
    the prefix and the drafts of steps ``0 .. step`` (written by this and the earlier steps)."""

    def __init__(self, model_runner, step: int):
        super().__init__(model_runner)
        self.step = step

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        q, out, caches = _store_and_operands(self, q, k, v, layer, forward_batch, save_kv_cache)
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


class TorchNativeMultiStepDraftBackend:
    """The per-step backends of one EAGLE draft pass, in the container form SGLang's draft worker
    uses (``attn_backends[i]`` serves step ``i``; the last step only samples)."""

    def __init__(self, model_runner, topk: int, speculative_num_steps: int):
        if topk != 1:
            raise ValueError(
                f"--speculative-eagle-topk {topk}: the torch-native draft backend runs chains of drafts "
                "only (top-k 1); draft trees need a tree mask it does not build"
            )
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.attn_backends = [TorchNativeDraftStepBackend(model_runner, i) for i in range(speculative_num_steps - 1)]

    def init_forward_metadata(self, forward_batch) -> None:
        for backend in self.attn_backends:
            backend.init_forward_metadata(forward_batch)
