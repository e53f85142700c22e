"""Long prompts on the CPU platform: the tiny M3's time to first token at 4K-32K tokens.

The real SGLang server on the project's CPU platform (the tiny random-weight M3, context raised to
40K), one streamed greedy request at a time: a 16-token prompt (the fixed path of any request),
then for each length a fresh prompt (its whole prefill: the TTFT a user's first long prompt
pays) and the same prompt again several times (a radix hit: one new token after the cached
prefix, what every later turn of a long conversation pays). ``--env KEY=VALUE`` serves under a
switch (e.g. ``SGLANG_M3_DENSE_PREFILL=sglang`` for SGLang's torch-native extend in the dense
layers). Report only.

    .venv/bin/python benchmarks/cpu_long_prompt.py [--out benchmarks/results/cpu_long_prompt.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from provenance import commit  # noqa: E402
from serving_client import stream_generate  # noqa: E402
from server_harness import launch_cpu_server  # noqa: E402
from transformers_oracle import random_prompt  # noqa: E402

LENGTHS = (4096, 8192, 16384, 32768)
HITS = 4


def ttft_ms(url: str, prompt: list[int]) -> float:
    return round(1e3 * stream_generate(url, prompt, 1).ttft_s, 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu_long_prompt.json"))
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="set for the server (repeatable)")
    args = parser.parse_args(argv)
    from sglang_m3.tiny.checkpoint import build_tiny_checkpoint

    env = {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1", **dict(item.split("=", 1) for item in args.env)}
    work = tempfile.mkdtemp(prefix="cpu-long-")
    model_dir = build_tiny_checkpoint(os.path.join(work, "m3"))
    longest = max(args.lengths)
    rows = []
    with launch_cpu_server(model_dir, work, "--context-length", str(longest + 1024), "--max-total-tokens", str(2 * longest + 4096),
                           env=env) as server:
        short = [ttft_ms(server.base_url, random_prompt(s, 16)) for s in range(HITS + 1)][1:]  # the first warms up
        print(f"16 tokens: {short} ms", flush=True)
        for i, length in enumerate(args.lengths):
            prompt = random_prompt(1000 + i, length)
            first = ttft_ms(server.base_url, prompt)
            hits = [ttft_ms(server.base_url, prompt) for _ in range(HITS)]
            rows.append({"prompt_tokens": length, "first_ttft_ms": first, "radix_hit_ttft_ms": hits,
                         "radix_hit_median_ms": statistics.median(hits)})
            print(json.dumps(rows[-1]), flush=True)
    result = {"commit": commit(), "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
              "env": env, "ttft_16_ms": short, "rows": rows}
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
