"""Which ``--tp`` / ``--ep`` an M3 config can be split by, checked before anything is built.

The same conditions SGLang's parallel layers assert while they are built (and the project's
MoE block), restated so a refusal names the config dimension that does not divide instead of
failing inside a constructor.
"""

from __future__ import annotations

from sglang_m3.config import M3TextSpec


class ParallelSizeError(ValueError):
    """A tensor- or expert-parallel size the config cannot be split by; names the dimension."""


def check_parallel_sizes(spec: M3TextSpec, tp: int, ep: int) -> None:
    if tp < 1 or ep < 1:
        raise ParallelSizeError(f"--tp and --ep must be >= 1, got --tp {tp} --ep {ep}")
    _divides("num_attention_heads", spec.num_heads, tp, "--tp")
    if tp % spec.num_kv_heads and spec.num_kv_heads % tp:
        raise ParallelSizeError(
            f"--tp {tp} and num_key_value_heads ({spec.num_kv_heads}): one must divide the other "
            "(KV heads are split below that size and replicated above it)"
        )
    _divides("dense_intermediate_size", spec.dense_intermediate_size, tp, "--tp")
    _divides("shared_intermediate_size", spec.shared_intermediate_size, tp, "--tp")
    _divides("intermediate_size (one routed expert)", spec.moe_intermediate_size, tp, "--tp")
    if tp % ep:
        raise ParallelSizeError(
            f"--ep {ep} must divide --tp {tp}: SGLang splits the TP group into ep expert groups of "
            "tp/ep ranks each"
        )
    _divides("num_local_experts", spec.num_experts, ep, "--ep")


def _divides(field: str, value: int, size: int, flag: str) -> None:
    if value % size:
        raise ParallelSizeError(f"{field} ({value}) is not divisible by {flag} {size}")
