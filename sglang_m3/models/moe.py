"""M3's MoE block: sigmoid router (with a choice-only correction bias where the config has one),
routed experts, shared expert.

The routed experts are plain tensors looped over per hit expert. That is the torch-native path
the CPU platform needs (SGLang's fused MoE kernels need Triton or sgl_kernel); under tensor
parallelism each rank holds a slice of every expert's intermediate dimension and the block's
output is all-reduced once.
"""

from __future__ import annotations

import torch
from sglang.srt.distributed import tensor_model_parallel_all_reduce
from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from sglang.srt.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from torch import nn

from sglang_m3.config import M3TextSpec
from sglang_m3.models.layers import gated_activation


class GatedMLP(nn.Module):
    """Dense MLP (and M3's shared expert): separate gate/up halves, the config's gated activation
    (swiglu-oai in M3), down projection."""

    def __init__(self, spec: M3TextSpec, intermediate_size: int, reduce_results: bool, quant_config=None, prefix: str = ""):
        super().__init__()
        self.act = gated_activation(spec.hidden_act, spec.swiglu_alpha, spec.swiglu_limit)
        self.gate_up_proj = MergedColumnParallelLinear(
            spec.hidden_size, [intermediate_size] * 2, bias=False, quant_config=quant_config, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, spec.hidden_size, bias=False, quant_config=quant_config,
            reduce_results=reduce_results, prefix=f"{prefix}.down_proj",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        gate, up = gate_up.chunk(2, dim=-1)
        out, _ = self.down_proj(self.act(gate, up))
        return out


class M3SparseMoeBlock(nn.Module):
    def __init__(self, spec: M3TextSpec, quant_config=None, prefix: str = ""):
        super().__init__()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        if spec.moe_intermediate_size % self.tp_size:
            raise ValueError(
                f"intermediate_size ({spec.moe_intermediate_size}) is not divisible by the tensor-parallel size ({self.tp_size})"
            )
        self.top_k = spec.experts_per_token
        self.scaling = spec.routed_scaling_factor
        self.act = gated_activation(spec.hidden_act, spec.swiglu_alpha, spec.swiglu_limit)
        self.local_inter = spec.moe_intermediate_size // self.tp_size
        e, h = spec.num_experts, spec.hidden_size
        # Router: replicated, evaluated in fp32 so the expert choice does not depend on the dtype.
        self.gate = nn.Linear(h, e, bias=False, dtype=torch.float32)
        if spec.use_routing_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(e, dtype=torch.float32), requires_grad=False)
        else:
            self.register_parameter("e_score_correction_bias", None)
        # Experts: rows [0, I) of w13 are the gate (w1) slice of this rank, rows [I, 2I) the up (w3) slice.
        self.w13 = nn.Parameter(torch.empty(e, 2 * self.local_inter, h), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, self.local_inter), requires_grad=False)
        self.shared_experts = GatedMLP(
            spec, spec.shared_intermediate_size, reduce_results=False, quant_config=quant_config, prefix=f"{prefix}.shared_experts"
        )

    def load_expert_weight(self, expert: int, which: str, weight: torch.Tensor) -> None:
        """Copy this rank's slice of checkpoint tensor ``experts.{expert}.{which}.weight``."""
        lo, hi = self.tp_rank * self.local_inter, (self.tp_rank + 1) * self.local_inter
        if which == "w1":
            self.w13.data[expert, : self.local_inter].copy_(weight[lo:hi])
        elif which == "w3":
            self.w13.data[expert, self.local_inter :].copy_(weight[lo:hi])
        else:
            self.w2.data[expert].copy_(weight[:, lo:hi])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k]): bias (if any) picks the experts, raw sigmoid weighs them."""
        probs = torch.sigmoid(self.gate(x.float()))
        scores = probs if self.e_score_correction_bias is None else probs + self.e_score_correction_bias
        _, chosen = torch.topk(scores, self.top_k, dim=-1, sorted=False)
        weights = probs.gather(1, chosen)
        return weights / weights.sum(dim=-1, keepdim=True), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        routed = torch.zeros_like(x)
        for expert in torch.unique(chosen).tolist():
            token_idx, slot = torch.where(chosen == expert)
            gate_up = x[token_idx] @ self.w13[expert].t()
            gate, up = gate_up.split(self.local_inter, dim=-1)
            out = self.act(gate, up) @ self.w2[expert].t()
            routed.index_add_(0, token_idx, (out * weights[token_idx, slot, None]).to(x.dtype))
        out = routed * self.scaling + self.shared_experts(x)
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out
