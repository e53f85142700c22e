"""MiniMax M3's shape and weight layout, in one place, for the rules and the memory-fit estimate.

Everything ``sglang-m3 inspect`` can measure comes from ``data/m3_geometry.json``, which it wrote
from the real config (``data/m3_config.json``) by building the model on the meta device:
layer and head counts, parameter bytes by sharding group, KV and index-key bytes per token.
The recipe layer reads that record instead of computing it, because it must judge a deployment
before any weights are downloaded, on a machine with neither torch nor SGLang; a test keeps the
record equal to what inspect computes now, for BF16 weights and for the MXFP8 checkpoint
(its quantized linears at 1 byte per element plus one e8m0 scale byte per 32: 443.96 GB in all,
the published ~440 GB). Every GPU serves an MXFP8 checkpoint at those bytes: Blackwell through
SGLang's MX-scaled GEMMs, Hopper through the project's W8A16 kernels for the routed experts
(``sglang_m3.models.mxfp8_moe``) and the dense linears (``sglang_m3.quant.mxfp8_linear``), which
keep exactly the linears inspect counts as quantized (the index projections stay BF16 on both).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: Model path that names the project's embedded tiny random-weight M3 instead of a checkpoint.
#: ``sglang-m3 serve`` builds that checkpoint and substitutes its directory for this value.
TINY_MODEL_PATH = "sglang-m3:tiny"

GB = 10**9

GEOMETRY_PATH = Path(__file__).parent / "data" / "m3_geometry.json"


@dataclass(frozen=True)
class WeightLayout:
    """Bytes (bf16, router in fp32) by sharding group, as inspect measured them.

    Groups: ``attention_tp`` (split over attention TP), ``kv_heads`` (split over
    min(attention TP, KV heads)), ``tp`` and ``experts`` (split over TP; expert parallelism
    inside the TP group keeps 1/tp of the experts per rank), ``replicated`` (whole on every rank).
    """

    first_stage: dict[str, int]
    last_stage: dict[str, int]
    layer_kinds: tuple[str, ...]
    layer_groups: dict[str, dict[str, int]]

    @property
    def total_bytes(self) -> int:
        layers = sum(sum(self.layer_groups[kind].values()) for kind in self.layer_kinds)
        return layers + sum(self.first_stage.values()) + sum(self.last_stage.values())


@dataclass(frozen=True)
class M3Geometry:
    """Attention, MoE and weight-size facts the rules and the fit estimate depend on."""

    num_layers: int
    dense_layers: int
    sparse_layers: int
    layer_is_sparse: tuple[bool, ...]
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    num_index_heads: int
    #: one index key of this width is cached per token per sparse layer (a single head,
    #: shared by the index query heads)
    index_key_dim: int
    num_routed_experts: int
    #: one routed expert's, the shared expert's and a dense MLP's intermediate width (what
    #: tensor parallelism splits; MXFP8 needs each rank's share in whole 32-column scale groups)
    moe_intermediate_size: int
    shared_intermediate_size: int
    dense_intermediate_size: int
    sparse_block_size: int
    #: blocks each query token selects per KV head (what a sparse-offload block cache must hold)
    sparse_topk_blocks: int
    hidden_size: int
    vocab_size: int
    max_context_length: int
    parameters: int
    weights: WeightLayout
    #: the same groups as the MXFP8 checkpoint stores them
    weights_mxfp8: WeightLayout

    def weight_layout(self, variant: str) -> WeightLayout:
        """The bytes a GPU holds for ``variant``."""
        return self.weights_mxfp8 if variant == "mxfp8" else self.weights


def load_geometry(path: Path = GEOMETRY_PATH) -> M3Geometry:
    record = json.loads(path.read_text(encoding="utf-8"))
    shape = record["geometry"]

    def layout(weights: dict) -> WeightLayout:
        return WeightLayout(
            first_stage=weights["first_stage"],
            last_stage=weights["last_stage"],
            layer_kinds=tuple(weights["layer_kinds"]),
            layer_groups=weights["layer_groups"],
        )

    return M3Geometry(
        num_layers=shape["num_layers"],
        dense_layers=shape["dense_layers"],
        sparse_layers=shape["sparse_layers"],
        layer_is_sparse=tuple(shape["layer_is_sparse"]),
        num_query_heads=shape["num_query_heads"],
        num_kv_heads=shape["num_kv_heads"],
        head_dim=shape["head_dim"],
        num_index_heads=shape["num_index_heads"],
        index_key_dim=shape["index_key_dim"],
        num_routed_experts=shape["num_routed_experts"],
        moe_intermediate_size=shape["moe_intermediate_size"],
        shared_intermediate_size=shape["shared_intermediate_size"],
        dense_intermediate_size=shape["dense_intermediate_size"],
        sparse_block_size=shape["sparse_block_size"],
        sparse_topk_blocks=shape["sparse_topk_blocks"],
        hidden_size=shape["hidden_size"],
        vocab_size=shape["vocab_size"],
        max_context_length=shape["max_context_length"],
        parameters=record["parameters"]["total"],
        weights=layout(record["weights"]),
        weights_mxfp8=layout(record["weights_mxfp8"]),
    )


M3 = load_geometry()

#: Longest context the model was trained for.
MAX_CONTEXT_LENGTH = M3.max_context_length

#: Total checkpoint bytes per weight variant, as inspect measured them.
WEIGHT_BYTES = {"bf16": M3.weights.total_bytes, "mxfp8": M3.weights_mxfp8.total_bytes}
