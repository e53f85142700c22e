"""Where a server's host time goes while it decodes one request: py-spy over its processes.

At concurrency 1 a graphed decode step is bound by the GPU or by the scheduler's host work,
whichever is longer. On the H100 (``results/e2e_gpu_h100.md``) upstream's M3 decoded a 2K-prompt
request at a steady 2.40 ms per step, while ours alternated between that and 2.65-3.03 ms windows
of the same request: the signature of host work close to the GPU time. This tool serves the
mid-size model with one implementation (``e2e_gpu.start_server``, the benchmark's flags), sends
``--requests`` lone requests of a 2K prompt with ``--tokens`` outputs each while ``py-spy record
--subprocesses --nonblocking`` samples every process of the server, and writes per request the
TPOT, and per process the functions holding the most samples (self and inclusive).

    scripts/gpu/run.sh exec python benchmarks/decode_host_profile.py --out $OUT --py-spy PATH [--impl ours]

Extra ``KEY=VALUE`` pairs of ``--env`` reach the server (e.g. ``SGLANG_M3_FULL_SELECTION_DENSE=0``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

import requests

sys.path.insert(0, os.path.dirname(__file__))
from e2e_gpu import THROUGHPUT_PROMPT, start_server, stop_server, warm_up  # noqa: E402
from midsize_m3 import write_midsize_checkpoint  # noqa: E402
from serving_client import random_prompt, stream_generate  # noqa: E402


def summarize(collapsed_path: str, top: int = 25) -> dict:
    """Per process, the functions with the most self and inclusive samples. With
    ``--subprocesses`` py-spy roots each stack at its process chain (``process PID:"NAME"``
    frames, parent first): a sample belongs to the innermost process of its chain."""
    processes: dict[str, dict] = {}
    with open(collapsed_path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            chain = [frame for frame in frames if frame.startswith("process ")]
            calls = [frame for frame in frames if not frame.startswith("process ")]
            name = chain[-1] if chain else "(unknown process)"
            process = processes.setdefault(name, {"samples": 0, "self": collections.Counter(), "inclusive": collections.Counter()})
            samples = int(count)
            process["samples"] += samples
            process["self"][calls[-1] if calls else "(no Python frame)"] += samples
            for frame in set(calls):
                process["inclusive"][frame] += samples
    return {
        name: {"samples": p["samples"], "self": p["self"].most_common(top), "inclusive": p["inclusive"].most_common(top)}
        for name, p in sorted(processes.items(), key=lambda item: -item[1]["samples"])
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--py-spy", required=True, help="the py-spy executable")
    parser.add_argument("--impl", default="ours", choices=("ours", "upstream"))
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--env", nargs="*", default=[], help="KEY=VALUE for the server")
    parser.add_argument("--label", default="")
    parser.add_argument("--server-arg", action="append", default=[], help="an extra server flag (repeat; e.g. --server-arg=--gc-warning-threshold-secs=0.001)")
    parser.add_argument("--freeze-gc", action="store_true", help="POST /freeze_gc after the warm-up (SGLang's own, after its start-up warm-up, is kept either way)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    label = args.label or args.impl
    env = dict(pair.split("=", 1) for pair in args.env)
    model_dir = write_midsize_checkpoint(tempfile.mkdtemp(prefix="m3-midsize-"), 1, 3)
    process, base_url, startup_s, _ = start_server(args.impl, model_dir, args.out, 1, 1, label=f"hostprof-{label}", env=env,
                                                    extra_args=tuple(args.server_arg))
    try:
        seed = iter(range(10**6))
        warm_up(base_url, seed)
        if args.freeze_gc:
            requests.post(f"{base_url}/freeze_gc", timeout=60).raise_for_status()
        prompts = [random_prompt(THROUGHPUT_PROMPT, next(seed)) for _ in range(args.requests)]
        collapsed = os.path.join(args.out, f"host_profile_{label}.txt")
        # long enough for every request: a 2K prefill plus up to 4 ms a token on the mid-size model
        seconds = int(args.requests * (0.5 + args.tokens * 0.004)) + 5
        recorder = subprocess.Popen([
            args.py_spy, "record", "--pid", str(process.pid), "--subprocesses", "--nonblocking", "--rate", str(args.rate),
            "--duration", str(seconds), "--format", "raw", "--output", collapsed,
        ], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        time.sleep(2)  # py-spy attaches to each process
        tpots = [1e3 * stream_generate(base_url, prompt, args.tokens).tpot_s for prompt in prompts]
        recorder.wait(timeout=seconds + 60)
        result = {"impl": args.impl, "env": env, "startup_s": startup_s, "tokens": args.tokens, "tpot_ms": tpots,
                  "processes": summarize(collapsed)}
    finally:
        stop_server(process)
    path = os.path.join(args.out, f"host_profile_{label}.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)
    print(f"[{label}] tpot ms per request: " + ", ".join(f"{t:.2f}" for t in tpots), flush=True)
    for name, process_summary in list(result["processes"].items())[:4]:
        print(f"  {name[:90]}: {process_summary['samples']} samples; top self:", flush=True)
        for frame, samples in process_summary["self"][:12]:
            print(f"    {samples:6d} {frame[:150]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
