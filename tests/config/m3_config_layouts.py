"""Text configs in the shipped checkpoint's layout, built from a spec, and the broken-config corpus.

``shipped_text_config(spec)`` writes every setting of an ``M3TextSpec`` the way the real
``config.json`` spells it (M3_FACTS s.1: ``moe_layer_freq``, nested ``sparse_attention_config``,
top-level ``rope_theta`` beside ``rope_parameters``, ``rotary_dim`` and ``partial_rotary_factor``,
explicit ``use_qk_norm`` / ``qk_norm_type`` / ``use_gemma_norm`` / ``scoring_func`` /
``use_routing_bias`` / ``n_shared_experts`` / ``swiglu_*``), so reading it back must give the
same spec. ``hf_text_config(spec)`` writes the flat Hugging Face layout of the same settings.

``CORPUS`` lists configs with exactly one field wrong: each entry edits a valid VL wrapper
(``{"text_config": shipped, "vision_config": ...}``) in place and names the field the refusal
must name (plus, where the field has a list of accepted values, one of them).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

from sglang_m3.config import M3TextSpec


def _sizes(spec: M3TextSpec) -> dict:
    """The size fields both layouts spell alike."""
    return {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.moe_intermediate_size,
        "dense_intermediate_size": spec.dense_intermediate_size,
        "shared_intermediate_size": spec.shared_intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
    }


def shipped_text_config(spec: M3TextSpec) -> dict:
    moe = [int(m) for m in spec.moe_layers]
    sparse = [int(s) for s in spec.sparse_layers]
    text = {
        **_sizes(spec),
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "rotary_dim": spec.rotary_dim,
        "partial_rotary_factor": spec.rotary_dim / spec.head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "use_qk_norm": True,
        "qk_norm_type": "per_head",
        "use_gemma_norm": spec.use_gemma_norm,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "num_local_experts": spec.num_experts,
        "num_experts_per_tok": spec.experts_per_token,
        "scoring_func": "sigmoid",
        "use_routing_bias": spec.use_routing_bias,
        "routed_scaling_factor": spec.routed_scaling_factor,
        "moe_layer_freq": moe,
        "hidden_act": spec.hidden_act,
        "swiglu_alpha": spec.swiglu_alpha,
        "swiglu_limit": spec.swiglu_limit,
        "swiglu_beta": 1.0,
        "num_mtp_modules": spec.num_mtp_modules,
        "num_nextn_predict_layers": spec.num_nextn_predict_layers,
        "sparse_attention_config": {
            "use_sparse_attention": any(sparse),
            "sparse_index_dim": spec.index_head_dim,
            "sparse_num_index_heads": spec.index_heads,
            "sparse_topk_blocks": spec.index_topk_blocks,
            "sparse_block_size": spec.index_block_size,
            "sparse_score_type": "max",
            "sparse_init_block": spec.index_init_blocks,
            "sparse_local_block": spec.index_local_blocks,
            "sparse_attention_freq": sparse,
            "sparse_disable_index_value": sparse,
        },
    }
    if spec.shared_intermediate_size % spec.moe_intermediate_size == 0:
        text["n_shared_experts"] = spec.shared_intermediate_size // spec.moe_intermediate_size
    return text


def hf_text_config(spec: M3TextSpec) -> dict:
    """The same settings in the flat layout transformers writes (its text ``model_type``)."""
    return {
        "model_type": "minimax_m3_vl_text",
        **_sizes(spec),
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": spec.rope_theta,
            "partial_rotary_factor": spec.rotary_dim / spec.head_dim,
        },
        "rotary_dim": spec.rotary_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "num_local_experts": spec.num_experts,
        "num_experts_per_tok": spec.experts_per_token,
        "routed_scaling_factor": spec.routed_scaling_factor,
        "hidden_act": "silu",  # transformers rewrites every hidden_act to this
        "swiglu_alpha": spec.swiglu_alpha,
        "swiglu_limit": spec.swiglu_limit,
        "index_n_heads": spec.index_heads,
        "index_head_dim": spec.index_head_dim,
        "index_block_size": spec.index_block_size,
        "index_topk_blocks": spec.index_topk_blocks,
        "index_local_blocks": spec.index_local_blocks,
        "index_init_blocks": spec.index_init_blocks,
        "layer_types": ["minimax_m3_sparse" if s else "full_attention" for s in spec.sparse_layers],
        "mlp_layer_types": ["sparse" if m else "dense" for m in spec.moe_layers],
        "num_mtp_modules": spec.num_mtp_modules,
        "num_nextn_predict_layers": spec.num_nextn_predict_layers,
    }


def vl_wrapper(text: dict) -> dict:
    """A VL top level around ``text`` whose vision sizes differ from every text size."""
    return {
        "model_type": "minimax_m3_vl",
        "architectures": ["MiniMaxM3SparseForCausalLM"],
        "tie_word_embeddings": text.get("tie_word_embeddings", False),
        "text_config": copy.deepcopy(text),
        "vision_config": {
            "model_type": "minimax_m3_vl_vision",
            "hidden_size": 40,
            "intermediate_size": 72,
            "num_hidden_layers": 3,
            "num_attention_heads": 5,
            "head_dim": 8,
            "rope_theta": 10000.0,
            "hidden_act": "gelu",
        },
    }


@dataclass(frozen=True)
class Broken:
    """One field wrong: ``edit(top)`` changes a valid VL top-level config in place."""

    name: str
    edit: Callable[[dict], None]
    #: must appear in the refusal: the field (and, for a choice, an accepted value)
    expected: tuple[str, ...]


def _text(**changes) -> Callable[[dict], None]:
    def edit(top: dict) -> None:
        top["text_config"].update(changes)

    return edit


def _sparse(**changes) -> Callable[[dict], None]:
    def edit(top: dict) -> None:
        top["text_config"]["sparse_attention_config"].update(changes)

    return edit


def _drop(key: str) -> Callable[[dict], None]:
    def edit(top: dict) -> None:
        del top["text_config"][key]

    return edit


def _moe_freq_entry(top: dict) -> None:
    top["text_config"]["moe_layer_freq"][-1] = 2


def _moe_freq_short(top: dict) -> None:
    top["text_config"]["moe_layer_freq"].pop()


def _mlp_types_disagree(top: dict) -> None:
    text = top["text_config"]
    text["mlp_layer_types"] = ["sparse"] * text["num_hidden_layers"]  # layer 0 is dense in moe_layer_freq


def _sparse_freq_long(top: dict) -> None:
    top["text_config"]["sparse_attention_config"]["sparse_attention_freq"].append(1)


def _index_value_enabled(top: dict) -> None:
    nested = top["text_config"]["sparse_attention_config"]
    last = nested["sparse_attention_freq"].index(1)
    nested["sparse_disable_index_value"] = list(nested["sparse_disable_index_value"])
    nested["sparse_disable_index_value"][last] = 0


def _flat_index_disagrees(top: dict) -> None:
    text = top["text_config"]
    text["index_topk_blocks"] = text["sparse_attention_config"]["sparse_topk_blocks"] + 1


def _rope_theta_disagrees(top: dict) -> None:
    top["text_config"]["rope_parameters"]["rope_theta"] = 10000.0


def _rope_yarn(top: dict) -> None:
    top["text_config"]["rope_parameters"]["rope_type"] = "yarn"


def _heads_not_multiple(top: dict) -> None:
    text = top["text_config"]
    text["num_attention_heads"] = text["num_key_value_heads"] * 3 + 1


def _index_heads(top: dict) -> None:
    nested = top["text_config"]["sparse_attention_config"]
    nested["sparse_num_index_heads"] = top["text_config"]["num_key_value_heads"] + 1


def _top_k_too_large(top: dict) -> None:
    text = top["text_config"]
    text["num_experts_per_tok"] = text["num_local_experts"] + 1


def _shared_disagrees(top: dict) -> None:
    top["text_config"]["n_shared_experts"] = 2


def _quantized(top: dict) -> None:
    top["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}


def _hidden_only_in_vision(top: dict) -> None:
    del top["text_config"]["hidden_size"]  # vision_config has one: it must not be taken


def _local_blocks_exceed_topk(top: dict) -> None:
    nested = top["text_config"]["sparse_attention_config"]
    nested["sparse_local_block"] = nested["sparse_topk_blocks"] + 1


CORPUS: tuple[Broken, ...] = (
    Broken("scoring_func softmax", _text(scoring_func="softmax"), ("scoring_func", "'sigmoid'")),
    Broken("qk_norm_type per_layer", _text(qk_norm_type="per_layer"), ("qk_norm_type", "'per_head'")),
    Broken("use_qk_norm false", _text(use_qk_norm=False), ("use_qk_norm",)),
    Broken("moe_layer_freq too short", _moe_freq_short, ("moe_layer_freq",)),
    Broken("moe_layer_freq entry 2", _moe_freq_entry, ("moe_layer_freq", "0, 1")),
    Broken("moe_layer_freq int 0", _text(moe_layer_freq=0), ("moe_layer_freq",)),
    Broken("mlp_layer_types disagrees with moe_layer_freq", _mlp_types_disagree, ("moe_layer_freq", "mlp_layer_types")),
    Broken("sparse_attention_freq too long", _sparse_freq_long, ("sparse_attention_freq",)),
    Broken("flat index key disagrees with nested", _flat_index_disagrees, ("index_topk_blocks", "sparse_topk_blocks")),
    Broken("rope_theta disagrees with rope_parameters", _rope_theta_disagrees, ("rope_theta", "rope_parameters.rope_theta")),
    Broken("rope_type yarn", _rope_yarn, ("rope_type", "'default'")),
    Broken("rope_scaling type yarn", _text(rope_scaling={"type": "yarn", "factor": 4.0}), ("rope_scaling.type", "'default'")),
    Broken("partial_rotary_factor 0", _text(partial_rotary_factor=0), ("partial_rotary_factor",)),
    Broken("partial_rotary_factor 1.5", _text(partial_rotary_factor=1.5), ("partial_rotary_factor",)),
    Broken("hidden_act gelu", _text(hidden_act="gelu"), ("hidden_act", "'swigluoai'", "'silu'")),
    Broken("swiglu_beta 2.0", _text(swiglu_beta=2.0), ("swiglu_beta", "1.0")),
    Broken("swiglu_limit 0", _text(swiglu_limit=0), ("swiglu_limit",)),
    Broken("n_shared_experts disagrees with shared_intermediate_size", _shared_disagrees, ("n_shared_experts", "shared_intermediate_size")),
    Broken("index value enabled on a sparse layer", _index_value_enabled, ("sparse_disable_index_value",)),
    Broken("use_sparse_attention false with sparse layers", _sparse(use_sparse_attention=False), ("use_sparse_attention",)),
    Broken("sparse_score_type mean", _sparse(sparse_score_type="mean"), ("sparse_score_type", "'max'")),
    Broken("unknown sparse_attention_config key", _sparse(sparse_value_dim=64), ("sparse_value_dim", "sparse_attention_config")),
    Broken("num_experts_per_tok > num_local_experts", _top_k_too_large, ("num_experts_per_tok", "num_local_experts")),
    Broken("index heads != KV heads", _index_heads, ("sparse_num_index_heads", "num_key_value_heads")),
    Broken("local blocks exceed top-k", _local_blocks_exceed_topk, ("sparse_local_block", "sparse_topk_blocks")),
    Broken("heads not a multiple of KV heads", _heads_not_multiple, ("num_attention_heads", "num_key_value_heads")),
    Broken("quantization_config not MXFP8", _quantized, ("quantization_config.quant_method", "'fp8'", "MXFP8")),
    Broken("intermediate_size missing", _drop("intermediate_size"), ("intermediate_size",)),
    Broken("head_dim missing", _drop("head_dim"), ("head_dim",)),
    Broken("hidden_size only in vision_config", _hidden_only_in_vision, ("hidden_size",)),
    Broken("routed_scaling_factor negative", _text(routed_scaling_factor=-2.0), ("routed_scaling_factor",)),
    Broken("use_gemma_norm not a boolean", _text(use_gemma_norm="yes"), ("use_gemma_norm",)),
    Broken("num_experts disagrees with num_local_experts", _text(num_experts=3), ("num_local_experts", "num_experts")),
)


def broken_config(base_top: dict, entry: Broken) -> dict:
    top = copy.deepcopy(base_top)
    entry.edit(top)
    return top
