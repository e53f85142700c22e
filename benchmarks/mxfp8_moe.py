"""MXFP8 W8A16 MoE experts (ours) against SGLang's BF16 Triton fused MoE at M3's shape, on one GPU.

One M3 MoE layer's routed experts at TP1: 128 experts, hidden 6144, intermediate 3072, top-4,
swiglu-oai. Both sides compute the same function: random MXFP8 weights (e4m3 elements, e8m0 scale
bytes 2**-14..2**-11) for ours, their exact bf16 dequantization for SGLang's ``fused_experts`` (the
served BF16 path, with the project's measured tile table where one exists for this GPU, as
``M3FusedMoeBlock`` uses it). Routing is excluded from both: random distinct top-4 ids and
weights are inputs.

Ours has four paths (``msa_kernels.triton_mxfp8_moe.PATHS``: the ``gemv`` of ``msa_kernels.mxfp8_gemv``
up to ``GEMV_MAX_TOKENS`` tokens, the core with ``fp16`` or ``bf16`` dots up to
``CORE_PATH_MAX_TOKENS``, ``CORE_DOT`` naming the served one, ``widen`` beyond); the headline
column is the path the served block takes at that token count, and every token count also times
the other paths (the GEMV only up to ``GEMV_TIMED_MAX_TOKENS``: it streams each pair's expert on
its own), each in its own column, so ``GEMV_MAX_TOKENS``, ``CORE_DOT`` and the crossover can be
set from the same run.

Before timing, each token count checks BF16 and all of our paths against the fp32 dequantized
reference (``msa_kernels.mxfp8_moe_reference``); ours must be within a relative error of 1e-2.
Timing: CUDA-graph replays of ``--reps`` calls, each call on the next of several input sets
(different tokens and routing), so consecutive calls read different experts; the weights of even
one call's 4 experts (226 MB in MXFP8, 453 MB in BF16) exceed L2 many times over. Reported per
call: microseconds, the byte minimum (the weights of the distinct experts the call's routing
chose, each read once) and the bandwidth that implies, and the BF16 / MXFP8 time ratio.
``--sweep`` also times the served path over a few tile configs per token count (the best goes to
``CORE_TILE_TABLE`` or ``TILE_TABLE`` in ``msa_kernels/triton_mxfp8_moe.py``). ``--sweep-gemv``
times the GEMV path at ``--sweep-gemv-tokens`` (default 1) over gate/up tiles (with the table's
down tile) and down tiles (with the table's gate/up tile): the best of each goes to
``MOE_GEMV_TABLE`` in ``msa_kernels/mxfp8_gemv.py``.

    scripts/gpu/run.sh exec python benchmarks/mxfp8_moe.py --out "$OUT" [--tokens 1 16 64 8192] [--sweep] [--sweep-gemv]

Writes ``mxfp8_moe_<gpu>.json`` and ``mxfp8_moe_<gpu>.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "kernels"), ROOT]

import torch  # noqa: E402

from msa_kernels.mxfp8_moe_reference import dequantize, reference_fused_experts  # noqa: E402
from msa_kernels.mxfp8_gemv import GemvTile, MoeGemvConfig  # noqa: E402
from msa_kernels.triton_mxfp8_moe import PATHS, TileConfig, gemm_path, mxfp8_fused_experts, pick_config  # noqa: E402
from provenance import commit  # noqa: E402

EXPERTS, HIDDEN, INTER, TOP_K = 128, 6144, 3072, 4
ALPHA, LIMIT = 1.702, 7.0
#: e8m0 bytes drawn per 32-element group (high end exclusive): factors 2**-14 .. 2**-11, weights of
#: standard deviation ~1e-2 (elements ~N(0, 64)), gate/up of order 1 for unit activations
SCALE_BYTES = (113, 117)
SWEEP = {
    # core paths: block_n is weight rows per program; fewer than 4 warps compile to mma.sync, 4+
    # warps with 64 rows per warpgroup to wgmma (the 27f1706 measurement: slower)
    "core": [
        TileConfig(16, 32, 256, 1, 2, 3), TileConfig(16, 32, 256, 1, 2, 4), TileConfig(16, 32, 128, 1, 2, 4),
        TileConfig(16, 32, 256, 1, 1, 3), TileConfig(16, 64, 256, 1, 1, 3), TileConfig(16, 64, 128, 1, 4, 4),
        TileConfig(32, 32, 128, 4, 2, 3),
    ],
    "decode": [
        TileConfig(16, 32, 128, 1, 4, 4), TileConfig(16, 64, 128, 1, 4, 4), TileConfig(16, 64, 256, 1, 4, 3),
        TileConfig(16, 128, 128, 1, 4, 3), TileConfig(16, 64, 128, 1, 4, 5), TileConfig(16, 32, 256, 1, 4, 4),
    ],
    "prefill": [
        TileConfig(64, 128, 64, 8, 8, 3), TileConfig(64, 128, 128, 8, 8, 3), TileConfig(128, 128, 64, 8, 8, 3),
        TileConfig(64, 64, 128, 8, 4, 4), TileConfig(128, 64, 64, 8, 4, 3),
    ],
}


#: most tokens at which the GEMV path is timed (and checked) when it is not the served one
GEMV_TIMED_MAX_TOKENS = 64
#: ``--sweep-gemv`` candidates (block_n, block_k, num_warps): each kernel's, with the other kernel
#: at its table tile. Gate/up ``block_n`` counts intermediate columns (twice the weight rows);
#: down ``block_n`` hidden columns per token (times top-k weight rows).
SWEEP_GEMV = {
    "gate_up": [GemvTile(8, 256, 4), GemvTile(16, 256, 4), GemvTile(32, 256, 4), GemvTile(16, 128, 4),
                GemvTile(16, 256, 2), GemvTile(16, 256, 8), GemvTile(32, 256, 8), GemvTile(64, 256, 8)],
    "down": [GemvTile(4, 256, 4), GemvTile(8, 256, 4), GemvTile(16, 256, 4), GemvTile(8, 128, 4),
             GemvTile(8, 256, 2), GemvTile(8, 256, 8), GemvTile(16, 256, 8), GemvTile(32, 256, 8)],
}


def timed_paths(tokens: int) -> tuple[str, ...]:
    """Our paths timed at ``tokens`` (the served one always)."""
    return tuple(path for path in PATHS if path != "gemv" or tokens <= GEMV_TIMED_MAX_TOKENS or gemm_path(tokens) == "gemv")


def load_benchmark_module(name: str):
    """A sibling benchmark module, loaded by path (this folder is off ``sys.path``, see above)."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench", os.path.join(HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: the fused-MoE tuner: its single-rank runtime context and its CUDA-graph timing serve here too
TUNE = load_benchmark_module("tune_fused_moe")


class Weights:
    """Random MXFP8 experts (built expert by expert) and their exact BF16 dequantization."""

    def __init__(self, seed: int = 0):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        shapes = {"w13": (2 * INTER, HIDDEN), "w2": (HIDDEN, INTER)}
        self.fp8, self.scale, self.bf16 = {}, {}, {}
        for name, (rows, cols) in shapes.items():
            self.fp8[name] = torch.empty(EXPERTS, rows, cols, dtype=torch.float8_e4m3fn, device="cuda")
            self.scale[name] = torch.randint(*SCALE_BYTES, (EXPERTS, rows, cols // 32), generator=gen, device="cuda", dtype=torch.uint8)
            self.bf16[name] = torch.empty(EXPERTS, rows, cols, dtype=torch.bfloat16, device="cuda")
            for e in range(EXPERTS):
                values = torch.randn(rows, cols, generator=gen, device="cuda", dtype=torch.bfloat16) * 64
                self.fp8[name][e] = values.clamp(-448, 448).to(torch.float8_e4m3fn)
                self.bf16[name][e] = dequantize(self.fp8[name][e], self.scale[name][e]).to(torch.bfloat16)

    def mxfp8_args(self):
        return self.fp8["w13"], self.scale["w13"], self.fp8["w2"], self.scale["w2"]

    @staticmethod
    def expert_bytes() -> dict[str, int]:
        elements = 3 * INTER * HIDDEN
        return {"bf16": 2 * elements, "mxfp8": elements + elements // 32}


def inputs(tokens: int, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``count`` sets of (x, topk_ids int32, topk_weights fp32): distinct uniformly random top-4."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    sets = []
    for _ in range(count):
        x = torch.randn(tokens, HIDDEN, generator=gen, device="cuda", dtype=torch.bfloat16)
        ids = torch.rand(tokens, EXPERTS, generator=gen, device="cuda").argsort(dim=1)[:, :TOP_K].to(torch.int32)
        weights = torch.rand(tokens, TOP_K, generator=gen, device="cuda") + 0.1
        sets.append((x, ids, weights / weights.sum(dim=1, keepdim=True)))
    return sets


class Bf16Baseline:
    """SGLang's ``fused_experts`` (its Triton fused MoE) with M3's activation, on one rank."""

    def __init__(self, weights: Weights):
        from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig

        from sglang_m3.models.moe_kernel_configs import tile_table

        midsize = load_benchmark_module("midsize_m3")
        TUNE.publish_single_rank(midsize.write_midsize_checkpoint(tempfile.mkdtemp(prefix="m3-mxfp8-bench-"), 1, 1))
        self.weights = weights
        self.runner = MoeRunnerConfig(
            num_experts=EXPERTS, num_local_experts=EXPERTS, hidden_size=HIDDEN, intermediate_size_per_partition=INTER,
            top_k=TOP_K, params_dtype=torch.bfloat16, activation="silu", is_gated=True, inplace=False,
            gemm1_alpha=ALPHA, gemm1_clamp_limit=LIMIT, gate_up_interleaved=False,
        )
        self.table = tile_table(EXPERTS, INTER, HIDDEN)

    def tiles(self, tokens: int) -> dict | None:
        from sglang_m3.models.moe_kernel_configs import nearest

        return nearest(self.table, tokens) if self.table else None

    def __call__(self, x, ids, weights):
        from sglang.srt.layers.moe.fused_moe_triton import override_config
        from sglang.srt.layers.moe.moe_runner.triton_utils import fused_experts
        from sglang.srt.layers.moe.topk import StandardTopKOutput

        tiles = self.tiles(x.shape[0])
        topk = StandardTopKOutput(topk_weights=weights, topk_ids=ids, router_logits=None)
        with override_config(tiles) if tiles else contextlib.nullcontext():
            return fused_experts(x, self.weights.bf16["w13"], self.weights.bf16["w2"], topk, self.runner)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got.float() - want).norm() / want.norm()).item()


def measure(tokens: int, weights: Weights, baseline: Bf16Baseline, reps: int, sweep: bool, sweep_gemv: bool = False) -> dict:
    sets = inputs(tokens, 8 if tokens <= 64 else 2, seed=tokens)
    x, ids, topk_weights = sets[0]
    torch.backends.cuda.matmul.allow_tf32 = False
    want = reference_fused_experts(x, *weights.mxfp8_args(), topk_weights, ids, ALPHA, LIMIT)
    served = gemm_path(tokens)
    errors = {"bf16_fused_experts": relative_error(baseline(x, ids, topk_weights), want)}
    for path in timed_paths(tokens):
        errors[path] = relative_error(mxfp8_fused_experts(x, *weights.mxfp8_args(), topk_weights, ids, ALPHA, LIMIT, path=path), want)
        if errors[path] > 1e-2:
            raise SystemExit(f"T={tokens}: MXFP8 experts ({path} path) differ from the reference by {errors[path]:.3e} (relative)")

    def ours(config, path=served):
        return lambda x, ids, w: mxfp8_fused_experts(x, *weights.mxfp8_args(), w, ids, ALPHA, LIMIT, config=config, path=path)

    row = {
        "tokens": tokens,
        "distinct_experts": sum(torch.unique(s[1]).numel() for s in sets) / len(sets),
        "relative_error": errors,
        "bf16_tiles": baseline.tiles(tokens) or "sglang default",
        "mxfp8_path": served,
        "mxfp8_tiles": dataclasses.asdict(pick_config(tokens, served)),
        "bf16_us": TUNE.graph_us(baseline, sets, reps),
        "mxfp8_us": TUNE.graph_us(ours(None), sets, reps),
    }
    row["other_paths"] = {path: TUNE.graph_us(ours(None, path), sets, reps) for path in timed_paths(tokens) if path != served}
    row["path_us"] = {path: row["mxfp8_us"] if path == served else row["other_paths"][path] for path in timed_paths(tokens)}
    if sweep_gemv:
        row["gemv_sweep"] = sweep_gemv_tiles(tokens, sets, reps, ours)
    if sweep:
        candidates = SWEEP["core" if served != "widen" else "decode" if tokens <= 64 else "prefill"]
        row["sweep"] = []
        for config in candidates:
            try:
                row["sweep"].append({"tiles": vars(config), "us": TUNE.graph_us(ours(config), sets, reps)})
            except Exception as error:  # a tile too large for shared memory
                row["sweep"].append({"tiles": vars(config), "error": f"{type(error).__name__}: {error}"[:300]})
    sizes = Weights.expert_bytes()
    for kind in ("bf16", "mxfp8"):
        row[f"{kind}_min_bytes"] = row["distinct_experts"] * sizes[kind]
        row[f"{kind}_gb_per_s"] = row[f"{kind}_min_bytes"] / row[f"{kind}_us"] / 1e3
    row["speedup"] = row["bf16_us"] / row["mxfp8_us"]
    return row


def sweep_gemv_tiles(tokens: int, sets, reps: int, ours) -> list[dict]:
    """The GEMV path at ``tokens`` over :data:`SWEEP_GEMV` (each kernel's candidates with the other
    kernel's table tile; the table's tiles as they are, not narrowed: M3 at TP1 is not)."""
    table = pick_config(tokens, "gemv")
    configs = [MoeGemvConfig(tile, table.down) for tile in SWEEP_GEMV["gate_up"]]
    configs += [MoeGemvConfig(table.gate_up, tile) for tile in SWEEP_GEMV["down"] if tile != table.down]
    timed = []
    for config in configs:
        entry = {"gate_up": vars(config.gate_up), "down": vars(config.down), "table": config == table}
        try:
            entry["us"] = TUNE.graph_us(ours(config, "gemv"), sets, reps)
        except Exception as error:  # a tile Triton cannot compile
            entry["error"] = f"{type(error).__name__}: {error}"[:300]
        timed.append(entry)
    return timed


def markdown(result: dict) -> str:
    lines = [
        f"# MXFP8 W8A16 MoE vs BF16 fused MoE, {result['gpu']}",
        "",
        f"M3 experts at TP1 ({EXPERTS} x [{2 * INTER}x{HIDDEN} + {HIDDEN}x{INTER}]), top-{TOP_K}, routing excluded; "
        f"CUDA-graph replays of {result['reps']} calls on rotating inputs; commit {result['commit']}.",
        "Byte minimum: the weights of the distinct chosen experts, read once. MXFP8: the GEMM path the served "
        "block takes at that token count; 'other paths' times ours on the others.",
        "",
        "| tokens | distinct experts | BF16 us | BF16 GB/s | MXFP8 path | MXFP8 us | MXFP8 GB/s | BF16 / MXFP8 | "
        + " | ".join(f"{path} us" for path in PATHS) + f" | rel. error ({', '.join(PATHS)}, BF16 fused) |",
        "|---:|---:|---:|---:|---|---:|---:|---:|" + "---:|" * len(PATHS) + "---|",
    ]
    for r in result["rows"]:
        errors = r["relative_error"]
        paths_us = r.get("path_us", {r["mxfp8_path"]: r["mxfp8_us"], **r["other_paths"]})
        lines.append(
            f"| {r['tokens']} | {r['distinct_experts']:.1f} | {r['bf16_us']:.1f} | {r['bf16_gb_per_s']:.0f} | "
            f"{r['mxfp8_path']} | {r['mxfp8_us']:.1f} | {r['mxfp8_gb_per_s']:.0f} | {r['speedup']:.2f}x | "
            + " | ".join(f"{paths_us[path]:.1f}" if path in paths_us else "-" for path in PATHS) + " | "
            + ", ".join(f"{errors[key]:.1e}" if key in errors else "-" for key in (*PATHS, "bf16_fused_experts")) + " |"
        )
    sweeps = [r for r in result["rows"] if "sweep" in r]
    if sweeps:
        lines += ["", "Tile sweep (ours, served path): block_m, block_n, block_k, group_m, warps, stages -> us", ""]
        for r in sweeps:
            timed = [f"{tuple(s['tiles'].values())}: {s['us']:.1f}" for s in r["sweep"] if "us" in s]
            lines.append(f"- T={r['tokens']} ({r['mxfp8_path']}): " + "; ".join(timed))
    gemv_sweeps = [r for r in result["rows"] if "gemv_sweep" in r]
    if gemv_sweeps:
        lines += ["", "GEMV tile sweep (gate/up and down: block_n, block_k, warps -> us; * the table's):", "",
                  "| tokens | gate/up | down | us | BF16 / this |", "|---:|---|---|---:|---:|"]
        for r in gemv_sweeps:
            for s in r["gemv_sweep"]:
                tiles = [tuple(s[name].values()) for name in ("gate_up", "down")]
                us = f"{s['us']:.1f} | {r['bf16_us'] / s['us']:.2f}x" if "us" in s else f"{s['error'][:60]} | -"
                lines.append(f"| {r['tokens']} | {tiles[0]}{' *' if s['table'] else ''} | {tiles[1]} | {us} |")
    return "\n".join(lines) + "\n"


def write_results(out: str, stem: str, result: dict, markdown_text: str) -> str:
    """``<stem>_<gpu>.json`` (``result``) and ``.md`` into ``out``; returns ``<stem>_<gpu>``."""
    gpu = result["gpu"]
    name = f"{stem}_" + ("h100" if "H100" in gpu else "h200" if "H200" in gpu else gpu.replace(" ", "_").lower())
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)
    with open(os.path.join(out, f"{name}.md"), "w", encoding="utf-8") as handle:
        handle.write(markdown_text)
    return name


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 512, 8192])
    parser.add_argument("--reps", type=int, default=10, help="calls per captured graph")
    parser.add_argument("--sweep", action="store_true", help="also time ours over candidate tile configs")
    parser.add_argument("--sweep-gemv", action="store_true", help="also time the GEMV path over candidate tiles (SWEEP_GEMV)")
    parser.add_argument("--sweep-gemv-tokens", type=int, nargs="+", default=[1], help="token counts of --sweep-gemv")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    import triton

    torch.set_grad_enabled(False)
    started = time.perf_counter()
    weights = Weights()
    baseline = Bf16Baseline(weights)
    print(f"weights ready in {time.perf_counter() - started:.0f} s; BF16 tiles: {'measured table' if baseline.table else 'SGLang default'}", flush=True)
    gpu = torch.cuda.get_device_name()
    result = {
        "gpu": gpu, "triton": triton.__version__, "torch": torch.__version__, "commit": commit(),
        "shape": {"experts": EXPERTS, "hidden": HIDDEN, "intermediate": INTER, "top_k": TOP_K}, "reps": args.reps, "rows": [],
    }
    tokens_list = list(dict.fromkeys(args.tokens + (args.sweep_gemv_tokens if args.sweep_gemv else [])))
    for tokens in tokens_list:
        row = measure(tokens, weights, baseline, args.reps, args.sweep, args.sweep_gemv and tokens in args.sweep_gemv_tokens)
        result["rows"].append(row)
        print(
            f"T={tokens:5d}: BF16 {row['bf16_us']:9.1f} us ({row['bf16_gb_per_s']:6.0f} GB/s) | MXFP8 {row['mxfp8_path']} "
            f"{row['mxfp8_us']:9.1f} us ({row['mxfp8_gb_per_s']:6.0f} GB/s) | {row['speedup']:.2f}x | "
            f"other paths {row['other_paths']} us | rel err {row['relative_error']}",
            flush=True,
        )
        for entry in row.get("sweep", []):
            print(f"    {entry['tiles']}: {entry.get('us', entry.get('error'))}", flush=True)
        for entry in row.get("gemv_sweep", []):
            print(f"    gemv gate_up {entry['gate_up']} down {entry['down']}: {entry.get('us', entry.get('error'))}", flush=True)
    name = write_results(args.out, "mxfp8_moe", result, markdown(result))
    print(f"wrote {name}.json/.md in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
