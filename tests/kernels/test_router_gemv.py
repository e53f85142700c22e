"""The router's GEMV (``sglang_m3.models.router_gemv``) under the Triton interpreter against a
float64 reference, and its place in ``moe_routing.router_logits``: CUDA rows up to
``MAX_GEMV_ROWS`` only, so the CPU platform keeps what it ran.

The weights are random fp32 router weights split by ``moe_routing.split_into_16bit_parts`` into
one, two or three bf16 or fp16 parts. Two kinds of check:

- Random rows: each logit within the fp32 summation bound of its own terms (``summation_bound``).
  That bound is rigorous but, at H terms, far wider than the error such sums show, so
- rows with a single nonzero power of two (``test_one_hot_rows_give_the_fp32_weight_exactly``):
  there every sum is exact, and the logits must be that power times the fp32 weight bit for bit,
  which a dropped or misplaced part, a wrong row or column, a lost tile or mask would break.

``tests/gpu/test_router_gpu.py`` runs the kernel compiled on CUDA at M3's width (against the
GEMM over the parts and the fp32 linear, from run to run, inside a CUDA graph).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from interpreter_only import INTERPRETER_ONLY
from torch import nn

from sglang_m3.models import moe_routing
from sglang_m3.models.moe_routing import add_router_parameters, router_logits, split_into_16bit_parts
from sglang_m3.models.router_gemv import (
    GEMV_TILES,
    MAX_GEMV_ROWS,
    gemv_serves,
    gemv_tile,
    padded_rows,
    router_logits_gemv,
)

pytestmark = INTERPRETER_ONLY

FP32_UNIT_ROUNDOFF = 2.0**-24


def weight_in_parts(experts: int, hidden: int, dtype: torch.dtype, parts: int, gen: torch.Generator):
    """(fp32 weight ``[E, H]``, its ``split_into_16bit_parts`` ``[parts * E, H]``): a random weight
    cut to what ``parts`` parts hold (the sum of its first ``parts`` parts)."""
    if dtype == torch.bfloat16:
        full = torch.randn(experts, hidden, generator=gen) * hidden**-0.5
    else:
        # fp16's exponent range: magnitudes around 1 keep every bit of three parts above 2**-24
        full = torch.randn(experts, hidden, generator=gen).clamp(-4, 4)
    kept, rest = torch.zeros_like(full, dtype=torch.float64), full
    for _ in range(parts):
        part = rest.to(dtype)
        kept += part.double()
        rest = rest - part.float()
    weight = kept.float()
    assert torch.equal(weight.double(), kept), "the kept parts' sum is not an fp32 value"
    split = split_into_16bit_parts(weight, dtype)
    assert split is not None and split.shape == (parts * experts, hidden), "the weight does not take exactly that many parts"
    assert torch.equal(split.double().view(parts, experts, hidden).sum(0), weight.double())
    return weight, split


def activations(rows: int, hidden: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, hidden, generator=gen).to(dtype)


def summation_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Largest error ``[T, E]`` of an fp32 logit against the float64 one.

    The kernel sums the parts to the fp32 weight exactly (``router_gemv``'s docstring), so a logit
    is ``sum_k x[k] w[k]`` over H terms, each product rounded at most once (the interpreter's
    multiply; CUDA fuses it into the add) and then H - 1 fp32 additions in some fixed order. In any
    order each term goes through at most H - 1 additions, each a relative error of at most
    u = 2**-24, so (Higham, *Accuracy and Stability of Numerical Algorithms*, 4.2 and 3.1)
    ``|error| <= gamma(H) * sum_k |x[k] w[k]|`` with ``gamma(n) = n u / (1 - n u)``; one more
    ``n`` covers the float64 reference's own rounding (2**-53 per operation, far below)."""
    n = x.shape[1] + 1
    gamma = n * FP32_UNIT_ROUNDOFF / (1 - n * FP32_UNIT_ROUNDOFF)
    return gamma * (x.double().abs() @ weight.double().abs().t())


def check_gemv(x: torch.Tensor, weight: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
    experts = weight.shape[0]
    got = router_logits_gemv(x, parts, experts)
    assert got.dtype == torch.float32 and got.shape == (x.shape[0], experts)
    assert got.is_contiguous()
    reference = x.double() @ weight.double().t()
    error = (got.double() - reference).abs()
    bound = summation_bound(x, weight)
    worst = (error / bound).max().item()
    assert bool((error <= bound).all()), f"error up to {worst:.3g} of the fp32 summation bound"
    return got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 3, MAX_GEMV_ROWS])
@pytest.mark.parametrize(
    "experts, hidden",
    # odd experts and H over several K steps, the last partial; H a multiple of every K step
    [(7, 2500), (16, 2048)],
)
def test_matches_float64_reference(dtype, parts, rows, experts, hidden):
    gen = torch.Generator().manual_seed(1000 * parts + 10 * rows + experts)
    weight, split = weight_in_parts(experts, hidden, dtype, parts, gen)
    check_gemv(activations(rows, hidden, dtype, gen), weight, split)


@pytest.mark.parametrize("parts", [1, 3])
def test_m3_width_one_row(parts):
    """M3's router at decode: 128 experts x 6,144, one row, a bf16 checkpoint's one part or a
    random fp32 weight's three."""
    gen = torch.Generator().manual_seed(parts)
    weight, split = weight_in_parts(128, 6144, torch.bfloat16, parts, gen)
    check_gemv(activations(1, 6144, torch.bfloat16, gen), weight, split)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("hidden", [2500, 2048])
def test_one_hot_rows_give_the_fp32_weight_exactly(dtype, parts, hidden):
    """Row t is ``c_t`` (a power of two) at column ``k_t``, zero elsewhere: every product but one is
    zero, so the logit is ``c_t * w[e, k_t]`` exactly, the fp32 weight that the parts sum to. The
    columns lie in the first, a middle and the last (for H = 2500 partial) K step; five rows take
    a padded tile (8 rows)."""
    experts, rows = 7, 5
    gen = torch.Generator().manual_seed(parts * 7 + hidden)
    weight, split = weight_in_parts(experts, hidden, dtype, parts, gen)
    cols = [0, hidden // 2 + 3, hidden - 1, 1, hidden - 2]
    scales = [1.0, -2.0, 0.5, 4.0, -0.25]
    x = torch.zeros(rows, hidden, dtype=dtype)
    for t, (k, c) in enumerate(zip(cols, scales)):
        x[t, k] = c
    got = router_logits_gemv(x, split, experts)
    want = torch.stack([c * weight[:, k] for k, c in zip(cols, scales)])
    assert torch.equal(got, want)


def test_row_strided_activations():
    """Rows of a wider buffer (any row stride; unit stride along hidden)."""
    gen = torch.Generator().manual_seed(5)
    weight, split = weight_in_parts(7, 1000, torch.bfloat16, 3, gen)
    wide = activations(4, 1100, torch.bfloat16, gen)
    x = wide[:, 50:1050]
    assert x.stride() == (1100, 1)
    assert torch.equal(check_gemv(x, weight, split), router_logits_gemv(x.contiguous(), split, 7))


def test_bit_identical_from_call_to_call():
    gen = torch.Generator().manual_seed(6)
    weight, split = weight_in_parts(16, 2048, torch.bfloat16, 3, gen)
    x = activations(MAX_GEMV_ROWS, 2048, torch.bfloat16, gen)
    assert torch.equal(router_logits_gemv(x, split, 16), router_logits_gemv(x, split, 16))


def test_every_row_count_has_a_tile():
    for rows in range(1, MAX_GEMV_ROWS + 1):
        assert padded_rows(rows) in GEMV_TILES and padded_rows(rows) >= rows
        assert gemv_tile(rows).block_e >= 1 and gemv_tile(rows).block_k >= 16


def test_refuses_bad_operands():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    parts = torch.zeros(3 * 8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"1 to {MAX_GEMV_ROWS} rows"):
        router_logits_gemv(torch.zeros(MAX_GEMV_ROWS + 1, 64, dtype=torch.bfloat16), parts, 8)
    with pytest.raises(ValueError, match=f"1 to {MAX_GEMV_ROWS} rows"):
        router_logits_gemv(torch.zeros(0, 64, dtype=torch.bfloat16), parts, 8)
    with pytest.raises(ValueError, match="16-bit dtype"):
        router_logits_gemv(x.float(), parts.float(), 8)
    with pytest.raises(ValueError, match="16-bit dtype"):
        router_logits_gemv(x, parts.half(), 8)
    with pytest.raises(ValueError, match="P in 1..3"):
        router_logits_gemv(x, torch.zeros(4 * 8, 64, dtype=torch.bfloat16), 8)
    with pytest.raises(ValueError, match="P in 1..3"):
        router_logits_gemv(x, parts, 7)
    with pytest.raises(ValueError, match="P in 1..3"):
        router_logits_gemv(x, parts[:, :32], 8)
    with pytest.raises(ValueError, match="unit stride"):
        router_logits_gemv(torch.zeros(64, 2, dtype=torch.bfloat16).t(), parts, 8)


# ----------------------------------------------------------------------------- the router's dispatch


def test_the_gemv_serves_cuda_rows_up_to_max_gemv_rows_only():
    def rows(count: int, cuda: bool = True, unit_stride: bool = True):
        return SimpleNamespace(is_cuda=cuda, shape=(count, 6144), stride=lambda dim: 1 if unit_stride else 2)

    assert all(gemv_serves(rows(count)) for count in (1, 4, MAX_GEMV_ROWS))
    assert not any(gemv_serves(rows(count)) for count in (0, MAX_GEMV_ROWS + 1, 8192))
    assert not gemv_serves(rows(1, cuda=False))
    assert not gemv_serves(rows(1, unit_stride=False))
    assert not gemv_serves(torch.zeros(1, 16, dtype=torch.bfloat16))  # a CPU tensor


def _router(experts: int, hidden: int, parts: int):
    block = nn.Module()
    add_router_parameters(block, SimpleNamespace(num_experts=experts, hidden_size=hidden, use_routing_bias=False))
    weight, split = weight_in_parts(experts, hidden, torch.bfloat16, parts, torch.Generator().manual_seed(parts))
    with torch.no_grad():
        block.gate.weight.copy_(weight)
    return block.gate, split


def _cpu_mm(a, b, out_dtype=None):
    """``torch.mm(a, b, out_dtype=float32)`` of 16-bit operands, which CPU torch lacks: exact
    products, float64 sums rounded to fp32 (the GEMM's value up to its summation order)."""
    assert out_dtype == torch.float32
    return (a.double() @ b.double()).float()


@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("rows", [1, MAX_GEMV_ROWS])
def test_cpu_rows_keep_the_gemm_over_the_parts(monkeypatch, parts, rows):
    """On the CPU ``router_logits`` with parts runs what it ran before: one ``torch.mm`` over the
    stacked parts, the parts' logits summed; never the GEMV. (CPU torch has no ``mm`` with an
    ``out_dtype``, and the CPU platform never makes parts: the GEMM is stood in for.)"""
    gate, split = _router(8, 64, parts)
    calls = []

    def mm(a, b, out_dtype=None):
        calls.append((a.shape, b.shape))
        return _cpu_mm(a, b, out_dtype)

    def no_gemv(*args, **kwargs):
        raise AssertionError("the GEMV ran for CPU rows")

    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(moe_routing, "router_logits_gemv", no_gemv)
    x = activations(rows, 64, torch.bfloat16, torch.Generator().manual_seed(rows))
    logits = router_logits(gate, x, split)
    assert calls == [((rows, 64), (64, parts * 8))]
    per_part = _cpu_mm(x, split.t(), torch.float32)
    want = per_part if parts == 1 else per_part.view(rows, parts, 8).sum(1)
    assert torch.equal(logits, want)


def test_rows_the_gemv_serves_take_it(monkeypatch):
    """Where ``gemv_serves`` (CUDA rows, stood in for here) the logits are the GEMV's, whole."""
    gate, split = _router(7, 1000, 3)
    monkeypatch.setattr(moe_routing, "gemv_serves", lambda x: True)
    monkeypatch.setattr(torch, "mm", lambda *args, **kwargs: pytest.fail("torch.mm ran for rows the GEMV serves"))
    x = activations(3, 1000, torch.bfloat16, torch.Generator().manual_seed(9))
    logits = router_logits(gate, x, split)
    assert torch.equal(logits, router_logits_gemv(x, split, 7))
    assert bool((logits.double() - x.double() @ gate.weight.double().t()).abs().le(summation_bound(x, gate.weight)).all())


def test_without_parts_the_router_stays_the_fp32_linear(monkeypatch):
    monkeypatch.setattr(moe_routing, "gemv_serves", lambda x: True)
    gate, split = _router(8, 64, 1)
    x = activations(2, 64, torch.bfloat16, torch.Generator().manual_seed(3))
    assert torch.equal(router_logits(gate, x), gate(x.float()))
    # parts of another dtype than the activations are not used either
    assert torch.equal(router_logits(gate, x.half(), split), gate(x.half().float()))
