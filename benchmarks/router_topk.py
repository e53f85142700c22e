"""MoE routing after the router logits: torch ops against ``router_topk``'s one launch (GPU).

Times what ``M3FusedMoeBlock.route`` runs after the router logits at M3's 128 experts, top 4 and
the shared slot as a fifth column: the torch ops (sigmoid, bias, top-k, gather, renormalise,
scale, int32, two pads) against :func:`sglang_m3.models.router_topk.route_topk`, eagerly and as
CUDA-graph replays (the timers of ``fused_attn_ops.py``, as the other fused-op benchmarks), per
row count; and checks that both choose the same experts with weights within a few roundings.

    PYTHONPATH=.:kernels python benchmarks/router_topk.py --out results.json
"""

from __future__ import annotations

import argparse
import json

import torch
from fused_add_rmsnorm import time_variants, timers
from provenance import commit

from sglang_m3.models.moe_routing import fused_layer_routing
from sglang_m3.models.router_topk import route_topk

EXPERTS, TOP_K, SCALE = 128, 4, 2.0


def torch_route(logits, bias):
    return fused_layer_routing(logits, bias, TOP_K, SCALE, shared_slot=EXPERTS)


def fused_route(logits, bias):
    return route_topk(logits, bias, TOP_K, SCALE, shared_slot=EXPERTS)


def measure(rows: int, bias: torch.Tensor, gen: torch.Generator, time_eager, time_graph) -> dict:
    logits = torch.randn(rows, EXPERTS, device="cuda", generator=gen) * 3
    got_w, got_i = fused_route(logits, bias)
    want_w, want_i = torch_route(logits, bias)
    order_got, order_want = got_i.argsort(1), want_i.argsort(1)
    got_w, want_w = got_w.gather(1, order_got), want_w.gather(1, order_want)
    row = {
        "rows": rows,
        "same_experts": torch.equal(got_i.gather(1, order_got), want_i.gather(1, order_want)),
        "max_weight_rel_error": ((got_w - want_w).abs() / want_w).max().item(),
    }
    return time_variants(row, {"torch": lambda: torch_route(logits, bias), "fused": lambda: fused_route(logits, bias)},
                         time_eager, time_graph)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for the rows")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 8192])
    args = parser.parse_args()
    time_eager, time_graph = timers()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bias = torch.randn(EXPERTS, device="cuda", generator=gen) * 0.2
    rows = []
    for count in args.rows:
        rows.append(measure(count, bias, gen, time_eager, time_graph))
        print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump({"gpu": torch.cuda.get_device_name(), "commit": commit(), "experts": EXPERTS, "top_k": TOP_K, "rows": rows},
                  handle, indent=1)


if __name__ == "__main__":
    main()
