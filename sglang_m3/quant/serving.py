"""How SGLang serves an MXFP8 M3 checkpoint through this plugin: plain layers, dequantized at load.

SGLang builds a quantization config from ``config.json``'s ``quantization_config`` (its
``Fp8Config`` with ``use_mxfp8``) and hands it to the model, whose linears would then hold e4m3
weights for MX-scaled GEMMs that exist on Blackwell only (``get_min_capability`` 100) and not at
all on the CPU. For the M3 architectures this hook returns no quantization config instead: the
model builds ordinary layers in the serving dtype and ``TextWeightLoader`` turns each weight/scale
pair into plain values (``sglang_m3.quant.loading``). The one native path, the routed experts
kept in MXFP8 on CUDA, needs no SGLang quantization config either: the project's own MoE block
(``sglang_m3.models.mxfp8_moe``) holds them and the loader passes their pairs through.
"""

from __future__ import annotations

import logging

from sglang_m3.integration.hooks import M3_ARCHITECTURES

logger = logging.getLogger(__name__)


def dequantize_mxfp8_at_load(original, model_config, load_config):
    """AROUND ``sglang.srt.model_loader.loader._get_quantization_config``."""
    architecture = (getattr(model_config.hf_config, "architectures", None) or [None])[0]
    if architecture in M3_ARCHITECTURES and model_config.quantization == "mxfp8":
        logger.info("MXFP8 checkpoint: building unquantized layers, weights dequantized at load")
        return None
    return original(model_config, load_config)
