"""How SGLang serves an MXFP8 M3 checkpoint through this plugin: the project's own layers.

SGLang builds a quantization config from ``config.json``'s ``quantization_config`` (its
``Fp8Config`` with ``use_mxfp8``) and hands it to the model, whose linears would then hold e4m3
weights for MX-scaled GEMMs that exist on Blackwell only (``get_min_capability`` 100) and not at
all on the CPU. For the M3 architectures this hook returns the project's config instead:

- on CUDA, for bf16/fp16/fp32 models, :class:`~sglang_m3.quant.mxfp8_linear.M3Mxfp8LinearConfig`:
  the dense linears the checkpoint stores in MXFP8 keep their bytes and run W8A16 kernels on
  Hopper (W8A32 for fp32 models: fp32 activations, the exactness runs against the dequantized twin);
- elsewhere (the CPU platform) none: the model builds ordinary layers in the serving dtype and
  ``TextWeightLoader`` turns each weight/scale pair into plain values (``sglang_m3.quant.loading``).

The routed experts need no SGLang config either way: on CUDA the project's own MoE block
(``sglang_m3.models.mxfp8_moe``) keeps them in MXFP8 and the loader passes their pairs through.
"""

from __future__ import annotations

import logging

import torch

from sglang_m3.config import M3TextSpec
from sglang_m3.integration.hooks import M3_ARCHITECTURES
from sglang_m3.quant.mxfp8_linear import M3Mxfp8LinearConfig

logger = logging.getLogger(__name__)


def m3_mxfp8_quantization(original, model_config, load_config):
    """AROUND ``sglang.srt.model_loader.loader._get_quantization_config``."""
    architecture = (getattr(model_config.hf_config, "architectures", None) or [None])[0]
    if architecture not in M3_ARCHITECTURES or model_config.quantization != "mxfp8":
        return original(model_config, load_config)
    from sglang.srt.platforms import current_platform

    on_cuda = current_platform.device_type == "cuda" and torch.cuda.is_available()
    if on_cuda and model_config.dtype in M3Mxfp8LinearConfig.ACT_DTYPES:
        hf_config = model_config.hf_config
        spec = M3TextSpec.from_config(hf_config, getattr(hf_config, "_name_or_path", None) or None)
        logger.info("MXFP8 checkpoint: dense linears kept in MXFP8 (%s activations); unquantized ones dequantized at load", model_config.dtype)
        return M3Mxfp8LinearConfig(spec.quantization)
    logger.info("MXFP8 checkpoint: building unquantized layers, weights dequantized at load")
    return None
