"""Host time of the dense-layer prefill path per chunk, cold and warm, with and without a profiler.

A per-kernel GPU profile of the TP2 + EP2 server's 32K prefill (``e2e_gpu.py --profile-only``,
one 32K prompt before it) showed the GPU idle 70-80 ms before the first cuDNN attention call of
every 8K chunk. This times, on one GPU, the plugin's own per-chunk call
(:func:`sglang_m3.msa.dense_prefill.causal_sdpa` on keys gathered from a cache by slot, as the
server does) for each chunk of a prompt: the host's wall time to issue it (no synchronisation
inside) and the GPU's time, over several passes of the same shapes on fresh tensors, the last
ones under ``torch.profiler`` (CUDA activity, as SGLang's ``/start_profile``). On the H100: 50-80
ms of host on a shape's first call (cuDNN building its plan), 0.4-1.2 ms on every later one,
profiled or not (``benchmarks/results/prefill_host_h100/``).

``--prepare`` first runs what the server runs at start-up (:func:`prepare_cudnn`, then
:func:`prebuild_chunk_plans` for ``--chunk`` over the longest prompt). ``--prompts``
takes several prompt lengths, run one after the other in each pass (a length that is not a
multiple of the chunk ends in a shorter chunk), and ``--label`` names the result file, so one
process per setting of the environment (e.g. ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE``, read once per
process by torch; ``SGLANG_M3_DENSE_CUDNN=always``) compares what each new shape costs.

    scripts/gpu/run.sh exec python benchmarks/dense_prefill_host.py --tp 2 --out $OUT [--prompts 32768 30001] [--label ragged]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from provenance import commit  # noqa: E402

from sglang_m3.msa.dense_prefill import causal_sdpa, prebuild_chunk_plans, prepare_cudnn  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 64, 4, 128


def one_chunk(q, k_cache, v_cache, slots, prefix: int) -> dict:
    """Host and GPU milliseconds of one chunk's gather plus attention (the server's per-request work)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began = time.perf_counter()
    start.record()
    cached = slots[: prefix + q.shape[0]]
    keys, values = k_cache[cached], v_cache[cached]
    causal_sdpa(q, keys, values, HEAD_DIM**-0.5)
    end.record()
    host_ms = 1e3 * (time.perf_counter() - began)
    torch.cuda.synchronize()
    return {"prefix": prefix, "host_ms": round(host_ms, 3), "gpu_ms": round(start.elapsed_time(end), 3)}


def one_pass(args, heads: int, kv_heads: int) -> list[dict]:
    """Every chunk of each prompt on freshly allocated tensors (new data pointers, same shapes)."""
    dev = torch.device("cuda")
    rows = []
    for prompt in args.prompts:
        k_cache = torch.randn(prompt + 64, kv_heads, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        slots = torch.randperm(prompt, device=dev)
        for prefix in range(0, prompt, args.chunk):
            q = torch.randn(min(args.chunk, prompt - prefix), heads, HEAD_DIM, device=dev, dtype=torch.bfloat16)
            rows.append({"prompt": prompt, "new": q.shape[0], **one_chunk(q, k_cache, v_cache, slots, prefix)})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size: heads per rank are 64/tp over 4/tp")
    parser.add_argument("--prompts", type=int, nargs="+", default=[32768], help="prompt lengths, in this order in every pass")
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--passes", type=int, default=3, help="plain passes before the profiled ones")
    parser.add_argument("--profiled-passes", type=int, default=2)
    parser.add_argument("--label", default="", help="added to the result file's name")
    parser.add_argument("--prepare", action="store_true", help="first run the server's start-up steps (prepare_cudnn, prebuild_chunk_plans), timed")
    args = parser.parse_args(argv)
    heads, kv_heads = HEADS // args.tp, max(1, KV_HEADS // args.tp)
    result = {"commit": commit(), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
              "tp": args.tp, "heads": heads, "kv_heads": kv_heads, "prompts": args.prompts, "chunk": args.chunk, "label": args.label, "passes": []}
    if args.prepare:
        widths = (heads, kv_heads, HEAD_DIM, torch.bfloat16, torch.device("cuda"))
        result["prepare_s"] = round(prepare_cudnn(*widths), 3)
        shapes, seconds = prebuild_chunk_plans(*widths, chunk=args.chunk, context=max(args.prompts))
        result["chunk_plans"] = {"shapes": shapes, "seconds": round(seconds, 3)}
        print(f"prepare_cudnn: {result['prepare_s']} s; chunk plans: {shapes} shapes in {seconds:.3f} s", flush=True)
    result["env"] = {key: value for key, value in os.environ.items() if key.startswith(("TORCH_CUDNN", "SGLANG_M3_DENSE"))}
    for index in range(args.passes):
        result["passes"].append({"pass": index, "profiled": False, "chunks": one_pass(args, heads, kv_heads)})
    for index in range(args.profiled_passes):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
            rows = one_pass(args, heads, kv_heads)
        result["passes"].append({"pass": args.passes + index, "profiled": True, "chunks": rows})
    for entry in result["passes"]:
        print(f"pass {entry['pass']}{' (profiled)' if entry['profiled'] else ''}: " + ", ".join(
            f"{row['new']} after {row['prefix']}: host {row['host_ms']:.2f} ms gpu {row['gpu_ms']:.2f} ms" for row in entry["chunks"]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"dense_prefill_host_tp{args.tp}{'_' + args.label if args.label else ''}.json")
    with open(path, "w") as handle:
        json.dump(result, handle, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
