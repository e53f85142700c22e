"""Logprob drift of an fp8 (e4m3) KV cache: the tiny M3 on the CPU platform, served twice.

One server keeps the model's float32 K/V, the other runs with ``--kv-cache-dtype fp8_e4m3`` (index
keys unquantized in both); same checkpoint, flags and prompts. Per prompt: max and mean |prompt
logprob difference| between the two, greedy-token agreement over the generated tokens, and how far
the fp8 server is from transformers' M3 with its K/V rounded through e4m3 (``tests/fp8_kv_oracle``),
which says whether the drift is the rounding's and nothing else. The tiny model has random weights
(a near-flat next-token distribution), so greedy agreement here is a lower bound for a real model.

    .venv/bin/python benchmarks/fp8_kv_drift.py [--out benchmarks/results/fp8_kv_drift.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from fp8_kv_oracle import e4m3_prompt_logprobs  # noqa: E402
from server_harness import TINY_PREFILL_CHUNK, launch_cpu_server  # noqa: E402
from transformers_oracle import random_prompt  # noqa: E402

from tests.e2e.served_vs_reference import generate, output_ids  # noqa: E402
from provenance import commit  # noqa: E402

PROMPT_LENGTHS = (20, 40, 150, 301, 470)
NEW_TOKENS = 16


def serve_and_collect(model_dir: str, log_dir: str, prompts: dict, *extra: str) -> dict:
    """Prompt logprobs (positions 1..) and greedy continuations of every prompt on one server."""
    collected = {}
    with launch_cpu_server(model_dir, log_dir, "--chunked-prefill-size", str(TINY_PREFILL_CHUNK), *extra) as server:
        for label, prompt in prompts.items():
            result = generate(server, prompt, max_new_tokens=NEW_TOKENS, logprob_start=0)
            logprobs = [entry[0] for entry in result["meta_info"]["input_token_logprobs"][1:]]
            collected[label] = (logprobs, output_ids(result))
    return collected


def compare(base: dict, fp8: dict, oracle: dict) -> list[dict]:
    rows = []
    for label, (base_lp, base_tokens) in base.items():
        fp8_lp, fp8_tokens = fp8[label]
        diffs = [abs(a - b) for a, b in zip(fp8_lp, base_lp)]
        prefix = next((i for i, (a, b) in enumerate(zip(fp8_tokens, base_tokens)) if a != b), len(base_tokens))
        rows.append({
            "prompt": label, "tokens": len(diffs) + 1,
            "max_abs": max(diffs), "mean_abs": sum(diffs) / len(diffs),
            "greedy_same": sum(a == b for a, b in zip(fp8_tokens, base_tokens)), "greedy_equal_prefix": prefix,
            "to_e4m3_oracle": max(abs(a - b) for a, b in zip(fp8_lp, oracle[label])),
        })
    return rows


def markdown(rows: list[dict], commit: str) -> str:
    lines = [
        "# fp8 (e4m3) KV cache: logprob drift on the tiny M3 (CPU)",
        "",
        f"Commit {commit}; {platform.machine()} CPU, {os.cpu_count()} cores; `benchmarks/fp8_kv_drift.py`.",
        "Tiny random-weight M3 (4 layers: 1 dense + 3 MSA, block 16, top-4), float32 model, served by SGLang",
        f"0.5.23 on the project's CPU platform, prefill chunks of {TINY_PREFILL_CHUNK}. Baseline: float32 KV;",
        "fp8: `--kv-cache-dtype fp8_e4m3` (no checkpoint KV scales: scale 1.0; index keys stay float32).",
        f"Prompt logprobs of every position after the first; {NEW_TOKENS} greedy tokens.",
        "",
        "| prompt | tokens | max abs logprob diff | mean abs logprob diff | greedy tokens equal | equal prefix | fp8 vs e4m3 oracle (max) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['prompt']} | {r['tokens']} | {r['max_abs']:.4f} | {r['mean_abs']:.4f} | "
            f"{r['greedy_same']}/{NEW_TOKENS} | {r['greedy_equal_prefix']} | {r['to_e4m3_oracle']:.1e} |"
        )
    every = [r["max_abs"] for r in rows]
    lines += [
        "",
        f"Over all prompts: max {max(every):.4f} nats, mean of means "
        f"{sum(r['mean_abs'] for r in rows) / len(rows):.4f} nats.",
        "",
        "e4m3 keeps 3 mantissa bits: each stored K/V element moves by up to 2^-4 (6.25%) of its value. The",
        "last column compares the fp8 server with transformers' M3 whose attention sees its K/V rounded",
        "through e4m3 (independent code): the drift is the rounding's, within the project's 2e-3",
        "served-vs-transformers tolerance (the larger entries, ~1e-4, were not investigated; K elements",
        "within float32 noise of an e4m3 rounding boundary may round differently in the two codes).",
        "Greedy tokens diverge early on most prompts because the random tiny model's next-token",
        "distribution is nearly flat (prompt logprobs around -6 to -8 nats), not because of an error: the",
        "fp8 server's greedy tokens equal the e4m3 oracle's (tests/e2e/test_fp8_kv_served.py).",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "fp8_kv_drift.md"))
    args = parser.parse_args()
    from sglang_m3.tiny.checkpoint import build_tiny_checkpoint

    prompts = {f"p{n}": random_prompt(1000 + n, n) for n in PROMPT_LENGTHS}
    with tempfile.TemporaryDirectory() as work:
        model = build_tiny_checkpoint(os.path.join(work, "tiny"))
        base = serve_and_collect(model, work, prompts)
        fp8 = serve_and_collect(model, work, prompts, "--kv-cache-dtype", "fp8_e4m3")
        oracle = {label: e4m3_prompt_logprobs(model, prompt).tolist() for label, prompt in prompts.items()}
    report = markdown(compare(base, fp8, oracle), commit())
    with open(args.out, "w", encoding="utf-8") as handle:
        handle.write(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
