"""Fused vs torch residual add + RMSNorm of M3's hidden states on a CUDA GPU (issue 13).

One add + Gemma RMSNorm at the real width (hidden 6144, bf16, eps 1e-6) for T rows: the torch
path the model runs with ``SGLANG_M3_FUSED_NORM=0`` (``M3RMSNorm.add_forward``) against the
Triton kernel (``msa_kernels.triton_add_rmsnorm``). Every decoder layer runs two of these. Timed
eagerly and as CUDA-graph replays with the timers of ``benchmarks/fused_attn_ops.py``; the
outputs are checked against the torch path first (new residual bit-identical, normed rows within
one bf16 ulp).

Usage: PYTHONPATH=kernels:. python benchmarks/fused_add_rmsnorm.py [--tokens 1 64 8192] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

import torch

from msa_kernels.triton_add_rmsnorm import add_rmsnorm
from sglang_m3.models.layers import M3RMSNorm

HIDDEN, EPS, DTYPE = 6144, 1e-6, torch.bfloat16


def timers():
    """``time_eager`` and ``time_graph`` of the fused attention-op benchmark beside this file."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fused_attn_ops.py")
    spec = importlib.util.spec_from_file_location("fused_attn_ops_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.time_eager, module.time_graph


def time_variants(row: dict, variants: dict, time_eager, time_graph) -> dict:
    """``row`` with each of ``variants`` ("torch", "fused") timed eagerly and as graph replays,
    and the fused one's speed-up over torch in each mode."""
    for name, fn in variants.items():
        row[name] = {"eager_us": time_eager(fn), "graph_us": time_graph(fn)}
    for mode in ("eager_us", "graph_us"):
        row[f"speedup_{mode[:-3]}"] = row["torch"][mode] / row["fused"][mode]
    return row


def measure(tokens: int, time_eager, time_graph) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen, device="cuda").to(DTYPE)
    residual = (3 * torch.randn(tokens, HIDDEN, generator=gen, device="cuda")).to(DTYPE)
    norm = M3RMSNorm(HIDDEN, EPS, gemma=True).to(device="cuda", dtype=DTYPE)
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.3, generator=gen)
    variants = {
        "torch": lambda: norm.add_forward(x, residual),
        "fused": lambda: add_rmsnorm(x, residual, norm.weight, eps=EPS, weight_offset=norm.offset),
    }
    with torch.no_grad():
        (want, want_sum), (got, got_sum) = variants["torch"](), variants["fused"]()
        if not torch.equal(got_sum, want_sum):
            raise SystemExit(f"T={tokens}: the fused residual differs from the torch path's")
        ulp = 2.0 ** (torch.frexp(want.float())[1] - 8).float()
        worst = ((got.float() - want.float()).abs() / ulp).max().item()
        if worst > 1:
            raise SystemExit(f"T={tokens}: fused normed rows {worst:.2f} bf16 ulps from the torch path's")
        row = {"tokens": tokens, "max_error_ulps": worst, "identical_fraction": (got == want).float().mean().item()}
        return time_variants(row, variants, time_eager, time_graph)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 8192])
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    time_eager, time_graph = timers()
    rows = []
    for tokens in args.tokens:
        row = measure(tokens, time_eager, time_graph)
        rows.append(row)
        print(
            f"T={tokens:5d}  torch {row['torch']['eager_us']:8.1f} us eager {row['torch']['graph_us']:7.1f} us graph | "
            f"fused {row['fused']['eager_us']:8.1f} / {row['fused']['graph_us']:7.1f} us | "
            f"speedup {row['speedup_eager']:.2f}x / {row['speedup_graph']:.2f}x | identical {row['identical_fraction']:.5f}",
            flush=True,
        )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump({"gpu": torch.cuda.get_device_name(), "hidden": HIDDEN, "dtype": "bf16", "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
