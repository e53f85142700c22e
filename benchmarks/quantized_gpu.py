"""BF16 against MXFP8 experts, served end to end on one GPU (issue 17 item 6).

The mid-size M3 of ``e2e_gpu.py`` (real widths, 1 dense + 3 MoE/MSA layers, dummy weights) is
served by the plugin twice with the same flags as there: as a BF16 checkpoint, and as an MXFP8
checkpoint (the same ``config.json`` plus the published ``quantization_config``), whose routed
experts the plugin keeps in e4m3 with e8m0 scales and runs through its W8A16 kernels. Per server:
TTFT of an 8K prompt, TPOT at concurrency 1 (median of 5 requests sent one at a time) and 16
(2K prompts, 256 output tokens), peak GPU memory, the weight memory SGLang reports after loading,
and start-up time.

The MoE layer's own decode time (``moe_layer_decode_us_c1``) comes from ``benchmarks/mxfp8_moe.py``
run in the same device call (``--moe-layer-json``: its T=1 row, both paths on identical inputs),
and the tiny-model exactness fields from the served GPU tests' records (``--tiny-json``, once per
record ``tests/gpu/test_mxfp8_moe_gpu.py`` wrote under ``$OUT``: bf16 and fp32); a field whose
source was not given is null.

    scripts/gpu/run.sh exec python benchmarks/quantized_gpu.py --out $OUT \
        [--moe-layer-json $OUT/mxfp8_moe_h100.json] \
        [--tiny-json $OUT/mxfp8_served_tiny.json --tiny-json $OUT/mxfp8_served_tiny_fp32.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from e2e_gpu import PeakGpuMemory, gpu_name, graphs_captured, start_server, stop_server, warm_up  # noqa: E402
from provenance import commit  # noqa: E402
from e2e_gpu_report import gpu_key  # noqa: E402
from midsize_m3 import add_mxfp8_quantization_config, midsize_text_config, write_midsize_checkpoint  # noqa: E402
from serving_client import random_prompt, run_group, single_stream_tpot_ms, stream_generate  # noqa: E402


VARIANTS = ("bf16", "mxfp8")
TTFT_PROMPT, PROMPT_TOKENS, OUTPUT_TOKENS = 8192, 2048, 256
SINGLE_RUNS = 5  # concurrency 1: the median of this many requests, one at a time
#: SGLang picks its flashinfer_trtllm MoE runner for any MXFP8 checkpoint and autotunes it at
#: warm-up; the harness has no flashinfer (a stock install does, and runs a harmless autotune).
MXFP8_HARNESS_FLAGS = ("--disable-flashinfer-autotune",)
WEIGHT_MEMORY = re.compile(r"Load weight end\..*?mem usage=([\d.]+) GB")


def write_variant(variant: str) -> str:
    model_dir = write_midsize_checkpoint(tempfile.mkdtemp(prefix=f"m3-midsize-{variant}-"))
    return add_mxfp8_quantization_config(model_dir) if variant == "mxfp8" else model_dir


def bench_variant(variant: str, out_dir: str, quick: bool) -> dict:
    model_dir = write_variant(variant)
    extra = MXFP8_HARNESS_FLAGS if variant == "mxfp8" else ()
    result: dict = {}
    seed = iter(range(10**6))
    with PeakGpuMemory() as memory:
        process, base_url, startup_s, log_path = start_server("ours", model_dir, out_dir, 1, 1, extra, label=f"quant-{variant}")
        try:
            with open(log_path, encoding="utf-8", errors="replace") as handle:
                log = handle.read()
            weights = WEIGHT_MEMORY.search(log)
            result.update(startup_s=startup_s, cuda_graphs=graphs_captured(log_path),
                          weight_memory_gb=float(weights.group(1)) if weights else None,
                          mxfp8_experts_used="mxfp8 path" in log)
            print(f"[{variant}] ready in {startup_s:.0f} s, weights {result['weight_memory_gb']} GB", flush=True)
            warm_up(base_url, seed)
            stream_generate(base_url, random_prompt(TTFT_PROMPT, next(seed)), 1)
            runs = [stream_generate(base_url, random_prompt(TTFT_PROMPT, next(seed)), 1).ttft_s for _ in range(2)]
            result["ttft_ms_8k"] = 1e3 * sum(runs) / len(runs)
            output = 64 if quick else OUTPUT_TOKENS
            singles = single_stream_tpot_ms(base_url, [random_prompt(PROMPT_TOKENS, next(seed)) for _ in range(SINGLE_RUNS)], output)
            result.update(tpot_ms_c1=statistics.median(singles), tpot_ms_c1_runs=singles)
            group = run_group(base_url, [random_prompt(PROMPT_TOKENS, next(seed)) for _ in range(16)], output)
            result["tpot_ms_c16"] = group.mean_tpot_ms
            print(f"[{variant}] ttft 8K {result['ttft_ms_8k']:.1f} ms, tpot c1 {result['tpot_ms_c1']:.2f} ms, "
                  f"c16 {result['tpot_ms_c16']:.2f} ms", flush=True)
        finally:
            stop_server(process)
    result["peak_memory_gb"] = memory.peak_mib * 2**20 / 1e9
    return result


def moe_layer_row(path: str | None) -> dict | None:
    if not path:
        return None
    with open(path, encoding="utf-8") as handle:
        rows = json.load(handle)["rows"]
    row = next((r for r in rows if r["tokens"] == 1), None)
    return {"bf16": row["bf16_us"], "mxfp8": row["mxfp8_us"]} if row else None


def tiny_record(paths: list[str] | None) -> dict:
    """The tiny-model exactness fields: those of the fp32 record when given (W8A32 against the fp32
    twin, where greedy tokens must be identical), else of the one given; every record also under
    ``tiny_by_dtype``, so the bf16 record's logprob drift stays reported beside the fp32 result."""
    if not paths:
        return {"greedy_identical_to_dequantized": None, "logprob_max_diff": None}
    records = {}
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            record = json.load(handle)
        records[record["dtype"]] = record
    return {**records.get("float32", next(iter(records.values()))), "tiny_by_dtype": records}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the result JSON and the server logs")
    parser.add_argument("--variant", choices=VARIANTS, action="append", help="servers to run (default: both)")
    parser.add_argument("--moe-layer-json", help="benchmarks/mxfp8_moe.py's result of the same call")
    parser.add_argument("--tiny-json", action="append", help="a served tiny-model record the GPU tests wrote (repeat for bf16 and fp32)")
    parser.add_argument("--quick", action="store_true", help="64 output tokens per timed request")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"stopped by signal {signum}"))
    servers, failures = {}, 0
    for variant in args.variant or VARIANTS:
        try:
            servers[variant] = bench_variant(variant, args.out, args.quick)
        except Exception as error:  # one server failing must not lose the other's numbers
            print(f"[{variant}] FAILED: {error}", flush=True)
            servers[variant] = {"failed": str(error)[-2000:]}
            failures += 1

    def per_variant(key: str) -> dict:
        return {v: servers.get(v, {}).get(key) for v in VARIANTS}

    summary = {
        "gpu": gpu_name(), "commit": commit(), "quick": args.quick, "model": midsize_text_config(),
        "moe_layer_decode_us_c1": moe_layer_row(args.moe_layer_json),
        "tpot_ms_c1": per_variant("tpot_ms_c1"), "tpot_ms_c16": per_variant("tpot_ms_c16"),
        "ttft_ms_8k": per_variant("ttft_ms_8k"), "peak_memory_gb": per_variant("peak_memory_gb"),
        "weight_memory_gb": per_variant("weight_memory_gb"),
        **tiny_record(args.tiny_json), "servers": servers,
    }
    path = os.path.join(args.out, f"quantized_gpu_{gpu_key(gpu_name())}.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(summary, handle, indent=2)
    print(f"wrote {path}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
