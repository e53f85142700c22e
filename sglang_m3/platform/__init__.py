"""Entry point of the ``sglang.srt.platforms`` group: a torch-native CPU platform.

``activate`` is called by SGLang in every process while it discovers platforms. It must never
claim a GPU machine by surprise, so it activates only when asked for by name
(``SGLANG_PLATFORM=sglang_m3_cpu``) or when torch sees no accelerator at all.
"""

from __future__ import annotations

import os

PLATFORM_NAME = "sglang_m3_cpu"
PLATFORM_CLASS = "sglang_m3.platform.cpu_platform.TorchNativeCpuPlatform"


def _has_accelerator() -> bool:
    import torch

    if torch.cuda.is_available():
        return True
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return True
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def activate() -> str | None:
    """Return the platform class path, or None to let SGLang pick its in-tree platform."""
    if os.environ.get("SGLANG_PLATFORM") == PLATFORM_NAME:
        return PLATFORM_CLASS
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        # The user asked for SGLang's own sgl_kernel CPU engine; do not shadow it.
        return None
    return None if _has_accelerator() else PLATFORM_CLASS
