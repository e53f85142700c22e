"""Fused vs torch swiglu-oai of M3's dense MLP and shared experts on a CUDA GPU (issue 13).

The activation over one ``gate_up`` projection at M3's widths (bf16, alpha 1.702, limit 7): the
torch ops the model runs with ``SGLANG_M3_FUSED_ACT=0`` (``layers.swiglu_oai`` on the halves)
against the Triton kernel (``msa_kernels.triton_swiglu_oai``). Intermediate 3072 is a shared
expert's at TP1 (1536 at TP2), 12288 the dense layer's MLP. Timed eagerly and as CUDA-graph
replays with the timers of ``benchmarks/fused_attn_ops.py``, after checking the outputs against the
torch path (within two ulps, nearly all identical: ``tests/fused_act_cases.py``). ``bytes_min``
is one read of ``gate_up`` and one write of the result; ``fused_tb_s`` what the kernel reached.

Usage: PYTHONPATH=kernels:. python benchmarks/fused_swiglu_oai.py [--shapes 8192x12288 ...] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from provenance import commit
from fused_add_rmsnorm import time_variants, timers

from msa_kernels.triton_swiglu_oai import swiglu_oai
from sglang_m3.models.layers import swiglu_oai as torch_swiglu_oai

ALPHA, LIMIT, DTYPE = 1.702, 7.0, torch.bfloat16
SHAPES = ("1x3072", "64x3072", "8192x3072", "8192x1536", "1x12288", "8192x12288")


def measure(tokens: int, inter: int, time_eager, time_graph) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(tokens + inter)
    gate_up = (4 * torch.randn(tokens, 2 * inter, generator=gen, device="cuda")).to(DTYPE)
    gate, up = gate_up.chunk(2, dim=-1)
    variants = {
        "torch": lambda: torch_swiglu_oai(gate, up, ALPHA, LIMIT),
        "fused": lambda: swiglu_oai(gate_up, alpha=ALPHA, limit=LIMIT),
    }
    with torch.no_grad():
        want, got = variants["torch"](), variants["fused"]()
        ulp = 2.0 ** (torch.frexp(want.float())[1] - 8).float()
        worst = ((got.float() - want.float()).abs() / ulp).max().item()
        if worst > 2:
            raise SystemExit(f"{tokens}x{inter}: fused {worst:.2f} bf16 ulps from the torch path's")
        row = {"tokens": tokens, "intermediate": inter, "max_error_ulps": worst,
               "identical_fraction": (got == want).float().mean().item(), "bytes_min": 3 * tokens * inter * gate_up.element_size()}
        time_variants(row, variants, time_eager, time_graph)
    row["fused_tb_s"] = row["bytes_min"] / (row["fused"]["graph_us"] * 1e6)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="TOKENSxINTERMEDIATE")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    time_eager, time_graph = timers()
    rows = []
    for shape in args.shapes:
        tokens, inter = map(int, shape.split("x"))
        row = measure(tokens, inter, time_eager, time_graph)
        rows.append(row)
        print(
            f"{tokens:5d}x{inter:5d}  torch {row['torch']['eager_us']:8.1f} us eager {row['torch']['graph_us']:8.1f} us graph | "
            f"fused {row['fused']['eager_us']:7.1f} / {row['fused']['graph_us']:7.1f} us ({row['fused_tb_s']:.2f} TB/s) | "
            f"speedup {row['speedup_eager']:.2f}x / {row['speedup_graph']:.2f}x | identical {row['identical_fraction']:.5f}",
            flush=True,
        )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump({"gpu": torch.cuda.get_device_name(), "commit": commit(), "dtype": "bf16", "alpha": ALPHA, "limit": LIMIT, "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
