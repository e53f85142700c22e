"""MXFP8 W8A16 dense linears (ours) against BF16 ``F.linear`` (cuBLAS) at M3's shapes, on one GPU.

The shapes are one rank's slices of M3's dense linears at TP8 (the served Hopper recipes), plus the
whole qkv projection (TP1): qkv 1280 x 6144 (8 query heads + the replicated KV head), o 6144 x 1024,
shared expert gate_up 768 x 6144 and down 6144 x 384, dense MLP gate_up 3072 x 6144 and down
6144 x 1536; TP1 qkv 9216 x 6144. Both sides compute the same function: random MXFP8 weights
(e4m3 elements, e8m0 bytes 2**-14..2**-11) for ours, their exact bf16 dequantization for
``F.linear`` (what SGLang's unquantized linear method runs on CUDA).

Before timing, each (shape, token count) checks our paths (``msa_kernels.triton_mxfp8_linear.PATHS``:
``gemv`` up to ``GEMV_MAX_TOKENS`` tokens, the MMA core ``gemm`` up to ``GEMM_MAX_TOKENS``,
``dequantize`` + matmul beyond; the GEMV only up to ``GEMV_TIMED_MAX_TOKENS``) against the fp32
reference; ours must be within a relative error of 1e-2. Timing: CUDA-graph replays of ``--reps``
calls cycling over enough weight copies that they exceed L2 four times over (one layer's slice
alone would sit in L2), so every call reads its weight from HBM as in a real decode step. Reported
per call: microseconds of BF16, of ours on the path it takes and on each other path (a column per
path), the weight bytes per second, and BF16 / ours. The last table sums one TP8 layer's qkv + o +
shared expert. ``--sweep-gemv`` times the GEMV at ``--sweep-gemv-tokens`` (default 1) over
:data:`SWEEP_GEMV` tiles per shape (the winners set ``linear_gemv_tile`` in
``msa_kernels/mxfp8_gemv.py``).

    scripts/gpu/run.sh exec python benchmarks/mxfp8_linear.py --out "$OUT" [--tokens 1 8 64 128 256 512 8192] [--shapes ...] [--sweep-gemv]

Writes ``mxfp8_linear_<gpu>.json`` and ``mxfp8_linear_<gpu>.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "kernels"), ROOT]

import torch  # noqa: E402

from msa_kernels import mxfp8_gemv  # noqa: E402
from msa_kernels import triton_mxfp8_linear as linear  # noqa: E402
from msa_kernels.mxfp8_gemv import GemvTile  # noqa: E402
from msa_kernels.mxfp8_moe_reference import dequantize  # noqa: E402
from provenance import commit  # noqa: E402

#: name -> (out features, in features)
SHAPES = {
    "qkv_tp8": (1280, 6144),
    "o_tp8": (6144, 1024),
    "shared_gate_up_tp8": (768, 6144),
    "shared_down_tp8": (6144, 384),
    "dense_gate_up_tp8": (3072, 6144),
    "dense_down_tp8": (6144, 1536),
    "qkv_tp1": (9216, 6144),
}
#: the linears of one MoE layer at TP8 (the 57 sparse layers' decode share of dense weights)
MOE_LAYER = ("qkv_tp8", "o_tp8", "shared_gate_up_tp8", "shared_down_tp8")
SCALE_BYTES = (113, 117)
L2_MULTIPLE = 4
#: most tokens at which the GEMV is timed (and checked) when it is not the served path
GEMV_TIMED_MAX_TOKENS = 16
#: ``--sweep-gemv`` candidates (block_n, block_k, num_warps)
SWEEP_GEMV = [GemvTile(8, 256, 2), GemvTile(8, 256, 4), GemvTile(16, 256, 2), GemvTile(16, 256, 4), GemvTile(16, 128, 4),
              GemvTile(32, 256, 4), GemvTile(32, 256, 8), GemvTile(64, 256, 8)]


def load_moe_benchmark():
    """``benchmarks/mxfp8_moe.py`` by path (this folder is off ``sys.path``): its result files and
    the fused-MoE tuner's CUDA-graph timing it loads."""
    spec = importlib.util.spec_from_file_location("mxfp8_moe_bench", os.path.join(HERE, "mxfp8_moe.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MOE = load_moe_benchmark()
TUNE = MOE.TUNE


def weight_copies(rows: int, cols: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(e4m3, scales, bf16 dequantization)`` copies whose BF16 bytes exceed L2 ``L2_MULTIPLE`` times."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    count = max(2, min(64, -(-L2_MULTIPLE * l2 // (2 * rows * cols))))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    copies = []
    for _ in range(count):
        values = torch.randn(rows, cols, generator=gen, device="cuda", dtype=torch.bfloat16) * 64
        elements = values.clamp(-448, 448).to(torch.float8_e4m3fn)
        scales = torch.randint(*SCALE_BYTES, (rows, cols // 32), generator=gen, device="cuda", dtype=torch.uint8)
        copies.append((elements, scales, dequantize(elements, scales).to(torch.bfloat16)))
    return copies


def timed_paths(tokens: int) -> tuple[str, ...]:
    """Our paths timed at ``tokens`` (the served one always)."""
    return tuple(p for p in linear.PATHS if p != "gemv" or tokens <= GEMV_TIMED_MAX_TOKENS or linear.linear_path(tokens) == "gemv")


def measure(name: str, tokens: int, copies, tickets, reps: int, sweep_gemv: bool = False) -> dict:
    rows, cols = SHAPES[name]
    x = torch.randn(tokens, cols, device="cuda", dtype=torch.bfloat16)
    elements, scales, bf16 = copies[0]
    torch.backends.cuda.matmul.allow_tf32 = False
    want = x.float() @ dequantize(elements, scales).T
    served = linear.linear_path(tokens)
    paths = timed_paths(tokens)
    errors = {path: MOE.relative_error(linear.mxfp8_linear(x, elements, scales, tickets, path=path), want) for path in paths}
    errors["bf16"] = MOE.relative_error(torch.nn.functional.linear(x, bf16), want)
    for path in paths:
        if errors[path] > 1e-2:
            raise SystemExit(f"{name} T={tokens}: MXFP8 linear ({path}) differs from the reference by {errors[path]:.3e}")

    def ours(path, tile=None):
        return lambda e, s, _: linear.mxfp8_linear(x, e, s, tickets, path=path, gemv_tile=tile)

    row = {
        "shape": name, "out_features": rows, "in_features": cols, "tokens": tokens, "weight_copies": len(copies),
        "relative_error": errors, "mxfp8_path": served,
        "bf16_us": TUNE.graph_us(lambda e, s, w: torch.nn.functional.linear(x, w), copies, reps),
        "mxfp8_us": TUNE.graph_us(ours(served), copies, reps),
    }
    row["path_us"] = {path: row["mxfp8_us"] if path == served else TUNE.graph_us(ours(path), copies, reps) for path in paths}
    other = "dequantize" if served != "dequantize" else "gemm"
    row["other_path"] = {"path": other, "us": row["path_us"][other]}
    if sweep_gemv:
        row["gemv_sweep"] = []
        for tile in SWEEP_GEMV:
            entry = {"tile": vars(tile), "table": tile == mxfp8_gemv.linear_gemv_tile(cols)}
            try:
                entry["us"] = TUNE.graph_us(ours("gemv", tile), copies, reps)
            except Exception as error:  # a tile Triton cannot compile, or more tiles than tickets
                entry["error"] = f"{type(error).__name__}: {error}"[:300]
            row["gemv_sweep"].append(entry)
    elements_count = rows * cols
    row["bf16_gb_per_s"] = 2 * elements_count / row["bf16_us"] / 1e3
    row["mxfp8_gb_per_s"] = elements_count * (1 + 1 / 32) / row["mxfp8_us"] / 1e3
    row["speedup"] = row["bf16_us"] / row["mxfp8_us"]
    return row


def markdown(result: dict) -> str:
    lines = [
        f"# MXFP8 W8A16 dense linears vs BF16 F.linear, {result['gpu']}",
        "",
        f"CUDA-graph replays of {result['reps']} calls cycling weight copies that exceed L2 {L2_MULTIPLE}x; commit {result['commit']}. "
        f"MXFP8: the path taken at that token count (gemv up to {result.get('gemv_max_tokens', 0)} tokens, gemm up to "
        f"{result['gemm_max_tokens']}, dequantize + matmul beyond); a column per path times each (gemv up to {GEMV_TIMED_MAX_TOKENS} tokens).",
        "",
        "| shape | N x K | tokens | BF16 us | BF16 GB/s | MXFP8 path | MXFP8 us | MXFP8 GB/s | BF16 / MXFP8 | "
        + " | ".join(f"{path} us" for path in linear.PATHS) + f" | rel. error ({', '.join(linear.PATHS)}, bf16) |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|" + "---:|" * len(linear.PATHS) + "---|",
    ]
    for r in result["rows"]:
        e = r["relative_error"]
        paths_us = r.get("path_us", {r["mxfp8_path"]: r["mxfp8_us"], r["other_path"]["path"]: r["other_path"]["us"]})
        lines.append(
            f"| {r['shape']} | {r['out_features']} x {r['in_features']} | {r['tokens']} | {r['bf16_us']:.1f} | {r['bf16_gb_per_s']:.0f} | "
            f"{r['mxfp8_path']} | {r['mxfp8_us']:.1f} | {r['mxfp8_gb_per_s']:.0f} | {r['speedup']:.2f}x | "
            + " | ".join(f"{paths_us[path]:.1f}" if path in paths_us else "-" for path in linear.PATHS) + " | "
            + ", ".join(f"{e[key]:.1e}" if key in e else "-" for key in (*linear.PATHS, "bf16")) + " |"
        )
    layer = result.get("moe_layer_tp8", {})
    if layer:
        lines += ["", "One TP8 MoE layer's dense linears (qkv + o + shared gate_up + down), sum of the rows above:", "",
                  "| tokens | BF16 us | MXFP8 us | BF16 / MXFP8 |", "|---:|---:|---:|---:|"]
        for tokens, sums in layer.items():
            lines.append(f"| {tokens} | {sums['bf16_us']:.1f} | {sums['mxfp8_us']:.1f} | {sums['bf16_us'] / sums['mxfp8_us']:.2f}x |")
    sweeps = [r for r in result["rows"] if "gemv_sweep" in r]
    if sweeps:
        lines += ["", "GEMV tile sweep (block_n, block_k, warps -> us; * the tile linear_gemv_tile picks):", ""]
        for r in sweeps:
            timed = [f"{tuple(s['tile'].values())}{'*' if s['table'] else ''}: {s['us']:.1f}" for s in r["gemv_sweep"] if "us" in s]
            lines.append(f"- {r['shape']} T={r['tokens']} (BF16 {r['bf16_us']:.1f}): " + "; ".join(timed))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 128, 256, 512, 8192])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--reps", type=int, default=20, help="calls per captured graph")
    parser.add_argument("--sweep-gemv", action="store_true", help="also time the GEMV over candidate tiles (SWEEP_GEMV)")
    parser.add_argument("--sweep-gemv-tokens", type=int, nargs="+", default=[1], help="token counts of --sweep-gemv")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    import triton

    torch.set_grad_enabled(False)
    started = time.perf_counter()
    gpu = torch.cuda.get_device_name()
    result = {
        "gpu": gpu, "triton": triton.__version__, "torch": torch.__version__, "commit": commit(),
        "reps": args.reps, "gemm_max_tokens": linear.GEMM_MAX_TOKENS, "gemv_max_tokens": linear.GEMV_MAX_TOKENS, "rows": [],
    }
    for index, name in enumerate(args.shapes):
        copies = weight_copies(*SHAPES[name], seed=index)
        tickets = torch.zeros(linear.ticket_count(SHAPES[name][0]), dtype=torch.int32, device="cuda")
        for tokens in list(dict.fromkeys(args.tokens + (args.sweep_gemv_tokens if args.sweep_gemv else []))):
            row = measure(name, tokens, copies, tickets, args.reps, args.sweep_gemv and tokens in args.sweep_gemv_tokens)
            assert torch.count_nonzero(tickets).item() == 0, "split tickets not back at zero"
            result["rows"].append(row)
            print(
                f"{name:20s} T={tokens:5d}: BF16 {row['bf16_us']:8.1f} us | MXFP8 {row['mxfp8_path']} {row['mxfp8_us']:8.1f} us "
                f"({row['mxfp8_gb_per_s']:5.0f} GB/s) | {row['speedup']:.2f}x | paths " + ", ".join(f"{p} {us:.1f}" for p, us in row["path_us"].items()),
                flush=True,
            )
            for entry in row.get("gemv_sweep", []):
                print(f"    gemv {entry['tile']}: {entry.get('us', entry.get('error'))}", flush=True)
        del copies
    if all(name in args.shapes for name in MOE_LAYER):
        result["moe_layer_tp8"] = {
            tokens: {kind: sum(r[kind] for r in result["rows"] if r["tokens"] == tokens and r["shape"] in MOE_LAYER) for kind in ("bf16_us", "mxfp8_us")}
            for tokens in args.tokens
        }
    name = MOE.write_results(args.out, "mxfp8_linear", result, markdown(result))
    print(f"wrote {name}.json/.md in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
