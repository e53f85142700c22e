"""M3's MoE block on CUDA for an MXFP8 checkpoint: the routed experts stay e4m3 + e8m0 scales.

Hopper has no MX-scaled FP8 GEMM, so without this block the experts would be dequantized at load
to bf16 (854 GB for the full model). Here they keep the checkpoint's bytes (about half) and run
through the W8A16 Triton kernels of ``msa_kernels.triton_mxfp8_moe`` (bf16 activations, fp32
accumulation; the path by token count: a GEMV without MMA for decode batches, an MMA core with
e4m3 widened in registers beyond; that module's docstring has the measured crossovers). Decode
reads the chosen experts' weights once per step, so halving those bytes is what makes it faster
than the BF16 path. An fp32 model runs the same kernels with fp32 activations, intermediates and
output (W8A32: the dequantized fp32 experts' result up to summation order), for exactness runs
against the dequantized twin; ``make_moe_block`` picks this block for fp32 models only when
``SGLANG_M3_MOE_IMPL=mxfp8`` asks for it.

The router is the torch blocks' one (:mod:`sglang_m3.models.moe_routing`, routed scaling factor
folded into the weights, as in :class:`sglang_m3.models.fused_moe.M3FusedMoeBlock`); the shared
expert is the ordinary :class:`~sglang_m3.models.moe.GatedMLP`, whose linears the quantization
config keeps in MXFP8 too (``sglang_m3.quant.mxfp8_linear``).

Checkpoint tensors ``block_sparse_moe.experts.{e}.w1/w2/w3.weight`` arrive with their scales as
:class:`~sglang_m3.quant.loading.MXFP8Weight` pairs (the loader passes the pairs of layers whose
block sets :attr:`M3Mxfp8MoeBlock.holds_mxfp8_experts` through undequantized). Parallel layout:
the torch blocks' (:func:`sglang_m3.models.moe.expert_layout`): a contiguous range of whole
experts per expert-parallel group, and a slice of the intermediate dimension per rank of a group:
rows of w1/w3 with their scale rows, columns of w2 with their scale columns. A w2 scale covers 32
intermediate columns, so the per-rank intermediate size must be a multiple of 32.

Nothing in ``forward`` reads a device tensor on the host, so decode can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch
from msa_kernels.triton_mxfp8_moe import mxfp8_fused_experts
from sglang.srt.distributed import tensor_model_parallel_all_reduce
from torch import nn

from sglang_m3.config import M3TextSpec
from sglang_m3.models.checkpoint_layout import CheckpointError
from sglang_m3.models.moe import GatedMLP, expert_layout
from sglang_m3.models.moe_overlap import overlap_stream, shared_beside_routed
from sglang_m3.models.moe_routing import add_router_parameters, sigmoid_topk_route
from sglang_m3.quant.loading import MXFP8Weight
from sglang_m3.quant.mxfp8 import BIAS as UNIT_SCALE, BLOCK, SCALE_DTYPE, WEIGHT_DTYPE


class M3Mxfp8MoeBlock(nn.Module):
    #: tells the weight loader to hand this block's expert weights over still quantized
    holds_mxfp8_experts = True

    def __init__(self, spec: M3TextSpec, layer_id: int, quant_config=None, prefix: str = ""):
        super().__init__()
        layout = expert_layout(spec, "MXFP8 MoE block")
        if spec.hidden_size % BLOCK:
            raise ValueError(f"hidden_size ({spec.hidden_size}) must be a multiple of {BLOCK} for MXFP8 experts")
        if layout.local_inter % BLOCK:
            raise ValueError(
                f"intermediate_size ({spec.moe_intermediate_size}) split over the expert tensor-parallel ranks "
                f"(--tp-size / --ep-size) gives {layout.local_inter} per rank, not a multiple of the MXFP8 "
                f"scale group ({BLOCK}); choose a smaller --tp-size or a larger --ep-size"
            )
        self.layer_id = layer_id
        self.prefix = prefix
        self.tp_size = layout.tp_size
        self.top_k = spec.experts_per_token
        self.scaling = spec.routed_scaling_factor
        swiglu = spec.hidden_act != "silu"
        self.alpha = spec.swiglu_alpha if swiglu else None
        self.limit = spec.swiglu_limit if swiglu else None
        self.local_experts = layout.local_experts
        self.inter_slice = layout.inter_slice
        e, i, h = len(layout.local_experts), layout.local_inter, spec.hidden_size
        add_router_parameters(self, spec)
        # Rows [0, i) of w13 are this rank's gate (w1) slice, rows [i, 2i) its up (w3) slice.
        # Scales start at e8m0 127 (2^0): SGLang's dummy loader fills only floating-point
        # parameters, so a --load-format dummy model (the benchmarks) multiplies by 1, not by
        # whatever bytes the allocation held (255 is NaN). A real load overwrites them.
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=WEIGHT_DTYPE), requires_grad=False)
        self.w13_scale = nn.Parameter(torch.full((e, 2 * i, h // BLOCK), UNIT_SCALE, dtype=SCALE_DTYPE), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i, dtype=WEIGHT_DTYPE), requires_grad=False)
        self.w2_scale = nn.Parameter(torch.full((e, h, i // BLOCK), UNIT_SCALE, dtype=SCALE_DTYPE), requires_grad=False)
        self.shared_experts = GatedMLP(
            spec, spec.shared_intermediate_size, reduce_results=False, quant_config=quant_config, prefix=f"{prefix}.shared_experts"
        )
        self.alt_stream = overlap_stream()

    def load_expert_weight(self, expert: int, which: str, weight: MXFP8Weight) -> None:
        """This rank's slice of checkpoint tensor ``experts.{expert}.{which}.weight`` and its scales
        (nothing when another expert-parallel group holds that expert)."""
        if not isinstance(weight, MXFP8Weight):
            raise CheckpointError(
                f"'{self.prefix}.experts.{expert}.{which}.weight' arrived as a plain {getattr(weight, 'dtype', type(weight))} "
                "tensor, but this layer's MXFP8 MoE block holds float8_e4m3fn experts with scales "
                "(is the layer's expert on the checkpoint's ignore list, quantization_config.ignored_layers or "
                "modules_to_not_convert?)"
            )
        if expert not in self.local_experts:
            return
        local = expert - self.local_experts.start
        rows, i = self.inter_slice, self.inter_slice.stop - self.inter_slice.start
        if which in ("w1", "w3"):
            half = slice(0, i) if which == "w1" else slice(i, 2 * i)
            self.w13.data[local, half].copy_(weight.elements[rows])
            self.w13_scale.data[local, half].copy_(weight.scales[rows])
        else:
            groups = slice(rows.start // BLOCK, rows.stop // BLOCK)
            self.w2.data[local].copy_(weight.elements[:, rows])
            self.w2_scale.data[local].copy_(weight.scales[:, groups])

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's experts' share of the routed sum for ``x``, already scaled."""
        weights, chosen, _ = sigmoid_topk_route(self.gate, self.e_score_correction_bias, x, self.top_k, self.gate_half)
        return mxfp8_fused_experts(
            x, self.w13, self.w13_scale, self.w2, self.w2_scale, weights * self.scaling, chosen, self.alpha, self.limit,
            first_expert=self.local_experts.start,
        )

    def partial_forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the block's output: its experts' slices and its shared-expert slice."""
        if x.shape[0] == 0:
            return self.shared_experts(x)
        shared, routed = shared_beside_routed(self.alt_stream, x, self.shared_experts, self.routed)
        return routed + shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.partial_forward(x)
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out
