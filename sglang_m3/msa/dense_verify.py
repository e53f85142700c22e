"""M3's dense-attention layers in speculative verify batches, on the MSA decode kernels.

SGLang's Triton backend verifies drafts with its extend kernel, which gives each (request, query
head) one program walking the whole context: on the H200 that took 170 us per dense layer at a
2K context for a chain of 4 (``benchmarks/results/speculative_gpu_h200.md``), where a decode step
of the same layer took 29 us, and it grows with the context. The sparse layers' decode plan
already holds the batch's pages and every verify token's position (and, for draft trees, its
path), so the dense layers can run the same kernels over every block instead of the chosen ones
(:func:`msa_kernels.api.decode_attention` with ``dense``): split over the keys, merged in the last split.

On the H200 (``benchmarks/results/dense_verify_h200/``) the dense layer's verify took about 12 us
instead of 170 us, and with both servers alive on one GPU (ABBA rounds) the chain of 3 decoded
at 1.69 ms against 1.97 ms per token at concurrency 1 and 3.02 against 3.30 at 16, greedy output
identical. It is the default; ``SGLANG_M3_DENSE_VERIFY=sglang`` keeps SGLang's backend for the
dense layers (an A/B switch).
"""

from __future__ import annotations

import torch
from msa_kernels import api as msa_api
from msa_kernels.plan import DecodePlan

from sglang_m3.env_switch import env_choice
from sglang_m3.msa.backend import stored_kv_scales, store_kv
from sglang_m3.msa.batch_shape import is_target_verify
from sglang_m3.msa.dense_prefill import plain_causal_call

ENV = "SGLANG_M3_DENSE_VERIFY"


def dense_verify_enabled() -> bool:
    return env_choice(ENV, ("msa", "sglang")) == "msa"


def takes(layer, forward_batch, plan, extra: dict) -> bool:
    """Whether a dense layer's call in this batch is one the decode kernels compute as SGLang's
    backend would: a verify batch planned for the decode kernels, as many KV heads as the plan
    was made for (its merge tickets count them), plain causal attention."""
    return (
        is_target_verify(forward_batch.forward_mode)
        and isinstance(plan, DecodePlan)
        and getattr(layer, "tp_k_head_num", plan.num_kv_heads) == plan.num_kv_heads
        and plain_causal_call(layer, extra)
    )


def attend(pool, plan: DecodePlan, q, k, v, layer, forward_batch, save_kv_cache: bool = True) -> torch.Tensor:
    """The layer's K/V written at the batch's slots, then causal GQA of every verify token over
    every key before it: ``[tokens, heads * v_head_dim]``."""
    if save_kv_cache:
        store_kv(pool, layer, forward_batch.out_cache_loc, k, v)
    q = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
    k_cache = pool.get_key_buffer(layer.layer_id)
    k_scale, v_scale = stored_kv_scales(layer, q, k_cache)
    out = msa_api.decode_attention(
        plan, q, k_cache, pool.get_value_buffer(layer.layer_id), None,
        sm_scale=layer.scaling, k_scale=k_scale, v_scale=v_scale, dense=True,
    )
    return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)
