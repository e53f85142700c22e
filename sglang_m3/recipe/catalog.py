"""Hardware catalog: what each accelerator profile offers an M3 deployment.

One entry per profile a recipe may name in ``spec.hardware.profile``. The rules read the
variants and attention backend from here, the memory fit reads the memory, and the operator
reads the node label and resource name to schedule pods. Memory is the vendor's nominal
capacity in decimal GB, which is at or below what the driver reports, so fits err on the safe
side.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from .model_geometry import GB

Vendor = Literal["nvidia", "amd", "cpu"]
Architecture = Literal["hopper", "blackwell", "cdna3", "cdna4", "cpu"]
Variant = Literal["bf16", "mxfp8"]


class HardwareProfile(BaseModel):
    """One accelerator type as deployed in a typical node."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    description: str
    vendor: Vendor
    architecture: Architecture
    memory_gb: float
    gpus_per_node: int
    variants: tuple[Variant, ...]
    attention_backend: str
    #: vision-tower attention backend, or None for SGLang's default on this hardware
    mm_attention_backend: str | None = None
    #: the SGLang ``--device`` value
    device: str
    #: GPUs joined by one NVLink / Infinity Fabric domain: tensor parallelism beyond it
    #: crosses the slower scale-out network (72 on a GB200 NVL72 rack, else one node)
    scale_up_gpus: int
    #: Kubernetes node label (key, value) that selects nodes with this accelerator: the
    #: product label GPU feature discovery (NVIDIA) or the AMD node labeller publishes; the
    #: value is the usual product string, and clusters that label differently must override it
    node_label: tuple[str, str]
    #: extended resource the pods request, or None where no device plugin is involved
    resource_name: str | None
    #: peak memory bandwidth of one accelerator in TB/s (10^12 bytes/s), from the vendor's data
    #: sheet: the rate behind the decode floor's time per token (``sglang-m3 inspect``); None for
    #: the CPU profile, whose rate depends on the machine
    hbm_tbps: float | None = None

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * GB)

    @property
    def is_gpu(self) -> bool:
        return self.vendor != "cpu"

    @property
    def is_amd(self) -> bool:
        return self.vendor == "amd"


def _nvidia(name, description, architecture, memory_gb, hbm_tbps, variants, backend, product,
            per_node=8, scale_up=8):
    # The SGLang cookbook adds the cuDNN vision-tower backend for image serving on Blackwell.
    mm_backend = "flashinfer_cudnn" if architecture == "blackwell" else None
    return HardwareProfile(
        name=name,
        description=description,
        vendor="nvidia",
        architecture=architecture,
        memory_gb=memory_gb,
        hbm_tbps=hbm_tbps,
        gpus_per_node=per_node,
        scale_up_gpus=scale_up,
        variants=variants,
        attention_backend=backend,
        mm_attention_backend=mm_backend,
        device="cuda",
        node_label=("nvidia.com/gpu.product", product),
        resource_name="nvidia.com/gpu",
    )


def _amd(name, description, architecture, memory_gb, hbm_tbps, product):
    # MXFP8 runs natively on CDNA4; on CDNA3 SGLang converts it to block FP8 at load time.
    return HardwareProfile(
        name=name,
        description=description,
        vendor="amd",
        architecture=architecture,
        memory_gb=memory_gb,
        hbm_tbps=hbm_tbps,
        gpus_per_node=8,
        scale_up_gpus=8,
        variants=("bf16", "mxfp8"),
        attention_backend="triton",
        device="cuda",
        node_label=("amd.com/gpu.product-name", product),
        resource_name="amd.com/gpu",
    )


# Hopper runs M3 through fa3 for dense layers (SGLang picks it for page size 128). It has no
# MX-scaled fp8 GEMMs, so MXFP8 weights take the project's Hopper path: every quantized linear
# (routed and shared experts, attention q/k/v/o, dense MLPs) stays e4m3 + e8m0 scales and runs
# through W8A16 Triton kernels, so the fit counts the checkpoint's bytes as on Blackwell (443.96 GB
# in all, 57.61 GB per GPU at TP8). Blackwell uses fa4 (trtllm_mha for fp8 KV).
_PROFILES = (
    _nvidia("h100", "NVIDIA H100 SXM 80 GB", "hopper", 80, 3.35, ("bf16", "mxfp8"), "fa3",
            "NVIDIA-H100-80GB-HBM3"),
    _nvidia("h200", "NVIDIA H200 SXM 141 GB", "hopper", 141, 4.8, ("bf16", "mxfp8"), "fa3",
            "NVIDIA-H200"),
    _nvidia("b200", "NVIDIA B200 180 GB", "blackwell", 180, 8.0, ("bf16", "mxfp8"), "fa4",
            "NVIDIA-B200"),
    _nvidia("b300", "NVIDIA B300 288 GB", "blackwell", 288, 8.0, ("bf16", "mxfp8"), "fa4",
            "NVIDIA-B300-SXM6-AC"),
    _nvidia("gb200", "NVIDIA GB200 NVL72, 4 Blackwell GPUs of 186 GB per compute tray",
            "blackwell", 186, 8.0, ("bf16", "mxfp8"), "fa4", "NVIDIA-GB200", per_node=4, scale_up=72),
    _amd("mi300x", "AMD Instinct MI300X 192 GB", "cdna3", 192, 5.3, "AMD_Instinct_MI300X"),
    _amd("mi325x", "AMD Instinct MI325X 256 GB", "cdna3", 256, 6.0, "AMD_Instinct_MI325X"),
    _amd("mi350x", "AMD Instinct MI350X 288 GB", "cdna4", 288, 8.0, "AMD_Instinct_MI350X"),
    _amd("mi355x", "AMD Instinct MI355X 288 GB", "cdna4", 288, 8.0, "AMD_Instinct_MI355X"),
    HardwareProfile(
        name="cpu",
        description="CPU only (SGLang torch-native platform); for the tiny test model",
        vendor="cpu",
        architecture="cpu",
        memory_gb=16,
        gpus_per_node=1,
        scale_up_gpus=1,
        variants=("bf16",),
        attention_backend="torch_native",
        device="cpu",
        node_label=("kubernetes.io/arch", "amd64"),
        resource_name=None,
    ),
)

CATALOG: dict[str, HardwareProfile] = {profile.name: profile for profile in _PROFILES}

ProfileName = Literal[
    "h100", "h200", "b200", "b300", "gb200", "mi300x", "mi325x", "mi350x", "mi355x", "cpu"
]


def get_profile(name: str) -> HardwareProfile:
    """The catalog entry for ``name``; KeyError names the known profiles."""
    try:
        return CATALOG[name]
    except KeyError:
        raise KeyError(f"unknown hardware profile {name!r}; known: {', '.join(CATALOG)}") from None
