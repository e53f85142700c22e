"""Where each tensor of an original M3 checkpoint goes, and what shape it must have.

The loader checks every incoming tensor against ``expected_text_tensors`` before copying it (and
that no earlier tensor loaded the same weight), and checks at the end that every expected tensor
arrived, so a truncated, duplicated or mismatched checkpoint fails at load time with the tensor's
name instead of producing garbage later.

Checkpoint names are the original ones (as ``transformers`` saves them): VL checkpoints prefix the
text model with ``language_model.``; text-only ones do not. A dense MLP layer may appear under
``mlp.`` (original checkpoints) or ``block_sparse_moe.`` (transformers' save of a dense layer), so
both spellings are accepted. ``mtp.*`` modules (multi-token prediction) are skipped, as
upstream SGLang does, until speculative decoding uses them. An MXFP8 checkpoint's weight/scale
pairs are turned into plain weights by ``sglang_m3.quant.loading`` before these checks; in a
checkpoint whose config declares no quantization, scale tensors and FP8 weights are refused by name
rather than failing later on a shape or being cast silently.
"""

from __future__ import annotations

import re

from sglang_m3.config import M3TextSpec

IGNORED_PREFIXES = ("mtp.", "model.mtp.", "language_model.mtp.", "language_model.model.mtp.")
#: endings of buffers that some tools save beside the weights (rotary tables, which the model
#: computes from the config): skipped, as SGLang's own loaders skip them
DERIVED_BUFFER_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def is_derived_buffer(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is one of the ``DERIVED_BUFFER_SUFFIXES`` buffers."""
    return name.endswith(DERIVED_BUFFER_SUFFIXES)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
#: tensor-name endings that only quantized checkpoints have -> the format they indicate
_QUANTIZED_SUFFIXES = {
    ".weight_scale_inv": "block-wise FP8",
    ".weight_scale": "FP8/INT scaled weights",
    ".input_scale": "FP8 static activation scales",
    ".weight_scale_2": "NVFP4",
    ".qweight": "GPTQ/AWQ packed int weights",
    ".scales": "GPTQ/AWQ group scales",
}


#: checkpoint tensor (within a layer) -> (model parameter it loads into, shard id) of packed projections
PACKED = {
    "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", "q"),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", "k"),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", "v"),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1),
    "block_sparse_moe.shared_experts.gate_proj.weight": ("mlp.shared_experts.gate_up_proj.weight", 0),
    "block_sparse_moe.shared_experts.up_proj.weight": ("mlp.shared_experts.gate_up_proj.weight", 1),
}
#: checkpoint tensor (within a layer) -> the model parameter of another name it loads into
RENAMED = {
    "block_sparse_moe.shared_experts.down_proj.weight": "mlp.shared_experts.down_proj.weight",
    "block_sparse_moe.gate.weight": "mlp.gate.weight",
    "block_sparse_moe.e_score_correction_bias": "mlp.e_score_correction_bias",
}


def checkpoint_modules(module: str) -> list[str]:
    """The checkpoint modules whose weights the model's layer ``module`` (``model.layers.N.`` plus
    the model's name, e.g. ``...self_attn.qkv_proj``) holds: the parts of a packed projection
    (:data:`PACKED`), the original name of a renamed one (:data:`RENAMED`), else ``module`` itself.
    A dense MLP's parts are listed under both spellings ``canonical_dense_mlp_name`` accepts."""
    match = _LAYER.match(module)
    if match is None:
        return [module]
    layer, local = f"model.layers.{match.group(1)}.", match.group(2) + ".weight"
    parts = [name for name, (target, _) in PACKED.items() if target == local]
    parts += [name for name, target in RENAMED.items() if target == local]
    parts = parts or [local]
    if local.startswith("mlp.") and not local.startswith("mlp.shared_experts."):
        parts += ["block_sparse_moe." + name[len("mlp.") :] for name in parts]
    return [layer + name[: -len(".weight")] for name in parts]


class CheckpointError(ValueError):
    """A checkpoint tensor is missing, misshapen or not part of M3; the message names it."""


def quantized_format(name: str) -> str | None:
    """The quantization format a tensor name ending indicates, None for a plain tensor name."""
    return next((fmt for suffix, fmt in _QUANTIZED_SUFFIXES.items() if name.endswith(suffix)), None)


def refuse_quantized_tensor(name: str, tensor=None) -> None:
    """Raise for a quantized tensor (by name ending or 8-bit float dtype) in a checkpoint whose
    config declares no quantization, naming the tensor and the format."""
    fmt = quantized_format(name)
    if fmt is None and tensor is not None and tensor.dtype.is_floating_point and tensor.element_size() == 1:
        fmt = f"{tensor.dtype} weights"
    if fmt is not None:
        raise CheckpointError(
            f"checkpoint tensor '{name}' belongs to a quantized checkpoint ({fmt}), but config.json "
            "declares no quantization_config: sglang-m3 serves BF16 checkpoints and MXFP8 ones "
            "declared as such"
        )


def text_tensor_name(name: str) -> str | None:
    """Canonical text-model name (``model.layers.N...`` / ``lm_head.weight``) or None for non-text tensors."""
    if name.startswith("language_model."):
        name = name[len("language_model.") :]
    if name.startswith(("model.", "lm_head.")):
        return name
    return None


def canonical_dense_mlp_name(name: str, spec: M3TextSpec) -> str:
    """Map ``block_sparse_moe.{gate,up,down}_proj`` of a dense layer onto ``mlp.``."""
    match = _LAYER.match(name)
    if match and int(match.group(1)) < spec.num_layers and not spec.moe_layers[int(match.group(1))]:
        rest = match.group(2)
        if rest.startswith("block_sparse_moe."):
            return f"model.layers.{match.group(1)}.mlp.{rest[len('block_sparse_moe.'):]}"
    return name


def missing_tensor_spellings(name: str) -> str:
    """Canonical tensor ``name`` as a checkpoint may spell it, for naming a missing tensor: a
    dense MLP's under both spellings ``canonical_dense_mlp_name`` accepts, since transformers
    saves it under ``block_sparse_moe.``, which the canonical ``mlp.`` name does not show."""
    match = _LAYER.match(name)
    if match is None or not match.group(2).startswith("mlp."):
        return name
    return f"{name} (or model.layers.{match.group(1)}.block_sparse_moe.{match.group(2)[len('mlp.'):]})"


def expected_text_tensors(spec: M3TextSpec) -> dict[str, tuple[int, ...]]:
    """Full (unsharded) shapes of every text-model tensor in canonical naming."""
    h, d = spec.hidden_size, spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (spec.num_heads * d, h),
                p + "self_attn.k_proj.weight": (spec.num_kv_heads * d, h),
                p + "self_attn.v_proj.weight": (spec.num_kv_heads * d, h),
                p + "self_attn.o_proj.weight": (h, spec.num_heads * d),
                p + "self_attn.q_norm.weight": (d,),
                p + "self_attn.k_norm.weight": (d,),
            }
        )
        if spec.sparse_layers[i]:
            di = spec.index_head_dim
            shapes.update(
                {
                    p + "self_attn.index_q_proj.weight": (spec.index_heads * di, h),
                    p + "self_attn.index_k_proj.weight": (di, h),
                    p + "self_attn.index_q_norm.weight": (di,),
                    p + "self_attn.index_k_norm.weight": (di,),
                }
            )
        if spec.moe_layers[i]:
            m = p + "block_sparse_moe."
            inter, shared = spec.moe_intermediate_size, spec.shared_intermediate_size
            shapes[m + "gate.weight"] = (spec.num_experts, h)
            if spec.use_routing_bias:
                shapes[m + "e_score_correction_bias"] = (spec.num_experts,)
            for e in range(spec.num_experts):
                shapes[m + f"experts.{e}.w1.weight"] = (inter, h)
                shapes[m + f"experts.{e}.w3.weight"] = (inter, h)
                shapes[m + f"experts.{e}.w2.weight"] = (h, inter)
            shapes[m + "shared_experts.gate_proj.weight"] = (shared, h)
            shapes[m + "shared_experts.up_proj.weight"] = (shared, h)
            shapes[m + "shared_experts.down_proj.weight"] = (h, shared)
        else:
            inter = spec.dense_intermediate_size
            shapes[p + "mlp.gate_proj.weight"] = (inter, h)
            shapes[p + "mlp.up_proj.weight"] = (inter, h)
            shapes[p + "mlp.down_proj.weight"] = (h, inter)
    return shapes
