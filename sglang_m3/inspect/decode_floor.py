"""The least one concurrency-1 decode step must read from HBM, per rank, and the time that takes.

A lone request's decode step is bound by memory traffic: each weight it uses is read once per
token and nothing is reused across tokens. So the bytes a rank must read for one token, over the
GPU's peak HBM bandwidth, give a time per token that no server can beat; a measured TPOT over it
says how far a server is from the memory bound, whatever another server does. It is counted from
the rank as built (``meta_build``), not from a formula of the config, so every split the model
classes make (KV heads replicated beyond their count, vocabulary-parallel lm head, experts by TP
or EP) is the one counted:

* the lm head and the final norm (the whole embedding table where the lm head is tied to it), and
  one embedding row otherwise;
* every weight inside the layers except the routed experts: attention and index projections,
  norms, the fp32 router, dense MLPs and shared experts;
* the routed experts a token chooses: ``num_experts_per_tok`` of them per MoE layer under TP; under
  EP the experts are spread over ``ep`` ranks, and whichever experts are chosen, some rank holds at
  least ``ceil(k / ep)`` of them, so that many are counted on the busiest rank;
* the cache at ``context`` tokens: K and V of every token on dense layers; on sparse layers the
  index keys of every token plus K and V of the selected blocks only (``sparse_topk_blocks`` blocks
  of ``sparse_block_size`` tokens, or the whole context where it is shorter).

The vision tower is not read while decoding text, and activations (kilobytes) are left out.
"""

from __future__ import annotations

import math

from sglang_m3.config import M3TextSpec
from sglang_m3.recipe.catalog import CATALOG

#: the context the floor is counted at unless told: the e2e benchmark's 2K-token prompts
DEFAULT_FLOOR_CONTEXT = 2048

#: the step's parts in the order the report lists them
PARTS = ("lm_head", "embedding_row", "layer_weights", "chosen_experts", "kv_cache", "index_keys")


class FloorContextError(ValueError):
    """A context the floor cannot be counted at (under one token, or past the model's length)."""


def check_context(context: int, spec: M3TextSpec) -> None:
    if not 1 <= context <= spec.max_position_embeddings:
        raise FloorContextError(
            f"context {context:,} tokens: the decode floor is counted at 1 to "
            f"max_position_embeddings ({spec.max_position_embeddings:,}) tokens"
        )


def _product_key(name: str) -> str:
    return name.upper().replace(" ", "-").replace("_", "-")


def peak_bandwidth(gpu: str) -> float | None:
    """Peak memory bytes per second of ``gpu``, a device name as torch reports it ("NVIDIA H100 80GB
    HBM3"), or None for a device the catalog does not hold. Names are matched whole against the
    product string each profile's node label carries (the device name with dashes or underscores
    for spaces), so an H100 PCIe (2.0 TB/s) or NVL (3.9 TB/s) does not take the SXM part's rate."""
    key = _product_key(gpu)
    return next((profile.hbm_tbps * 1e12 for profile in CATALOG.values()
                 if profile.hbm_tbps and _product_key(profile.node_label[1]) == key), None)


def nbytes(param) -> int:
    return param.nbytes


def rank_step_bytes(rank, spec: M3TextSpec, ep: int, context: int, size=nbytes) -> dict[str, int]:
    """Bytes ``rank`` (a ``RankBuild``) reads in one decode step at ``context`` tokens, by part
    (:data:`PARTS`, plus ``total``); ``size`` gives a parameter's bytes (as built, or as the MXFP8
    checkpoint stores it); ``context`` as :func:`check_context` accepts."""
    parts = dict.fromkeys(PARTS, 0)
    text = [param for param in rank.params if not param.name.startswith("vision.")]
    embedding = [param for param in text if param.place == "first"]
    last = [param for param in text if param.place == "last"]
    tied = not any(param.name.startswith("lm_head.") for param in last)
    parts["lm_head"] = sum(size(param) for param in last + (embedding if tied else []))
    if not tied:
        parts["embedding_row"] = sum(size(param) // param.shape[0] for param in embedding)
    chosen_per_layer = math.ceil(spec.experts_per_token / ep)
    for param in text:
        if not isinstance(param.place, int):
            continue
        if param.group == "experts":  # [experts on this rank, ...]: the chosen ones' share
            parts["chosen_experts"] += min(chosen_per_layer, param.shape[0]) * size(param) // param.shape[0]
        else:
            parts["layer_weights"] += size(param)
    kv_per_layer = rank.kv_bytes_per_token // spec.num_layers
    sparse_layers = len(spec.sparse_layer_ids)
    selected = min(context, spec.index_topk_blocks * spec.index_block_size)
    parts["kv_cache"] = kv_per_layer * (len(spec.dense_layer_ids) * context + sparse_layers * selected)
    parts["index_keys"] = rank.index_bytes_per_token * context
    parts["total"] = sum(parts.values())
    return parts


def decode_floor(ranks: list, spec: M3TextSpec, ep: int, context: int, mxfp8_size) -> dict:
    """The busiest rank's step at ``context`` tokens, as built (bf16, fp32 routers) and with the
    MXFP8 checkpoint's weights (``mxfp8_size`` per parameter; the cache stays bf16), with the time
    per token each accelerator profile of the catalog needs to read it."""
    steps = {}
    for name, size in (("bf16", nbytes), ("mxfp8", mxfp8_size)):
        steps[name] = max((rank_step_bytes(rank, spec, ep, context, size) for rank in ranks), key=lambda step: step["total"])
    return {
        "context": context,
        "chosen_experts_per_moe_layer": min(math.ceil(spec.experts_per_token / ep), spec.num_experts // ep),
        **steps,
        "ms_per_token": {
            profile.name: {name: 1e3 * step["total"] / (profile.hbm_tbps * 1e12) for name, step in steps.items()}
            for profile in CATALOG.values() if profile.hbm_tbps
        },
    }
