"""M3's dense-attention layers in verify and decode batches, on the MSA decode kernels.

SGLang's Triton backend verifies drafts with its extend kernel, which gives each (request, query
head) one program walking the whole context: on the H200 that took 170 us per dense layer at a
2K context for a chain of 4 (``benchmarks/results/speculative_gpu_h200.md``), where a decode step
of the same layer took 29 us, and it grows with the context. The sparse layers' decode plan
already holds the batch's pages and every query token's position (and, for draft trees, its
path), so the dense layers can run the same kernels over every block instead of the chosen ones
(:func:`msa_kernels.api.decode_attention` with ``dense``): split over the keys, merged in the last split.

Verify batches (``SGLANG_M3_DENSE_VERIFY``, default ``msa``): on the H200
(``benchmarks/results/dense_verify_h200/``) the dense layer's verify took about 12 us instead of
170 us, and with both servers alive on one GPU (ABBA rounds) the chain of 3 decoded at 1.69 ms
against 1.97 ms per token at concurrency 1 and 3.02 against 3.30 at 16, greedy output identical.
``sglang`` keeps SGLang's backend (an A/B switch).

Decode batches (``SGLANG_M3_DENSE_DECODE``, default ``msa``): the verify path's kernels at one
query token (tested on the GPU, ``tests/kernels/test_msa_gpu.py::test_dense_decode_*``). Where
every dense layer runs here, SGLang's backend does not plan the batch at all
(``sglang_m3.msa.hybrid``), and that plan, not the kernel, was the cost: a decode step is as long
as the scheduler's host work at concurrency 1. A same-minute A/B on the H200 with both servers
alive (``benchmarks/results/dense_decode_h200/``) decoded a 2K-prompt request at 2.557 ms per
token here against 2.845 ms on SGLang's split decode kernel (planned), and sixteen at 5.937
against 5.925 ms. ``sglang`` keeps SGLang's backend.
"""

from __future__ import annotations

import torch
from msa_kernels import api as msa_api
from msa_kernels.plan import DecodePlan

from sglang_m3.env_switch import env_choice
from sglang_m3.msa.backend import stored_kv_scales, store_kv
from sglang_m3.msa.batch_shape import is_target_verify
from sglang_m3.msa.dense_prefill import plain_causal_call

VERIFY_ENV = "SGLANG_M3_DENSE_VERIFY"
DECODE_ENV = "SGLANG_M3_DENSE_DECODE"


def enabled_batch_kinds() -> frozenset[str]:
    """The batch kinds (``"verify"``, ``"decode"``) whose dense layers the switches send here."""
    kinds = set()
    if env_choice(VERIFY_ENV, ("msa", "sglang")) == "msa":
        kinds.add("verify")
    if env_choice(DECODE_ENV, ("msa", "sglang")) == "msa":
        kinds.add("decode")
    return frozenset(kinds)


def batch_kind(forward_mode) -> str | None:
    """``"verify"`` or ``"decode"`` (the kinds the switches name), None for any other batch."""
    if is_target_verify(forward_mode):
        return "verify"
    return "decode" if forward_mode.is_decode() else None


def computes_layer(layer, num_kv_heads: int) -> bool:
    """Whether the decode kernels can attend this layer at all: as many KV heads as a plan of
    ``num_kv_heads`` (its merge tickets count them), and plain causal attention."""
    return getattr(layer, "tp_k_head_num", num_kv_heads) == num_kv_heads and plain_causal_call(layer, {})


def computes_call(layer, plan, extra: dict) -> bool:
    """Whether the decode kernels compute this layer's call as SGLang's backend would, given a
    plan: one for the decode kernels, a layer :func:`computes_layer` accepts, no extra operands."""
    return isinstance(plan, DecodePlan) and not extra and computes_layer(layer, plan.num_kv_heads)


def attend(pool, plan: DecodePlan, q, k, v, layer, forward_batch, save_kv_cache: bool = True) -> torch.Tensor:
    """The layer's K/V written at the batch's slots, then causal GQA of every query token over
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
