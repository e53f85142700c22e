"""The text model's settings as one frozen spec, read field by field from the checkpoint config.

Layouts accepted (M3_FACTS s.1): the shipped one (``moe_layer_freq``, nested
``sparse_attention_config``, top-level ``rope_theta`` and ``partial_rotary_factor``) and the flat
Hugging Face one (``mlp_layer_types``, ``layer_types``, ``index_*``, ``rope_parameters``). Where
both spellings of a setting are present they must agree. Each field is read once, in the
``_read_*`` function that owns it; a value the project does not implement is refused with the
accepted values, never replaced by a default.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

from sglang_m3.config import fields
from sglang_m3.config.errors import M3ConfigError
from sglang_m3.config.quantization import MXFP8Config, read_quantization
from sglang_m3.config.source import checkpoint_config, text_part

logger = logging.getLogger(__name__)

SPARSE_LAYER = "minimax_m3_sparse"
DENSE_LAYER = "full_attention"

#: nested ``sparse_attention_config`` key -> flat Hugging Face key
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
#: transformers' own text config class: it rewrites any ``hidden_act`` to "silu" while its
#: modeling always computes swiglu-oai, so "silu" written by it carries no information.
_TRANSFORMERS_TEXT_TYPE = "minimax_m3_vl_text"

#: math-changing fields that may be absent, read then as the shipped M3 value (which is also the
#: only form transformers' M3 computes). Upstream SGLang reads some of them differently when
#: absent (no Gemma norm, no routing bias, per-layer q/k norm), so the absence is logged.
_SHIPPED_DEFAULTS = {
    "use_qk_norm": True,
    "qk_norm_type": "per_head",
    "use_gemma_norm": True,
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
    "hidden_act": "swigluoai",
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
}


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
    #: "swigluoai" (clamped, ``(up + 1) * g * sigmoid(alpha * g)``) or "silu" (``up * silu(g)``)
    hidden_act: str
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
    #: RMSNorm scale ``1 + w`` (Gemma form, M3) rather than ``w``
    use_gemma_norm: bool = True
    #: the router's per-expert correction bias (used for choosing experts only) exists
    use_routing_bias: bool = True
    tie_word_embeddings: bool = False
    #: multi-token-prediction modules in the checkpoint (skipped at load; for speculative decoding)
    num_mtp_modules: int = 0
    num_nextn_predict_layers: int = 0
    #: the checkpoint's weight quantization (MXFP8), None for a BF16 checkpoint
    quantization: MXFP8Config | None = None

    @property
    def sparse_layer_ids(self) -> list[int]:
        return [i for i, sparse in enumerate(self.sparse_layers) if sparse]

    @property
    def dense_layer_ids(self) -> list[int]:
        return [i for i, sparse in enumerate(self.sparse_layers) if not sparse]

    @classmethod
    def from_config(cls, config: Any, raw_config_dir: str | None = None, overrides: Mapping | None = None) -> "M3TextSpec":
        """Build from the checkpoint config (a dict, a transformers config, or the directory's
        ``config.json`` when ``raw_config_dir`` is given or the object was loaded from one, with
        ``overrides`` as in :func:`checkpoint_config`)."""
        return _build_spec(text_part(checkpoint_config(config, raw_config_dir, overrides)))

    def validate_page_size(self, page_size: int) -> None:
        """The MSA selection works on whole KV blocks; a block must be a whole number of pages."""
        if page_size < 1 or self.index_block_size % page_size:
            raise M3ConfigError(
                f"index_block_size ({self.index_block_size}) must be a multiple of the KV page "
                f"size (--page-size {page_size})"
            )


def _build_spec(text: Mapping) -> M3TextSpec:
    num_layers = fields.positive_int(text, "num_hidden_layers")
    hidden = fields.positive_int(text, "hidden_size")
    num_heads = fields.positive_int(text, "num_attention_heads")
    num_kv_heads = fields.positive_int(text, "num_key_value_heads")
    if num_heads % num_kv_heads:
        raise M3ConfigError(
            f"config field 'num_attention_heads' ({num_heads}) must be a multiple of "
            f"'num_key_value_heads' ({num_kv_heads})"
        )
    # No default: transformers' M3 assumes 128 where upstream SGLang assumes hidden // heads.
    head_dim = fields.positive_int(text, "head_dim")
    sparse = _read_sparse(text, num_layers)
    moe_intermediate = fields.positive_int(text, "intermediate_size")
    _read_qk_norm(text)
    spec = M3TextSpec(
        vocab_size=fields.positive_int(text, "vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rotary_dim=_read_rotary_dim(text, head_dim),
        rope_theta=_read_rope_theta(text),
        rms_norm_eps=fields.positive_float(text, "rms_norm_eps", 1e-6),
        max_position_embeddings=fields.positive_int(text, "max_position_embeddings", 1_048_576),
        dense_intermediate_size=fields.positive_int(text, "dense_intermediate_size"),
        moe_intermediate_size=moe_intermediate,
        shared_intermediate_size=_read_shared_intermediate(text, moe_intermediate),
        num_experts=_read_num_experts(text),
        experts_per_token=fields.positive_int(text, "num_experts_per_tok"),
        routed_scaling_factor=fields.positive_float(text, "routed_scaling_factor"),
        hidden_act=_read_activation(text),
        swiglu_alpha=fields.positive_float(text, "swiglu_alpha", _SHIPPED_DEFAULTS["swiglu_alpha"]),
        swiglu_limit=fields.positive_float(text, "swiglu_limit", _SHIPPED_DEFAULTS["swiglu_limit"]),
        use_gemma_norm=fields.boolean(text, "use_gemma_norm", _SHIPPED_DEFAULTS["use_gemma_norm"]),
        use_routing_bias=_read_routing(text),
        moe_layers=_read_moe_layers(text, num_layers),
        tie_word_embeddings=fields.boolean(text, "tie_word_embeddings", False),
        num_mtp_modules=fields.non_negative_int(text, "num_mtp_modules", 0),
        num_nextn_predict_layers=fields.non_negative_int(text, "num_nextn_predict_layers", 0),
        quantization=read_quantization(text),
        **sparse,
    )
    _check_consistency(spec)
    _log_shipped_defaults(text)
    return spec


def _log_shipped_defaults(text: Mapping) -> None:
    if text.get("model_type") == _TRANSFORMERS_TEXT_TYPE:
        return  # transformers' own config class has none of them and computes only these values
    absent = [f"{key}={default!r}" for key, default in _SHIPPED_DEFAULTS.items() if text.get(key) is None]
    if absent:
        logger.info("M3 config fields absent, read as the shipped checkpoint's values: %s", ", ".join(absent))


def _read_rope_theta(text: Mapping) -> float:
    """``rope_theta`` at the top level (shipped) or in ``rope_parameters`` (transformers).

    Only plain RoPE is implemented: the type may be spelled ``rope_parameters.rope_type`` or,
    in the older form, ``rope_scaling.rope_type`` / ``rope_scaling.type``; any of them other than
    "default" is refused (a scaled RoPE would silently change every position's rotation).
    """
    rope = _rope_parameters(text)
    for where, section in (("rope_parameters", text.get("rope_parameters")), ("rope_scaling", text.get("rope_scaling"))):
        if isinstance(section, Mapping):
            for key in ("rope_type", "type"):
                fields.choice(section, key, ("default",), "default", name=f"{where}.{key}")
    theta = fields.agree("rope_theta", text.get("rope_theta"), "rope_parameters.rope_theta", rope.get("rope_theta"))
    return fields.positive_float({"rope_theta": theta}, "rope_theta")


def _read_rotary_dim(text: Mapping, head_dim: int) -> int:
    """Channels rotated per head: ``rotary_dim``, or ``head_dim x partial_rotary_factor``.

    Both are in the shipped config (64 and 0.5), where they agree. transformers' M3 ignores
    ``rotary_dim`` and rotates ``head_dim x rope_parameters.partial_rotary_factor`` channels, and
    writes its class default ``rotary_dim`` 64 into every config it saves: a checkpoint saved with
    a factor for a smaller head (``head_dim`` 32, factor 0.5) holds ``rotary_dim`` 64 beside it.
    So where both are given and disagree, the factor counts (as in transformers, against which
    outputs are checked), and the disagreement is logged. A config with ``rotary_dim`` alone is
    read as ``rotary_dim``, as upstream SGLang reads it (transformers would rotate all
    ``head_dim`` channels there; that is logged too).
    """
    rope = _rope_parameters(text)
    factor = fields.agree(
        "partial_rotary_factor", text.get("partial_rotary_factor"),
        "rope_parameters.partial_rotary_factor", rope.get("partial_rotary_factor"),
    )
    rotary_dim = text.get("rotary_dim")
    from_factor = None
    if factor is not None:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise M3ConfigError(f"config field 'partial_rotary_factor' must be a number in (0, 1], got {factor!r}")
        channels = head_dim * factor
        from_factor = round(channels)
        if abs(channels - from_factor) > 1e-6 or from_factor % 2:
            raise M3ConfigError(
                f"config field 'partial_rotary_factor' ({factor!r}) x head_dim ({head_dim}) = {channels} "
                "must be an even whole number of rotated channels"
            )
    if rotary_dim is not None and from_factor is not None and rotary_dim != from_factor:
        logger.warning(
            "config fields 'rotary_dim' (%r) and 'partial_rotary_factor' (%r x head_dim %s = %s) disagree: "
            "rotating %s channels, as transformers' minimax_m3_vl does (it ignores rotary_dim)",
            rotary_dim, factor, head_dim, from_factor, from_factor,
        )
        rotary_dim = from_factor
    if rotary_dim is None:
        rotary_dim = head_dim if from_factor is None else from_factor
    elif from_factor is None and rotary_dim != head_dim:
        logger.warning(
            "config sets rotary_dim=%s without partial_rotary_factor: sglang-m3 (like upstream SGLang) "
            "rotates %s of %s channels; transformers' minimax_m3_vl would rotate all %s",
            rotary_dim, rotary_dim, head_dim, head_dim,
        )
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise M3ConfigError(f"config field 'rotary_dim' must be an even integer in [2, head_dim={head_dim}], got {rotary_dim!r}")
    return rotary_dim


def _rope_parameters(text: Mapping) -> Mapping:
    """``rope_parameters`` (transformers 5), or the older ``rope_scaling``; both may be present
    (then both are read, and a key in both must agree)."""
    merged: dict = {}
    for key in ("rope_scaling", "rope_parameters"):
        section = text.get(key)
        if section is None:
            continue
        if not isinstance(section, Mapping):
            raise M3ConfigError(f"config field '{key}' must be a mapping, got {section!r}")
        for name, found in section.items():
            merged[name] = fields.agree(f"rope_scaling.{name}", merged.get(name), f"rope_parameters.{name}", found)
    return merged


def _read_qk_norm(text: Mapping) -> None:
    """Per-head q/k norms are part of M3's attention; other forms are not implemented."""
    if not fields.boolean(text, "use_qk_norm", _SHIPPED_DEFAULTS["use_qk_norm"]):
        raise M3ConfigError("config field 'use_qk_norm' is false; sglang-m3 supports true (per-head q/k RMSNorm)")
    fields.choice(text, "qk_norm_type", ("per_head",), _SHIPPED_DEFAULTS["qk_norm_type"])


def _read_activation(text: Mapping) -> str:
    """``hidden_act`` of the experts, dense MLPs and shared expert."""
    act = fields.choice(text, "hidden_act", ("swigluoai", "silu"), _SHIPPED_DEFAULTS["hidden_act"])
    if act == "silu" and text.get("model_type") == _TRANSFORMERS_TEXT_TYPE:
        logger.info("hidden_act 'silu' written by transformers' %s means swiglu-oai (its modeling computes only that)", _TRANSFORMERS_TEXT_TYPE)
        act = "swigluoai"
    if act == "swigluoai":
        fields.choice(text, "swiglu_beta", (1.0,), 1.0)
    return act


def _read_routing(text: Mapping) -> bool:
    """Sigmoid router; whether the choice-only correction bias exists."""
    fields.choice(text, "scoring_func", ("sigmoid",), _SHIPPED_DEFAULTS["scoring_func"])
    return fields.boolean(text, "use_routing_bias", _SHIPPED_DEFAULTS["use_routing_bias"])


def _read_num_experts(text: Mapping) -> int:
    count = fields.agree("num_local_experts", text.get("num_local_experts"), "num_experts", text.get("num_experts"))
    return fields.positive_int({"num_local_experts": count}, "num_local_experts")


def _read_shared_intermediate(text: Mapping, moe_intermediate: int) -> int:
    """One shared expert of width ``shared_intermediate_size`` (= ``intermediate_size`` x
    ``n_shared_experts`` where only the latter is given, as upstream SGLang reads it)."""
    count = fields.positive_int(text, "n_shared_experts", 1)
    implied = moe_intermediate * count if text.get("n_shared_experts") is not None else None
    width = fields.agree("shared_intermediate_size", text.get("shared_intermediate_size"), "intermediate_size x n_shared_experts", implied)
    return fields.positive_int({"shared_intermediate_size": width}, "shared_intermediate_size")


def _read_moe_layers(text: Mapping, num_layers: int) -> tuple[bool, ...]:
    """Which layers are MoE: ``moe_layer_freq`` (shipped: list of 0/1, or an int k: every k-th
    layer from ``first_k_dense_replace``) or ``mlp_layer_types`` (HF); both must agree."""
    freq = text.get("moe_layer_freq")
    if isinstance(freq, int) and not isinstance(freq, bool):
        if freq < 1:
            raise M3ConfigError(f"config field 'moe_layer_freq' must be >= 1 or a per-layer list, got {freq!r}")
        first = fields.non_negative_int(text, "first_k_dense_replace", 0)
        freq = [int(i >= first and i % freq == 0) for i in range(num_layers)]
    from_freq = None if freq is None else fields.per_layer_flags(freq, num_layers, "moe_layer_freq", {1}, {0})
    types = text.get("mlp_layer_types")
    from_types = None if types is None else fields.per_layer_flags(types, num_layers, "mlp_layer_types", {"sparse", "moe"}, {"dense"})
    moe = fields.agree("moe_layer_freq", from_freq, "mlp_layer_types", from_types)
    if moe is None:
        raise M3ConfigError("config field 'moe_layer_freq' (or 'mlp_layer_types') is missing: which layers are MoE")
    return moe


def _read_sparse(text: Mapping, num_layers: int) -> dict:
    """MSA settings from the flat keys and/or ``sparse_attention_config``; spellings must agree."""
    nested = text.get("sparse_attention_config") or {}
    if not isinstance(nested, Mapping):
        raise M3ConfigError("config field 'sparse_attention_config' must be a mapping")
    unknown = sorted(set(nested) - _KNOWN_NESTED)
    if unknown:
        raise M3ConfigError(
            f"unknown key(s) in config field 'sparse_attention_config': {', '.join(unknown)}; "
            f"accepted keys: {', '.join(sorted(_KNOWN_NESTED))}"
        )
    fields.choice(nested, "sparse_score_type", ("max",), "max", name="sparse_attention_config.sparse_score_type")
    merged = {}
    for nested_key, flat_key in _NESTED_TO_FLAT.items():
        merged[flat_key] = fields.agree(flat_key, text.get(flat_key), f"sparse_attention_config.{nested_key}", nested.get(nested_key))
    sparse_layers = _read_sparse_layers(text, nested, num_layers)
    _read_disable_index_value(nested, sparse_layers)
    def count(flat_key: str, reader=fields.positive_int, *default) -> int:
        return reader(merged, flat_key, *default, name=_sparse_field(flat_key))

    return dict(
        index_heads=count("index_n_heads"),
        index_head_dim=count("index_head_dim"),
        index_block_size=count("index_block_size"),
        index_topk_blocks=count("index_topk_blocks"),
        index_local_blocks=count("index_local_blocks", fields.non_negative_int),
        # absent means none: the shipped checkpoint writes 0, a later revision 1
        index_init_blocks=count("index_init_blocks", fields.non_negative_int, 0),
        sparse_layers=sparse_layers,
    )


def _read_sparse_layers(text: Mapping, nested: Mapping, num_layers: int) -> tuple[bool, ...]:
    freq = nested.get("sparse_attention_freq")
    from_freq = None if freq is None else fields.per_layer_flags(freq, num_layers, "sparse_attention_config.sparse_attention_freq", {1}, {0})
    types = text.get("layer_types")
    from_types = None if types is None else fields.per_layer_flags(types, num_layers, "layer_types", {SPARSE_LAYER}, {DENSE_LAYER, "dense"})
    layers = fields.agree("layer_types", from_types, "sparse_attention_config.sparse_attention_freq", from_freq)
    if layers is None:
        raise M3ConfigError("config field 'layer_types' (or 'sparse_attention_config.sparse_attention_freq') is missing: which layers use MSA")
    if nested and not fields.boolean(nested, "use_sparse_attention", True, name="sparse_attention_config.use_sparse_attention") and any(layers):
        raise M3ConfigError(
            "config fields 'sparse_attention_config.use_sparse_attention' (false) and the sparse layer "
            "schedule (layers " + ", ".join(str(i) for i, s in enumerate(layers) if s) + ") disagree"
        )
    return layers


def _read_disable_index_value(nested: Mapping, sparse_layers: tuple[bool, ...]) -> None:
    """M3 has no index value: every sparse layer must disable it (the value path is not implemented)."""
    flags = nested.get("sparse_disable_index_value")
    if flags is None:
        return
    disabled = fields.per_layer_flags(flags, len(sparse_layers), "sparse_attention_config.sparse_disable_index_value", {1}, {0})
    enabled_on = [i for i, (s, d) in enumerate(zip(sparse_layers, disabled)) if s and not d]
    if enabled_on:
        raise M3ConfigError(
            f"config field 'sparse_attention_config.sparse_disable_index_value' enables the index value on "
            f"sparse layers {enabled_on}; sglang-m3 supports 1 (disabled) on every sparse layer"
        )


def _sparse_field(flat_key: str) -> str:
    """Both spellings of an MSA setting, for messages about a value read from either."""
    nested = {flat: nested for nested, flat in _NESTED_TO_FLAT.items()}[flat_key]
    return f"{flat_key} / sparse_attention_config.{nested}"


def _check_consistency(spec: M3TextSpec) -> None:
    if spec.experts_per_token > spec.num_experts:
        raise M3ConfigError(
            f"config field 'num_experts_per_tok' ({spec.experts_per_token}) exceeds 'num_local_experts' ({spec.num_experts})"
        )
    if not any(spec.sparse_layers):
        return
    if spec.index_heads != spec.num_kv_heads:
        raise M3ConfigError(
            f"config field '{_sparse_field('index_n_heads')}' ({spec.index_heads}) "
            f"must equal 'num_key_value_heads' ({spec.num_kv_heads}): each index head selects blocks for one KV group"
        )
    if spec.index_local_blocks + spec.index_init_blocks > spec.index_topk_blocks:
        raise M3ConfigError(
            f"config fields '{_sparse_field('index_local_blocks')}' ({spec.index_local_blocks}) + "
            f"'{_sparse_field('index_init_blocks')}' ({spec.index_init_blocks}) must not exceed "
            f"'{_sparse_field('index_topk_blocks')}' ({spec.index_topk_blocks})"
        )
    if spec.index_head_dim < spec.rotary_dim:
        raise M3ConfigError(
            f"config field '{_sparse_field('index_head_dim')}' ({spec.index_head_dim}) must be >= 'rotary_dim' ({spec.rotary_dim}): "
            "the index branch uses the same partial RoPE"
        )
