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

import json
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
    from sglang_m3.tiny.checkpoint import save_processor

    vision = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": vision_intermediate}
    save_transformers_model(directory, vision, seed)
    save_processor(directory)
    return directory


def save_transformers_model(directory: str, vision: dict, seed: int = 0, dtype=torch.float32, **save_options) -> str:
    """The tokenizer and the model (``text_settings()`` and ``vision``) saved by transformers into
    ``directory``, in the model's ``dtype``; ``save_options`` go to ``save_pretrained`` (e.g.
    ``max_shard_size``). No processor files; returns ``directory``."""
    from transformers.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig

    from sglang_m3.parsers import chat_template_path
    from sglang_m3.tiny.checkpoint import MAX_POSITIONS, redraw_weights
    from sglang_m3.tiny.tokenizer import BOS, EOS, IMAGE_TOKEN, VIDEO_TOKEN, build_tokenizer, save_tokenizer

    os.makedirs(directory, exist_ok=True)
    text = text_settings()
    special = save_tokenizer(directory, build_tokenizer(text["vocab_size"]), chat_template_path().read_text(), MAX_POSITIONS)
    text.update(bos_token_id=special[BOS], eos_token_id=special[EOS])
    config = MiniMaxM3VLConfig(
        text_config=text, vision_config=vision, projector_hidden_size=text["hidden_size"],
        image_token_index=special[IMAGE_TOKEN], video_token_index=special[VIDEO_TOKEN],
    )
    torch.manual_seed(seed)
    model = MiniMaxM3SparseForConditionalGeneration(config)
    redraw_weights(model, seed)  # transformers' 0.02 init leaves every logit nearly equal
    model.to(dtype).save_pretrained(directory, **save_options)
    return directory


def rewrite_in_shipped_layout(directory: str, keep_rotary_dim: bool = True, n_shared_experts: int | None = None) -> None:
    """Rewrite the ``config.json`` transformers saved into the shipped checkpoint's layout
    (M3_FACTS s.1): ``moe_layer_freq``, nested ``sparse_attention_config`` (``use_sparse_attention``
    false for an all-dense schedule), top-level ``rope_theta`` / ``partial_rotary_factor``,
    "swigluoai", and a ``clip_vision_model`` vision config with its RoPE theta at the top and
    ``projection_dim``. The shared expert of this module's checkpoint (40) is narrower than a
    routed one (48), so ``n_shared_experts`` is left out unless given, as transformers ignores it;
    ``keep_rotary_dim`` False drops transformers' ``rotary_dim``."""
    path = os.path.join(directory, "config.json")
    with open(path, encoding="utf-8") as handle:
        top = json.load(handle)
    text, vision = top["text_config"], top["vision_config"]
    sparse = [int(kind == "minimax_m3_sparse") for kind in text.pop("layer_types")]
    rope = text.pop("rope_parameters")
    text.update(
        model_type="minimax_m2", rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
        moe_layer_freq=[int(kind == "sparse") for kind in text.pop("mlp_layer_types")], hidden_act="swigluoai",
        swiglu_beta=1.0, use_qk_norm=True, qk_norm_type="per_head", use_gemma_norm=True, scoring_func="sigmoid",
        use_routing_bias=True,
        sparse_attention_config={
            "use_sparse_attention": any(sparse), "sparse_score_type": "max", "sparse_init_block": 0,
            **{nested: text.pop(flat) for flat, nested in _FLAT_TO_NESTED.items()},
            "sparse_attention_freq": sparse, "sparse_disable_index_value": sparse,
        },
    )
    if not keep_rotary_dim:
        del text["rotary_dim"]
    if n_shared_experts is not None:
        text["n_shared_experts"] = n_shared_experts
    vision.update(model_type="clip_vision_model", rope_theta=vision.pop("rope_parameters")["rope_theta"], projection_dim=top["projector_hidden_size"])
    top.pop("merged_hidden_size")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(top, handle, indent=2)


_FLAT_TO_NESTED = {
    "index_n_heads": "sparse_num_index_heads",
    "index_head_dim": "sparse_index_dim",
    "index_block_size": "sparse_block_size",
    "index_topk_blocks": "sparse_topk_blocks",
    "index_local_blocks": "sparse_local_block",
}
