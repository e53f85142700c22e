"""EAGLE3 on the GPU: TPOT with and without speculation, acceptance, greedy identity (issue 15).

The mid-size M3 of ``e2e_gpu.py`` (real widths, 1 dense + 3 MoE/MSA layers, dummy weights) is
served by the plugin with the same flags as there, once without a draft and once per draft shape
(``chain3``: 3 drafts verified as 4 tokens, the recipes' shape; ``tree8``: top-3 branches over
3 steps, 8 verify tokens; ``chain7``: 7 drafts verified as 8 tokens, what a draft accepted as
often as the copy draft would be run with; ``adaptive``: chain3 under SGLang's
``--speculative-adaptive``, which re-picks the chain's length from the acceptance it sees), with the lm-head-copy draft of ``midsize_draft.py`` (high acceptance, reduced draft
vocabulary) loaded from real files (``--speculative-draft-load-format auto``). Per server: TPOT
at concurrency 1 (median of 5 requests one at a time) and 16 (2K-token prompts, 256 output
tokens, streamed), the acceptance length (tokens per verify step over a concurrent group) and
the greedy output of fixed prompts, which must equal the output without a draft token for token
(``greedy_identical``).

Run through the harness: ``scripts/gpu/run.sh exec python benchmarks/speculative_gpu.py --out $OUT``;
it writes ``speculative_gpu_<gpu>.json`` under ``--out`` after every server.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from e2e_gpu import PeakGpuMemory, gpu_name, graphs_captured, plugin_switches, profile_steps, start_server, stop_server  # noqa: E402
from provenance import commit  # noqa: E402
from host_probe import host_probe, probed  # noqa: E402
from e2e_gpu_report import gpu_key  # noqa: E402
from midsize_draft import hot_ids, write_copy_draft  # noqa: E402
from midsize_m3 import midsize_text_config, write_midsize_checkpoint  # noqa: E402
from serving_client import run_group, stream_generate  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "speculative"))
from spec_requests import accept_length, generate, generate_concurrently  # noqa: E402

DRAFTS = {
    "none": (),
    "chain3": ("--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"),
    "tree8": ("--speculative-num-steps", "3", "--speculative-eagle-topk", "3", "--speculative-num-draft-tokens", "8"),
    "chain7": ("--speculative-num-steps", "7", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "8"),
    "adaptive": ("--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
                 "--speculative-adaptive"),
}
PROMPT_TOKENS, OUTPUT_TOKENS, CONCURRENCY = 2048, 256, (1, 16)
#: the copy draft's vocabulary, as published EAGLE3 drafts reduce theirs (the prompts come from it)
DRAFT_VOCAB = 32000
SINGLE_RUNS = 5  # concurrency 1: the median of this many requests, one at a time
PROFILE_STEPS = 20
#: the profiled request's length: still running 0.5 s in plus 20 steps at 4 accepted tokens per
#: cycle (at 400 tokens a chain's request ended as the profiler started, and no trace came)
PROFILE_TOKENS = 2000
#: greedy-identity prompts: short, several MSA blocks (128 tokens each), and a long chunked one
IDENTITY_LENGTHS, IDENTITY_TOKENS = (5, 700, 3000, 9000), 48


def hot_prompt(length: int, seed: int, draft_vocab: int) -> list[int]:
    """Token ids from the draft's vocabulary (see ``midsize_draft``: the prompt's last token must
    be one the draft can propose)."""
    rng = random.Random(seed)
    ids = hot_ids(draft_vocab)
    return [rng.choice(ids) for _ in range(length)]


def speculative_args(draft: str, draft_dir: str) -> tuple[str, ...]:
    if draft == "none":
        return ()
    return (
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", draft_dir,
        "--speculative-draft-load-format", "auto", *DRAFTS[draft],
    )


def bench_draft(draft: str, model_dir: str, draft_dir: str, out_dir: str, draft_vocab: int, quick: bool, profile: bool) -> dict:
    """One server: its rows, acceptance and greedy outputs."""
    result = {"draft": draft, "rows": [], "greedy": {}}
    seed = iter(range(10**6))
    with PeakGpuMemory() as memory:
        process, base_url, startup_s, log_path = start_server(
            "ours", model_dir, out_dir, 1, 1, speculative_args(draft, draft_dir), label=f"spec-{draft}")
        try:
            result.update(startup_s=startup_s, cuda_graphs=graphs_captured(log_path))
            print(f"[{draft}] ready in {startup_s:.0f} s (graphs {result['cuda_graphs']})", flush=True)
            for length in (256, PROMPT_TOKENS, 8192):  # compile and autotune outside the measurements
                stream_generate(base_url, hot_prompt(length, next(seed), draft_vocab), 16)
            run_group(base_url, [hot_prompt(PROMPT_TOKENS, next(seed), draft_vocab) for _ in range(16)], 16)
            for length in IDENTITY_LENGTHS:
                answer = generate(base_url, hot_prompt(length, 7 + length, draft_vocab), IDENTITY_TOKENS)
                result["greedy"][str(length)] = answer["output_ids"]
            output = 64 if quick else OUTPUT_TOKENS
            for concurrency in CONCURRENCY:
                prompts = [hot_prompt(PROMPT_TOKENS, next(seed), draft_vocab) for _ in range(max(concurrency, SINGLE_RUNS))]
                if concurrency == 1:
                    singles = [probed(lambda: 1e3 * stream_generate(base_url, ids, output).tpot_s) for ids in prompts]
                    tpots = [tpot for tpot, _ in singles]
                    row = {"value": statistics.median(tpots), "runs": tpots, "host_loop_ms": [loop_ms for _, loop_ms in singles]}
                else:
                    row = {"value": run_group(base_url, prompts[:concurrency], output).mean_tpot_ms}
                result["rows"].append({"metric": "tpot_ms", "concurrency": concurrency, "draft": draft, **row})
                prompts = prompts[:concurrency]
                if draft != "none":
                    answers = generate_concurrently(base_url, prompts, 64)
                    result["rows"].append({"metric": "accept_len", "concurrency": concurrency, "draft": draft, "value": accept_length(answers)})
                print(f"[{draft}] c{concurrency}: " + ", ".join(f"{r['metric']} {r['value']:.3f}" for r in result["rows"][-2:]), flush=True)
            if profile:
                # 20 steps of one request 0.5 s in (its 2K prefill is long done): a step is a
                # decode step without a draft, a whole draft-verify cycle with one.
                result["profile_c1"] = profile_steps(
                    base_url, out_dir, f"spec-{draft}", PROMPT_TOKENS, PROFILE_TOKENS, PROFILE_STEPS, 0.5,
                    prompt=hot_prompt(PROMPT_TOKENS, 10**7, draft_vocab))
        finally:
            stop_server(process)
    result["peak_gpu_memory_gb"] = memory.peak_mib * 2**20 / 1e9
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the result JSON and the server logs")
    parser.add_argument("--draft", choices=list(DRAFTS), action="append", help="draft servers to run (default: all); the no-draft server always runs first, as the TPOT anchor and the greedy reference")
    parser.add_argument("--draft-vocab", type=int, default=DRAFT_VOCAB, help=f"the copy draft's vocabulary size (default {DRAFT_VOCAB})")
    parser.add_argument("--quick", action="store_true", help="64 output tokens per timed request")
    parser.add_argument("--profile", action="store_true", help="also profile 20 steps at concurrency 1 per server (GPU kernel time and span per step)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"stopped by signal {signum}"))
    config = midsize_text_config()
    model_dir = write_midsize_checkpoint(tempfile.mkdtemp(prefix="m3-midsize-"))
    draft_dir = write_copy_draft(tempfile.mkdtemp(prefix="m3-midsize-draft-"), config, args.draft_vocab)
    drafts = args.draft or list(DRAFTS)
    if "none" not in drafts:
        drafts.insert(0, "none")  # the greedy-identity reference and the TPOT anchor
    path = os.path.join(args.out, f"speculative_gpu_{gpu_key(gpu_name())}.json")
    summary = {"gpu": gpu_name(), "commit": commit(), "switches": plugin_switches(), "quick": args.quick, "draft_vocab": args.draft_vocab,
               "model": config, "servers": {}, "rows": [], "greedy_identical": None}
    failures = 0
    for draft in drafts:
        host = host_probe()  # before this server starts: the host's own speed and load
        try:
            server = bench_draft(draft, model_dir, draft_dir, args.out, args.draft_vocab, args.quick, args.profile)
        except Exception as error:  # one server failing must not lose the others' numbers
            print(f"[{draft}] FAILED: {error}", flush=True)
            summary["servers"][draft] = {"failed": str(error)[-2000:]}
            failures += 1
            continue
        summary["servers"][draft] = {**{k: v for k, v in server.items() if k != "rows"}, "host": host}
        summary["rows"] += server["rows"]
        reference = summary["servers"].get("none", {}).get("greedy")
        measured = [s["greedy"] for name, s in summary["servers"].items() if name != "none" and "greedy" in s]
        if reference and measured:
            summary["greedy_identical"] = all(g == reference for g in measured)
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(summary, handle, indent=2)
        print(f"[{draft}] wrote {path}; greedy_identical so far: {summary['greedy_identical']}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
