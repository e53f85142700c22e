"""M3's MoE block in torch: sigmoid router (:mod:`sglang_m3.models.moe_routing`), routed
experts, shared expert.

The routed experts are plain tensors, evaluated one of two ways (the same arithmetic per token):

- ``loop`` (the CPU platform's path): only the experts some token chose, each on the rows that
  chose it. Fast on the CPU, but ``torch.unique(...).tolist()`` reads the choice on the host, so
  it cannot be captured in a CUDA graph.
- ``static`` (the GPU path for fp32 models): every expert on every row, each row's output kept
  only where that row chose the expert (``torch.where``, weight from the chosen slot). Fixed
  shapes, no host sync: capturable by CUDA graphs, and exact in fp32, unlike SGLang's Triton
  fused MoE, which computes in fp16 for fp32 activations. It costs ``num_experts / top_k`` times
  the expert FLOPs: meant for fp32 exactness runs, not for serving at real widths.

Both accumulate the experts in ascending id order. Parallel layout (the one SGLang's fused MoE
uses, so ``--tp-size`` / ``--ep-size`` mean the same on every platform): the ``tp`` ranks form
``ep`` expert groups of ``tp / ep`` ranks each; a rank holds the ``num_experts / ep`` experts of
its group (a contiguous id range) and a ``1 / (tp / ep)`` slice of each one's intermediate
dimension, plus its TP slice of the shared expert. Every rank routes every token (the router is
replicated) and sums only what it holds, so each (expert, slice) term lands on exactly one rank
and one all-reduce over the TP group completes the block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.distributed import tensor_model_parallel_all_reduce
from sglang.srt.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from sglang.srt.runtime_context import get_parallel
from torch import nn

from sglang_m3.config import M3TextSpec
from sglang_m3.models.fused_activation import GatedActivation
from sglang_m3.models.layers import gated_activation
from sglang_m3.models.moe_routing import add_router_parameters, sigmoid_topk_route

EXPERT_PATHS = ("loop", "static")


class GatedMLP(nn.Module):
    """Dense MLP (and M3's shared expert): separate gate/up halves, the config's gated activation
    (swiglu-oai in M3), down projection."""

    def __init__(
        self, spec: M3TextSpec, intermediate_size: int, reduce_results: bool, quant_config=None, prefix: str = "",
        field: str = "shared_intermediate_size",
    ):
        """``field``: the config field ``intermediate_size`` comes from, for the refusal of a width
        that does not split over the tensor-parallel ranks."""
        super().__init__()
        tp_size = get_parallel().tp_size
        if intermediate_size % tp_size:
            # SGLang's parallel linears failed on a bare assertion for such a width.
            raise ValueError(
                f"{field} ({intermediate_size}) is not divisible by the tensor-parallel size (--tp-size {tp_size})"
            )
        self.act = GatedActivation(spec.hidden_act, spec.swiglu_alpha, spec.swiglu_limit)
        self.gate_up_proj = MergedColumnParallelLinear(
            spec.hidden_size, [intermediate_size] * 2, bias=False, quant_config=quant_config, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, spec.hidden_size, bias=False, quant_config=quant_config,
            reduce_results=reduce_results, prefix=f"{prefix}.down_proj",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(self.act(gate_up))
        return out


@dataclass(frozen=True)
class ExpertLayout:
    """This rank's share of the routed experts (the layout in the module docstring)."""

    tp_size: int
    #: global ids of the experts this rank holds; local expert ``i`` is ``local_experts.start + i``
    local_experts: range
    #: this rank's slice of each expert's intermediate dimension
    inter_slice: slice

    @property
    def local_inter(self) -> int:
        return self.inter_slice.stop - self.inter_slice.start


def expert_layout(spec: M3TextSpec, block: str) -> ExpertLayout:
    """The current rank's :class:`ExpertLayout` from SGLang's parallel context; refuses, naming the
    flag or field, what ``block`` (for messages) cannot serve."""
    parallel = get_parallel()
    if parallel.moe_dp_size > 1:
        # Each MoE-DP replica would add the whole routed sum into the TP all-reduce.
        raise ValueError(f"the {block} does not support --moe-dp-size > 1 (got {parallel.moe_dp_size})")
    ep_size, ep_rank = parallel.moe_ep_size, parallel.moe_ep_rank
    moe_tp_size, moe_tp_rank = parallel.moe_tp_size, parallel.moe_tp_rank
    if spec.num_experts % ep_size:
        raise ValueError(f"num_local_experts ({spec.num_experts}) is not divisible by --ep-size ({ep_size})")
    if spec.moe_intermediate_size % moe_tp_size:
        raise ValueError(
            f"intermediate_size ({spec.moe_intermediate_size}) is not divisible by the expert tensor-parallel "
            f"size (--tp-size / --ep-size = {moe_tp_size})"
        )
    local_inter = spec.moe_intermediate_size // moe_tp_size
    local_experts = spec.num_experts // ep_size
    return ExpertLayout(
        tp_size=parallel.tp_size,
        local_experts=range(ep_rank * local_experts, (ep_rank + 1) * local_experts),
        inter_slice=slice(moe_tp_rank * local_inter, (moe_tp_rank + 1) * local_inter),
    )


class M3SparseMoeBlock(nn.Module):
    def __init__(self, spec: M3TextSpec, quant_config=None, prefix: str = "", experts_path: str = "loop"):
        super().__init__()
        if experts_path not in EXPERT_PATHS:
            raise ValueError(f"experts_path must be one of {EXPERT_PATHS}, got {experts_path!r}")
        self.experts_path = experts_path
        layout = expert_layout(spec, "torch MoE block")
        self.tp_size = layout.tp_size
        self.top_k = spec.experts_per_token
        self.scaling = spec.routed_scaling_factor
        self.act = gated_activation(spec.hidden_act, spec.swiglu_alpha, spec.swiglu_limit)
        self.local_inter = layout.local_inter
        self.inter_slice = layout.inter_slice
        #: global ids of the experts this rank holds; ``w13[i]`` is expert ``local_experts.start + i``
        self.local_experts = layout.local_experts
        local_experts = len(layout.local_experts)
        h = spec.hidden_size
        add_router_parameters(self, spec)
        # Experts: rows [0, I) of w13 are the gate (w1) slice of this rank, rows [I, 2I) the up (w3) slice.
        self.w13 = nn.Parameter(torch.empty(local_experts, 2 * self.local_inter, h), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(local_experts, h, self.local_inter), requires_grad=False)
        self.shared_experts = GatedMLP(
            spec, spec.shared_intermediate_size, reduce_results=False, quant_config=quant_config, prefix=f"{prefix}.shared_experts"
        )

    def load_expert_weight(self, expert: int, which: str, weight: torch.Tensor) -> None:
        """Copy this rank's slice of checkpoint tensor ``experts.{expert}.{which}.weight`` (nothing
        when another expert-parallel group holds that expert)."""
        if expert not in self.local_experts:
            return
        local = expert - self.local_experts.start
        if which == "w1":
            self.w13.data[local, : self.local_inter].copy_(weight[self.inter_slice])
        elif which == "w3":
            self.w13.data[local, self.local_inter :].copy_(weight[self.inter_slice])
        else:
            self.w2.data[local].copy_(weight[:, self.inter_slice])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k]): bias (if any) picks the experts, raw sigmoid weighs them."""
        weights, chosen, _ = sigmoid_topk_route(self.gate, self.e_score_correction_bias, x, self.top_k, self.gate_half)
        return weights, chosen

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of global expert ``expert`` on rows ``x``."""
        local = expert - self.local_experts.start
        gate_up = x @ self.w13[local].t()
        gate, up = gate_up.split(self.local_inter, dim=-1)
        return self.act(gate, up) @ self.w2[local].t()

    def routed_loop(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Weighted sum of the chosen local experts' outputs, per hit expert on its rows (host sync)."""
        routed = torch.zeros_like(x)
        hit = torch.unique(chosen).tolist()
        for expert in (e for e in hit if e in self.local_experts):
            token_idx, slot = torch.where(chosen == expert)
            out = self._expert(expert, x[token_idx])
            routed.index_add_(0, token_idx, (out * weights[token_idx, slot, None]).to(x.dtype))
        return routed

    def routed_static(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The same sum with fixed shapes: every local expert on every row, kept where the row chose it."""
        routed = torch.zeros_like(x)
        for expert in self.local_experts:
            hit = chosen == expert
            # A row chooses an expert at most once: the sum is that slot's weight or exactly 0.
            weight = torch.where(hit, weights, 0.0).sum(dim=-1, keepdim=True)
            out = (self._expert(expert, x) * weight).to(x.dtype)
            routed = routed + torch.where(hit.any(dim=-1, keepdim=True), out, 0.0)
        return routed

    def partial_forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the block's output: its experts' slices and its shared-expert slice."""
        weights, chosen = self.route(x)
        experts = self.routed_static if self.experts_path == "static" else self.routed_loop
        return experts(x, weights, chosen) * self.scaling + self.shared_experts(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.partial_forward(x)
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out
