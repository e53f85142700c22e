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

    scripts/gpu/run.sh exec python benchmarks/dense_prefill_host.py --tp 2 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from e2e_gpu import commit  # noqa: E402

from sglang_m3.msa.dense_prefill import causal_sdpa  # noqa: E402

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
    """Every chunk of a prompt on freshly allocated tensors (new data pointers, same shapes)."""
    dev = torch.device("cuda")
    k_cache = torch.randn(args.prompt + 64, kv_heads, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(args.prompt, device=dev)
    rows = []
    for prefix in range(0, args.prompt, args.chunk):
        q = torch.randn(args.chunk, heads, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        rows.append(one_chunk(q, k_cache, v_cache, slots, prefix))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size: heads per rank are 64/tp over 4/tp")
    parser.add_argument("--prompt", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--passes", type=int, default=3, help="plain passes before the profiled ones")
    parser.add_argument("--profiled-passes", type=int, default=2)
    args = parser.parse_args(argv)
    heads, kv_heads = HEADS // args.tp, max(1, KV_HEADS // args.tp)
    result = {"commit": commit(), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
              "tp": args.tp, "heads": heads, "kv_heads": kv_heads, "prompt": args.prompt, "chunk": args.chunk, "passes": []}
    for index in range(args.passes):
        result["passes"].append({"pass": index, "profiled": False, "chunks": one_pass(args, heads, kv_heads)})
    for index in range(args.profiled_passes):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
            rows = one_pass(args, heads, kv_heads)
        result["passes"].append({"pass": args.passes + index, "profiled": True, "chunks": rows})
    for entry in result["passes"]:
        print(f"pass {entry['pass']}{' (profiled)' if entry['profiled'] else ''}: " + ", ".join(
            f"prefix {row['prefix']}: host {row['host_ms']:.2f} ms gpu {row['gpu_ms']:.2f} ms" for row in entry["chunks"]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"dense_prefill_host_tp{args.tp}.json")
    with open(path, "w") as handle:
        json.dump(result, handle, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
