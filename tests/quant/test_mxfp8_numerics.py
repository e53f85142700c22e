"""MXFP8 quantize/dequantize: round-trip bounds, exact e8m0 handling, refusals (property tests)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_m3.quant.mxfp8 import BLOCK, E4M3_MAX, MXFP8FormatError, decode_scales, dequantize, nan_elements, quantize

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@st.composite
def matrices(draw):
    rows = draw(st.integers(1, 3))
    blocks = draw(st.integers(1, 3))
    exponent = draw(st.integers(-120, 100))
    values = draw(st.lists(finite, min_size=rows * blocks * BLOCK, max_size=rows * blocks * BLOCK))
    x = torch.tensor(values, dtype=torch.float32).reshape(rows, blocks * BLOCK)
    # bring the values near 2**exponent so every magnitude range is visited
    return x / max(x.abs().max().item(), 1e-30) * 2.0**exponent


@settings(max_examples=150, deadline=None)
@given(matrices())
def test_round_trip_error_is_within_half_an_e4m3_step(x):
    elements, scales = quantize(x)
    back = dequantize(elements, scales)
    factor = decode_scales(scales).repeat_interleave(BLOCK, dim=-1)
    # e4m3 has 3 mantissa bits: relative error <= 2**-4 for normals; subnormal step 2**-9 -> abs 2**-10
    bound = torch.maximum(x.abs() * 2.0**-4, factor * 2.0**-10)
    assert ((back - x).abs() <= bound).all()


@settings(max_examples=150, deadline=None)
@given(matrices())
def test_scale_is_the_smallest_power_of_two_that_does_not_saturate(x):
    _, scales = quantize(x)
    amax = x.reshape(*scales.shape, BLOCK).abs().amax(-1).double()
    exponent = scales.to(torch.int64) - 127
    factor = torch.pow(2.0, exponent.double())
    assert (amax <= E4M3_MAX * factor).all()
    smaller_fits = amax <= E4M3_MAX * factor / 2
    assert not (smaller_fits & (exponent > -126) & (amax > 0)).any()


@settings(max_examples=100, deadline=None)
@given(st.integers(-126, 119), st.integers(0, BLOCK - 1), st.integers(-9, 8))
def test_powers_of_two_and_block_maxima_round_trip_exactly(k, position, lower):
    x = torch.zeros(1, BLOCK)
    x[0, position] = E4M3_MAX * 2.0**k  # the largest e4m3 value at scale 2**k
    x[0, (position + 1) % BLOCK] = 2.0 ** (k + lower)  # a power of two inside the block's range
    elements, scales = quantize(x)
    assert scales.item() == k + 127
    assert torch.equal(dequantize(elements, scales), x)


def test_zero_blocks_get_the_smallest_scale_and_stay_zero():
    x = torch.zeros(2, 2 * BLOCK)
    x[1, BLOCK:] = 1.0
    elements, scales = quantize(x)
    assert scales.tolist() == [[1, 1], [1, 119]]  # 1.0 needs 2**-8: 1 / 2**-8 = 256 <= 448 < 512
    assert torch.equal(dequantize(elements, scales), x)


def test_decoding_follows_sglang_byte_zero_is_zero_byte_255_refused():
    assert decode_scales(torch.tensor([0, 1, 127, 254], dtype=torch.uint8)).tolist() == [
        0.0, 2.0**-126, 1.0, 2.0**127,
    ]
    with pytest.raises(MXFP8FormatError, match="255"):
        decode_scales(torch.tensor([255], dtype=torch.uint8))


def test_bf16_dequantization_is_exact():
    x = torch.randn(8, 4 * BLOCK) * 3
    elements, scales = quantize(x)
    assert torch.equal(dequantize(elements, scales, torch.bfloat16).float(), dequantize(elements, scales))


@pytest.mark.parametrize("width", [1, 31, 33, 48, 100])
def test_widths_not_divisible_by_32_are_refused(width):
    with pytest.raises(MXFP8FormatError, match=rf"shape \(2, {width}\).*multiple of 32"):
        quantize(torch.ones(2, width))


def test_bad_pairs_are_refused_by_name():
    elements, scales = quantize(torch.ones(4, 64))
    with pytest.raises(MXFP8FormatError, match=r"w1: scale shape \(4, 3\).*expected \(4, 2\)"):
        dequantize(elements, torch.zeros(4, 3, dtype=torch.uint8), what="w1")
    with pytest.raises(MXFP8FormatError, match="uint8"):
        dequantize(elements, scales.float())
    with pytest.raises(MXFP8FormatError, match="float8_e4m3fn"):
        dequantize(elements.float(), scales)
    with pytest.raises(MXFP8FormatError, match="non-finite"):
        quantize(torch.tensor([[math.inf] * 32]))


@st.composite
def e4m3_bytes(draw):
    """A float8_e4m3fn matrix of arbitrary bytes, NaN ones (0x7F, 0xFF) drawn often."""
    rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    byte = st.one_of(st.sampled_from([0x7F, 0xFF]), st.integers(0, 255))
    raw = draw(st.lists(byte, min_size=rows * cols, max_size=rows * cols))
    return torch.tensor(raw, dtype=torch.uint8).reshape(rows, cols).view(torch.float8_e4m3fn)


@settings(max_examples=200, deadline=None)
@given(e4m3_bytes())
def test_nan_elements_agree_with_torchs_e4m3_decoding(elements):
    """The byte test finds exactly what a float conversion finds: the count and the first NaN."""
    isnan = elements.float().isnan()
    count, first = nan_elements(elements)
    assert count == int(isnan.sum())
    assert first == (tuple(isnan.nonzero()[0].tolist()) if count else None)


def test_every_e4m3_byte_is_classified_as_torch_decodes_it():
    elements = torch.arange(256, dtype=torch.uint8).reshape(16, 16).view(torch.float8_e4m3fn)
    assert nan_elements(elements) == (2, (7, 15))  # 0x7F, then 0xFF
    assert int(elements.float().isnan().sum()) == 2
