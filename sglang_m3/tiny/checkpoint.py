"""Builds the tiny random-weight M3 checkpoint (text-only or VL) in one of two config layouts.

The weights are created by instantiating transformers' own M3 classes from a small config and
saving them with ``save_pretrained``, so tensor names are exactly what transformers writes for a
real checkpoint; values are then re-drawn from a seeded generator at scales that keep activations
O(1) (transformers' 0.02 init would make every logit nearly equal and greedy decoding a coin toss).
The geometry is chosen so MSA's selection is non-trivial on prompts of a few hundred tokens:
block size 16 and top-4 blocks on 3 sparse layers. The vision tower's sizes (hidden, intermediate,
heads, layers) all differ from the text model's and from transformers' defaults, so a size read
from the wrong sub-config fails to load instead of passing unnoticed.

Layouts of ``config.json`` (both a VL wrapper with ``text_config``, M3_FACTS s.1):

* ``shipped`` (default): the form of the real checkpoint's file: ``moe_layer_freq`` per layer,
  nested ``sparse_attention_config``, top-level ``rope_theta``, ``rotary_dim`` and
  ``partial_rotary_factor``, ``hidden_act`` "swigluoai" with its constants, the qk-norm, Gemma
  norm, routing and MTP fields, and a ``clip_vision_model`` vision config; no ``layer_types``,
  ``mlp_layer_types``, ``index_*`` or ``rope_parameters``.
* ``hf``: the file exactly as transformers' ``save_pretrained`` writes it (flat ``layer_types``,
  ``mlp_layer_types``, ``index_*``, ``rope_parameters``, ``hidden_act`` rewritten to "silu").

transformers reads both layouts into the same model (it maps the shipped spellings onto its flat
fields), so its ``from_pretrained`` of either checkpoint is the reference for the same weights.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass

import torch

from sglang_m3.parsers import chat_template_path
from sglang_m3.tiny.output_dir import apply_umask, move_into_place, prepare_output
from sglang_m3.tiny.tokenizer import BOS, EOS, IMAGE_TOKEN, VIDEO_TOKEN, build_tokenizer, save_tokenizer

TEXT_ARCH = "MiniMaxM3SparseForCausalLM"
VL_ARCH = "MiniMaxM3SparseForConditionalGeneration"
MAX_POSITIONS = 4096
#: Bumped whenever the builder writes a different checkpoint for the same seed (layout, sizes,
#: weights), so caches keyed on it (``sglang-m3 serve``'s) never reuse an older build.
BUILD_FORMAT = 2
LAYOUTS = ("shipped", "hf")
#: ``text_config.model_type`` of the shipped file (SGLang's VL config code names M3's text model
#: type ``minimax_m2``; transformers ignores the sub-config's model_type when it loads a VL config).
SHIPPED_TEXT_MODEL_TYPE = "minimax_m2"
SHIPPED_VISION_MODEL_TYPE = "clip_vision_model"
ROPE_THETA = 5_000_000.0
VISION_ROPE_THETA = 10_000.0


@dataclass(frozen=True)
class TinyGeometry:
    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    rotary_dim: int = 16
    dense_intermediate: int = 128
    moe_intermediate: int = 64
    shared_intermediate: int = 64
    num_experts: int = 8
    experts_per_token: int = 2
    index_head_dim: int = 32
    block_size: int = 16
    topk_blocks: int = 4
    local_blocks: int = 1
    dense_layers: int = 1


@dataclass(frozen=True)
class TinyVisionGeometry:
    """Every size unlike the text model's (128 hidden, 8 heads, 4 layers, 64/64/128 MLPs) and
    unlike transformers' vision defaults (1280, 16, 32, 5120)."""

    hidden_size: int = 48
    intermediate_size: int = 80
    num_layers: int = 3
    num_heads: int = 3


def _sparse_flags(g: TinyGeometry) -> list[bool]:
    return [i >= g.dense_layers for i in range(g.num_layers)]


def _sizes(g: TinyGeometry) -> dict:
    """The size fields both layouts spell alike."""
    return {
        "vocab_size": g.vocab_size,
        "hidden_size": g.hidden_size,
        "intermediate_size": g.moe_intermediate,
        "dense_intermediate_size": g.dense_intermediate,
        "shared_intermediate_size": g.shared_intermediate,
        "num_hidden_layers": g.num_layers,
        "num_attention_heads": g.num_heads,
        "num_key_value_heads": g.num_kv_heads,
        "head_dim": g.head_dim,
    }


def text_config_flat(g: TinyGeometry, special_ids: dict[str, int]) -> dict:
    """The text settings in transformers' flat form (what its config class takes)."""
    sparse = _sparse_flags(g)
    return {
        **_sizes(g),
        "rotary_dim": g.rotary_dim,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA, "partial_rotary_factor": g.rotary_dim / g.head_dim},
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "num_local_experts": g.num_experts,
        "num_experts_per_tok": g.experts_per_token,
        "routed_scaling_factor": 2.0,
        "index_n_heads": g.num_kv_heads,
        "index_head_dim": g.index_head_dim,
        "index_block_size": g.block_size,
        "index_topk_blocks": g.topk_blocks,
        "index_local_blocks": g.local_blocks,
        "layer_types": ["minimax_m3_sparse" if s else "full_attention" for s in sparse],
        "mlp_layer_types": ["sparse" if s else "dense" for s in sparse],
        "bos_token_id": special_ids[BOS],
        "eos_token_id": special_ids[EOS],
        "tie_word_embeddings": False,
    }


def text_config_shipped(g: TinyGeometry, special_ids: dict[str, int], mtp_modules: int = 0) -> dict:
    """The text settings in the form of the real checkpoint's ``text_config`` (M3_FACTS s.1)."""
    freq = [int(s) for s in _sparse_flags(g)]
    if g.shared_intermediate != g.moe_intermediate:
        raise ValueError("the shipped form has one shared expert as wide as a routed one (n_shared_experts 1)")
    return {
        "model_type": SHIPPED_TEXT_MODEL_TYPE,
        **_sizes(g),
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_theta": ROPE_THETA,
        "rotary_dim": g.rotary_dim,
        "partial_rotary_factor": g.rotary_dim / g.head_dim,
        "use_qk_norm": True,
        "qk_norm_type": "per_head",
        "use_gemma_norm": True,
        "tie_word_embeddings": False,
        "num_local_experts": g.num_experts,
        "num_experts_per_tok": g.experts_per_token,
        "n_shared_experts": 1,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "routed_scaling_factor": 2.0,
        "moe_layer_freq": freq,
        "hidden_act": "swigluoai",
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "swiglu_beta": 1.0,
        "num_mtp_modules": mtp_modules,
        "num_nextn_predict_layers": 1 if mtp_modules else 0,
        "sparse_attention_config": {
            "use_sparse_attention": True,
            "sparse_index_dim": g.index_head_dim,
            "sparse_num_index_heads": g.num_kv_heads,
            "sparse_topk_blocks": g.topk_blocks,
            "sparse_block_size": g.block_size,
            "sparse_score_type": "max",
            "sparse_init_block": 0,
            "sparse_local_block": g.local_blocks,
            "sparse_attention_freq": freq,
            "sparse_disable_index_value": freq,
        },
        "bos_token_id": special_ids[BOS],
        "eos_token_id": special_ids[EOS],
    }


def vision_config(v: TinyVisionGeometry) -> dict:
    """The vision settings transformers' config class takes."""
    return {
        "hidden_size": v.hidden_size,
        "intermediate_size": v.intermediate_size,
        "num_hidden_layers": v.num_layers,
        "num_attention_heads": v.num_heads,
        "rope_parameters": {"rope_type": "axial", "rope_theta": VISION_ROPE_THETA},
    }


def vision_config_shipped(v: TinyVisionGeometry, text_hidden: int) -> dict:
    """The vision settings in the shipped file's form (``clip_vision_model``, top-level RoPE theta)."""
    sizes = {k: val for k, val in vision_config(v).items() if k != "rope_parameters"}
    return {
        "model_type": SHIPPED_VISION_MODEL_TYPE,
        **sizes,
        "num_channels": 3,
        "patch_size": 14,
        "image_size": 2016,
        "projection_dim": text_hidden,
        "rope_theta": VISION_ROPE_THETA,
        "hidden_act": "gelu",
        "layer_norm_eps": 1e-5,
    }


def redraw_weights(model: torch.nn.Module, seed: int) -> None:
    """Seeded values for every tensor, at scales that keep activations and logits spread."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in sorted(list(model.named_parameters()) + list(model.named_buffers())):
            if not tensor.is_floating_point() or "inv_freq" in name:
                continue
            if "norm" in name or "layrnorm" in name:
                values = torch.empty(tensor.shape).uniform_(-0.3, 0.3, generator=generator)
                if name.endswith("weight") and ("layer_norm" in name or "layrnorm" in name):
                    values += 1.0  # LayerNorm (vision) scales by w, not 1 + w
            elif "e_score_correction_bias" in name:
                values = torch.randn(tensor.shape, generator=generator) * 0.1
            elif "embed_tokens" in name:
                values = torch.randn(tensor.shape, generator=generator)
            elif tensor.dim() == 1:
                values = torch.randn(tensor.shape, generator=generator) * 0.02
            else:
                # 1/sqrt(last dim): the input width of every linear and stacked expert weight
                # (the 5-D vision patch kernel gets its patch width, a larger but harmless scale).
                values = torch.randn(tensor.shape, generator=generator) / math.sqrt(tensor.shape[-1])
            tensor.copy_(values.to(tensor.dtype))


def build_tiny_checkpoint(
    directory: str, seed: int = 0, vision: bool = False, layout: str = "shipped", mtp_modules: int = 0,
    quantization: str | None = None,
) -> str:
    """Write the checkpoint into ``directory`` (created; must be empty or absent). Returns it.

    ``layout`` picks the config.json form ("shipped" or "hf", see the module docstring); the
    tensors are the same for both. ``mtp_modules`` > 0 (shipped layout only) adds that many
    multi-token-prediction modules under ``model.mtp.layers.{i}.`` (tensors no reference model
    reads; a server must skip them). Built in a temporary sibling and renamed into place, so an
    interrupted build leaves nothing half-written under ``directory``. ``quantization``
    "mxfp8" writes the same weights in the published MXFP8 format, "mxfp8-dequantized" its plain
    twin (the weights after quantize -> dequantize); see ``sglang_m3.quant.checkpoint_writer``.
    Every quantized input width of the tiny geometry (128 hidden, 256 attention, 128/64/64 MLPs)
    is a multiple of the MXFP8 block (32).
    """
    from transformers.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if mtp_modules and layout != "shipped":
        raise ValueError("MTP modules are part of the shipped layout only (transformers writes none)")
    parent = prepare_output(directory)
    staging = tempfile.mkdtemp(prefix=".tiny-m3-", dir=parent)
    try:
        geometry, vision_geometry = TinyGeometry(), TinyVisionGeometry()
        tokenizer = build_tokenizer(geometry.vocab_size)
        with open(chat_template_path(), encoding="utf-8") as handle:
            template = handle.read()
        special_ids = save_tokenizer(staging, tokenizer, template, MAX_POSITIONS)
        torch.manual_seed(seed)
        config = MiniMaxM3VLConfig(
            text_config=text_config_flat(geometry, special_ids), vision_config=vision_config(vision_geometry),
            projector_hidden_size=geometry.hidden_size,
            image_token_index=special_ids[IMAGE_TOKEN], video_token_index=special_ids[VIDEO_TOKEN],
        )
        model = MiniMaxM3SparseForConditionalGeneration(config)
        redraw_weights(model, seed)
        model.save_pretrained(staging)
        _rewrite_tensors(staging, vision, geometry, mtp_modules, seed)
        _write_config(staging, layout, vision, geometry, vision_geometry, special_ids, mtp_modules)
        if quantization is not None:
            from sglang_m3.quant.checkpoint_writer import rewrite_as_mxfp8

            rewrite_as_mxfp8(staging, quantization)
        if vision:
            save_processor(staging)
        apply_umask(staging)
        move_into_place(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def _rewrite_tensors(directory: str, vision: bool, g: TinyGeometry, mtp_modules: int, seed: int) -> None:
    """Text-only: the VL layout (``language_model.`` names) without the vision tensors. MTP
    modules, when asked for, are appended under the shipped checkpoint's ``model.mtp.`` names."""
    if vision and not mtp_modules:
        return
    from safetensors.torch import load_file, save_file

    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    if not vision:
        tensors = {name: t for name, t in tensors.items() if name.startswith("language_model.")}
    tensors.update(mtp_tensors(g, mtp_modules, seed))
    save_file(tensors, path, metadata={"format": "pt"})


def mtp_tensors(g: TinyGeometry, count: int, seed: int) -> dict[str, torch.Tensor]:
    """``count`` MTP modules (an embedding/hidden merge and one attention block each), seeded.

    Only the ``model.mtp.layers.{i}.`` prefix is the shipped one (M3_FACTS s.1); the names under
    it are illustrative: no model here reads them, the point is that loaders skip them.
    """
    generator = torch.Generator().manual_seed(seed + 7919)
    q, kv = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
    shapes = {
        "enorm.weight": (g.hidden_size,),
        "hnorm.weight": (g.hidden_size,),
        "eh_proj.weight": (g.hidden_size, 2 * g.hidden_size),
        "self_attn.q_proj.weight": (q, g.hidden_size),
        "self_attn.k_proj.weight": (kv, g.hidden_size),
        "self_attn.v_proj.weight": (kv, g.hidden_size),
        "self_attn.o_proj.weight": (g.hidden_size, q),
        "final_layernorm.weight": (g.hidden_size,),
    }
    return {
        f"language_model.model.mtp.layers.{i}.{name}": torch.randn(shape, generator=generator) * 0.02
        for i in range(count)
        for name, shape in shapes.items()
    }


def _write_config(
    directory: str, layout: str, vision: bool, g: TinyGeometry, v: TinyVisionGeometry,
    special_ids: dict[str, int], mtp_modules: int,
) -> None:
    """Rewrite config.json into ``layout`` (both keep the VL wrapper with ``text_config``).

    A text-only checkpoint keeps that wrapper and names the text-only architecture, which is how
    the shipped checkpoint is served without its vision tower.
    """
    path = os.path.join(directory, "config.json")
    with open(path, encoding="utf-8") as handle:
        saved = json.load(handle)
    if layout == "shipped":
        saved["text_config"] = text_config_shipped(g, special_ids, mtp_modules)
        saved["vision_config"] = vision_config_shipped(v, g.hidden_size)
        saved.pop("merged_hidden_size", None)  # transformers' derived value, not in the shipped file
    saved["architectures"] = [VL_ARCH if vision else TEXT_ARCH]
    saved["bos_token_id"], saved["eos_token_id"] = special_ids[BOS], special_ids[EOS]
    if not vision:
        # SGLang's switch for multimodal-family checkpoints served as text only.
        saved["language_model_only"] = True
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(saved, handle, indent=2)


def save_processor(directory: str) -> None:
    """The image/video processor configs a real VL checkpoint ships (saved by transformers), plus
    the shipped checkpoint's own ``preprocessor_config.json``, for the VL checkpoint in ``directory``."""
    processor = transformers_processor(directory)
    processor.save_pretrained(directory)
    image = processor.image_processor
    # The shipped checkpoint's own preprocessor file, which SGLang's M3 processor loader reads.
    shipped_form = {
        "processor_class": "MiniMaxM3VLProcessor",
        "patch_size": image.patch_size,
        "img_token_compression_config": {"spatial_merge_size": image.merge_size, "temporal_patch_size": image.temporal_patch_size},
        "image_mean": list(image.image_mean),
        "image_std": list(image.image_std),
        "size": [672, 672],
    }
    with open(os.path.join(directory, "preprocessor_config.json"), "w", encoding="utf-8") as handle:
        json.dump(shipped_form, handle, indent=2)


def transformers_processor(directory: str):
    """transformers' M3 processor (tokenizer from ``directory``) patching as the checkpoint's
    ``vision_config`` says: patch, temporal patch and merge sizes as the model's tower reads them
    from its config.json (``VisionDims``, defaults included). Built from transformers' defaults
    alone, a tower with other patches (e.g. ``patch_size`` 8) got processor files of patch 14,
    which the server refuses at start-up."""
    from transformers import AutoTokenizer
    from transformers.models.minimax_m3_vl import MiniMaxM3VLImageProcessor, MiniMaxM3VLProcessor, MiniMaxM3VLVideoProcessor

    from sglang_m3.config import checkpoint_config
    from sglang_m3.models.vision import VisionDims

    dims = VisionDims.from_checkpoint_config(checkpoint_config(None, directory, overrides={}))
    geometry = {
        "patch_size": dims.patch_size,
        "temporal_patch_size": dims.temporal_patch_size,
        "merge_size": dims.spatial_merge_size,
    }
    return MiniMaxM3VLProcessor(
        image_processor=MiniMaxM3VLImageProcessor(**geometry),
        tokenizer=AutoTokenizer.from_pretrained(directory),
        video_processor=MiniMaxM3VLVideoProcessor(**geometry),
    )
