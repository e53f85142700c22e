"""RoPE of a config with ``rotary_dim`` 8, ``head_dim`` 16 and no ``partial_rotary_factor``.

Documents a transformers bug: transformers' ``minimax_m3_vl`` ignores ``rotary_dim`` and rotates
``head_dim x rope_parameters.partial_rotary_factor`` channels (the factor defaults to 1.0, so all
16 here). sglang-m3, like upstream SGLang, rotates ``rotary_dim`` channels. Both are checked
against RoPE computed in float64 from its definition: NeoX rotate-half on the first
``rotary_dim`` channels with ``inv_freq[i] = theta ** (-2i / rotary_dim)``, the rest unchanged.
The shipped checkpoint sets both ``rotary_dim`` 64 and ``partial_rotary_factor`` 0.5, on which
the two agree; tests/e2e/transformers_saved.py spells both for the same reason.
"""

from __future__ import annotations

import torch

HEAD_DIM, ROTARY_DIM, THETA = 16, 8, 5_000_000.0
TEXT_CONFIG = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 16,
    "dense_intermediate_size": 16,
    "shared_intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": HEAD_DIM,
    "rotary_dim": ROTARY_DIM,
    "rope_parameters": {"rope_type": "default", "rope_theta": THETA},  # no partial_rotary_factor
    "num_local_experts": 2,
    "num_experts_per_tok": 1,
    "routed_scaling_factor": 2.0,
    "mlp_layer_types": ["dense"],
    "layer_types": ["full_attention"],
    "index_n_heads": 1,
    "index_head_dim": 16,
    "index_block_size": 16,
    "index_topk_blocks": 4,
    "index_local_blocks": 1,
    "max_position_embeddings": 4096,
}
TOLERANCE = 5e-6  # float32 RoPE at positions < 64 vs float64 (measured ~3e-7 and ~1e-6)


def rope_float64(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """RoPE from the definition, in float64. ``x``: [tokens, heads, head_dim]."""
    x = x.double()
    half = rotary_dim // 2
    inv_freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / rotary_dim)
    angle = positions.double()[:, None, None] * inv_freq  # [tokens, 1, half]
    cos, sin = angle.cos(), angle.sin()
    first, second = x[..., :half], x[..., half:rotary_dim]
    return torch.cat((first * cos - second * sin, second * cos + first * sin, x[..., rotary_dim:]), dim=-1)


def inputs():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(48, 2, HEAD_DIM, generator=generator)
    positions = torch.cat((torch.arange(40), torch.tensor([41, 47, 50, 53, 57, 59, 61, 63])))
    return q, positions


def sglang_m3_rope(q, positions):
    from sglang_m3.config import M3TextSpec
    from sglang_m3.models.layers import PartialNeoxRotary

    spec = M3TextSpec.from_config(TEXT_CONFIG)
    assert spec.rotary_dim == ROTARY_DIM
    (out,) = PartialNeoxRotary(spec.rotary_dim, spec.rope_theta)(positions, q)
    return out


def transformers_rope(q, positions):
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLRotaryEmbedding, apply_rotary_pos_emb

    config = MiniMaxM3VLTextConfig(**TEXT_CONFIG)
    assert config.rotary_dim == ROTARY_DIM  # read, then not used by the rotary embedding
    heads = q.transpose(0, 1)[None]  # [1, heads, tokens, head_dim]
    cos, sin = MiniMaxM3VLRotaryEmbedding(config)(heads, positions[None])
    rotated, _ = apply_rotary_pos_emb(heads, heads, cos, sin)
    return rotated[0].transpose(0, 1)


def test_sglang_m3_rotates_rotary_dim_channels_as_defined():
    q, positions = inputs()
    expected = rope_float64(q, positions, ROTARY_DIM, THETA)
    assert (sglang_m3_rope(q, positions).double() - expected).abs().max().item() < TOLERANCE


def test_transformers_bug_ignores_rotary_dim_and_rotates_every_channel():
    q, positions = inputs()
    served_by_transformers = transformers_rope(q, positions).double()
    as_defined = rope_float64(q, positions, ROTARY_DIM, THETA)
    all_channels = rope_float64(q, positions, HEAD_DIM, THETA)
    assert (served_by_transformers - as_defined).abs().max().item() > 0.1
    assert (served_by_transformers - all_channels).abs().max().item() < TOLERANCE
    # the channels past rotary_dim, which RoPE must leave alone, are changed
    assert not torch.equal(served_by_transformers[..., ROTARY_DIM:], q[..., ROTARY_DIM:].double())
