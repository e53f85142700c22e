"""The fused residual add + RMSNorm kernel (Triton interpreter, CPU) against the torch path, and
its wiring: the decoder layers carry the residual, the CPU model path computes exactly what it
computed before, and the kernel runs only for CUDA tensors (``SGLANG_M3_FUSED_NORM``).

Tolerances are derived in ``tests/fused_norm_cases.py``; ``tests/gpu/test_fused_add_rmsnorm_gpu.py``
runs the same checks compiled on CUDA at M3's real width.
"""

from __future__ import annotations

import types

import pytest
import torch
from interpreter_only import INTERPRETER_ONLY
from fused_attn_cases import assert_fp32_close, random_norm, tiny_text_spec
from fused_norm_cases import (
    assert_nearly_all_identical,
    check_add_rmsnorm,
    rows,
    run_model,
    tiny_text_model,
    unfused_forward,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from msa_kernels.triton_add_rmsnorm import add_rmsnorm

pytestmark = INTERPRETER_ONLY


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gemma", [True, False])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize(
    "tokens, hidden, pad",
    [(3, 6144, 0), (1, 64, 0), (5, 96, 0), (7, 64, 5), (0, 64, 0)],  # real width; tiny; strided rows; no rows
)
def test_matches_torch_path(dtype, gemma, with_residual, tokens, hidden, pad):
    gen = torch.Generator().manual_seed(tokens * 31 + hidden + pad)
    x, residual = rows(tokens, hidden, dtype, gen, pad=pad)
    check_add_rmsnorm(x, residual if with_residual else None, random_norm(hidden, gemma, gen))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_nearly_always_bit_identical(dtype):
    gen = torch.Generator().manual_seed(1)
    counts = []
    for gemma in (True, False):
        x, residual = rows(4, 6144, dtype, gen)
        norm = random_norm(6144, gemma, gen)
        counts += [check_add_rmsnorm(x, residual, norm), check_add_rmsnorm(x, None, norm)]
    assert_nearly_all_identical(counts)


@settings(max_examples=30, deadline=None)
@given(
    tokens=st.integers(0, 5),
    hidden=st.integers(1, 300),
    pad=st.integers(0, 4),
    gemma=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    with_residual=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_match_torch_path(tokens, hidden, pad, gemma, dtype, with_residual, seed):
    """Any hidden size (powers of two or not), row count and row stride, both norm forms."""
    gen = torch.Generator().manual_seed(seed)
    x, residual = rows(tokens, hidden, dtype, gen, pad=pad)
    check_add_rmsnorm(x, residual if with_residual else None, random_norm(hidden, gemma, gen))


def test_refuses_bad_operands():
    x, w = torch.zeros(2, 16), torch.zeros(16)

    def call(x=x, residual=None, weight=w):
        return add_rmsnorm(x, residual, weight, eps=1e-6, weight_offset=1.0)

    with pytest.raises(ValueError, match=r"x must be \[rows, hidden\]"):
        call(x=torch.zeros(2, 3, 16))
    with pytest.raises(ValueError, match="x's hidden dim must have unit stride"):
        call(x=torch.zeros(16, 2).t())
    with pytest.raises(ValueError, match="residual must match x"):
        call(residual=torch.zeros(2, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="residual must match x"):
        call(residual=torch.zeros(3, 16))
    with pytest.raises(ValueError, match=r"weight must be \[16\]"):
        call(weight=torch.zeros(8))


# ---------------------------------------------------------------- wiring in the model


@pytest.fixture(scope="module")
def spec():
    return tiny_text_spec()


def _inputs(spec, tokens=9):
    ids = torch.randint(0, spec.vocab_size, (tokens,), generator=torch.Generator().manual_seed(tokens))
    return ids, torch.arange(tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_model_path_is_unchanged(spec, dtype):
    """With the residual carried, the CPU path is bit-identical to ``h = h + attn(ln1(h));
    h = h + mlp(ln2(h))``, the aux hidden states (EAGLE3) included."""
    model = tiny_text_model(spec, dtype)
    ids, positions = _inputs(spec)
    want, layer_outputs = unfused_forward(model, ids, positions)
    assert torch.equal(run_model(model, ids, positions), want)
    model.aux_layer_ids = (2, 0, spec.num_layers - 1)
    got, aux = run_model(model, ids, positions)
    assert torch.equal(got, want)
    for layer_id, captured in zip(model.aux_layer_ids, aux):
        assert torch.equal(captured, layer_outputs[layer_id]), layer_id


def test_switch_reads_the_device_and_the_environment(monkeypatch):
    from sglang_m3.models.fused_norm import FUSED_NORM_ENV, fused_norm_on

    cuda_like = types.SimpleNamespace(is_cuda=True)
    monkeypatch.delenv(FUSED_NORM_ENV, raising=False)
    assert fused_norm_on(cuda_like) and not fused_norm_on(torch.zeros(1))
    monkeypatch.setenv(FUSED_NORM_ENV, "0")
    assert not fused_norm_on(cuda_like)
    monkeypatch.setenv(FUSED_NORM_ENV, "yes")
    with pytest.raises(ValueError, match=FUSED_NORM_ENV):
        fused_norm_on(cuda_like)


def test_model_runs_every_add_and_norm_through_the_kernel_when_fused(spec, monkeypatch):
    """Standing in for a CUDA device: every layer's two norms and the final norm go through the
    kernel (2 L + 1 launches), each on the right operands; the aux hidden states are the sums the
    kernel forms; the result stays on the torch path's (a wiring error moves it by O(1))."""
    from sglang_m3.models import fused_norm

    model = tiny_text_model(spec, torch.float32)
    ids, positions = _inputs(spec)
    want, _ = unfused_forward(model, ids, positions)
    calls = []

    def spy(x, residual, weight, **kwargs):
        calls.append((x, residual, add_rmsnorm(x, residual, weight, **kwargs)))
        return calls[-1][2]

    monkeypatch.setattr(fused_norm, "add_rmsnorm_kernel", spy)
    monkeypatch.setattr(fused_norm, "fused_norm_on", lambda x: True)
    model.aux_layer_ids = tuple(range(spec.num_layers))
    got, aux = run_model(model, ids, positions)

    assert len(calls) == 2 * spec.num_layers + 1
    norms = [n for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)] + [model.norm]
    for norm, (x, residual, _) in zip(norms, calls):
        check_add_rmsnorm(x, residual, norm)
    assert calls[0][1] is None  # the first layer's input norm reads the embeddings alone
    assert got is calls[-1][2][0]
    for layer_id, captured in enumerate(aux):  # layer i's output is what layer i + 1 (or the final norm) sums
        assert torch.equal(captured, calls[2 * layer_id + 2][2][1])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert_fp32_close(calls[-1][2][0], model.norm(calls[-1][2][1]))


# ---------------------------------------------------------------- compiled form (no GPU needed)

_COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from msa_kernels.triton_add_rmsnorm import add_rmsnorm_kernel

for dtype in ("bf16", "fp32"):
    for residual in (True, False):
        consts = dict(D=6144, BLOCK=8192, HAS_RESIDUAL=residual, PRECISE=True)
        types = {"eps": "fp32", "w_offset": "fp32", "w_ptr": "*fp32", "x_row_stride": "i64", "r_row_stride": "i64"}
        signature = {n: "constexpr" if n in consts else types.get(n, f"*{dtype}") for n in add_rmsnorm_kernel.arg_names}
        ptx = triton.compile(ASTSource(add_rmsnorm_kernel, signature, consts), target=GPUTarget("cuda", 90, 32),
                             options={"enable_fp_fusion": False, "num_warps": 16}).asm["ptx"]
        assert "fma.rn.f32" not in ptx, "contracted multiply-adds in the compiled kernel"
print("compiled")
"""


def test_kernel_compiles_for_hopper():
    """The interpreter does not run Triton's compiler: compile the kernel for sm_90 at M3's width
    (no GPU needed) and check that no multiply-add was contracted."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
