"""M3's MoE router, shared by every expert path (the torch blocks of :mod:`sglang_m3.models.moe`
and the fused block of :mod:`sglang_m3.models.fused_moe`).

A replicated fp32 linear gives one logit per expert; the sigmoid of the logits is the expert
probability. Where the config has ``use_routing_bias`` a correction bias is added to the
probabilities for the choice of the top-k experts only: the chosen experts are weighed by their
raw probabilities, renormalised over the chosen k. Evaluating the router in fp32 keeps the choice
independent of the model's dtype.

On CUDA with 16-bit activations the fp32 linear runs on CUDA cores (an SGEMM of the upcast
activations). The logits come from a 16-bit tensor-core GEMM with fp32 accumulation and output
instead, over the fp32 weight written as the sum of at most three 16-bit parts (bf16 keeps 8 of
fp32's 24 significant bits; a bf16 checkpoint's router is one part): every product of a 16-bit
activation and a 16-bit part is exact in fp32, so the logits differ from the fp32 router's only in
how the sums round, and the tensor cores' fp32 accumulation rounds more coarsely than the SGEMM.
On the H200 (``benchmarks/results/router_gemm_h200/``, 128 experts x 6,144, three parts) the
logits' largest error against a float64 reference was 1.5e-6 to 7.7e-6 of the largest logit,
against 1.2e-7 to 1.3e-6 for the fp32 linear, and the time per layer 13.8 against 18.8 us for 4
rows and 251 against 1,596 us for a 32K-token prefill. A weight three parts cannot hold (fp16's
narrow exponent range) keeps the fp32 linear. At decode's few rows that GEMM is a cuBLAS split-K
of two launches, 7 to 10 us back to back whatever the rows: up to ``MAX_GEMV_ROWS`` (8) CUDA rows
take a Triton GEMV over the parts instead (:mod:`sglang_m3.models.router_gemv`: one launch,
deterministic, 3 to 7 us), which sums the parts to the fp32 weight exactly, so that its logits are
the fp32 linear's up to summation order.

The parameters are registered on the MoE block itself (``gate.weight``,
``e_score_correction_bias``), the names the checkpoint loader maps onto.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_m3.config import M3TextSpec
from sglang_m3.models.router_gemv import gemv_serves, router_logits_gemv


def add_router_parameters(block: nn.Module, spec: M3TextSpec) -> None:
    """``block.gate`` (fp32 linear, hidden -> experts) and ``block.e_score_correction_bias`` (or None)."""
    e, h = spec.num_experts, spec.hidden_size
    block.gate = nn.Linear(h, e, bias=False, dtype=torch.float32)
    block.gate_half = None  # see prepare_half_router
    if spec.use_routing_bias:
        block.e_score_correction_bias = nn.Parameter(torch.zeros(e, dtype=torch.float32), requires_grad=False)
    else:
        block.register_parameter("e_score_correction_bias", None)


#: bf16 keeps 8 significant bits of fp32's 24 over the same exponents: three parts hold any fp32 value
#: but those above bf16's largest finite value or with bits below its smallest subnormal
MAX_ROUTER_PARTS = 3


def split_into_16bit_parts(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``weight`` (fp32, [E, H]) as the fewest ``dtype`` tensors whose exact sum is ``weight``,
    stacked on the first dim ([P * E, H], largest part first); None where ``MAX_ROUTER_PARTS`` do
    not suffice. Each remainder is exact in fp32 (the rounding error of a narrower significand
    over the same binade), so a zero remainder means the parts sum to ``weight`` exactly. Host syncs."""
    parts, rest = [], weight
    for _ in range(MAX_ROUTER_PARTS):
        part = rest.to(dtype)
        parts.append(part)
        rest = rest - part.float()
        if not torch.any(rest):
            return torch.cat(parts)
    return None


def prepare_half_router(block: nn.Module, dtype: torch.dtype) -> bool:
    """After loading: give ``block`` its router weight as stacked 16-bit parts (``gate_half``, see
    :func:`split_into_16bit_parts`) when the weight is on CUDA and ``dtype`` is 16-bit; else None.
    Returns whether it did. Run once per load (it compares on the device: host syncs)."""
    weight = block.gate.weight.detach()
    block.gate_half = None
    if dtype in (torch.bfloat16, torch.float16) and weight.is_cuda:
        block.gate_half = split_into_16bit_parts(weight, dtype)
    return block.gate_half is not None


def router_logits(gate: nn.Linear, x: torch.Tensor, gate_half: torch.Tensor | None = None) -> torch.Tensor:
    """Router logits [T, E] in fp32: from the 16-bit parts when there are some for ``x``'s dtype
    (CUDA rows up to ``MAX_GEMV_ROWS``: the GEMV of :mod:`router_gemv`; else one GEMM over all
    parts, then the parts' logits summed)."""
    if gate_half is not None and x.dtype == gate_half.dtype:
        experts = gate.out_features
        if gemv_serves(x):
            return router_logits_gemv(x, gate_half, experts)
        logits = torch.mm(x, gate_half.t(), out_dtype=torch.float32)
        parts = gate_half.shape[0] // experts
        return logits if parts == 1 else logits.view(-1, parts, experts).sum(1)
    return gate(x.float())


def sigmoid_topk(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32 summing to 1 per token, expert ids [T, k] int64) of router ``logits``
    (:mod:`sglang_m3.models.router_topk` is the same in one launch on the GPU)."""
    probs = torch.sigmoid(logits)
    scores = probs if bias is None else probs + bias
    _, chosen = torch.topk(scores, top_k, dim=-1, sorted=False)
    weights = probs.gather(1, chosen)
    return weights / weights.sum(dim=-1, keepdim=True), chosen


def fused_layer_routing(
    logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, scale: float, shared_slot: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the fused MoE layer takes, on torch ops: :func:`sigmoid_topk`'s weights times ``scale``
    (fp32 ``[T, k]``) and int32 ids, with ``shared_slot`` one more column per row, that id at
    weight 1 (:func:`sglang_m3.models.router_topk.route_topk` is the same in one launch on the GPU)."""
    weights, chosen = sigmoid_topk(logits, bias, top_k)
    weights, ids = weights * scale, chosen.to(torch.int32)
    if shared_slot is not None:
        weights, ids = F.pad(weights, (0, 1), value=1.0), F.pad(ids, (0, 1), value=shared_slot)
    return weights, ids


def sigmoid_topk_route(
    gate: nn.Linear, bias: torch.Tensor | None, x: torch.Tensor, top_k: int, gate_half: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32 summing to 1 per token, expert ids [T, k] int64, router logits [T, E] fp32)."""
    logits = router_logits(gate, x, gate_half)
    return *sigmoid_topk(logits, bias, top_k), logits
