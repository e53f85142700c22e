"""The decode top-k in a served graph: whole-context width against the narrowest width that holds
the visible blocks (``msa_kernels.api.topk_widths``).

A decode graph's plan spans the server's whole context (the e2e benchmark's servers: 131,456
tokens, 1,027 blocks of 128, so the top-k's block range rounds to 2,048), while the requests it
replays hold 2K or 32K tokens. For batches of 1, 16 and 64 requests, M3's four index heads
(``--heads 2`` for one TP2 rank's) and live contexts of 2K, 32K and 128K tokens, this times the
top-k alone as a CUDA-graph replay twice: every token ranking all 2,048 blocks (``SHORT`` =
``MEDIUM`` = ``NBP``: the kernel before the widths), and as ``decode_select`` launches it. Both
selections must be identical (checked on every row before timing). JSON to ``--out``.

    scripts/gpu/run.sh exec python benchmarks/decode_topk_widths.py --out $OUT/decode_topk_widths.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))
from provenance import commit  # noqa: E402
from msa_kernel_bench import graph_replay_us  # noqa: E402
from msa_kernels import api  # noqa: E402
from msa_kernels.plan import plan_decode  # noqa: E402
from msa_kernels.reference import MSAParams  # noqa: E402
from msa_kernels.triton_select import decode_topk_kernel  # noqa: E402

PARAMS = MSAParams(block_size=128, topk=16, local_blocks=1, init_blocks=0)
GRAPH_CONTEXT = 131072 + 256 + 128  # e2e_gpu.py's --context-length
BATCHES = (1, 16, 64)
LIVE_CONTEXTS = (2048, 32768, 131072)


def measure(batch: int, live: int, heads: int) -> dict:
    blocks = -(-GRAPH_CONTEXT // PARAMS.block_size)
    pages = torch.arange(batch * blocks, device="cuda", dtype=torch.int32).view(batch, blocks)
    plan = plan_decode(PARAMS, pages, torch.full((batch,), live, device="cuda"), q_len=1, num_kv_heads=heads)
    tiles = plan.tiles
    rows = max(16, triton.next_power_of_2(heads))
    scores = torch.randn(batch, rows, plan.max_blocks, device="cuda")
    nbp = triton.next_power_of_2(plan.max_blocks)

    def launch(selected, widths):
        decode_topk_kernel[(batch, heads, 1)](
            scores, selected, tiles.tok0, tiles.pos0, tiles.ntok,
            scores.stride(0), scores.stride(1), selected.stride(0), selected.stride(1),
            NUM_HEADS=heads, BLOCK=PARAMS.block_size, NBP=nbp, TOPK=PARAMS.topk, KP=PARAMS.topk,
            LOCAL=PARAMS.local_blocks, INIT=PARAMS.init_blocks, **widths, num_warps=api.topk_num_warps(nbp),
        )

    full_widths, widths = {"SHORT": nbp, "MEDIUM": nbp}, api.topk_widths(nbp)
    full_sel = torch.empty(batch, heads, PARAMS.topk, dtype=torch.int32, device="cuda")
    sel = torch.empty_like(full_sel)
    launch(full_sel, full_widths)
    launch(sel, widths)
    identical = bool(torch.equal(full_sel, sel))
    return {
        "batch": batch, "heads": heads, "live_tokens": live, "graph_tokens": GRAPH_CONTEXT, "nbp": nbp, **widths,
        "identical": identical,
        "full_width_us": graph_replay_us(lambda _: launch(full_sel, full_widths), 1),
        "widths_us": graph_replay_us(lambda _: launch(sel, widths), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--heads", type=int, nargs="+", default=[4, 2], help="index heads per rank (4: TP1, 2: TP2)")
    args = parser.parse_args()
    rows = []
    for heads in args.heads:
        for batch in BATCHES:
            for live in LIVE_CONTEXTS:
                row = measure(batch, live, heads)
                rows.append(row)
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "commit": commit(), "triton": triton.__version__, "rows": rows}
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)
    if not all(row["identical"] for row in rows):
        sys.exit("selections differ between the whole width and the narrow widths")


if __name__ == "__main__":
    main()
