"""Out-of-tree SGLang platform of the GPU harness (test infrastructure, never imported by the product).

SGLang's in-tree CUDA platform needs the compiled ``sgl_kernel`` wheel, which cannot travel to the
lent GPU. This platform is CUDA in all but name: device ``cuda``, SGLang's Triton attention,
pytorch sampling, torch-native fused ops (dispatch key ``native``) except the unquantized fused
MoE and the RMSNorm, GemmaRMSNorm, SiluAndMul and RotaryEmbedding layers, whose CUDA forwards are
registered for it (the latter four unless ``M3_HARNESS_CUDA_CUSTOM_OPS=0``), and SGLang's decode
CUDA-graph runner.
Selected with ``SGLANG_PLATFORM=m3_gpu_harness`` (the entry point ``build_site.sh`` writes).
"""

from __future__ import annotations

import os

PLATFORM_NAME = "m3_gpu_harness"
PLATFORM_CLASS = "m3_gpu_harness.platform.HarnessCudaPlatform"


def activate() -> str | None:
    return PLATFORM_CLASS if os.environ.get("SGLANG_PLATFORM") == PLATFORM_NAME else None
