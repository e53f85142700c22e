"""Routed experts of a prefill-size batch: SGLang's Triton fused MoE against the grouped GEMMs.

For M3's expert shapes on one rank (TP1: E=128, N=3072; TP2: E=128, N=1536; TP2 + EP2: 64 local
experts of the 128, N=3072) and batches of 256 to 8,192 tokens at top-4 (uniformly random
choices, as ``tune_fused_moe.py`` draws them), each as a CUDA-graph replay:

- ``fused_us``: SGLang's ``fused_experts`` with the tile the M3 block would hand it (the shipped
  table of ``sglang_m3/models/moe_kernel_configs``, measured best on this GPU);
- ``grouped_us``: ``sglang_m3.models.grouped_moe.grouped_experts`` (sort, gather, two
  ``torch._grouped_mm``, activation, weighted combine);
- ``tflops``: the two expert GEMMs' FLOPs over each time;
- ``max_err_fused`` / ``max_err_grouped``: each path's largest difference from an fp32 evaluation
  of the same bf16 weights, relative to that output's largest magnitude.

    scripts/gpu/run.sh exec python benchmarks/grouped_moe.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from e2e_gpu import commit, gpu_name  # noqa: E402
from midsize_m3 import midsize_text_config, write_midsize_checkpoint  # noqa: E402
from tune_fused_moe import TOP_K, MoeCase, graph_us, publish_single_rank  # noqa: E402

TOKENS = (256, 512, 1024, 2048, 4096, 8192)
#: (label, local experts, intermediate per rank, expert-parallel ranks)
SHAPES = (("tp1", 128, 3072, 1), ("tp2", 128, 1536, 1), ("tp2_ep2", 64, 3072, 2))


def fp32_reference(case: MoeCase, x, ids, weights, act):
    """The routed sum in fp32 over the bf16 weights, one expert at a time."""
    import torch

    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for expert in range(case.experts):
        token, choice = (ids == expert).nonzero(as_tuple=True)
        if token.numel():
            hidden = act((x[token].float() @ case.w13[expert].float().T))
            out.index_add_(0, token, weights[token, choice, None] * (hidden @ case.w2[expert].float().T))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    args = parser.parse_args(argv)

    import torch

    from sglang_m3.models.fused_activation import GatedActivation
    from sglang_m3.models.grouped_moe import grouped_experts
    from sglang_m3.models.layers import gated_activation
    from sglang_m3.models.moe_kernel_configs import nearest, tile_table

    model = midsize_text_config(1, 3)
    alpha, limit, hidden = model["swiglu_alpha"], model["swiglu_limit"], model["hidden_size"]
    publish_single_rank(write_midsize_checkpoint(tempfile.mkdtemp(prefix="m3-grouped-"), 1, 3))
    torch.set_grad_enabled(False)
    act = GatedActivation(model["hidden_act"], alpha, limit)
    torch_act = gated_activation(model["hidden_act"], alpha, limit)
    rows = []
    for label, experts, intermediate, ep in SHAPES:
        case = MoeCase(experts, intermediate, hidden, alpha, limit, ep=ep)
        table = tile_table(experts, intermediate, hidden)
        for tokens in args.tokens:
            x, ids, weights = case.batch(tokens)
            tiles = nearest(table, tokens) if table else None

            def fused():
                return case.run(tokens, tiles)

            def grouped():
                return grouped_experts(x, ids, weights, case.w13, case.w2, act)

            reference = fp32_reference(case, x, ids, weights, lambda h: torch_act(*h.chunk(2, dim=-1)))
            scale = reference.abs().max().item()
            errors = {name: (call().float() - reference).abs().max().item() / scale for name, call in (("fused", fused), ("grouped", grouped))}
            fused_us, grouped_us = graph_us(fused, [()], args.reps, 3), graph_us(grouped, [()], args.reps, 3)
            chosen = int((ids >= 0).sum().item())
            flops = 2 * chosen * hidden * 3 * intermediate
            row = {"shape": label, "experts": experts, "intermediate": intermediate, "ep": ep, "tokens": tokens, "top_k": TOP_K,
                   "tile": tiles, "fused_us": round(fused_us, 1), "grouped_us": round(grouped_us, 1),
                   "speedup": round(fused_us / grouped_us, 3),
                   "tflops_fused": round(flops / fused_us / 1e6, 1), "tflops_grouped": round(flops / grouped_us / 1e6, 1),
                   "max_err_fused": round(errors["fused"], 5), "max_err_grouped": round(errors["grouped"], 5)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"gpu": gpu_name(), "commit": commit(), "torch": torch.__version__, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "grouped_moe.json"), "w") as handle:
        json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
