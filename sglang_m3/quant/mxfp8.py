"""MXFP8 (OCP microscaling FP8) numerics: e4m3 elements with one e8m0 scale per 32 elements.

The layout is the one SGLang 0.5.23 reads (see ``sglang_m3/quant/README.md`` for the sources):
a weight ``[..., N, K]`` is stored as ``float8_e4m3fn`` of the same shape plus ``uint8`` scales
``[..., N, K // 32]``; scale byte ``b`` means the factor ``2 ** (b - 127)`` for the 32 consecutive
elements along the input dimension K. Decoding follows SGLang's ``_ue8m0_to_fp32`` (the byte
shifted into the fp32 exponent field), so byte 0 decodes to 0.0 and is never written for a block
with a non-zero element; byte 255 (NaN in e8m0) is refused. e4m3 (``float8_e4m3fn``) has no
infinity and two NaN bytes, 0x7F and 0xFF: :func:`nan_elements` finds them so a loader can refuse them.

Quantization picks, per block, the smallest power of two ``2 ** e`` with ``amax / 2 ** e <= 448``
(the e4m3 maximum): the round-up rule of SGLang's MXFP8 quantizers (``ceil_to_ue8m0`` in
``fp8_utils``, triton_kernels' ``downcast_to_mxfp``), so nothing saturates. Elements then round
to nearest-even e4m3 (torch's cast). ``e`` is found from the exact binary exponent of ``amax``
(``frexp``), not from a rounded ``log2``, so a block whose maximum is ``448 * 2 ** k`` gets
exactly ``e = k``.
"""

from __future__ import annotations

import torch

BLOCK = 32
E4M3_MAX = 448.0
#: exponent bias of e8m0; byte b <-> 2 ** (b - BIAS)
BIAS = 127
#: smallest exponent written: byte 1 (byte 0 decodes to 0.0 in SGLang)
MIN_EXPONENT = 1 - BIAS
MAX_EXPONENT = 254 - BIAS
WEIGHT_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.uint8
#: torch's own e8m0 type: the same bytes, which quantizers built on torch's MX types write
E8M0_DTYPE = torch.float8_e8m0fnu
#: e8m0's NaN byte
SCALE_NAN = 255
#: the bits below the sign of float8_e4m3fn; all set (0x7F, 0xFF) is NaN
E4M3_MAGNITUDE_BITS = 0x7F


class MXFP8FormatError(ValueError):
    """A tensor cannot be quantized, or a weight/scale pair is not valid MXFP8; names the fault."""


def scale_shape(weight_shape: tuple[int, ...], what: str = "weight") -> tuple[int, ...]:
    """The scale shape of a weight shape; refuses an input dimension that is not a multiple of 32."""
    if len(weight_shape) < 1 or weight_shape[-1] % BLOCK:
        raise MXFP8FormatError(
            f"{what} of shape {tuple(weight_shape)}: MXFP8 needs the last (input) dimension to be a "
            f"multiple of {BLOCK}"
        )
    return (*weight_shape[:-1], weight_shape[-1] // BLOCK)


def quantize(x: torch.Tensor, what: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (fp32/bf16/fp16) -> (e4m3 elements of ``x``'s shape, uint8 e8m0 scales ``[..., K/32]``)."""
    if not x.is_floating_point() or x.dtype in (WEIGHT_DTYPE, torch.float8_e5m2):
        raise MXFP8FormatError(f"{what}: only fp32/bf16/fp16 tensors are quantized, got {x.dtype}")
    blocks_shape = scale_shape(tuple(x.shape), what)
    values = x.detach().to(torch.float32).reshape(*blocks_shape, BLOCK)
    if not torch.isfinite(values).all():
        raise MXFP8FormatError(f"{what}: has non-finite values, which MXFP8 cannot represent")
    amax = values.abs().amax(dim=-1)
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2**exponent, mantissa in [0.5, 1)
    # 448 = 0.875 * 2**9: amax <= 448 * 2**e  <=>  e >= exponent - 9 (mantissa <= 0.875) else exponent - 8
    needed = exponent - 9 + (mantissa > 0.875).to(exponent.dtype)
    needed = torch.where(amax > 0, needed, torch.full_like(needed, MIN_EXPONENT))
    scale_exp = needed.clamp(MIN_EXPONENT, MAX_EXPONENT)
    scaled = torch.ldexp(values, -scale_exp.unsqueeze(-1).to(torch.float32))
    elements = scaled.to(WEIGHT_DTYPE).reshape(x.shape)
    return elements, (scale_exp + BIAS).to(SCALE_DTYPE)


def scale_bytes(scales: torch.Tensor) -> torch.Tensor:
    """``scales`` as uint8 e8m0 bytes. A ``float8_e8m0fnu`` tensor holds the same bytes (2 ** (b - 127),
    0xFF NaN) and is reinterpreted, never converted: a value cast to uint8 (what a plain copy into
    SGLang's uint8 scale parameter does) turns every factor below 1 into 0. Other dtypes are refused."""
    if scales.dtype == E8M0_DTYPE:
        return scales.view(SCALE_DTYPE)
    if scales.dtype != SCALE_DTYPE:
        raise MXFP8FormatError(f"MXFP8 scales must be uint8 or float8_e8m0fnu (e8m0 bytes), got {scales.dtype}")
    return scales


def decode_scales(scales: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes (uint8 or float8_e8m0fnu) -> fp32 factors (byte << 23 read as fp32, as SGLang decodes
    them). A NaN byte is refused with how many there are and where the first is, so a bad scale
    tensor can be found in the checkpoint."""
    scales = scale_bytes(scales)
    count, first = _count_and_first(scales == SCALE_NAN)
    if count:
        raise MXFP8FormatError(
            f"MXFP8 scale byte {SCALE_NAN} is NaN in e8m0: {count} of {scales.numel()} scales, first at {first}"
        )
    return (scales.to(torch.int32) << 23).view(torch.float32)


def nan_elements(elements: torch.Tensor) -> tuple[int, tuple[int, ...] | None]:
    """How many ``float8_e4m3fn`` elements are NaN, and the index of the first (None without one).
    Read on the bytes (0x7F / 0xFF), one byte-wide mask: a loader checks every weight as it
    arrives, and a float conversion would hold four bytes per element of the largest tensors."""
    if elements.dtype != WEIGHT_DTYPE:
        raise MXFP8FormatError(f"MXFP8 elements must be float8_e4m3fn, got {elements.dtype}")
    magnitude = elements.view(torch.uint8) & E4M3_MAGNITUDE_BITS
    return _count_and_first(magnitude == E4M3_MAGNITUDE_BITS)


def _count_and_first(mask: torch.Tensor) -> tuple[int, tuple[int, ...] | None]:
    """How many entries of boolean ``mask`` are set, and the (row-major) index of the first set one.
    The index is only looked for when there is one (a clean tensor costs one reduction), by
    ``argmax`` (its first maximum) rather than ``nonzero``, which would list every set entry."""
    count = int(mask.sum())
    if not count:
        return 0, None
    first = mask.flatten().view(torch.uint8).argmax()
    return count, tuple(int(i) for i in torch.unravel_index(first, mask.shape))


def dequantize(
    elements: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, what: str = "weight"
) -> torch.Tensor:
    """(e4m3 elements, e8m0 scales) -> ``dtype``. Exact in fp32 and bf16: an e4m3 value times a
    power of two needs at most 4 significant bits, inside both formats' exponent range."""
    if elements.dtype != WEIGHT_DTYPE:
        raise MXFP8FormatError(f"{what}: MXFP8 elements must be float8_e4m3fn, got {elements.dtype}")
    expected = scale_shape(tuple(elements.shape), what)
    if tuple(scales.shape) != expected:
        raise MXFP8FormatError(
            f"{what}: scale shape {tuple(scales.shape)} does not match weight shape "
            f"{tuple(elements.shape)} (expected {expected}: one scale per {BLOCK} input elements)"
        )
    factors = decode_scales(scales).unsqueeze(-1)
    values = elements.to(torch.float32).reshape(*expected, BLOCK) * factors
    return values.reshape(elements.shape).to(dtype)
