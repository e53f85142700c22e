"""SGLang on a plain CPU with torch-native operators: no sgl_kernel, no CUDA graphs, gloo.

Modelled on SGLang's in-tree MPS platform. SGLang's own CPU engine (``SGLANG_USE_CPU_ENGINE``)
needs the compiled sgl_kernel CPU build; this platform needs nothing beyond torch, which is what
lets the project's tests serve a tiny M3 on any CI machine.
"""

from __future__ import annotations

from typing import Optional

import psutil
import torch
from sglang.srt.platforms.device_mixin import DeviceMixin, PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

from sglang_m3.platform.rank_cores import assign_rank_cores


#: The speculative algorithms this platform serves (draft models through torch-native attention).
SPECULATIVE_ALGORITHMS = frozenset({"EAGLE", "EAGLE3"})


class TorchNativeCpuDeviceMixin(DeviceMixin):
    """Device queries answered by the host: one device, the process's RAM."""

    _enum: PlatformEnum = PlatformEnum.OOT
    device_name: str = "cpu"
    device_type: str = "cpu"

    def get_device_total_memory(self, device_id: int = 0) -> int:
        return int(psutil.virtual_memory().total)

    def get_current_memory_usage(self, device: Optional[torch.device] = None) -> float:
        return float(psutil.Process().memory_info().rss)

    def get_available_memory(self, device_id: int = 0) -> tuple[int, int]:
        memory = psutil.virtual_memory()
        return int(memory.available), int(memory.total)

    def get_device(self, device_id: int = 0) -> str:
        # SGLang stores the answer in ServerArgs.device and splits it as a string.
        return "cpu"

    def set_device(self, device: torch.device) -> None:
        if torch.device(device).type != "cpu":
            raise ValueError(f"the {type(self).__name__} platform cannot select device {device}")

    def get_device_name(self, device_id: int = 0) -> str:
        return "cpu"

    def get_device_uuid(self, device_id: int = 0) -> str:
        return "cpu:0"

    def get_device_capability(self, device_id: int = 0):
        return None

    def get_torch_distributed_backend_str(self) -> str:
        return "gloo"

    def get_torch_profiler_activity_str(self) -> str:
        return "CPU"

    def get_torch_profiler_activity(self) -> torch.profiler.ProfilerActivity:
        return torch.profiler.ProfilerActivity.CPU


class TorchNativeCpuPlatform(TorchNativeCpuDeviceMixin, SRTPlatform):
    """The SRT platform: torch-native attention, eager execution, pytorch sampling."""

    capabilities = PlatformCapabilities()

    def get_default_attention_backend(self) -> str:
        return "torch_native"

    def get_compile_backend(self, mode: str | None = None) -> str:
        return "eager"

    def get_dispatch_key_name(self) -> str:
        return "native"

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        # EAGLE drafts run on the torch-native attention (see sglang_m3.speculative.torch_native);
        # M3's MSA backend verifies chains and EAGLE draft trees.
        return algorithm in SPECULATIVE_ALGORITHMS

    def get_speculative_cache_locs_fn(self):
        # A verify batch whose write window the draft did not plan (draft trees, top-k > 1) asks the
        # platform for its cache locations; SGLang has none for out-of-tree platforms.
        from sglang_m3.speculative.torch_kernels import assign_extend_cache_locs

        return assign_extend_cache_locs

    def apply_server_args_defaults(self, server_args) -> None:
        # SGLang's own CPU rules pick "intel_amx" (sgl_kernel's CPU engine) for device "cpu";
        # this platform has no sgl_kernel, so that choice is replaced by torch-native attention.
        server_args.device = "cpu"
        server_args.sampling_backend = "pytorch"
        for name in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
            if getattr(server_args, name, None) in (None, "intel_amx"):
                setattr(server_args, name, "torch_native")
        # More ranks than NUMA nodes (--tp-size 2 on one node) needs each rank's cores named.
        assign_rank_cores(server_args)
