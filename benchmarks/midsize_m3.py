"""A mid-size MiniMax M3 for one-GPU serving benchmarks: real widths, few layers, no weights.

The full model (60 layers, 427 B parameters) does not fit one GPU, but what a serving comparison
measures per layer (attention over the real head counts and MSA settings, the MoE over 128 real-size
experts, the 200K-entry vocabulary) only needs the real widths. This writes the shipped text
settings (``sglang_m3/recipe/data/m3_config.json``) with the layer count cut to a few dense and
sparse layers, in the flat text-only layout that both the project's reader and upstream SGLang's
M3 classes read. Weights come from ``--load-format dummy`` (random), so no tokenizer or tensors
are written: clients send token ids (``--skip-tokenizer-init``).

``write_midsize_vl_checkpoint`` writes the same text model inside the shipped VL wrapper (the real
vision tower's settings) with the tiny tokenizer, M3's chat template and the processor files: what a
server started with a recipe's rendered arguments (``--enable-multimodal``, the M3 parsers, chat
completions) needs. ``mxfp8_quantization_config`` gives either checkpoint the published MXFP8
``quantization_config``, its ignore list taken from the project's own model built on the meta device.
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
    config = _cut_layers(shipped_text_config(), dense_layers, sparse_layers)
    del config["model_type"], config["num_mtp_modules"]
    config["architectures"] = [TEXT_ONLY_ARCHITECTURE]
    config["model_type"] = TEXT_ONLY_MODEL_TYPE
    config["torch_dtype"] = "bfloat16"
    return config


def _cut_layers(text: dict, dense_layers: int, sparse_layers: int) -> dict:
    """A copy of the shipped ``text`` settings keeping ``dense_layers`` dense and ``sparse_layers``
    sparse layers (every per-layer list cut with them) and no MTP module."""
    if dense_layers < 0 or sparse_layers < 1:
        raise ValueError(f"need at least one sparse layer and no negative counts, got {dense_layers} dense, {sparse_layers} sparse")
    real_dense = text["moe_layer_freq"].index(1)
    if dense_layers > real_dense:
        raise ValueError(f"the real model has {real_dense} dense layers, asked for {dense_layers}")
    keep = list(range(dense_layers)) + list(range(real_dense, real_dense + sparse_layers))
    config = dict(text)
    config["num_hidden_layers"] = dense_layers + sparse_layers
    config["num_mtp_modules"] = 0
    config["num_nextn_predict_layers"] = 0
    for key in _PER_LAYER_LISTS:
        config[key] = [text[key][i] for i in keep]
    sparse = dict(text["sparse_attention_config"])
    for key in _PER_LAYER_SPARSE_LISTS:
        sparse[key] = [sparse[key][i] for i in keep]
    config["sparse_attention_config"] = sparse
    return config


def write_midsize_checkpoint(directory: str, dense_layers: int = 1, sparse_layers: int = 3) -> str:
    """``directory/config.json`` of the mid-size model (serve it with ``--load-format dummy``)."""
    os.makedirs(directory, exist_ok=True)
    config = midsize_text_config(dense_layers, sparse_layers)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2)
    return directory


def write_midsize_vl_checkpoint(directory: str, dense_layers: int = 1, sparse_layers: int = 3) -> str:
    """``directory`` as a VL checkpoint without tensors (serve it with ``--load-format dummy``).

    The shipped ``config.json`` with its text model cut to the mid-size layers and the real vision
    settings; the tiny tokenizer (its ids fit in the 200K vocabulary) with M3's chat template, its
    special ids written into the config as the real checkpoint carries its own; the processor files
    the real checkpoint ships, which the multimodal server loads at start-up.
    """
    from sglang_m3.parsers import chat_template_path
    from sglang_m3.tiny.checkpoint import save_processor
    from sglang_m3.tiny.tokenizer import BOS, EOS, IMAGE_TOKEN, VIDEO_TOKEN, build_tokenizer, save_tokenizer

    os.makedirs(directory, exist_ok=True)
    top = json.loads(files("sglang_m3.recipe.data").joinpath("m3_config.json").read_text())
    text = _cut_layers(top["text_config"], dense_layers, sparse_layers)
    with open(chat_template_path(), encoding="utf-8") as handle:
        template = handle.read()
    ids = save_tokenizer(directory, build_tokenizer(), template, text["max_position_embeddings"])
    text["bos_token_id"], text["eos_token_id"] = ids[BOS], ids[EOS]
    top.update(text_config=text, bos_token_id=ids[BOS], eos_token_id=ids[EOS],
               image_token_index=ids[IMAGE_TOKEN], video_token_index=ids[VIDEO_TOKEN])
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(top, handle, indent=2)
    save_processor(directory)
    return directory


def mxfp8_quantization_config(directory: str) -> dict:
    """The published MXFP8 ``quantization_config`` for the checkpoint in ``directory``: every linear
    the format keeps in BF16 (embeddings, lm head, routers, index projections, the vision tower), as
    ``sglang-m3 tiny-checkpoint --mxfp8`` derives it from tensor names and shapes, here from the
    project's model built on the meta device (the dummy checkpoint has no tensors to read)."""
    from sglang_m3.config.quantization import MXFP8Config
    from sglang_m3.inspect.report import inspect_config
    from sglang_m3.quant.checkpoint_writer import ignore_list

    tensors = inspect_config(directory, tensors=True)["tensors"]
    return MXFP8Config(ignored_modules=tuple(ignore_list(tensors.items()))).to_json()


def add_mxfp8_quantization_config(directory: str) -> str:
    """Rewrite ``directory/config.json`` as the MXFP8 form of the same checkpoint."""
    path = os.path.join(directory, "config.json")
    quantization = mxfp8_quantization_config(directory)
    with open(path, encoding="utf-8") as handle:
        config = json.load(handle)
    config["quantization_config"] = quantization
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2)
    return directory
