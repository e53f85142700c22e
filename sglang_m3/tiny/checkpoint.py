"""Builds the tiny random-weight M3 checkpoint (text-only or VL) in the original checkpoint layout.

The weights are created by instantiating transformers' own M3 classes from a small config and
saving them with ``save_pretrained``, so tensor names are exactly what transformers writes for a
real checkpoint; values are then re-drawn from a seeded generator at scales that keep activations
O(1) (transformers' 0.02 init would make every logit nearly equal and greedy decoding a coin toss).
The geometry is chosen so MSA's selection is non-trivial on prompts of a few hundred tokens:
block size 16 and top-4 blocks on 3 sparse layers.
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
from sglang_m3.tiny.tokenizer import BOS, EOS, IMAGE_TOKEN, VIDEO_TOKEN, build_tokenizer, save_tokenizer

TEXT_ARCH = "MiniMaxM3SparseForCausalLM"
VL_ARCH = "MiniMaxM3SparseForConditionalGeneration"
MAX_POSITIONS = 4096


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


def text_config_flat(g: TinyGeometry, special_ids: dict[str, int]) -> dict:
    sparse = [i >= g.dense_layers for i in range(g.num_layers)]
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
        "rotary_dim": g.rotary_dim,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": g.rotary_dim / g.head_dim},
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


def to_nested_sparse_form(text: dict) -> dict:
    """The same settings in the ``sparse_attention_config`` form of the shipped checkpoint."""
    text = dict(text)
    freq = [1 if t == "minimax_m3_sparse" else 0 for t in text.pop("layer_types")]
    text["sparse_attention_config"] = {
        "use_sparse_attention": True,
        "sparse_index_dim": text.pop("index_head_dim"),
        "sparse_num_index_heads": text.pop("index_n_heads"),
        "sparse_topk_blocks": text.pop("index_topk_blocks"),
        "sparse_block_size": text.pop("index_block_size"),
        "sparse_score_type": "max",
        "sparse_init_block": 0,
        "sparse_local_block": text.pop("index_local_blocks"),
        "sparse_attention_freq": freq,
        "sparse_disable_index_value": freq,
    }
    return text


def _redraw(model: torch.nn.Module, seed: int) -> None:
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


def _vision_config() -> dict:
    return {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2}


def build_tiny_checkpoint(directory: str, seed: int = 0, vision: bool = False, sparse_form: str = "flat") -> str:
    """Write the checkpoint into ``directory`` (created; must be empty or absent). Returns it.

    Built in a temporary sibling and renamed into place, so an interrupted build leaves nothing
    half-written under ``directory``.
    """
    from transformers.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig

    if sparse_form not in ("flat", "nested"):
        raise ValueError(f"sparse_form must be 'flat' or 'nested', got {sparse_form!r}")
    if os.path.exists(directory) and os.listdir(directory):
        raise FileExistsError(f"{directory} exists and is not empty")
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".tiny-m3-", dir=parent)
    try:
        geometry = TinyGeometry()
        tokenizer = build_tokenizer(geometry.vocab_size)
        with open(chat_template_path(), encoding="utf-8") as handle:
            template = handle.read()
        special_ids = save_tokenizer(staging, tokenizer, template, MAX_POSITIONS)
        text = text_config_flat(geometry, special_ids)
        torch.manual_seed(seed)
        config = MiniMaxM3VLConfig(
            text_config=text, vision_config=_vision_config(), projector_hidden_size=geometry.hidden_size,
            image_token_index=special_ids[IMAGE_TOKEN], video_token_index=special_ids[VIDEO_TOKEN],
        )
        model = MiniMaxM3SparseForConditionalGeneration(config)
        _redraw(model, seed)
        model.save_pretrained(staging)
        if not vision:
            _drop_vision_tensors(staging)
        _write_config(staging, text, vision, sparse_form, special_ids)
        if vision:
            _save_processor(staging)
        if os.path.exists(directory):
            _move_into(staging, directory)  # an empty directory the caller made
        else:
            os.replace(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def _drop_vision_tensors(directory: str) -> None:
    """Text-only checkpoint: the VL layout (``language_model.`` names) without the vision tensors."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    text_only = {name: t for name, t in tensors.items() if name.startswith("language_model.")}
    save_file(text_only, path, metadata={"format": "pt"})


def _write_config(directory: str, text: dict, vision: bool, sparse_form: str, special_ids: dict[str, int]) -> None:
    """Rewrite config.json in the layout of the shipped checkpoint (VL wrapper with ``text_config``).

    A text-only checkpoint keeps that layout and names the text-only architecture, which is how
    the shipped checkpoint is served without its vision tower.
    """
    path = os.path.join(directory, "config.json")
    with open(path, encoding="utf-8") as handle:
        saved = json.load(handle)
    text_out = to_nested_sparse_form(text) if sparse_form == "nested" else dict(text)
    text_out["model_type"] = "minimax_m3_vl_text"
    saved["text_config"] = text_out
    saved["architectures"] = [VL_ARCH if vision else TEXT_ARCH]
    saved["bos_token_id"], saved["eos_token_id"] = special_ids[BOS], special_ids[EOS]
    saved.pop("merged_hidden_size", None)
    if not vision:
        # SGLang's switch for multimodal-family checkpoints served as text only.
        saved["language_model_only"] = True
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(saved, handle, indent=2)


def _save_processor(directory: str) -> None:
    """The image/video processor configs a real VL checkpoint ships (saved by transformers)."""
    from transformers import AutoTokenizer
    from transformers.models.minimax_m3_vl import MiniMaxM3VLImageProcessor, MiniMaxM3VLProcessor, MiniMaxM3VLVideoProcessor

    tokenizer = AutoTokenizer.from_pretrained(directory)
    processor = MiniMaxM3VLProcessor(
        image_processor=MiniMaxM3VLImageProcessor(), tokenizer=tokenizer, video_processor=MiniMaxM3VLVideoProcessor()
    )
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


def _move_into(staging: str, directory: str) -> None:
    for entry in os.listdir(staging):
        os.replace(os.path.join(staging, entry), os.path.join(directory, entry))
    os.rmdir(staging)
