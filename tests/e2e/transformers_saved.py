"""A tiny M3 written entirely by transformers (``MiniMaxM3VLConfig`` -> ``save_pretrained``).

Its sizes are unlike the project's own tiny checkpoint in every dimension that was once read from
the wrong place: head_dim 16 with 6 query / 3 KV heads, 5 layers of which 2 dense, 6 experts of
width 48 (SGLang's CPU path used to pad that to 64), a shared expert of 40, MSA block 8 and
top-4 blocks, and a 32-wide, 2-layer, 2-head vision tower. RoPE covers 8 of 16 channels, spelled
both ways (``rotary_dim`` 8 and ``rope_parameters.partial_rotary_factor`` 0.5): transformers'
M3 reads only the factor, SGLang only ``rotary_dim`` (see tests/test_rope_vs_transformers.py).
Only the tokenizer and the processor configs are added, so the server can start.
"""

from __future__ import annotations

import os

import torch

DENSE_LAYERS, LAYERS = 2, 5
EXPERT_INTERMEDIATE = 48


def text_settings() -> dict:
    sparse = [i >= DENSE_LAYERS for i in range(LAYERS)]
    return {
        "vocab_size": 512,
        "hidden_size": 96,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "head_dim": 16,
        "rotary_dim": 8,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.5},
        "num_hidden_layers": LAYERS,
        "mlp_layer_types": ["sparse" if s else "dense" for s in sparse],
        "layer_types": ["minimax_m3_sparse" if s else "full_attention" for s in sparse],
        "num_local_experts": 6,
        "num_experts_per_tok": 2,
        "intermediate_size": EXPERT_INTERMEDIATE,
        "shared_intermediate_size": 40,
        "dense_intermediate_size": 80,
        "index_n_heads": 3,
        "index_head_dim": 16,
        "index_block_size": 8,
        "index_topk_blocks": 4,
        "index_local_blocks": 1,
        "max_position_embeddings": 4096,
    }


def build_transformers_saved_checkpoint(directory: str, vision_intermediate: int, seed: int = 0) -> str:
    """Save the model with transformers into ``directory`` (a new or empty folder); return it."""
    from transformers.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig

    from sglang_m3.parsers import chat_template_path
    from sglang_m3.tiny.checkpoint import MAX_POSITIONS, redraw_weights, save_processor
    from sglang_m3.tiny.tokenizer import BOS, EOS, IMAGE_TOKEN, VIDEO_TOKEN, build_tokenizer, save_tokenizer

    os.makedirs(directory, exist_ok=True)
    text = text_settings()
    special = save_tokenizer(directory, build_tokenizer(text["vocab_size"]), chat_template_path().read_text(), MAX_POSITIONS)
    text.update(bos_token_id=special[BOS], eos_token_id=special[EOS])
    vision = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": vision_intermediate}
    config = MiniMaxM3VLConfig(
        text_config=text, vision_config=vision, projector_hidden_size=text["hidden_size"],
        image_token_index=special[IMAGE_TOKEN], video_token_index=special[VIDEO_TOKEN],
    )
    torch.manual_seed(seed)
    model = MiniMaxM3SparseForConditionalGeneration(config)
    redraw_weights(model, seed)  # transformers' 0.02 init leaves every logit nearly equal
    model.save_pretrained(directory)
    save_processor(directory)
    return directory
