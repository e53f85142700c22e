"""MoE routing after the router logits: torch ops against ``router_topk``'s one launch (GPU).

Times what ``M3FusedMoeBlock.route`` runs after the router logits at M3's 128 experts, top 4 and
the shared slot as a fifth column: the torch ops (sigmoid, bias, top-k, gather, renormalise,
scale, int32, two pads) against :func:`sglang_m3.models.router_topk.route_topk`, each as CUDA-graph
replays of ``--calls`` routings back to back (as the layers of a decode step replay them), per row
count; and checks that both choose the same experts with weights within a few roundings.

    PYTHONPATH=.:kernels python benchmarks/router_topk.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from provenance import commit  # noqa: E402

from sglang_m3.models.moe_routing import sigmoid_topk  # noqa: E402
from sglang_m3.models.router_topk import route_topk  # noqa: E402

EXPERTS, TOP_K, SCALE = 128, 4, 2.0


def torch_route(logits, bias):
    weights, chosen = sigmoid_topk(logits, bias, TOP_K)
    weights, ids = weights * SCALE, chosen.to(torch.int32)
    return F.pad(weights, (0, 1), value=1.0), F.pad(ids, (0, 1), value=EXPERTS)


def fused_route(logits, bias):
    return route_topk(logits, bias, TOP_K, SCALE, shared_slot=EXPERTS)


def replay_us(route, logits, bias, calls: int, reps: int) -> float:
    """Microseconds per routing: a graph of ``calls`` routings, replayed ``reps`` times."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            route(logits, bias)  # compile and warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            route(logits, bias)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for the rows")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 8192])
    parser.add_argument("--calls", type=int, default=30, help="routings per graph")
    parser.add_argument("--reps", type=int, default=50, help="replays timed")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bias = torch.randn(EXPERTS, device="cuda", generator=gen) * 0.2
    rows = []
    for count in args.rows:
        logits = torch.randn(count, EXPERTS, device="cuda", generator=gen) * 3
        got_w, got_i = fused_route(logits, bias)
        want_w, want_i = torch_route(logits, bias)
        order_got, order_want = got_i.argsort(1), want_i.argsort(1)
        same = torch.equal(got_i.gather(1, order_got), want_i.gather(1, order_want))
        error = ((got_w.gather(1, order_got) - want_w.gather(1, order_want)).abs() / want_w.gather(1, order_want)).max().item()
        row = {
            "rows": count, "same_experts": same, "max_weight_rel_error": error,
            "torch_us": replay_us(torch_route, logits, bias, args.calls, args.reps),
            "fused_us": replay_us(fused_route, logits, bias, args.calls, args.reps),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump({"gpu": torch.cuda.get_device_name(), "commit": commit(), "experts": EXPERTS, "top_k": TOP_K,
                   "calls_per_graph": args.calls, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
