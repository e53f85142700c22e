"""MiniMax M3's shape, in one place, for the rules and the memory-fit estimate.

The numbers are the published architecture (M3_FACTS s.1 and s.6). They live here rather than
being read from a checkpoint because the recipe layer must judge a deployment before any
weights are downloaded, on a machine with neither torch nor SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Model path that names the project's embedded tiny random-weight M3 instead of a checkpoint.
#: ``sglang-m3 serve`` builds that checkpoint and substitutes its directory for this value.
TINY_MODEL_PATH = "sglang-m3:tiny"

#: Longest context the model was trained for.
MAX_CONTEXT_LENGTH = 1_048_576

GB = 10**9


@dataclass(frozen=True)
class M3Geometry:
    """Attention, MoE and weight-size facts the rules and the fit estimate depend on."""

    num_layers: int = 60
    dense_layers: int = 3
    sparse_layers: int = 57
    num_query_heads: int = 64
    num_kv_heads: int = 4
    head_dim: int = 128
    num_index_heads: int = 4
    #: one index key of this width is cached per token per sparse layer (a single head,
    #: shared by the 4 index query heads)
    index_key_dim: int = 128
    num_routed_experts: int = 128
    sparse_block_size: int = 128
    hidden_size: int = 6144
    vocab_size: int = 200064


M3 = M3Geometry()

#: Total checkpoint size in bytes per weight variant (decimal GB, as published).
WEIGHT_BYTES = {
    "bf16": 854 * GB,
    "mxfp8": 440 * GB,
}
