"""M3's MoE block on CUDA: the routed experts run through SGLang's fused MoE layer.

Same router as the torch blocks (:mod:`sglang_m3.models.moe_routing`), with the routed scaling
factor folded into the weights, so the layer's output is already scaled.
The experts are SGLang's ``FusedMoE`` (``get_moe_impl_class``: the Triton fused MoE unquantized,
expert parallel under ``--ep-size``) with M3's activation handed to it the way upstream's M3 does:
gated ``silu`` plus ``gemm1_alpha`` / ``gemm1_clamp_limit`` selects the clamped swiglu-oai form on
non-interleaved ``[gate; up]`` halves. Checkpoint tensors ``experts.{e}.w1/w2/w3`` load through the
layer's own weight loader (it slices for tensor and expert parallelism). The fused kernel's tiles
come from the measured tables of :mod:`sglang_m3.models.moe_kernel_configs` where one exists for
the shape and GPU.

Nothing here reads a device tensor on the host, so decode can be captured in a CUDA graph; inside
a captured graph the shared expert overlaps the routed experts on a second stream
(:mod:`sglang_m3.models.moe_overlap`).

Which block serves (:func:`make_moe_block`): on a CUDA platform, bf16/fp16 models take this fused
block; fp32 models take the torch block's ``static`` path, because SGLang's Triton fused MoE
computes in fp16 whenever the activations are not bf16 (``compute_type`` in its
``fused_moe.py``), and M3's MSA block selection turns such rounding into different attended
blocks on longer prompts. A bf16 model from an MXFP8 checkpoint on CUDA takes
:class:`sglang_m3.models.mxfp8_moe.M3Mxfp8MoeBlock` instead (experts kept in MXFP8, W8A16
kernels) unless the checkpoint leaves that layer's experts unquantized. Other platforms (the CPU)
take the torch block's ``loop`` path, with any MXFP8 experts dequantized at load.
``SGLANG_M3_MOE_IMPL=loop|static|fused|mxfp8`` forces one (``torch`` is an alias of ``loop``;
``fused`` on an MXFP8 checkpoint is the dequantized-bf16 A/B; ``mxfp8`` needs an MXFP8 checkpoint).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from sglang.srt.distributed import tensor_model_parallel_all_reduce
from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_world_size
from torch import nn

from sglang_m3.config import M3TextSpec
from sglang_m3.env_switch import env_choice
from sglang_m3.models.moe import GatedMLP, M3SparseMoeBlock
from sglang_m3.models.moe_kernel_configs import nearest, tile_table
from sglang_m3.models.moe_overlap import overlap_stream, shared_beside_routed
from sglang_m3.models.moe_routing import add_router_parameters, sigmoid_topk_route
from sglang_m3.models.mxfp8_moe import M3Mxfp8MoeBlock

logger = logging.getLogger(__name__)

MOE_IMPL_ENV = "SGLANG_M3_MOE_IMPL"
MOE_IMPLS = ("auto", "loop", "static", "fused", "mxfp8", "torch")


class M3FusedMoeBlock(nn.Module):
    def __init__(self, spec: M3TextSpec, layer_id: int, quant_config=None, prefix: str = ""):
        super().__init__()
        from sglang.srt.layers.moe.ep_moe.layer import get_moe_impl_class

        self.tp_size = get_tensor_model_parallel_world_size()
        self.top_k = spec.experts_per_token
        self.scaling = spec.routed_scaling_factor
        e, h = spec.num_experts, spec.hidden_size
        add_router_parameters(self, spec)
        swiglu = spec.hidden_act != "silu"
        # The experts are plain weights here (a BF16 checkpoint, or MXFP8 dequantized at load):
        # the quantization config (MXFP8 dense linears on CUDA) is the shared expert's only.
        self.experts = get_moe_impl_class(None)(
            num_experts=e,
            top_k=self.top_k,
            hidden_size=h,
            intermediate_size=spec.moe_intermediate_size,
            layer_id=layer_id,
            quant_config=None,
            reduce_results=False,
            activation="silu",
            is_gated=True,
            gemm1_alpha=spec.swiglu_alpha if swiglu else None,
            gemm1_clamp_limit=spec.swiglu_limit if swiglu else None,
            gate_up_interleaved=False,
            prefix=f"{prefix}.experts",
        )
        local_experts, _, hidden = self.experts.w13_weight.shape
        #: measured tiles for this rank's expert shape on this GPU (None: SGLang's own choice)
        self.tile_table = tile_table(local_experts, self.experts.w2_weight.shape[2], hidden)
        self.shared_experts = GatedMLP(
            spec, spec.shared_intermediate_size, reduce_results=False, quant_config=quant_config, prefix=f"{prefix}.shared_experts"
        )
        self.alt_stream = overlap_stream()

    def load_expert_weight(self, expert: int, which: str, weight: torch.Tensor) -> None:
        """Checkpoint tensor ``experts.{expert}.{which}.weight`` into the fused layout (w1/w3 -> w13, w2)."""
        param = self.experts.w2_weight if which == "w2" else self.experts.w13_weight
        name = f"experts.{'w2' if which == 'w2' else 'w13'}_weight"
        self.experts.weight_loader(param, weight, name, shard_id=which, expert_id=expert)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32 times the routed scale, expert ids [T, k] int32, router logits)."""
        weights, chosen, logits = sigmoid_topk_route(self.gate, self.e_score_correction_bias, x, self.top_k, self.gate_half)
        return weights * self.scaling, chosen.to(torch.int32), logits

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum for ``x``, already scaled (``x`` has at least one row)."""
        from sglang.srt.layers.moe.fused_moe_triton import override_config
        from sglang.srt.layers.moe.topk import StandardTopKOutput

        weights, ids, logits = self.route(x)
        tiles = nearest(self.tile_table, x.shape[0]) if self.tile_table else None
        with override_config(tiles) if tiles else contextlib.nullcontext():
            return self.experts(x, StandardTopKOutput(topk_weights=weights, topk_ids=ids, router_logits=logits))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return self.shared_experts(x)
        shared, routed = shared_beside_routed(self.alt_stream, x, self.shared_experts, self.routed)
        out = routed + shared
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out


def moe_impl(dtype: torch.dtype | None = None, mxfp8_experts: bool = False) -> str:
    """``loop``, ``static``, ``fused`` or ``mxfp8`` for a model of ``dtype`` (default: torch's default
    dtype, which SGLang's model loader sets to the model's dtype while it builds the model) whose
    checkpoint has MXFP8 routed experts or not."""
    choice = env_choice(MOE_IMPL_ENV, MOE_IMPLS)
    if choice == "mxfp8" and not mxfp8_experts:
        raise ValueError(f"{MOE_IMPL_ENV}=mxfp8 needs a checkpoint with MXFP8 routed experts (quantization_config)")
    if choice == "torch":
        return "loop"
    if choice != "auto":
        return choice
    from sglang.srt.platforms import current_platform

    if not (current_platform.device_type == "cuda" and torch.cuda.is_available()):
        return "loop"
    dtype = dtype or torch.get_default_dtype()
    if mxfp8_experts and dtype == torch.bfloat16:
        return "mxfp8"
    return "fused" if dtype in (torch.bfloat16, torch.float16) else "static"


def has_mxfp8_experts(spec: M3TextSpec, layer_id: int) -> bool:
    """Whether the checkpoint stores layer ``layer_id``'s routed experts in MXFP8."""
    quant = spec.quantization
    return quant is not None and not quant.ignores(f"model.layers.{layer_id}.block_sparse_moe.experts")


def make_moe_block(spec: M3TextSpec, layer_id: int, quant_config=None, prefix: str = "") -> nn.Module:
    impl = moe_impl(mxfp8_experts=has_mxfp8_experts(spec, layer_id))
    if layer_id == min(i for i, moe in enumerate(spec.moe_layers) if moe):
        logger.info("M3 MoE experts: %s path (model dtype %s)", impl, torch.get_default_dtype())
    if impl == "mxfp8":
        return M3Mxfp8MoeBlock(spec, layer_id, quant_config, prefix)
    if impl == "fused":
        return M3FusedMoeBlock(spec, layer_id, quant_config, prefix)
    return M3SparseMoeBlock(spec, quant_config, prefix, experts_path=impl)
