"""Adds up the built ranks into the inspect report, and cuts the geometry record from it.

The report is plain data (the ``--json`` output). The geometry record is the part that does not
depend on ``--tp`` / ``--ep``; it is committed as ``sglang_m3/recipe/data/m3_geometry.json``
for the recipe layer, which must judge a deployment without torch or SGLang.
"""

from __future__ import annotations

from collections import defaultdict

from sglang_m3.config import M3TextSpec
from sglang_m3.inspect.decode_floor import DEFAULT_FLOOR_CONTEXT, check_context, decode_floor
from sglang_m3.inspect.meta_build import BUILD_DTYPE_NAME, RankBuild, architecture_of, layout
from sglang_m3.inspect.parallel_sizes import check_parallel_sizes
from sglang_m3.inspect.sharding import GROUP_RULES, GROUPS, ShardedParam
from sglang_m3.inspect.source import read_config

#: report keys that make up the geometry record (everything independent of --tp / --ep)
GEOMETRY_KEYS = ("dtype", "geometry", "parameters", "bytes", "weights", "weights_mxfp8", "kv_cache")
VISION_PREFIX = "vision."
GENERATED_BY = "sglang-m3 inspect CONFIG --write-geometry PATH (do not edit by hand; tests/test_inspect.py checks it)"


def inspect_config(path: str, tp: int = 1, ep: int = 1, tensors: bool = False, context: int = DEFAULT_FLOOR_CONTEXT) -> dict:
    top, spec = read_config(path)
    check_parallel_sizes(spec, tp, ep)
    check_context(context, spec)
    with layout(top, 1, 1) as build:
        full = build(0)
    if (tp, ep) == (1, 1):
        ranks = [full]
    else:
        with layout(top, tp, ep) as build:
            ranks = [build(rank) for rank in range(tp)]
    report = {
        "config": path,
        "architecture": architecture_of(top),
        "dtype": BUILD_DTYPE_NAME,
        "geometry": _geometry(spec),
        "parameters": _parameters(full, spec),
        "bytes": {
            "bf16": sum(p.numel for p in full.params) * 2,
            "as_built": sum(p.nbytes for p in full.params),
            "mxfp8": sum(mxfp8_bytes(p) for p in full.params),
        },
        "weights": _weights(full, spec),
        "weights_mxfp8": _weights(full, spec, mxfp8_bytes),
        "kv_cache": _kv_cache(full),
        "per_rank": {**_per_rank(full, ranks, spec, tp, ep), "decode_floor": decode_floor(ranks, spec, ep, context, mxfp8_bytes)},
    }
    if tensors:
        report["tensors"] = checkpoint_tensors(full, spec, "text_config" in top)
    return report


def geometry_record(report: dict) -> dict:
    return {"generated_by": GENERATED_BY, **{key: report[key] for key in GEOMETRY_KEYS}}


def layer_kind(spec: M3TextSpec, layer: int) -> str:
    attention = "sparse_attention" if spec.sparse_layers[layer] else "dense_attention"
    return f"{attention}+{'moe' if spec.moe_layers[layer] else 'dense_mlp'}"


def _geometry(spec: M3TextSpec) -> dict:
    return {
        "num_layers": spec.num_layers,
        "dense_layers": len(spec.dense_layer_ids),
        "sparse_layers": len(spec.sparse_layer_ids),
        "moe_layers": sum(spec.moe_layers),
        "layer_is_sparse": list(spec.sparse_layers),
        "num_query_heads": spec.num_heads,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "num_index_heads": spec.index_heads,
        "index_key_dim": spec.index_head_dim,
        "num_routed_experts": spec.num_experts,
        "experts_per_token": spec.experts_per_token,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "shared_intermediate_size": spec.shared_intermediate_size,
        "dense_intermediate_size": spec.dense_intermediate_size,
        "sparse_block_size": spec.index_block_size,
        "sparse_topk_blocks": spec.index_topk_blocks,
        "hidden_size": spec.hidden_size,
        "vocab_size": spec.vocab_size,
        "max_context_length": spec.max_position_embeddings,
    }


def _parameters(full: RankBuild, spec: M3TextSpec) -> dict:
    vision = sum(p.numel for p in full.params if p.name.startswith(VISION_PREFIX))
    total = sum(p.numel for p in full.params)
    return {
        "total": total,
        "text": total - vision,
        "vision": vision,
        "mtp_modules": spec.num_mtp_modules,
        "mtp_counted": False,
    }


def mxfp8_bytes(param: ShardedParam) -> int:
    """Bytes of ``param`` in the MXFP8 checkpoint. Quantized (1 byte per element plus one e8m0
    byte per 32): the sharded linears inside the layers, i.e. attention q/k/v/o, dense MLPs,
    shared and routed experts (see ``sglang_m3/quant/README.md``). As built: embeddings,
    lm_head, norms, index projections, routers (fp32) and the vision tower."""
    if isinstance(param.place, int) and param.group != "replicated" and len(param.shape) >= 2:
        return param.numel + param.numel // 32
    return param.nbytes


def _group_bytes(params: list[ShardedParam], size=lambda param: param.nbytes) -> dict[str, int]:
    totals = dict.fromkeys(GROUPS, 0)
    for param in params:
        totals[param.group] += size(param)
    return totals


def _weights(full: RankBuild, spec: M3TextSpec, size=lambda param: param.nbytes) -> dict:
    """Bytes by sharding group (``size`` per parameter: as built, or as MXFP8 stores it): outside
    the layers (first / last pipeline stage) and per layer kind."""
    by_place: dict[int | str, list[ShardedParam]] = defaultdict(list)
    for param in full.params:
        by_place[param.place].append(param)
    kinds = [layer_kind(spec, layer) for layer in range(spec.num_layers)]
    layer_groups = {}
    for layer, kind in enumerate(kinds):
        groups = _group_bytes(by_place[layer], size)
        if layer_groups.setdefault(kind, groups) != groups:
            raise AssertionError(f"layer {layer} differs from the other {kind} layers")
    return {
        "rules": GROUP_RULES,
        "first_stage": _group_bytes(by_place["first"], size),
        "last_stage": _group_bytes(by_place["last"], size),
        "layer_kinds": kinds,
        "layer_groups": layer_groups,
    }


def _kv_cache(build: RankBuild) -> dict:
    return {
        "dtype": BUILD_DTYPE_NAME,
        "kv_bytes_per_token": build.kv_bytes_per_token,
        "index_bytes_per_token": build.index_bytes_per_token,
        "total_bytes_per_token": build.kv_bytes_per_token + build.index_bytes_per_token,
        "rule": "K and V of every layer (KV heads on the rank x head_dim each) plus one index key of "
                "index_head_dim per sparse layer (replicated on every rank)",
    }


def _per_rank(full: RankBuild, ranks: list[RankBuild], spec: M3TextSpec, tp: int, ep: int) -> dict:
    full_shapes = {p.name: p.shape for p in full.params}
    full_groups = _group_bytes(full.params)
    rank_bytes = [sum(p.nbytes for p in rank.params) for rank in ranks]
    first = ranks[0]
    groups = _group_bytes(first.params)
    return {
        "tp": tp,
        "ep": ep,
        "parameters": sum(p.numel for p in first.params),
        "bytes": max(rank_bytes),
        "bytes_by_rank": rank_bytes,
        "groups": {
            group: {
                "bytes": groups[group],
                "split_ways": round(full_groups[group] / groups[group], 3) if groups[group] else None,
            }
            for group in GROUPS
        },
        "uneven": _uneven(full_shapes, ranks, spec, tp, ep),
        "kv_heads_per_rank": first.kv_heads_per_rank,
        "kv_head_replication": max(1, tp // spec.num_kv_heads),
        "kv_bytes_per_token": first.kv_bytes_per_token,
        "index_bytes_per_token": first.index_bytes_per_token,
        "total_kv_bytes_per_token": first.kv_bytes_per_token + first.index_bytes_per_token,
    }


def _uneven(full_shapes: dict, ranks: list[RankBuild], spec: M3TextSpec, tp: int, ep: int) -> list[str]:
    """Parameters whose rank shapes differ between ranks or do not make up the whole."""
    ways = {"attention_tp": tp, "kv_heads": min(tp, spec.num_kv_heads), "tp": tp, "experts": tp, "replicated": 1}
    problems = []
    for param in ranks[0].params:
        whole = 1
        for size in full_shapes[param.name]:
            whole *= size
        if param.numel * ways[param.group] != whole:
            problems.append(f"{param.name}: {param.shape} x {ways[param.group]} ranks != {full_shapes[param.name]}")
    reference = [p.shape for p in ranks[0].params]
    for rank in ranks[1:]:
        if [p.shape for p in rank.params] != reference:
            problems.append(f"rank {rank.rank} holds other shapes than rank 0")
    return problems


def checkpoint_tensors(full: RankBuild, spec: M3TextSpec, vl_layout: bool) -> dict[str, list[int]]:
    """Every tensor the checkpoint must hold for this config (MTP excluded), full shapes.

    Text tensors carry the ``language_model.`` prefix where the config has the VL layout
    (``text_config``), as such checkpoints are saved, text-only ones included.
    """
    from sglang_m3.models.checkpoint_layout import expected_text_tensors
    from sglang_m3.models.vision import checkpoint_name_of

    prefix = "language_model." if vl_layout else ""
    names = {prefix + name: list(shape) for name, shape in expected_text_tensors(spec).items()}
    for param in full.params:
        if param.name.startswith(VISION_PREFIX):
            names[checkpoint_name_of(param.name[len(VISION_PREFIX):])] = list(param.shape)
    return names
