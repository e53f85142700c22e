"""Rewrite a BF16/fp32 M3 checkpoint directory as MXFP8 (or as its dequantized twin).

``mxfp8``: every linear SGLang's M3 builds as quantizable (``loading.QUANTIZABLE``) except the
index projections becomes ``X.weight`` (float8_e4m3fn) + ``X.weight_scale_inv`` (uint8 e8m0,
``[N, K/32]``), and ``config.json`` gains the ``quantization_config`` SGLang reads, whose ignore
list names every other linear (router gates, index projections, embeddings, lm_head, vision tower)
so that SGLang's own loader would build those unquantized too. The index branch stays BF16 as the
published checkpoint keeps it (NeMo AutoModel's M3 adapter lists the released MXFP8 keys:
attention q/k/v/o, dense MLP, shared and routed experts).

``mxfp8-dequantized``: the same tensors after quantize -> dequantize, in the original dtype, and
no ``quantization_config``: a plain checkpoint whose weights equal what the MXFP8 one loads as,
the reference for exactness tests.
"""

from __future__ import annotations

import json
import os

from sglang_m3.config.quantization import MXFP8Config
from sglang_m3.quant.loading import QUANTIZABLE
from sglang_m3.quant.mxfp8 import dequantize, quantize

MODES = ("mxfp8", "mxfp8-dequantized")
_TEXT_PREFIXES = ("language_model.", "model.", "lm_head")


def quantized_module(name: str) -> str | None:
    """The module whose weight ``name`` is quantized in the written checkpoint, else None."""
    if not name.endswith(".weight") or ".mtp." in name:
        return None
    module = name[: -len(".weight")]
    if not QUANTIZABLE.search(module) or ".index_" in module:
        return None
    return module


def ignore_list(names) -> list[str]:
    """Every unquantized linear (2-D weight) of the text model by module name; non-text modules
    (vision tower, projector) by their top-level name."""
    ignored = set()
    for name, shape in names:
        if len(shape) < 2 or not name.endswith(".weight") or ".mtp." in name or quantized_module(name):
            continue
        module = name[: -len(".weight")]
        ignored.add(module.removeprefix("language_model.") if name.startswith(_TEXT_PREFIXES) else module.split(".")[0])
    return sorted(ignored)


def rewrite_as_mxfp8(directory: str, mode: str) -> None:
    """Rewrite ``directory/model.safetensors`` (and config.json for ``mxfp8``) in place."""
    from safetensors.torch import load_file, save_file

    if mode not in MODES:
        raise ValueError(f"MXFP8 mode must be one of {', '.join(MODES)}, got {mode!r}")
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    written = {}
    for name, tensor in tensors.items():
        module = quantized_module(name)
        if module is None:
            written[name] = tensor
            continue
        elements, scales = quantize(tensor, what=f"checkpoint tensor '{name}'")
        if mode == "mxfp8":
            written[name], written[module + ".weight_scale_inv"] = elements, scales
        else:
            written[name] = dequantize(elements, scales, tensor.dtype, what=name)
    save_file(written, path, metadata={"format": "pt"})
    if mode == "mxfp8":
        config_path = os.path.join(directory, "config.json")
        with open(config_path, encoding="utf-8") as handle:
            config = json.load(handle)
        ignored = ignore_list((name, tuple(t.shape)) for name, t in tensors.items())
        config["quantization_config"] = MXFP8Config(ignored_modules=tuple(ignored)).to_json()
        with open(config_path, "w", encoding="utf-8") as handle:
            json.dump(config, handle, indent=2)
