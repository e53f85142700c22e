"""Dequantize-at-load of an MXFP8 checkpoint: each weight/scale pair becomes one plain weight.

The loader sees the checkpoint as a stream of ``(name, tensor)``; an MXFP8 linear arrives as
``X.weight`` (float8_e4m3fn) and ``X.weight_scale_inv`` (e8m0 bytes, uint8 or torch's
float8_e8m0fnu; ``X.weight_scale`` is accepted too: SGLang's loader renames it to ``_inv`` for
MXFP8). Safetensors files list tensors sorted by name, so a pair is adjacent; whichever half
comes first is held until its partner arrives, so at most the unpaired halves are ever buffered,
never the checkpoint. The pair leaves as ``(X.weight, fp32 values)``, and the ordinary
name/shape checks and parameter copy follow.

Which modules may be quantized follows SGLang 0.5.23's M3 model (``srt/models/minimax_m3.py``):
the linears it builds with the quantization config (attention q/k/v/o, the index q/k
projections, dense MLP, shared and routed experts), minus the config's ignore list. The router
gate (built with ``quant_config=None``), norms, routing bias, embeddings, lm_head and the vision
tower stay BF16: a scale or FP8 weight for them is refused by name, as are pairs with one half
missing, wrong scale shapes, scale formats MXFP8 does not have, and NaN anywhere in a pair (e4m3
bytes 0x7F/0xFF, e8m0 byte 255), with the count and the first index.

The vision tower's tensors reach the VL model's vision loader, not this pairing: that loader casts
what it is given, so the tower's stream has to pass :func:`checked_vision_tensors` (in the VL
model's ``load_weights``), which refuses the same tensors the text side refuses (see there).

The modules for which ``keeps_quantized`` answers yes are the exception: a routed expert of a
serving block that keeps MXFP8 experts (``sglang_m3.models.mxfp8_moe``, CUDA) or a linear built
with MXFP8 parameters (``sglang_m3.quant.mxfp8_linear``, CUDA) takes its pair as it is, so it
leaves as ``(X.weight, MXFP8Weight)`` after the same checks, not dequantized.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Callable

import torch

from sglang_m3.config import MXFP8Config
from sglang_m3.models.checkpoint_layout import CheckpointError, quantized_format, refuse_quantized_tensor
from sglang_m3.quant.mxfp8 import (
    WEIGHT_DTYPE,
    MXFP8FormatError,
    decode_scales,
    dequantize,
    nan_elements,
    scale_bytes,
    scale_shape,
)

SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
#: module names (checkpoint spelling, ``model.`` or ``language_model.model.``) that SGLang's M3
#: builds as quantizable linears. Anchored at the text model's ``model.layers``: the vision tower's
#: ``vision_model.encoder.layers.N.self_attn.q_proj`` (and MTP layers) have the same tails.
QUANTIZABLE = re.compile(
    r"(?:^|\.)model\.layers\.\d+\.(?:"
    r"self_attn\.(?:q|k|v|o|index_q|index_k)_proj"
    r"|mlp\.(?:gate|up|down)_proj"
    r"|block_sparse_moe\.(?:(?:shared_experts\.)?(?:gate|up|down)_proj|experts\.\d+\.w[123])"
    r")$"
)
#: why the vision tower takes no MXFP8 tensor (error messages)
_VISION_UNQUANTIZED = "SGLang builds the vision tower unquantized, and no scale of it is ever read"
#: a routed expert's module (checkpoint spelling, any prefix); group 1 is the layer number
ROUTED_EXPERT = re.compile(r"(?:^|\.)layers\.(\d+)\.block_sparse_moe\.experts\.\d+\.w[123]$")


def held_past_the_reader(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as it may be kept while the weight reader moves on (one half of a weight/scale
    pair waits for the other, which may come from the next shard): a copy where it lies in device
    memory, because SGLang's fastsafetensors reader frees a shard's device buffer once it has
    yielded that shard's tensors; host tensors map their file and stay valid as they are."""
    return tensor.clone() if tensor.is_cuda else tensor


@dataclass(frozen=True)
class MXFP8Weight:
    """A checkpoint weight kept quantized: e4m3 ``elements [N, K]`` and uint8 e8m0 ``scales [N, K/32]``."""

    elements: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        """The weight's shape (the loader's shape check reads it as for a plain tensor)."""
        return self.elements.shape


class MXFP8Dequantizer:
    """Pairs an MXFP8 checkpoint's weights with their scales and hands out plain fp32 weights."""

    def __init__(self, config: MXFP8Config, keeps_quantized: Callable[[str], bool] = lambda module: False):
        self.config = config
        #: whether a checkpoint module's pair passes through as an :class:`MXFP8Weight`
        self.keeps_quantized = keeps_quantized
        self.waiting_weights: dict[str, tuple[str, torch.Tensor]] = {}
        self.waiting_scales: dict[str, tuple[str, torch.Tensor]] = {}
        #: modules whose weight already went through unquantized, with its dtype (names only)
        self.plain: dict[str, torch.dtype] = {}
        self.dequantized = 0
        self.kept_quantized = 0
        #: of ``kept_quantized``, the routed experts' pairs
        self.kept_experts = 0

    def push(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """The plain ``(name, tensor)`` to load now, or None while a pair's other half is due."""
        scale_suffix = next((s for s in SCALE_SUFFIXES if name.endswith(s)), None)
        if scale_suffix is not None:
            module = name[: -len(scale_suffix)]
            self._check_quantizable(module, name)
            if module in self.waiting_weights:
                return self._pair(module, *self.waiting_weights.pop(module), name, tensor)
            if module in self.plain:
                self._refuse_plain(f"{module}.weight", self.plain[module], name)
            self._check_unique(module, name, self.waiting_scales)
            self.waiting_scales[module] = (name, held_past_the_reader(tensor))
            return None
        fmt = quantized_format(name)
        if fmt is not None:
            raise CheckpointError(f"checkpoint tensor '{name}' ({fmt}) is not part of an MXFP8 checkpoint")
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if tensor.dtype == WEIGHT_DTYPE and module is not None:
            self._check_quantizable(module, name)
            if module in self.waiting_scales:
                return self._pair(module, name, tensor, *self.waiting_scales.pop(module))
            self._check_unique(module, name, self.waiting_weights)
            self.waiting_weights[module] = (name, held_past_the_reader(tensor))
            return None
        if tensor.dtype.is_floating_point and tensor.element_size() == 1:
            raise CheckpointError(
                f"checkpoint tensor '{name}' is {tensor.dtype}: only MXFP8 linear weights "
                "(float8_e4m3fn with a scale) are 8-bit in an MXFP8 checkpoint"
            )
        if module is not None and module in self.waiting_scales:
            self._refuse_plain(name, tensor.dtype, self.waiting_scales[module][0])
        if module is not None and QUANTIZABLE.search(module):
            self._refuse_plain_into_mxfp8(module, name, tensor.dtype)
            self.plain[module] = tensor.dtype
        return name, tensor

    def _refuse_plain_into_mxfp8(self, module: str, name: str, dtype: torch.dtype) -> None:
        """A 16/32-bit weight for a module whose parameters are MXFP8 (``keeps_quantized``: CUDA)
        is refused: copied in, its values would be cast to e4m3 with the scales never loaded, a
        silently wrong layer. Dequantizing modules (the CPU) take a plain weight as it is."""
        if self.keeps_quantized(module):
            raise CheckpointError(
                f"checkpoint tensor '{name}' is {dtype}, but '{module}' is served as MXFP8 (it is not in "
                f"'{self.config.ignore_field}'): store it as float8_e4m3fn with its "
                "'weight_scale_inv', or list the module as unquantized"
            )

    @staticmethod
    def _refuse_plain(name: str, dtype: torch.dtype, scale_name: str) -> None:
        raise CheckpointError(
            f"checkpoint tensor '{name}' is {dtype}, but its module has the MXFP8 scale "
            f"'{scale_name}': a quantized weight must be float8_e4m3fn"
        )

    def finish(self) -> None:
        """Refuse the halves whose partner never came."""
        if self.waiting_weights:
            module, (name, _) = sorted(self.waiting_weights.items())[0]
            raise CheckpointError(
                f"checkpoint tensor '{name}' is float8_e4m3fn but its scale '{module}.weight_scale_inv' "
                f"is missing ({len(self.waiting_weights)} FP8 weight(s) without a scale)"
            )
        if self.waiting_scales:
            module, (name, _) = sorted(self.waiting_scales.items())[0]
            raise CheckpointError(
                f"checkpoint tensor '{name}' is an MXFP8 scale but its weight '{module}.weight' is "
                f"missing ({len(self.waiting_scales)} scale(s) without a weight)"
            )

    def _check_quantizable(self, module: str, name: str) -> None:
        if not QUANTIZABLE.search(module):
            raise CheckpointError(
                f"checkpoint tensor '{name}' quantizes '{module}', which stays BF16 in an MXFP8 M3 "
                "checkpoint (SGLang builds it unquantized: router gate, norms, routing bias, "
                "embeddings, lm_head, vision tower)"
            )
        entry = self.config.ignoring_entry(module)
        if entry is not None:
            raise CheckpointError(
                f"checkpoint tensor '{name}' quantizes '{module}', which config field "
                f"'{self.config.ignore_field}' lists as unquantized (entry {entry!r})"
            )

    @staticmethod
    def _check_unique(module: str, name: str, waiting: dict) -> None:
        if module in waiting:
            raise CheckpointError(f"checkpoint tensor '{name}' arrives twice for module '{module}' ({waiting[module][0]})")

    def _pair(self, module: str, weight_name: str, weight: torch.Tensor, scale_name: str, scale: torch.Tensor):
        what = f"checkpoint tensor '{weight_name}'"
        refuse_nan_elements(weight_name, weight)
        try:
            # float8_e8m0fnu scales become their uint8 bytes here, so a kept pair copies bytes
            # into SGLang's uint8 scale parameter rather than casting values into it.
            scale = scale_bytes(scale)
            if self.keeps_quantized(module):
                self.kept_experts += ROUTED_EXPERT.search(module) is not None
                return weight_name, self._checked_pair(weight, scale, what)
            values = dequantize(weight, scale, torch.float32, what=what)
        except MXFP8FormatError as error:
            raise CheckpointError(f"{error} (scale tensor '{scale_name}')") from None
        self.dequantized += 1
        return weight_name, values

    def _checked_pair(self, weight: torch.Tensor, scale: torch.Tensor, what: str) -> MXFP8Weight:
        """The pair as is, after the checks ``dequantize`` makes (scale shape, no NaN byte)."""
        expected = scale_shape(tuple(weight.shape), what)
        if tuple(scale.shape) != expected:
            raise MXFP8FormatError(
                f"{what}: scale shape {tuple(scale.shape)} does not match weight shape {tuple(weight.shape)} "
                f"(expected {expected}: one scale per 32 input elements)"
            )
        decode_scales(scale)
        self.kept_quantized += 1
        return MXFP8Weight(weight, scale)


def refuse_nan_elements(name: str, weight: torch.Tensor) -> None:
    """Refuses checkpoint weight ``name`` (float8_e4m3fn) if any element is NaN (bytes 0x7F/0xFF):
    nothing downstream looks, so it would load silently, as NaN values when dequantized and as
    NaN bytes the MXFP8 kernels read when kept. Checked once per pair, on both paths."""
    count, first = nan_elements(weight)
    if count:
        raise CheckpointError(
            f"checkpoint tensor '{name}' has {count} NaN element(s) of {weight.numel()} "
            f"(float8_e4m3fn bytes 0x7F/0xFF), first at {first}: the checkpoint is corrupt"
        )


def checked_vision_tensors(
    weights: Iterable[tuple[str, torch.Tensor]], config: MXFP8Config | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The vision tower's checkpoint tensors, each refused as it passes if quantized (:class:`VisionTensorCheck`)."""
    check = VisionTensorCheck(config)
    for name, tensor in weights:
        check.refuse_quantized(name, tensor)
        yield name, tensor


class VisionTensorCheck:
    """Refuses quantized tensors of the vision tower as the text loader refuses them for a module
    built unquantized. The tower is plain torch modules (SGLang builds it with ``quant_config=None``)
    and its loader copies a tensor cast to the parameter's dtype, so an e4m3 weight would load as its
    unscaled element values.

    Without a ``quantization_config`` the text model's refusal applies (``refuse_quantized_tensor``).
    In an MXFP8 checkpoint a vision scale is refused as the router gate's is, and any 8-bit tensor
    at once, naming the ignore-list entry when one lists its module: no scale of the tower is ever
    read, so even a weight whose scale would follow could only load wrong.
    """

    def __init__(self, config: MXFP8Config | None):
        self.config = config

    def refuse_quantized(self, name: str, tensor: torch.Tensor) -> None:
        """Raises for a quantized tensor ``name``; a plain one goes on to the tower as it is."""
        if self.config is None:
            refuse_quantized_tensor(name, tensor)
            return
        self._refuse_quantized_name(name)
        if tensor.dtype.is_floating_point and tensor.element_size() == 1:
            self._refuse_8bit(name, name.removesuffix(".weight"), tensor.dtype)

    @staticmethod
    def _refuse_quantized_name(name: str) -> None:
        """A scale, or a tensor name only quantized formats have."""
        scale_suffix = next((s for s in SCALE_SUFFIXES if name.endswith(s)), None)
        if scale_suffix is not None:
            raise CheckpointError(
                f"checkpoint tensor '{name}' quantizes '{name[: -len(scale_suffix)]}', which stays BF16 in an MXFP8 "
                f"M3 checkpoint ({_VISION_UNQUANTIZED})"
            )
        fmt = quantized_format(name)
        if fmt is not None:
            raise CheckpointError(f"checkpoint tensor '{name}' ({fmt}) is not part of an MXFP8 checkpoint")

    def _refuse_8bit(self, name: str, module: str, dtype: torch.dtype) -> None:
        entry = self.config.ignoring_entry(module)
        if entry is not None:
            raise CheckpointError(
                f"checkpoint tensor '{name}' is {dtype}, but config field '{self.config.ignore_field}' "
                f"lists '{module}' as unquantized (entry {entry!r}): store it in bf16, fp16 or fp32"
            )
        if dtype == WEIGHT_DTYPE and name.endswith(".weight"):
            raise CheckpointError(
                f"checkpoint tensor '{name}' is float8_e4m3fn, but the vision tower stays BF16 in an MXFP8 M3 "
                f"checkpoint ({_VISION_UNQUANTIZED}, '{module}.weight_scale_inv' included): its values would load "
                "unscaled. Store it in bf16, fp16 or fp32"
            )
        raise CheckpointError(
            f"checkpoint tensor '{name}' is {dtype}: only MXFP8 linear weights (float8_e4m3fn with a scale) "
            "are 8-bit in an MXFP8 checkpoint, and the vision tower has none"
        )
