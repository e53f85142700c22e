"""Which element type the index-key cache stores: the server-side switch and its byte cost.

SGLang's server arguments cannot be extended by a plugin, so, like the project's other serving
switches (``SGLANG_M3_DENSE_PREFILL``, ``SGLANG_M3_MOE_IMPL``), the choice is an environment
variable, read where the KV pool is built; a recipe sets it from ``spec.kvCache.indexKeyDtype``
(the renderer owns the variable's name). ``bf16`` keeps the keys in the model's 16-bit dtype (an
fp8 main KV cache does not change that); ``fp8_e4m3`` stores e4m3 keys with one fp32 scale per
token, 132 instead of 256 bytes per token and sparse layer at M3's 128 dims (format:
``msa_kernels.reference.quantize_index_keys``; selection quality:
``benchmarks/results/index_fp8_quality.md``).
"""

from __future__ import annotations

import os
import typing

from sglang_m3.recipe.fit import INDEX_KEY_SCALE_BYTES
from sglang_m3.recipe.render import INDEX_KEY_DTYPE_ENV
from sglang_m3.recipe.schema import IndexKeyDtype

CHOICES = typing.get_args(IndexKeyDtype)


def index_key_dtype() -> str:
    """The configured index-key dtype (default ``bf16``); an unknown value is refused by name."""
    value = os.environ.get(INDEX_KEY_DTYPE_ENV, "bf16")
    if value not in CHOICES:
        raise ValueError(f"{INDEX_KEY_DTYPE_ENV}={value!r}: expected one of {', '.join(CHOICES)}")
    return value


def index_key_fp8() -> bool:
    return index_key_dtype() == "fp8_e4m3"


def index_key_bytes(index_head_dim: int, fp8: bool, element_bytes: int) -> int:
    """Bytes one token's index key takes in one sparse layer: fp8 + its scale, or ``element_bytes`` each."""
    return index_head_dim + INDEX_KEY_SCALE_BYTES if fp8 else index_head_dim * element_bytes
