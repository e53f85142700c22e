"""What a server does during its first long prompt and its first long radix hit: py-spy over them.

The paired TP2 run at c4cfdba (``results/e2e_gpu_h200_paired_tp2_ep1_c4cfdba.json``) took 1,462 ms
for ours' first 32K prompt after the warm-up against 237 ms for upstream's, and the TP2 probe of
29cdb90 paid 1.9 s once more at the first radix hit of a 32K prompt; at TP1 the first 32K prompt
cost about 30 ms more than the next. This tool serves the mid-size model (``e2e_gpu.start_server``,
the benchmark's flags), warms it up as the benchmarks do, then runs four phases, each one request
under ``py-spy record --subprocesses``: a first 32K prompt, a second (new ids), the second sent again
(the first radix hit of that length), and again. Per phase: the TTFT, and per process the functions
holding the most samples (self and inclusive; ``decode_host_profile.summarize``).

    scripts/gpu/run.sh exec python benchmarks/first_prompt_profile.py --out $OUT --py-spy PATH --tp 2 [--impl ours]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from decode_host_profile import add_profiled_server_arguments, start_py_spy, summarize  # noqa: E402
from e2e_gpu import LONG_CONTEXT_PROMPT, gpu_name, start_server, stop_server, warm_up  # noqa: E402
from provenance import commit  # noqa: E402
from midsize_m3 import write_midsize_checkpoint  # noqa: E402
from serving_client import random_prompt, stream_generate  # noqa: E402


def profiled_ttft_ms(args, base_url: str, process, prompt: list[int], label: str) -> dict:
    """One request under py-spy: its TTFT and the per-process sample summary."""
    collapsed = os.path.join(args.out, f"first_prompt_{label}.txt")
    seconds = 12
    recorder = start_py_spy(args, process, collapsed, seconds, label)
    ttft_ms = 1e3 * stream_generate(base_url, prompt, 1).ttft_s
    recorder.wait(timeout=seconds + 60)
    print(f"[{label}] ttft {ttft_ms:.1f} ms", flush=True)
    processes = summarize(collapsed)
    for name, process_summary in list(processes.items())[:3]:
        print(f"  {name[:90]}: {process_summary['samples']} samples; top inclusive:", flush=True)
        for frame, samples in process_summary["inclusive"][:25]:
            print(f"    {samples:6d} {frame[:160]}", flush=True)
    return {"ttft_ms": ttft_ms, "processes": processes}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_profiled_server_arguments(parser, rate=200)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    env = dict(pair.split("=", 1) for pair in args.env)
    model_dir = write_midsize_checkpoint(tempfile.mkdtemp(prefix="m3-midsize-"), 1, 3)
    process, base_url, startup_s, _ = start_server(args.impl, model_dir, args.out, args.tp, args.ep, label=f"first-{args.impl}", env=env)
    try:
        seed = iter(range(10**6))
        warm_up(base_url, seed)
        first, second = (random_prompt(LONG_CONTEXT_PROMPT, next(seed)) for _ in range(2))
        phases = {}
        for label, prompt in (("first_32k", first), ("second_32k", second), ("first_radix_hit", second), ("second_radix_hit", second)):
            phases[label] = profiled_ttft_ms(args, base_url, process, prompt, label)
    finally:
        stop_server(process)
    result = {"gpu": gpu_name(), "commit": commit(), "impl": args.impl, "tp": args.tp, "ep": args.ep, "env": env,
              "startup_s": startup_s, "prompt_tokens": LONG_CONTEXT_PROMPT, "phases": phases}
    path = os.path.join(args.out, f"first_prompt_profile_{args.impl}_tp{args.tp}_ep{args.ep}.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
