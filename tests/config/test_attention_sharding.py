"""Each tensor-parallel rank's index heads belong to the KV group it serves: the index query head
``r`` scores blocks for KV group ``r`` (M3_FACTS s.2), so a rank must keep exactly the index heads
of the KV heads SGLang's ``QKVParallelLinear`` loads on it, including when ``tp`` exceeds the KV
head count and KV heads are replicated. Checked by loading a k/q projection whose rows carry their
head number and reading back which heads landed on the rank."""

from __future__ import annotations

import pytest
import torch
from fused_attn_cases import as_rank, random_attention, tiny_text_spec


def _heads_held(attention, shard: str, heads: int, rank_heads: int, tp: int, rank: int) -> list[int]:
    """The global heads of projection ``shard`` ('q' or 'k') that the rank's qkv_proj holds."""
    dim, hidden = attention.head_dim, attention.qkv_proj.weight.shape[1]
    numbered = torch.arange(heads, dtype=torch.float32).repeat_interleave(dim)[:, None].expand(heads * dim, hidden)
    param = attention.qkv_proj.weight
    with as_rank(tp, rank), torch.no_grad():
        param.weight_loader(param, numbered.contiguous(), shard)
    start = 0 if shard == "q" else attention.num_heads * dim
    rows = param[start : start + rank_heads * dim, 0]
    return [int(rows[i * dim]) for i in range(rank_heads)]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_index_heads_follow_the_rank_kv_heads(tp):
    spec = tiny_text_spec()  # 8 query heads, 2 KV heads (= index heads)
    sparse_layer = spec.sparse_layers.index(True)
    group_size = spec.num_heads // spec.num_kv_heads
    for rank in range(tp):
        attention = random_attention(spec, sparse_layer, tp, rank)
        kv_heads = _heads_held(attention, "k", spec.num_kv_heads, attention.num_kv_heads, tp, rank)
        q_heads = _heads_held(attention, "q", spec.num_heads, attention.num_heads, tp, rank)
        index_heads = list(range(spec.index_heads))[attention.local_index_heads]
        assert index_heads == kv_heads, f"tp {tp} rank {rank}: index heads {index_heads}, KV heads {kv_heads}"
        assert sorted({q // group_size for q in q_heads}) == kv_heads, f"tp {tp} rank {rank}: query heads {q_heads}"
