"""M3's MoE block on CUDA: the routed experts run through SGLang's fused MoE layer.

Same routing and weights as the torch path in :mod:`sglang_m3.models.moe` (sigmoid router in
fp32, the correction bias only chooses, the chosen raw sigmoid weights are renormalised), and the
routed scaling factor is folded into those weights, so the layer's output is already scaled.
The experts are SGLang's ``FusedMoE`` (``get_moe_impl_class``: the Triton fused MoE unquantized,
expert parallel under ``--ep-size``) with M3's activation handed to it the way upstream's M3 does:
gated ``silu`` plus ``gemm1_alpha`` / ``gemm1_clamp_limit`` selects the clamped swiglu-oai form on
non-interleaved ``[gate; up]`` halves. Checkpoint tensors ``experts.{e}.w1/w2/w3`` load through the
layer's own weight loader (it slices for tensor and expert parallelism).

Nothing here reads a device tensor on the host, so decode can be captured in a CUDA graph.
"""

from __future__ import annotations

import os

import torch
from sglang.srt.distributed import tensor_model_parallel_all_reduce
from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_world_size
from torch import nn

from sglang_m3.config import M3TextSpec
from sglang_m3.models.moe import GatedMLP, M3SparseMoeBlock

# "torch" forces the per-expert torch path on any device (the GPU test compares both paths).
MOE_IMPL_ENV = "SGLANG_M3_MOE_IMPL"


class M3FusedMoeBlock(nn.Module):
    def __init__(self, spec: M3TextSpec, layer_id: int, quant_config=None, prefix: str = ""):
        super().__init__()
        from sglang.srt.layers.moe.ep_moe.layer import get_moe_impl_class

        self.tp_size = get_tensor_model_parallel_world_size()
        self.top_k = spec.experts_per_token
        self.scaling = spec.routed_scaling_factor
        e, h = spec.num_experts, spec.hidden_size
        self.gate = nn.Linear(h, e, bias=False, dtype=torch.float32)
        if spec.use_routing_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(e, dtype=torch.float32), requires_grad=False)
        else:
            self.register_parameter("e_score_correction_bias", None)
        swiglu = spec.hidden_act != "silu"
        self.experts = get_moe_impl_class(quant_config)(
            num_experts=e,
            top_k=self.top_k,
            hidden_size=h,
            intermediate_size=spec.moe_intermediate_size,
            layer_id=layer_id,
            quant_config=quant_config,
            reduce_results=False,
            activation="silu",
            is_gated=True,
            gemm1_alpha=spec.swiglu_alpha if swiglu else None,
            gemm1_clamp_limit=spec.swiglu_limit if swiglu else None,
            gate_up_interleaved=False,
            prefix=f"{prefix}.experts",
        )
        self.shared_experts = GatedMLP(
            spec, spec.shared_intermediate_size, reduce_results=False, quant_config=quant_config, prefix=f"{prefix}.shared_experts"
        )

    def load_expert_weight(self, expert: int, which: str, weight: torch.Tensor) -> None:
        """Checkpoint tensor ``experts.{expert}.{which}.weight`` into the fused layout (w1/w3 -> w13, w2)."""
        param = self.experts.w2_weight if which == "w2" else self.experts.w13_weight
        name = f"experts.{'w2' if which == 'w2' else 'w13'}_weight"
        self.experts.weight_loader(param, weight, name, shard_id=which, expert_id=expert)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32 times the routed scale, expert ids [T, k] int32, router logits)."""
        logits = self.gate(x.float())
        probs = torch.sigmoid(logits)
        scores = probs if self.e_score_correction_bias is None else probs + self.e_score_correction_bias
        _, chosen = torch.topk(scores, self.top_k, dim=-1, sorted=False)
        weights = probs.gather(1, chosen)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.scaling
        return weights, chosen.to(torch.int32), logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from sglang.srt.layers.moe.topk import StandardTopKOutput

        shared = self.shared_experts(x)
        if x.shape[0] == 0:
            return shared
        weights, ids, logits = self.route(x)
        routed = self.experts(x, StandardTopKOutput(topk_weights=weights, topk_ids=ids, router_logits=logits))
        out = routed + shared
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out


def fused_moe_wanted() -> bool:
    """The fused layer on a CUDA platform (unless ``SGLANG_M3_MOE_IMPL=torch``); the torch loop elsewhere."""
    choice = os.environ.get(MOE_IMPL_ENV, "auto")
    if choice not in ("auto", "torch", "fused"):
        raise ValueError(f"{MOE_IMPL_ENV} must be auto, torch or fused, got {choice!r}")
    if choice != "auto":
        return choice == "fused"
    from sglang.srt.platforms import current_platform

    return current_platform.device_type == "cuda" and torch.cuda.is_available()


def make_moe_block(spec: M3TextSpec, layer_id: int, quant_config=None, prefix: str = "") -> nn.Module:
    if fused_moe_wanted():
        return M3FusedMoeBlock(spec, layer_id, quant_config, prefix)
    return M3SparseMoeBlock(spec, quant_config, prefix)
