"""The harness's CUDA platform class (see the package docstring)."""

from __future__ import annotations

import logging
import os

import torch
from sglang.srt.platforms.cuda import CudaDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

logger = logging.getLogger(__name__)


class HarnessCudaPlatform(CudaDeviceMixin, SRTPlatform):
    _enum: PlatformEnum = PlatformEnum.OOT
    device_name: str = "cuda"
    device_type: str = "cuda"

    capabilities = PlatformCapabilities(supports_triton=True, graph_capture=True, supports_pynccl=True)

    def get_default_attention_backend(self) -> str:
        return "triton"

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return "triton"

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        return True

    def supports_speculative_draft_attention_backend(self, algorithm: str, backend: str) -> bool:
        return backend == "triton"

    def get_speculative_graph_runner_cls(self, algorithm: str, phase: str):
        """The EAGLE draft graph runners SGLang's in-tree CUDA platform gets (its draft backend is
        Triton here, one SGLang captures draft-extend graphs for). Without them every draft step
        ran eagerly: measured on the H100, a chain of 3 at acceptance 4.0 was slower per token
        than no speculation (4.80 vs 3.31 ms at concurrency 1)."""
        if phase == "draft_decode":
            from sglang.srt.speculative.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner

            return EAGLEDraftCudaGraphRunner
        if phase == "draft_extend":
            from sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner import EAGLEDraftExtendCudaGraphRunner

            return EAGLEDraftExtendCudaGraphRunner
        return None

    def get_dispatch_key_name(self) -> str:
        return "native"

    def get_graph_runner_cls(self):
        from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

        return DecodeCudaGraphRunner

    def get_torch_profiler_activity_str(self) -> str:
        """Out-of-tree platforms name their profiler activity: ``/start_profile`` asks for it."""
        return "CUDA"

    def get_torch_profiler_activity(self) -> torch.profiler.ProfilerActivity:
        return torch.profiler.ProfilerActivity.CUDA

    def get_group_coordinator_device(self, local_rank: int) -> torch.device:
        return torch.device("cuda", local_rank)

    def apply_server_args_defaults(self, server_args) -> None:
        server_args.device = "cuda"
        if getattr(server_args, "sampling_backend", None) in (None, "flashinfer"):
            server_args.sampling_backend = "pytorch"
        for name in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
            if getattr(server_args, name, None) not in (None, "triton", "torch_native"):
                logger.warning("harness platform: %s=%s replaced by triton", name, getattr(server_args, name))
                setattr(server_args, name, "triton")
        if getattr(server_args, "attention_backend", None) is None:
            server_args.attention_backend = "triton"

    def init_backend(self) -> None:
        # Unquantized fused MoE: its Triton CUDA forward (the native one loops over experts on the host).
        from sglang.kernels.fused_op import BaseFusedOp
        from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod

        BaseFusedOp.register_oot_forward(UnquantizedFusedMoEMethod, UnquantizedFusedMoEMethod.forward_cuda, "native")
        # Llama/Qwen2's small-batch dual GEMM is a CuTe-DSL kernel the device lacks.
        try:
            from sglang.srt.layers.dual_gemm import DualGemm

            DualGemm._select_mode = lambda self, gate_up_proj, hidden_size: None
        except ImportError:
            pass
        if os.environ.get(UPSTREAM_M3_ENV) == "1":
            allow_upstream_m3_kv_pool()
        if os.environ.get(CUDA_CUSTOM_OPS_ENV, "1") != "0":
            route_custom_ops_to_cuda_forwards()
        keep_custom_ops_direct_under_profiler()


#: SGLang's RMSNorm, GemmaRMSNorm, SiluAndMul and RotaryEmbedding layers take their CUDA forwards
#: (one launch each, as on a stock install) unless this is "0", which keeps their native torch
#: forwards (four to twelve torch kernels each). On the H200 each CUDA forward matched its native
#: one within a bf16 rounding (``scripts/gpu/check_cuda_custom_ops.py``); see
#: route_custom_ops_to_cuda_forwards.
CUDA_CUSTOM_OPS_ENV = "M3_HARNESS_CUDA_CUSTOM_OPS"


def route_custom_ops_to_cuda_forwards() -> None:
    """Give SGLang's norm, activation and rotary layers their CUDA forwards on this platform.

    The platform dispatches SGLang's fused ops as ``native``, so every RMSNorm and rotary
    embedding of upstream's M3 (the e2e anchor) and of an EAGLE draft ran as torch's mean, pow,
    rsqrt, multiply, add, index and concatenation kernels, where a stock CUDA install runs one
    launch. The norms' and activation's CUDA forwards call ``sgl_kernel.rmsnorm`` /
    ``fused_add_rmsnorm`` / ``gemma_rmsnorm`` / ``gemma_fused_add_rmsnorm`` / ``silu_and_mul``,
    which the stand-in implements in Triton (``sgl_kernel/ops.py``, checked against torch
    references on the CPU); the rotary embedding's calls SGLang's JIT rope kernel, which nvcc
    builds on the device at its first call. Registrations hold for these exact classes only (the
    scaled and multimodal rotary variants keep their native forwards). The project's own M3 uses
    its own fused kernels and does not pass through these layers.
    """
    from sglang.kernels.fused_op import BaseFusedOp
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    for op in (RMSNorm, GemmaRMSNorm, SiluAndMul, RotaryEmbedding):
        BaseFusedOp.register_oot_forward(op, op.forward_cuda, "native")
    logger.info(
        "harness platform: RMSNorm, GemmaRMSNorm, SiluAndMul and RotaryEmbedding take their CUDA forwards (%s=1)",
        CUDA_CUSTOM_OPS_ENV,
    )


def keep_custom_ops_direct_under_profiler() -> None:
    """Let ``/start_profile`` profile prefill steps on this platform.

    SGLang registers its custom ops (the KV store among them) for the ``PrivateUse1`` key on any
    out-of-tree platform, and calls them through the dispatcher only while the torch profiler
    runs; CUDA tensors then find no kernel and the scheduler dies. Outside the profiler the op's
    Python function is called directly, so the same direct call under the profiler changes
    nothing but the op's own profiler label (its GPU kernels are still recorded).
    """
    from sglang.srt.utils import custom_op

    custom_op._profiling = lambda: False


#: Set by ``benchmarks/e2e_gpu.py`` for the server that runs upstream SGLang's own M3 classes.
UPSTREAM_M3_ENV = "M3_HARNESS_UPSTREAM_M3"
_UPSTREAM_M3_POOL = "the MiniMax sparse-index KV pool"


def allow_upstream_m3_kv_pool() -> None:
    """Let upstream's M3 build its KV pool on this platform (the comparison's anchor).

    SGLang refuses its MiniMax sparse-index pool on any out-of-tree platform because the pool's
    classes assume CUDA; this platform is CUDA in all but name, so only that one refusal is lifted
    and every other out-of-tree refusal stays.
    """
    from sglang.srt.mem_cache import kv_cache_configurator

    refuse = kv_cache_configurator.reject_out_of_tree_path
    if getattr(refuse, "__m3_harness_lifted__", False):
        return

    def reject_except_upstream_m3_pool(platform, *, subsystem: str) -> None:
        if subsystem != _UPSTREAM_M3_POOL:
            refuse(platform, subsystem=subsystem)

    reject_except_upstream_m3_pool.__m3_harness_lifted__ = True
    kv_cache_configurator.reject_out_of_tree_path = reject_except_upstream_m3_pool
    logger.info("harness platform: upstream M3's sparse-index KV pool allowed (benchmark anchor)")
