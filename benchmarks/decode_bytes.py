"""The byte minimum of one concurrency-1 decode step of an M3 config: the anchor under the c1 TPOT rows.

A lone request's decode step is bound by memory traffic: every weight it uses is read once from
HBM per step and nothing is reused across tokens. The least a step can read, per GPU, is:

* the lm head (vocabulary-parallel under TP) and one embedding row;
* each layer's attention projections (q/k/v and output, split by TP; KV heads replicated where
  TP exceeds them) and, on sparse layers, the index projections (replicated);
* each dense layer's MLP, and on MoE layers the ``num_experts_per_tok`` routed experts chosen plus
  the shared experts, each split by TP (expert parallelism is left out: which rank holds a
  token's experts changes from step to step), and the fp32 router;
* the KV cache the token attends at ``context`` tokens: all of it on dense layers; on sparse layers
  the index keys of the whole context and the K/V of the selected blocks (``sparse_topk_blocks``
  of ``sparse_block_size`` tokens, or the whole context where it is shorter).

Weights and cache are bf16 (2 bytes), the router fp32. Norm weights and activations are left out
(kilobytes). Dividing by the GPU's peak HBM bandwidth gives a time no server can beat; the ratio of
a measured TPOT to it says how far the step is from the memory bound, whatever the other server
does.

    python benchmarks/decode_bytes.py CONFIG_JSON [--tp N] [--context TOKENS] [--gpu H200]
"""

from __future__ import annotations

import argparse
import json
import sys

BF16, FP32 = 2, 4

#: peak HBM bandwidth per GPU, bytes per second (the vendors' data sheets: H100 SXM5 3.35 TB/s,
#: H200 4.8 TB/s)
HBM_PEAK_BYTES_PER_S = {"h100": 3.35e12, "h200": 4.8e12}


def c1_decode_step_bytes(model: dict, tp: int = 1, context: int = 2048) -> dict[str, int]:
    """Bytes one GPU of a ``tp``-way tensor-parallel server reads in a concurrency-1 decode step at
    ``context`` tokens, by part (the module docstring lists them); ``model`` is the config.json of
    the served text model."""
    if tp < 1 or context < 1:
        raise ValueError(f"tp and context must be positive, got tp={tp}, context={context}")
    hidden, head_dim = model["hidden_size"], model["head_dim"]
    q_width = model["num_attention_heads"] * head_dim // tp
    kv_heads = max(1, model["num_key_value_heads"] // tp)
    kv_width = kv_heads * head_dim
    sparse = model["sparse_attention_config"]
    sparse_layers = sparse["sparse_attention_freq"]
    moe_layers = model["moe_layer_freq"]
    if len(sparse_layers) != model["num_hidden_layers"] or len(moe_layers) != model["num_hidden_layers"]:
        raise ValueError("moe_layer_freq and sparse_attention_freq need one entry per layer")
    index_dim, index_heads = sparse["sparse_index_dim"], sparse["sparse_num_index_heads"]
    selected_tokens = min(context, sparse["sparse_topk_blocks"] * sparse["sparse_block_size"])
    experts_read = model["num_experts_per_tok"]
    shared_width = model.get("shared_intermediate_size") or model["intermediate_size"]
    parts = {
        "lm_head": model["vocab_size"] * hidden * BF16 // tp,
        "embedding_row": hidden * BF16,
        "attention_projections": 0,
        "index_projections": 0,
        "dense_mlp": 0,
        "routed_experts": 0,
        "shared_experts": 0,
        "router": 0,
        "kv_cache": 0,
        "index_keys": 0,
    }
    for is_sparse, is_moe in zip(sparse_layers, moe_layers):
        parts["attention_projections"] += (hidden * (q_width + 2 * kv_width) + q_width * hidden) * BF16
        if is_sparse:
            parts["index_projections"] += hidden * (index_heads * index_dim + index_dim) * BF16
            parts["index_keys"] += context * index_dim * BF16
            parts["kv_cache"] += selected_tokens * 2 * kv_width * BF16
        else:
            parts["kv_cache"] += context * 2 * kv_width * BF16
        if is_moe:
            parts["routed_experts"] += experts_read * 3 * hidden * model["intermediate_size"] * BF16 // tp
            parts["shared_experts"] += model.get("n_shared_experts", 0) * 3 * hidden * shared_width * BF16 // tp
            parts["router"] += hidden * model["num_local_experts"] * FP32
        else:
            parts["dense_mlp"] += 3 * hidden * model["dense_intermediate_size"] * BF16 // tp
    parts["total"] = sum(parts.values())
    return parts


def peak_bandwidth(gpu: str) -> float | None:
    """Peak HBM bytes per second of ``gpu`` (a name such as "NVIDIA H200"), None when unknown."""
    lowered = gpu.lower()
    return next((rate for key, rate in HBM_PEAK_BYTES_PER_S.items() if key in lowered), None)


def c1_minimum_ms(model: dict, gpu: str, tp: int = 1, context: int = 2048) -> float | None:
    """The c1 decode step's byte minimum in milliseconds on ``gpu`` (None for an unknown GPU)."""
    rate = peak_bandwidth(gpu)
    return None if rate is None else 1e3 * c1_decode_step_bytes(model, tp, context)["total"] / rate


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="the served model's config.json")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    parser.add_argument("--context", type=int, default=2048, help="tokens in the request's context (default 2048)")
    parser.add_argument("--gpu", default="H200", help=f"GPU whose peak bandwidth divides the bytes ({', '.join(HBM_PEAK_BYTES_PER_S)})")
    args = parser.parse_args(argv)
    with open(args.config, encoding="utf-8") as handle:
        model = json.load(handle)
    parts = c1_decode_step_bytes(model, args.tp, args.context)
    for name, count in parts.items():
        print(f"{name:22s} {count / 1e6:12.1f} MB")
    minimum = c1_minimum_ms(model, args.gpu, args.tp, args.context)
    print(f"minimum on {args.gpu}: " + ("unknown GPU" if minimum is None else f"{minimum:.3f} ms"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
