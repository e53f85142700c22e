"""The shared expert beside the routed experts: two CUDA streams inside captured decode graphs.

At decode the shared expert's two GEMMs and the routed experts' fused MoE each leave most of the
GPU idle (a few rows against 6144-wide weights), and under expert parallelism each rank's routed
share halves while its shared expert does not shrink, so running them one after the other costs
the shared expert's whole time on every MoE layer. Captured on two streams, they overlap in
every replay of the graph.

Only inside a plain CUDA graph capture, as upstream's M3 does: there the fork and join are
recorded once and replay at no host cost, while eager forwards (prefill, whose GEMMs fill the GPU
alone, and the CPU platform) keep one stream. SGLang's breakable graphs (split at attention for
piecewise prefill replay) are left alone too. Memory stays safe across the two streams: the
caller holds the input until after the join, the routed experts' temporaries are allocated on the
second stream (the caching allocator keeps such blocks to the stream that made them), and both
outputs are read on the main stream only after the join. ``SGLANG_M3_MOE_OVERLAP=0`` keeps one
stream everywhere (the A/B switch).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from sglang_m3.env_switch import env_choice

logger = logging.getLogger(__name__)

MOE_OVERLAP_ENV = "SGLANG_M3_MOE_OVERLAP"
_announced = False


def overlap_stream() -> torch.cuda.Stream | None:
    """SGLang's process-wide ``alt`` stream on a CUDA platform with the overlap on, else None.

    Taken at model construction: a stream must exist before graph capture begins."""
    if env_choice(MOE_OVERLAP_ENV, ("1", "0")) == "0":
        return None
    from sglang.srt.platforms import current_platform

    if not (current_platform.device_type == "cuda" and torch.cuda.is_available()):
        return None
    from sglang.srt.runtime_context import get_stream

    return get_stream("alt")


def _capturing_plain_graph() -> bool:
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import is_in_breakable_cuda_graph

    return torch.cuda.is_current_stream_capturing() and not is_in_breakable_cuda_graph()


def shared_beside_routed(
    alt: torch.cuda.Stream | None,
    x: torch.Tensor,
    shared: Callable[[torch.Tensor], torch.Tensor],
    routed: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(shared(x), routed(x))``: the routed experts on ``alt`` while a plain graph is captured."""
    if alt is None or not _capturing_plain_graph():
        return shared(x), routed(x)
    global _announced
    if not _announced:
        logger.info("M3 MoE: shared expert captured beside the routed experts on a second stream")
        _announced = True
    main = torch.cuda.current_stream()
    alt.wait_stream(main)
    shared_out = shared(x)
    with torch.cuda.stream(alt):
        routed_out = routed(x)
    main.wait_stream(alt)
    return shared_out, routed_out
