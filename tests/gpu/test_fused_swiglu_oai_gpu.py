"""The fused swiglu-oai kernel on CUDA against the torch ops, at M3's widths.

Same checks and tolerances as the interpreter tests (``tests/fused_act_cases.py`` derives them),
here compiled (libdevice exp, no FP contraction) at a shared expert's width (3072, 1536 at TP2)
and the dense MLP's (12288) for decode (1 row), a small batch (64) and an 8K-token prefill chunk,
plus what only a GPU shows: the MLP's dispatch on CUDA tensors against ``SGLANG_M3_FUSED_ACT=0``,
and the kernel captured in a CUDA graph and replayed on new inputs. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from fused_act_cases import ALPHA, LIMIT, check_swiglu_oai, gate_up_rows
from fused_norm_cases import assert_nearly_all_identical

from msa_kernels.triton_swiglu_oai import swiglu_oai

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = "cuda"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 64, 8192])
@pytest.mark.parametrize("inter", [1536, 3072, 12288])
def test_real_width_matches_torch_ops(dtype, tokens, inter):
    gen = torch.Generator().manual_seed(tokens + inter)
    counts = check_swiglu_oai(gate_up_rows(tokens, inter, dtype, gen, CUDA))
    if dtype != torch.float32:
        assert_nearly_all_identical([counts])


def test_mlp_dispatch_on_cuda(monkeypatch):
    """On CUDA the MLP's activation is the kernel; SGLANG_M3_FUSED_ACT=0 gives the torch ops; the
    two agree within the derived tolerance (a wiring error, e.g. swapped halves, moves them by O(1))."""
    from sglang_m3.models import fused_activation

    launches = []
    monkeypatch.setattr(fused_activation, "swiglu_oai", lambda *a, **k: launches.append(1) or swiglu_oai(*a, **k))
    act = fused_activation.GatedActivation("swigluoai", ALPHA, LIMIT)
    gate_up = gate_up_rows(64, 3072, torch.bfloat16, torch.Generator().manual_seed(2), CUDA)
    fused = act(gate_up)
    assert launches == [1]
    monkeypatch.setenv(fused_activation.FUSED_ACT_ENV, "0")
    unfused = act(gate_up)
    assert launches == [1]
    identical = (fused == unfused).float().mean().item()
    assert identical > 0.99, f"only {identical:.4f} of the elements equal the torch ops'"


def test_graph_replay_on_new_inputs():
    """Captured once, replayed on new contents of the same buffer: the same result as eager."""
    gen = torch.Generator().manual_seed(9)
    static = gate_up_rows(16, 3072, torch.bfloat16, gen, CUDA).contiguous()
    swiglu_oai(static, alpha=ALPHA, limit=LIMIT)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = swiglu_oai(static, alpha=ALPHA, limit=LIMIT)
    fresh = gate_up_rows(16, 3072, torch.bfloat16, gen, CUDA)
    static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, swiglu_oai(fresh.contiguous(), alpha=ALPHA, limit=LIMIT))
