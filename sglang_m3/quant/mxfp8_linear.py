"""MXFP8 dense linears on CUDA: the checkpoint's e4m3 weights and e8m0 scales kept as stored.

Without this, every linear of an MXFP8 checkpoint other than the routed experts is dequantized
to BF16 at load (twice its bytes, about 1.3 GB per GPU for M3 at TP8). On CUDA, the quantization
hook (``sglang_m3.quant.serving``) hands SGLang :class:`M3Mxfp8LinearConfig` for bf16/fp16 models
(and fp32 ones: W8A32, fp32 activations throughout, for exactness runs), and every linear M3 builds
with a quantization config asks it for its method:

- MXFP8 (:class:`Mxfp8LinearMethod`, the W8A16 kernels of ``msa_kernels.triton_mxfp8_linear``)
  when the checkpoint stores all of the linear's parts quantized: attention q/k/v and o, the dense
  MLP and the shared experts' gate/up and down, unless the checkpoint's ignore list names one of
  them (a packed linear with any part listed stays BF16 and that checkpoint's pairs dequantize at
  load, as before);
- BF16 (SGLang's unquantized method) otherwise. The index projections, router, embeddings, lm head
  and vision tower are built without a quantization config and never ask; the routed experts are
  the MoE blocks' own (``sglang_m3.models.mxfp8_moe``); other layers (attention) get no method.

Tensor parallelism is SGLang's own, as for the BF16 linears: the weight ``[N, K]`` and its scale
``[N, K/32]`` are plain parameters with ``output_dim`` 0 and ``input_dim`` 1, so the column- and
QKV-parallel loaders cut and place rows (one scale row per weight row, so the same offsets) and
the row-parallel loader cuts the input dimension (``K/tp`` weight columns, ``K/tp/32`` scale
columns at ``rank * K/tp/32``), which needs ``K/tp`` to be a multiple of 32. The loader hands a
pair to a parameter of dtype float8 as it is (``TextWeightLoader``), so which linears are MXFP8 is
decided here once, at build.
"""

from __future__ import annotations

import torch
from msa_kernels.triton_mxfp8_linear import DOT_DTYPES, mxfp8_linear, ticket_count
from sglang.srt.layers.linear import LinearBase
from sglang.srt.layers.quantization.base_config import LinearMethodBase, QuantizationConfig
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
from sglang.srt.utils import set_weight_attrs
from torch.nn import Parameter

from sglang_m3.config import MXFP8Config
from sglang_m3.models.checkpoint_layout import checkpoint_modules
from sglang_m3.quant.loading import QUANTIZABLE
from sglang_m3.quant.mxfp8 import BIAS as UNIT_SCALE, BLOCK, SCALE_DTYPE, WEIGHT_DTYPE


class Mxfp8LinearMethod(LinearMethodBase):
    """A linear whose weight is e4m3 ``weight [N, K]`` with uint8 e8m0 ``weight_scale_inv [N, K/32]``."""

    def create_weights(
        self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype, **extra_weight_attrs
    ):
        if input_size_per_partition % BLOCK:
            raise ValueError(
                f"MXFP8 linear of input size {input_size} split over tensor-parallel ranks gives "
                f"{input_size_per_partition} per rank, not a multiple of the scale group ({BLOCK}); "
                "choose a smaller --tp-size"
            )
        rows = sum(output_partition_sizes)
        shapes = {"weight": (input_size_per_partition, WEIGHT_DTYPE), "weight_scale_inv": (input_size_per_partition // BLOCK, SCALE_DTYPE)}
        # Scales start at e8m0 127 (2^0), as the MXFP8 MoE block's do: SGLang's dummy loader fills
        # only floating-point parameters, and a --load-format dummy model multiplied by whatever
        # bytes the allocation held (255 is NaN). A real load overwrites them.
        fill = {"weight": None, "weight_scale_inv": UNIT_SCALE}
        for name, (cols, dtype) in shapes.items():
            data = torch.empty(rows, cols, dtype=dtype) if fill[name] is None else torch.full((rows, cols), fill[name], dtype=dtype)
            param = Parameter(data, requires_grad=False)
            set_weight_attrs(param, {"input_dim": 1, "output_dim": 0, "weight_loader": extra_weight_attrs["weight_loader"]})
            layer.register_parameter(name, param)
        # the split-K kernel's arrival counters: zeros between calls, so CUDA graphs replay them
        layer.register_buffer("mxfp8_tickets", torch.zeros(ticket_count(rows), dtype=torch.int32), persistent=False)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = mxfp8_linear(x, layer.weight, layer.weight_scale_inv, layer.mxfp8_tickets)
        return out if bias is None else out + bias


def holds_mxfp8(checkpoint: MXFP8Config, module: str) -> bool:
    """Whether the model's linear ``module`` keeps MXFP8 weights: every checkpoint module it holds is
    one M3 quantizes and none is on the checkpoint's ignore list."""
    parts = checkpoint_modules(module)
    return all(QUANTIZABLE.search(part) and not checkpoint.ignores(part) for part in parts)


class M3Mxfp8LinearConfig(QuantizationConfig):
    """SGLang's quantization config for an MXFP8 M3 checkpoint on CUDA (module docstring)."""

    #: model dtypes it serves: the activation dtypes ``mxfp8_linear`` takes
    ACT_DTYPES = tuple(DOT_DTYPES)

    def __init__(self, checkpoint: MXFP8Config):
        super().__init__()
        self.checkpoint = checkpoint

    def get_name(self) -> str:
        return "m3_mxfp8_w8a16"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return list(self.ACT_DTYPES)

    @classmethod
    def get_min_capability(cls) -> int:
        return 90  # wgmma (Hopper and later)

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict) -> "M3Mxfp8LinearConfig":
        from sglang_m3.config.quantization import FIELD, read_quantization

        return cls(read_quantization({FIELD: config}))

    def get_scaled_act_names(self) -> list[str]:
        return []

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if not isinstance(layer, LinearBase):
            return None
        return Mxfp8LinearMethod() if holds_mxfp8(self.checkpoint, prefix) else UnquantizedLinearMethod()
