"""M3's router logits on the GPU: the fp32 linear against the GEMM over 16-bit parts of the weight,
and, for decode's few rows, the Triton GEMV over the parts (``sglang_m3.models.router_gemv``).

At M3's widths (hidden 6,144, 128 experts), for two router weights, a random fp32 one (three bf16
parts, as ``--load-format dummy`` gives) and a bf16-exact one (one part, as a real checkpoint's
bf16 router gives), and for the row counts a decode step, a chain-of-3 verify, a batch of 16 and
prefill chunks give the router: each path's time as a CUDA-graph replay, and the largest
difference of the logits from a float64 reference (the parts' error must not exceed the fp32
linear's by more than a rounding). ``bf16_parts_us`` is the GEMM over the parts (``torch.mm``,
then the parts' logits summed) called directly: ``router_logits`` takes the GEMV at up to
``MAX_GEMV_ROWS`` rows on CUDA, so ``gemv_us`` is what it runs there. ``parts`` per row.

By default each graph holds one call on one weight (the method of the results at 0ca541b: the
replay's own few microseconds are in every column, and the weight sits in L2 after the first
replay). ``--weight-copies N`` captures N calls back to back over N copies of the weights instead
(each call's weight read from HBM once N copies exceed L2, as between the layers of a decode step)
and reports the time per call. ``--sweep-gemv`` also times the GEMV over :data:`SWEEP_TILES` at
``--sweep-rows`` (the winners set ``router_gemv.GEMV_TILES``). JSON to ``--out``.

    scripts/gpu/run.sh exec python3 benchmarks/router_gemm.py --out $OUT/router_gemm.json [--weight-copies 64] [--sweep-gemv]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(__file__))
from provenance import commit  # noqa: E402
from msa_kernel_bench import graph_replay_us  # noqa: E402

from sglang_m3.models.moe_routing import add_router_parameters, prepare_half_router, router_logits  # noqa: E402
from sglang_m3.models.router_gemv import MAX_GEMV_ROWS, GemvTile, gemv_tile, padded_rows, router_logits_gemv  # noqa: E402

EXPERTS, HIDDEN = 128, 6144
ROWS = (1, 4, 8, 16, 64, 8192, 32768)
WEIGHTS = ("random-fp32", "bf16-exact")
#: --sweep-gemv candidates (block_e, block_k, num_warps, vec); at each row count only those whose
#: ``T_PAD x block_e x block_k`` tile is at most :data:`SWEEP_MAX_PER_THREAD` values per thread
SWEEP_TILES = tuple(
    GemvTile(block_e, block_k, warps, vec)
    for block_e in (1, 2)
    for block_k in (512, 1024, 2048, 4096)
    for warps in (2, 4, 8)
    for vec in (4, 8)
)
SWEEP_MAX_PER_THREAD = 128


def parts_gemm(x: torch.Tensor, gate_half: torch.Tensor) -> torch.Tensor:
    """``router_logits``' GEMM over the parts, called directly: one ``torch.mm``, the parts' logits summed."""
    logits = torch.mm(x, gate_half.t(), out_dtype=torch.float32)
    parts = gate_half.shape[0] // EXPERTS
    return logits if parts == 1 else logits.view(-1, parts, EXPERTS).sum(1)


def router_copies(weight: torch.Tensor, copies: int) -> list[torch.nn.Module]:
    """``copies`` router blocks holding ``weight`` (fp32, [E, H]) and its bf16 parts."""
    blocks = []
    for _ in range(copies):
        block = torch.nn.Module()
        add_router_parameters(block, SimpleNamespace(num_experts=EXPERTS, hidden_size=HIDDEN, use_routing_bias=False))
        block.cuda()
        with torch.no_grad():
            block.gate.weight.copy_(weight)
        assert prepare_half_router(block, torch.bfloat16)
        blocks.append(block)
    return blocks


def time_us(call, blocks: list[torch.nn.Module]) -> float:
    """Per call: ``call(block)`` for every block captured back to back in one graph."""
    return graph_replay_us(lambda i: call(blocks[i]), len(blocks))


def max_err(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return (logits.double() - reference).abs().max().item()


def sweep(blocks: list[torch.nn.Module], rows: int) -> list[dict]:
    x = torch.randn(rows, HIDDEN, device="cuda").bfloat16()
    chosen = gemv_tile(rows)
    entries = []
    for tile in SWEEP_TILES:
        if padded_rows(rows) * tile.block_e * tile.block_k > SWEEP_MAX_PER_THREAD * 32 * tile.num_warps:
            continue
        entry = {"tile": vars(tile), "table": tile == chosen}
        try:
            entry["us"] = time_us(lambda block: router_logits_gemv(x, block.gate_half, EXPERTS, tile), blocks)
        except Exception as error:  # noqa: BLE001  (a tile that does not compile: out of resources)
            entry["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        entries.append(entry)
    timed = sorted((e for e in entries if "us" in e), key=lambda e: e["us"])
    best = ", ".join(f"{tuple(e['tile'].values())}{'*' if e['table'] else ''} {e['us']:.2f}" for e in timed[:6])
    print(f"  sweep T={rows:2d} (T_PAD {padded_rows(rows)}) x{blocks[0].gate_half.shape[0] // EXPERTS} parts, best: {best}", flush=True)
    return entries


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="result JSON")
    parser.add_argument("--weight-copies", type=int, default=1, help="weights (and calls) per timed graph; 1: the 0ca541b method")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="row counts")
    parser.add_argument("--sweep-gemv", action="store_true", help="also time the GEMV over SWEEP_TILES")
    parser.add_argument("--sweep-rows", type=int, nargs="+", default=[1, 4, 8], help="row counts of --sweep-gemv")
    parser.add_argument("--weights", nargs="+", choices=WEIGHTS, default=list(WEIGHTS),
                        help="router weights: a random fp32 one (three bf16 parts), its bf16 rounding (one part)")
    args = parser.parse_args()
    torch.manual_seed(0)
    random_weight = torch.randn(EXPERTS, HIDDEN, device="cuda") * HIDDEN**-0.5
    weights = {"random-fp32": random_weight, "bf16-exact": random_weight.bfloat16().float()}
    rows, sweeps = [], []
    with torch.inference_mode():
        for name in args.weights:
            weight = weights[name]
            blocks = router_copies(weight, args.weight_copies)
            gate, gate_half = blocks[0].gate, blocks[0].gate_half
            parts = gate_half.shape[0] // EXPERTS
            for tokens in args.rows:
                x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
                reference = x.double() @ weight.double().t()
                row = {
                    "weight": name,
                    "parts": parts,
                    "tokens": tokens,
                    "fp32_linear_us": time_us(lambda block: router_logits(block.gate, x), blocks),
                    "bf16_parts_us": time_us(lambda block: parts_gemm(x, block.gate_half), blocks),
                    "fp32_linear_max_err": max_err(router_logits(gate, x), reference),
                    "bf16_parts_max_err": max_err(parts_gemm(x, gate_half), reference),
                    "max_abs_logit": reference.abs().max().item(),
                }
                line = (f"x{parts} parts  T={tokens:6d}  fp32 linear {row['fp32_linear_us']:8.1f} us  "
                        f"bf16 parts GEMM {row['bf16_parts_us']:7.1f} us")
                errors = f"max err {row['fp32_linear_max_err']:.2e} / {row['bf16_parts_max_err']:.2e}"
                if tokens <= MAX_GEMV_ROWS:
                    gemv = router_logits_gemv(x, gate_half, EXPERTS)
                    assert torch.equal(router_logits(gate, x, gate_half), gemv), "router_logits did not take the GEMV"
                    row["gemv_us"] = time_us(lambda block: router_logits_gemv(x, block.gate_half, EXPERTS), blocks)
                    row["gemv_max_err"] = max_err(gemv, reference)
                    line += f"  GEMV {row['gemv_us']:6.1f} us"
                    errors += f" / {row['gemv_max_err']:.2e}"
                rows.append(row)
                print(f"{line}  {errors}  (max |logit| {row['max_abs_logit']:.2f})", flush=True)
            if args.sweep_gemv:
                for tokens in args.sweep_rows:
                    sweeps.append({"weight": name, "parts": parts, "tokens": tokens, "tiles": sweep(blocks, tokens)})
            del blocks
    result = {
        "gpu": torch.cuda.get_device_name(), "commit": commit(), "experts": EXPERTS, "hidden": HIDDEN,
        "weight_copies": args.weight_copies, "max_gemv_rows": MAX_GEMV_ROWS, "rows": rows,
    }
    if sweeps:
        result["gemv_sweep"] = sweeps
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
