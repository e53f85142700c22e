"""The fused residual add + RMSNorm on CUDA against the torch path, at M3's real width.

Same checks and tolerances as the interpreter tests (``tests/fused_norm_cases.py`` derives them),
here compiled (libdevice rsqrt, no FP contraction) at hidden 6144 for decode (1 row), a small
batch (64) and an 8K-token prefill chunk, plus what only a GPU shows: the model's dispatch on
CUDA tensors against ``SGLANG_M3_FUSED_NORM=0``, and the whole text model (kernel launches,
carried residual) captured in a CUDA graph and replayed on new tokens. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from fused_attn_cases import random_norm, tiny_text_spec
from fused_norm_cases import assert_nearly_all_identical, check_add_rmsnorm, rows, run_model, tiny_text_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = "cuda"
HIDDEN = 6144


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 64, 8192])
@pytest.mark.parametrize("gemma", [True, False])
@pytest.mark.parametrize("with_residual", [True, False])
def test_real_width_matches_torch_path(dtype, tokens, gemma, with_residual):
    gen = torch.Generator().manual_seed(tokens)
    x, residual = rows(tokens, HIDDEN, dtype, gen, CUDA)
    counts = check_add_rmsnorm(x, residual if with_residual else None, random_norm(HIDDEN, gemma, gen, CUDA))
    if dtype != torch.float32:
        assert_nearly_all_identical([counts])


def test_strided_rows():
    gen = torch.Generator().manual_seed(5)
    x, residual = rows(64, HIDDEN, torch.bfloat16, gen, CUDA, pad=128)
    assert x.stride(0) == HIDDEN + 128
    check_add_rmsnorm(x, residual, random_norm(HIDDEN, True, gen, CUDA))


@pytest.fixture
def cuda_model(monkeypatch):
    """The tiny text model on CUDA in fp32, its MoE on the graph-safe static torch path."""
    from sglang_m3.models.fused_moe import MOE_IMPL_ENV

    monkeypatch.setenv(MOE_IMPL_ENV, "static")
    spec = tiny_text_spec()
    ids = torch.randint(0, spec.vocab_size, (16,), generator=torch.Generator().manual_seed(3)).to(CUDA)
    return spec, tiny_text_model(spec, torch.float32, CUDA), ids, torch.arange(16, device=CUDA)


def test_model_takes_the_kernel_on_cuda(cuda_model, monkeypatch):
    """On CUDA tensors every add + norm is one kernel launch (2 L + 1); SGLANG_M3_FUSED_NORM=0
    gives the torch path; the results agree (a wiring error moves them by O(1))."""
    from sglang_m3.models import fused_norm

    spec, model, ids, positions = cuda_model
    calls = []
    real = fused_norm.add_rmsnorm_kernel
    monkeypatch.setattr(fused_norm, "add_rmsnorm_kernel", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv(fused_norm.FUSED_NORM_ENV, "0")
    reference = run_model(model, ids, positions)
    assert not calls
    monkeypatch.delenv(fused_norm.FUSED_NORM_ENV)
    fused = run_model(model, ids, positions)
    assert len(calls) == 2 * spec.num_layers + 1
    torch.testing.assert_close(fused, reference, rtol=1e-4, atol=1e-4)


def test_model_replays_in_a_cuda_graph(cuda_model):
    """Captured once, replayed on new token ids written in place: the eager result, bit for bit."""
    spec, model, ids, positions = cuda_model
    run_model(model, ids, positions)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = run_model(model, ids, positions)
    ids.copy_(torch.randint(0, spec.vocab_size, (16,), generator=torch.Generator().manual_seed(4)).to(CUDA))
    graph.replay()
    assert torch.equal(graph_out, run_model(model, ids, positions))
