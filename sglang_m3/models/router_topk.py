"""M3's MoE routing from the router logits to the fused layer's inputs, in one Triton launch.

From the fp32 router logits ``[T, E]`` (:mod:`sglang_m3.models.moe_routing`) a row is routed by
the sigmoid of each logit (the expert's probability), the correction bias added for the choice
only, the ``k`` experts of highest biased score, and their raw probabilities renormalised over
the ``k`` and scaled by ``routed_scaling_factor``; the fused MoE layer
(:mod:`sglang_m3.models.fused_moe`) takes the ids as int32 and, where the shared expert is one
more expert of that layer, one more column per row: the shared slot at weight 1. As torch ops that
is about ten launches per MoE layer (sigmoid, add, top-k, gather, sum, divide, scale, cast, two
pads), each a microsecond or more on a handful of rows: in a graphed decode step of the mid-size
M3 on an H200 torch's top-k alone took 5.9 us per layer
(``benchmarks/results/e2e_gpu_h200_servers/profiles_tp1_e5a8e53/``). Here one program per row does
all of it (:func:`route_topk`).

Same arithmetic as the torch path (:func:`sglang_m3.models.moe_routing.sigmoid_topk`): the
sigmoid is ``1 / (1 + exp(-x))`` in fp32, torch's CUDA form (libdevice ``exp``, IEEE division),
the bias an fp32 add, the weight the IEEE quotient of a probability by the sum of the chosen ones,
times the scale. Two things may differ, neither in which experts are chosen apart from exact ties:

* order: the ``k`` ids come out by descending biased score, ties to the lower expert id
  (``torch.topk(sorted=False)`` leaves its order, and which of two tied experts it keeps,
  unspecified); the fused layer sums its experts in the order given, so outputs can differ from
  the torch path's in the last bits;
* the renormalising sum adds the ``k`` probabilities pairwise (``tl.sum``), torch in its own order.

A NaN logit ranks above every number, as in ``torch.topk``, so an id is always one of the ``E``
experts. Graph-safe: nothing is read on the host and every output element is written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from sglang_m3.env_switch import env_choice

FUSED_ROUTE_ENV = "SGLANG_M3_FUSED_ROUTE"


def fused_route_on() -> bool:
    """On by default: in a paired A/B on an H200 (mid-size M3, TP1, c867987) it took the graphed
    concurrency-1 decode step from 1.681 to 1.606 ms, faster in 6 of 6 rounds
    (``benchmarks/results/e2e_gpu_h200_paired_tp1_fused_route_ab_c867987.json``).
    ``SGLANG_M3_FUSED_ROUTE=0`` keeps the torch ops (an A/B, or a fallback)."""
    return env_choice(FUSED_ROUTE_ENV, ("1", "0"), "'1' (one Triton launch on CUDA) or '0' (torch ops)") == "1"


def fused_route_serves(logits: torch.Tensor) -> bool:
    """Whether :func:`route_topk` routes these logits: CUDA tensors, with the switch on."""
    return fused_route_on() and logits.is_cuda


@triton.jit
def route_topk_kernel(
    logits_ptr, logits_stride, bias_ptr, weights_ptr, ids_ptr, out_stride, scale, shared_slot,
    E: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr, SHARED: tl.constexpr, PRECISE: tl.constexpr,
):
    """Row ``program_id(0)``: its ``K`` experts and weights (and the shared slot after them)."""
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, E_PAD)
    real = experts < E
    logits = tl.load(logits_ptr + row * logits_stride + experts, mask=real, other=0.0)
    if PRECISE:  # libdevice's exp, as torch's CUDA sigmoid; the interpreter has no libdevice
        decay = libdevice.exp(-logits)
    else:
        decay = tl.exp(-logits)
    probs = tl.math.div_rn(1.0, 1.0 + decay)
    scores = probs
    if HAS_BIAS:
        scores = probs + tl.load(bias_ptr + experts, mask=real, other=0.0)
    scores = tl.where(scores != scores, float("inf"), scores)  # NaN first, as torch.topk ranks it
    scores = tl.where(real, scores, float("-inf"))
    slots = tl.arange(0, K_PAD)
    chosen = tl.zeros([K_PAD], dtype=tl.int32)
    picked = tl.zeros([K_PAD], dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.max(scores, axis=0)
        first = tl.min(tl.where(scores == best, experts, E_PAD), axis=0)
        chosen = tl.where(slots == j, first, chosen)
        picked = tl.where(slots == j, tl.sum(tl.where(experts == first, probs, 0.0), axis=0), picked)
        scores = tl.where(experts == first, float("-inf"), scores)
    weights = tl.math.div_rn(picked, tl.sum(picked, axis=0)) * scale
    out = row * out_stride + slots
    tl.store(weights_ptr + out, weights, mask=slots < K)
    tl.store(ids_ptr + out, chosen, mask=slots < K)
    if SHARED:
        tl.store(weights_ptr + row * out_stride + K, 1.0)
        tl.store(ids_ptr + row * out_stride + K, shared_slot)


def route_topk(
    logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, scale: float, shared_slot: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[T, k]`` fp32, ids ``[T, k]`` int32) of the fp32 router ``logits [T, E]``: the
    ``top_k`` experts by ``sigmoid(logits) + bias``, weighted by their renormalised probabilities
    times ``scale``; with ``shared_slot``, one more column per row: that id at weight 1."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or (logits.shape[1] > 1 and logits.stride(-1) != 1):
        raise ValueError(f"route_topk takes fp32 logits [T, E] with unit stride along E, got {logits.dtype} {tuple(logits.shape)}")
    rows, experts = logits.shape
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k = {top_k} must be between 1 and the {experts} experts")
    if bias is not None and (bias.shape != (experts,) or bias.dtype != torch.float32):
        raise ValueError(f"the correction bias must be fp32 [{experts}], got {bias.dtype} {tuple(bias.shape)}")
    columns = top_k + (shared_slot is not None)
    weights = torch.empty(rows, columns, dtype=torch.float32, device=logits.device)
    ids = torch.empty(rows, columns, dtype=torch.int32, device=logits.device)
    if rows:
        route_topk_kernel[(rows,)](
            logits, logits.stride(0), logits if bias is None else bias, weights, ids, columns, float(scale),
            0 if shared_slot is None else int(shared_slot),
            E=experts, E_PAD=triton.next_power_of_2(experts), K=top_k, K_PAD=triton.next_power_of_2(top_k),
            HAS_BIAS=bias is not None, SHARED=shared_slot is not None, PRECISE=logits.is_cuda, num_warps=1,
            **({"enable_fp_fusion": False} if logits.is_cuda else {}),
        )
    return weights, ids
