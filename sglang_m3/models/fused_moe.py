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

Nothing here reads a device tensor on the host, so decode can be captured in a CUDA graph.

The shared expert lives in the fused layer as one more expert (slot ``num_experts``: the
layer's ``num_fused_shared_experts``, as upstream's M3 holds it) wherever it can: an unquantized
shared expert as wide as a routed one, without expert parallelism (under ``--ep-size`` each rank
would hold the whole shared expert and the TP all-reduce would add it once per rank). Batches of
up to ``FUSED_SHARED_MAX_ROWS`` rows (decode, verify) then choose it as a fifth expert of weight
1 beside the routed four, one fused kernel for all five, as upstream's decode does. At a few rows
the kernel streams the shared expert's weights with the routed ones (28 us more at one token at
TP1 on the H200), where the separate MLP's two GEMMs beside it took 54 us per layer at TP2
(e00266d profile). Paired on the H200 against the separate layout, decode TPOT moved 1.03x at
concurrency 1 and 1.00x at 16 at TP1, and 1.11x and 1.00x at TP2 (``benchmarks/results/
e2e_gpu_h200_notes.md``). Larger batches (prefill chunks) run the shared expert as the two dense
GEMMs the separate MLP ran, on the slot's weights (no copy); the shared expert inside the fused
kernel was not timed at prefill sizes. Where the fused layer cannot hold it, the shared expert is
a separate ``GatedMLP``, overlapping the routed experts on a second stream inside captured graphs
(:mod:`sglang_m3.models.moe_overlap`). ``SGLANG_M3_FUSE_SHARED_EXPERT=0`` keeps it separate (the
A/B switch).

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
import torch.nn.functional as F
from sglang.srt.distributed import tensor_model_parallel_all_reduce
from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_world_size
from sglang.srt.runtime_context import get_parallel
from torch import nn

from sglang_m3.config import M3TextSpec
from sglang_m3.env_switch import env_choice
from sglang_m3.models.fused_activation import GatedActivation
from sglang_m3.models.moe import GatedMLP, M3SparseMoeBlock
from sglang_m3.models.moe_kernel_configs import nearest, tile_table
from sglang_m3.models.moe_overlap import overlap_stream, shared_beside_routed
from sglang_m3.models.moe_routing import add_router_parameters, fused_layer_routing, router_logits
from sglang_m3.models.router_topk import FUSED_ROUTE_ENV, fused_route_on, fused_route_serves, route_topk
from sglang_m3.models.mxfp8_moe import M3Mxfp8MoeBlock

logger = logging.getLogger(__name__)

MOE_IMPL_ENV = "SGLANG_M3_MOE_IMPL"
MOE_IMPLS = ("auto", "loop", "static", "fused", "mxfp8", "torch")
FUSE_SHARED_ENV = "SGLANG_M3_FUSE_SHARED_EXPERT"
#: the most rows whose shared expert runs inside the fused kernel (decode and verify batches; the
#: shared-slot tile tables are measured up to here); more rows take dense GEMMs on the slot's weights
FUSED_SHARED_MAX_ROWS = 256


def fuses_shared_expert(spec: M3TextSpec, quant_config) -> bool:
    """Whether the fused layer holds the shared expert as one more expert (module docstring)."""
    if env_choice(FUSE_SHARED_ENV, ("1", "0"), "'1' (shared expert in the fused layer) or '0'") == "0":
        return False
    return (
        quant_config is None
        and spec.shared_intermediate_size == spec.moe_intermediate_size
        and get_parallel().moe_ep_size == 1
    )


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
        #: the shared expert's expert id in the fused layer, or None when it is a separate GatedMLP
        self.shared_slot = e if fuses_shared_expert(spec, quant_config) else None
        fused_shared = int(self.shared_slot is not None)
        # The experts are plain weights here (a BF16 checkpoint, or MXFP8 dequantized at load):
        # the quantization config (MXFP8 dense linears on CUDA) is the shared expert's only.
        self.experts = get_moe_impl_class(None)(
            num_experts=e + fused_shared,
            num_fused_shared_experts=fused_shared,
            top_k=self.top_k + fused_shared,
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
        slots, intermediate, hidden = self.experts.w13_weight.shape[0], self.experts.w2_weight.shape[2], h
        #: measured tiles for this rank's routed experts alone, and for them with the shared slot
        #: chosen by every row (None: SGLang's own choice)
        self.tile_table = tile_table(slots - fused_shared, intermediate, hidden)
        self.shared_tile_table = tile_table(slots, intermediate, hidden) if fused_shared else None
        if fused_shared:
            self.shared_act = GatedActivation(spec.hidden_act, spec.swiglu_alpha, spec.swiglu_limit)
        else:
            self.shared_experts = GatedMLP(
                spec, spec.shared_intermediate_size, reduce_results=False, quant_config=quant_config, prefix=f"{prefix}.shared_experts"
            )
        self.alt_stream = overlap_stream()

    def load_expert_weight(self, expert: int, which: str, weight: torch.Tensor) -> None:
        """Checkpoint tensor ``experts.{expert}.{which}.weight`` into the fused layout (w1/w3 -> w13, w2)."""
        param = self.experts.w2_weight if which == "w2" else self.experts.w13_weight
        name = f"experts.{'w2' if which == 'w2' else 'w13'}_weight"
        self.experts.weight_loader(param, weight, name, shard_id=which, expert_id=expert)

    def load_shared_weight(self, projection: str, weight: torch.Tensor) -> None:
        """Checkpoint tensor ``shared_experts.{projection}_proj.weight`` (gate, up or down) into
        the shared slot, sliced for tensor parallelism as the routed experts are."""
        self.load_expert_weight(self.shared_slot, {"gate": "w1", "up": "w3", "down": "w2"}[projection], weight)

    def shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert alone: the separate ``GatedMLP``, or two dense GEMMs over its slot
        of the fused weights."""
        if self.shared_slot is None:
            return self.shared_experts(x)
        gate_up = F.linear(x, self.experts.w13_weight[self.shared_slot])
        if getattr(self.experts.quant_method, "w13_swiglu_interleaved", False):
            # SGLang interleaved gate/up rows for its fused epilogue (plain SiLU gating only)
            gate_up = gate_up.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        return F.linear(self.shared_act(gate_up), self.experts.w2_weight[self.shared_slot])

    def route(self, x: torch.Tensor, with_shared: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32 times the routed scale, expert ids [T, k] int32, router logits); with
        ``with_shared`` one more column per row: the shared slot at weight 1."""
        logits = router_logits(self.gate, x, self.gate_half)
        shared = self.shared_slot if with_shared else None
        route = route_topk if fused_route_serves(logits) else fused_layer_routing
        return *route(logits, self.e_score_correction_bias, self.top_k, self.scaling, shared), logits

    def routed(self, x: torch.Tensor, with_shared: bool = False) -> torch.Tensor:
        """The routed experts' sum for ``x``, already scaled (``x`` has at least one row); with
        ``with_shared`` every row also chooses the shared slot at weight 1."""
        from sglang.srt.layers.moe.fused_moe_triton import override_config
        from sglang.srt.layers.moe.topk import StandardTopKOutput

        weights, ids, logits = self.route(x, with_shared)
        table = self.shared_tile_table if with_shared else self.tile_table
        tiles = nearest(table, x.shape[0]) if table else None
        with override_config(tiles) if tiles else contextlib.nullcontext():
            return self.experts(x, StandardTopKOutput(topk_weights=weights, topk_ids=ids, router_logits=logits))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return self.shared_expert(x)
        if self.shared_slot is not None and x.shape[0] <= FUSED_SHARED_MAX_ROWS:
            out = self.routed(x, with_shared=True)
        else:
            shared, routed = shared_beside_routed(self.alt_stream, x, self.shared_expert, self.routed)
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
    if impl == "mxfp8":
        block = M3Mxfp8MoeBlock(spec, layer_id, quant_config, prefix)
    elif impl == "fused":
        block = M3FusedMoeBlock(spec, layer_id, quant_config, prefix)
    else:
        block = M3SparseMoeBlock(spec, quant_config, prefix, experts_path=impl)
    if layer_id == min(i for i, moe in enumerate(spec.moe_layers) if moe):
        logger.info("M3 MoE experts: %s path (model dtype %s)", impl, torch.get_default_dtype())
        if getattr(block, "shared_slot", None) is not None:
            logger.info("M3 MoE: shared expert held in the fused layer (expert %d), inside the fused kernel up to %d rows",
                        block.shared_slot, FUSED_SHARED_MAX_ROWS)
        if impl == "fused" and fused_route_on():
            logger.info("M3 MoE: routing after the router logits in one Triton launch (%s=0 keeps torch's ops)", FUSED_ROUTE_ENV)
    return block
