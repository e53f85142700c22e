"""M3 configuration: one validated view of the text model, whatever form the checkpoint uses.

Checkpoints carry the sparse settings in two forms (M3_FACTS s.1): flat Hugging Face keys
(``index_n_heads``, ``index_block_size``, ``layer_types``, ...) or a nested
``sparse_attention_config`` dict (``sparse_topk_blocks``, ``sparse_attention_freq``, ...).
The VL checkpoint nests the whole text config under ``text_config``. ``M3TextSpec.from_config``
accepts all of these (a dict or a transformers config object) and rejects values the model
cannot run with, naming the offending field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

SPARSE_LAYER = "minimax_m3_sparse"
DENSE_LAYER = "full_attention"

# nested sparse_attention_config key -> flat key
_NESTED_TO_FLAT = {
    "sparse_num_index_heads": "index_n_heads",
    "sparse_index_dim": "index_head_dim",
    "sparse_block_size": "index_block_size",
    "sparse_topk_blocks": "index_topk_blocks",
    "sparse_local_block": "index_local_blocks",
    "sparse_init_block": "index_init_blocks",
}
_KNOWN_NESTED = set(_NESTED_TO_FLAT) | {
    "use_sparse_attention",
    "sparse_score_type",
    "sparse_attention_freq",
    "sparse_disable_index_value",
}


class M3ConfigError(ValueError):
    """A config value the model cannot run with; the message names the field."""


@dataclass(frozen=True)
class M3TextSpec:
    """Everything the SGLang model, the KV pool and the MSA backend need to agree on."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    dense_intermediate_size: int
    moe_intermediate_size: int
    shared_intermediate_size: int
    num_experts: int
    experts_per_token: int
    routed_scaling_factor: float
    swiglu_alpha: float
    swiglu_limit: float
    index_heads: int
    index_head_dim: int
    index_block_size: int
    index_topk_blocks: int
    index_local_blocks: int
    index_init_blocks: int
    sparse_layers: tuple[bool, ...]
    moe_layers: tuple[bool, ...]
    tie_word_embeddings: bool = False

    @property
    def sparse_layer_ids(self) -> list[int]:
        return [i for i, sparse in enumerate(self.sparse_layers) if sparse]

    @property
    def dense_layer_ids(self) -> list[int]:
        return [i for i, sparse in enumerate(self.sparse_layers) if not sparse]

    @classmethod
    def from_config(cls, config: Any, raw_config_dir: str | None = None) -> "M3TextSpec":
        """Build from a config dict / transformers config (VL or text), validating every field."""
        raw = _as_dict(config)
        if isinstance(raw.get("text_config"), Mapping) or hasattr(config, "text_config"):
            text = _as_dict(raw.get("text_config") if "text_config" in raw else config.text_config)
        else:
            text = raw
        if raw_config_dir is not None:
            text = _merge_raw_sparse_settings(text, raw_config_dir)
        return _build_spec(text)

    def validate_page_size(self, page_size: int) -> None:
        """The MSA selection works on whole KV blocks; a block must be a whole number of pages."""
        if page_size < 1 or self.index_block_size % page_size:
            raise M3ConfigError(
                f"index_block_size ({self.index_block_size}) must be a multiple of the KV page "
                f"size (--page-size {page_size})"
            )


def _as_dict(config: Any) -> dict:
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    return dict(vars(config))


def _merge_raw_sparse_settings(text: dict, config_dir: str) -> dict:
    """transformers drops ``sparse_attention_config`` (and so ``sparse_init_block``) while parsing.

    Re-read the checkpoint's own config.json so settings transformers does not model survive.
    """
    path = os.path.join(config_dir, "config.json")
    if not os.path.isfile(path):
        return text
    with open(path, encoding="utf-8") as handle:
        file_config = json.load(handle)
    file_text = file_config.get("text_config", file_config)
    merged = dict(text)
    for key in ("sparse_attention_config", "index_init_blocks"):
        if key in file_text and key not in merged:
            merged[key] = file_text[key]
    return merged


def _require(text: dict, key: str, default: Any = None) -> Any:
    value = text.get(key, default)
    if value is None:
        raise M3ConfigError(f"config field '{key}' is missing")
    return value


def _positive_int(text: dict, key: str, default: Any = None) -> int:
    value = _require(text, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise M3ConfigError(f"config field '{key}' must be a positive integer, got {value!r}")
    return value


def _schedule(value: Any, num_layers: int, field: str, true_names: set, false_names: set) -> tuple[bool, ...]:
    if not isinstance(value, (list, tuple)) or len(value) != num_layers:
        raise M3ConfigError(
            f"config field '{field}' must list one entry per layer ({num_layers}), got {value!r}"
        )
    out = []
    for i, entry in enumerate(value):
        if entry in true_names:
            out.append(True)
        elif entry in false_names:
            out.append(False)
        else:
            raise M3ConfigError(f"config field '{field}[{i}]' has unknown value {entry!r}")
    return tuple(out)


def _nested_sparse_settings(text: dict) -> dict:
    nested = text.get("sparse_attention_config")
    if not nested:
        return {}
    if not isinstance(nested, Mapping):
        raise M3ConfigError("config field 'sparse_attention_config' must be a mapping")
    unknown = sorted(set(nested) - _KNOWN_NESTED)
    if unknown:
        raise M3ConfigError(f"unknown key(s) in 'sparse_attention_config': {', '.join(unknown)}")
    score_type = nested.get("sparse_score_type", "max")
    if score_type != "max":
        raise M3ConfigError(
            f"'sparse_attention_config.sparse_score_type' must be 'max', got {score_type!r}"
        )
    flat = {_NESTED_TO_FLAT[k]: v for k, v in nested.items() if k in _NESTED_TO_FLAT}
    if "sparse_attention_freq" in nested:
        flat["layer_types"] = [SPARSE_LAYER if f else DENSE_LAYER for f in nested["sparse_attention_freq"]]
    return flat


def _rope_settings(text: dict, head_dim: int) -> tuple[int, float]:
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    theta = rope.get("rope_theta", text.get("rope_theta", 5_000_000.0))
    if rope.get("rope_type", "default") not in ("default", None):
        raise M3ConfigError(f"config field 'rope_parameters.rope_type' must be 'default', got {rope['rope_type']!r}")
    if "rotary_dim" in text:
        rotary_dim = text["rotary_dim"]
    else:
        rotary_dim = int(head_dim * rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)))
    if not isinstance(rotary_dim, int) or rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise M3ConfigError(f"config field 'rotary_dim' must be an even integer in [2, head_dim={head_dim}], got {rotary_dim!r}")
    return rotary_dim, float(theta)


def _build_spec(text: dict) -> M3TextSpec:
    text = {**text, **_nested_sparse_settings(text)}
    num_layers = _positive_int(text, "num_hidden_layers")
    num_heads = _positive_int(text, "num_attention_heads")
    num_kv_heads = _positive_int(text, "num_key_value_heads")
    hidden = _positive_int(text, "hidden_size")
    head_dim = _positive_int(text, "head_dim", hidden // num_heads)
    if num_heads % num_kv_heads:
        raise M3ConfigError(
            f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
        )
    rotary_dim, theta = _rope_settings(text, head_dim)
    sparse_layers = _schedule(
        text.get("layer_types") or [DENSE_LAYER] * num_layers, num_layers, "layer_types", {SPARSE_LAYER}, {DENSE_LAYER, "dense"}
    )
    moe_layers = _schedule(
        text.get("mlp_layer_types") or ["sparse"] * num_layers, num_layers, "mlp_layer_types", {"sparse", "moe"}, {"dense"}
    )
    spec_fields: dict[str, Any] = dict(
        vocab_size=_positive_int(text, "vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_theta=theta,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=_positive_int(text, "max_position_embeddings", 1_048_576),
        dense_intermediate_size=_positive_int(text, "dense_intermediate_size", 12288),
        moe_intermediate_size=_positive_int(text, "intermediate_size"),
        shared_intermediate_size=_positive_int(text, "shared_intermediate_size", 3072),
        num_experts=_positive_int(text, "num_local_experts", text.get("num_experts", 128)),
        experts_per_token=_positive_int(text, "num_experts_per_tok", 4),
        routed_scaling_factor=float(text.get("routed_scaling_factor", 2.0)),
        swiglu_alpha=float(text.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(text.get("swiglu_limit", 7.0)),
        index_heads=_positive_int(text, "index_n_heads", 4),
        index_head_dim=_positive_int(text, "index_head_dim", 128),
        index_block_size=_positive_int(text, "index_block_size", 128),
        index_topk_blocks=_require(text, "index_topk_blocks", 16),
        index_local_blocks=_require(text, "index_local_blocks", 1),
        index_init_blocks=_require(text, "index_init_blocks", 0),
        sparse_layers=sparse_layers,
        moe_layers=moe_layers,
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
    )
    _check_sparse_fields(spec_fields)
    return M3TextSpec(**spec_fields)


def _check_sparse_fields(f: dict) -> None:
    for key in ("index_topk_blocks",):
        if isinstance(f[key], bool) or not isinstance(f[key], int) or f[key] < 1:
            raise M3ConfigError(f"config field '{key}' must be an integer >= 1, got {f[key]!r}")
    for key in ("index_local_blocks", "index_init_blocks"):
        if isinstance(f[key], bool) or not isinstance(f[key], int) or f[key] < 0:
            raise M3ConfigError(f"config field '{key}' must be an integer >= 0, got {f[key]!r}")
    if any(f["sparse_layers"]):
        if f["index_heads"] != f["num_kv_heads"]:
            raise M3ConfigError(
                f"index_n_heads ({f['index_heads']}) must equal num_key_value_heads "
                f"({f['num_kv_heads']}): each index head selects blocks for one KV group"
            )
        if f["index_local_blocks"] + f["index_init_blocks"] > f["index_topk_blocks"]:
            raise M3ConfigError(
                f"index_local_blocks ({f['index_local_blocks']}) + index_init_blocks "
                f"({f['index_init_blocks']}) must not exceed index_topk_blocks ({f['index_topk_blocks']})"
            )
        if f["index_head_dim"] < f["rotary_dim"]:
            raise M3ConfigError(
                f"index_head_dim ({f['index_head_dim']}) must be >= rotary_dim ({f['rotary_dim']}): "
                "the index branch uses the same partial RoPE"
            )
    if f["experts_per_token"] > f["num_experts"]:
        raise M3ConfigError(
            f"num_experts_per_tok ({f['experts_per_token']}) exceeds num_local_experts ({f['num_experts']})"
        )
