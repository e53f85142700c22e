"""M3's MoE router, shared by every expert path (the torch blocks of :mod:`sglang_m3.models.moe`
and the fused block of :mod:`sglang_m3.models.fused_moe`).

A replicated fp32 linear gives one logit per expert; the sigmoid of the logits is the expert
probability. Where the config has ``use_routing_bias`` a correction bias is added to the
probabilities for the choice of the top-k experts only: the chosen experts are weighed by their
raw probabilities, renormalised over the chosen k. Evaluating the router in fp32 keeps the choice
independent of the model's dtype.

The parameters are registered on the MoE block itself (``gate.weight``,
``e_score_correction_bias``), the names the checkpoint loader maps onto.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang_m3.config import M3TextSpec


def add_router_parameters(block: nn.Module, spec: M3TextSpec) -> None:
    """``block.gate`` (fp32 linear, hidden -> experts) and ``block.e_score_correction_bias`` (or None)."""
    e, h = spec.num_experts, spec.hidden_size
    block.gate = nn.Linear(h, e, bias=False, dtype=torch.float32)
    if spec.use_routing_bias:
        block.e_score_correction_bias = nn.Parameter(torch.zeros(e, dtype=torch.float32), requires_grad=False)
    else:
        block.register_parameter("e_score_correction_bias", None)


def sigmoid_topk_route(
    gate: nn.Linear, bias: torch.Tensor | None, x: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32 summing to 1 per token, expert ids [T, k] int64, router logits [T, E] fp32)."""
    logits = gate(x.float())
    probs = torch.sigmoid(logits)
    scores = probs if bias is None else probs + bias
    _, chosen = torch.topk(scores, top_k, dim=-1, sorted=False)
    weights = probs.gather(1, chosen)
    return weights / weights.sum(dim=-1, keepdim=True), chosen, logits
