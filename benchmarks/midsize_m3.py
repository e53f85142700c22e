"""A mid-size MiniMax M3 for one-GPU serving benchmarks: real widths, few layers, no weights.

The full model (60 layers, 427 B parameters) does not fit one GPU, but what a serving comparison
measures per layer (attention over the real head counts and MSA settings, the MoE over 128 real-size
experts, the 200K-entry vocabulary) only needs the real widths. This writes the shipped text
settings (``sglang_m3/recipe/data/m3_config.json``) with the layer count cut to a few dense and
sparse layers, in the flat text-only layout that both the project's reader and upstream SGLang's
M3 classes read. Weights come from ``--load-format dummy`` (random), so no tokenizer or tensors
are written: clients send token ids (``--skip-tokenizer-init``).
"""

from __future__ import annotations

import json
import os
from importlib.resources import files

#: Upstream SGLang's own M3 takes a text-only checkpoint as this architecture; transformers has no
#: text-only M3 config class, so the file names the MiniMax-M2 config class, whose unknown keys
#: (the sparse-attention settings) stay attributes.
TEXT_ONLY_ARCHITECTURE = "MiniMaxM3SparseForCausalLM"
TEXT_ONLY_MODEL_TYPE = "minimax_m2"

_PER_LAYER_LISTS = ("moe_layer_freq",)
_PER_LAYER_SPARSE_LISTS = ("sparse_attention_freq", "sparse_disable_index_value")


def shipped_text_config() -> dict:
    shipped = json.loads(files("sglang_m3.recipe.data").joinpath("m3_config.json").read_text())
    return shipped["text_config"]


def midsize_text_config(dense_layers: int = 1, sparse_layers: int = 3) -> dict:
    """The shipped text settings with ``dense_layers`` dense + ``sparse_layers`` MoE/MSA layers.

    The real model's first layers are dense (dense attention and MLP) and the rest sparse (MSA and
    MoE); the cut keeps that order, and every per-layer list is cut with it.
    """
    if dense_layers < 0 or sparse_layers < 1:
        raise ValueError(f"need at least one sparse layer and no negative counts, got {dense_layers} dense, {sparse_layers} sparse")
    text = shipped_text_config()
    real_dense = text["moe_layer_freq"].index(1)
    if dense_layers > real_dense:
        raise ValueError(f"the real model has {real_dense} dense layers, asked for {dense_layers}")
    layers = dense_layers + sparse_layers
    keep = list(range(dense_layers)) + list(range(real_dense, real_dense + sparse_layers))
    config = {key: value for key, value in text.items() if key not in ("model_type", "num_mtp_modules")}
    config["num_hidden_layers"] = layers
    config["num_nextn_predict_layers"] = 0
    for key in _PER_LAYER_LISTS:
        config[key] = [text[key][i] for i in keep]
    sparse = dict(text["sparse_attention_config"])
    for key in _PER_LAYER_SPARSE_LISTS:
        sparse[key] = [sparse[key][i] for i in keep]
    config["sparse_attention_config"] = sparse
    config["architectures"] = [TEXT_ONLY_ARCHITECTURE]
    config["model_type"] = TEXT_ONLY_MODEL_TYPE
    config["torch_dtype"] = "bfloat16"
    return config


def write_midsize_checkpoint(directory: str, dense_layers: int = 1, sparse_layers: int = 3) -> str:
    """``directory/config.json`` of the mid-size model (serve it with ``--load-format dummy``)."""
    os.makedirs(directory, exist_ok=True)
    config = midsize_text_config(dense_layers, sparse_layers)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2)
    return directory
