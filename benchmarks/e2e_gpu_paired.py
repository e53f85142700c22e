"""Decode of ours and upstream's M3 paired on the same GPUs: both servers live at once.

``e2e_gpu.py`` serves the two implementations one after the other, so its concurrency-1 row
compares two stretches of the machine's life. At concurrency 1 a graphed decode step of the
mid-size model is as long as the scheduler's host work per step (about 2.4 ms on the H100 for both
servers), and that host work ran at different speeds from one device call to the next: the same
server decoded lone requests at 2.38 ms in one call and at 2.65-3.03 ms in another, upstream's at
2.40 in one call and 2.52-2.65 in another (``results/e2e_gpu_h100.md``). Here both servers run
side by side (same flags, the KV pool capped by ``--max-total-tokens`` so two fit), each warmed
up, and groups of 2K-prompt requests (one request at concurrency 1, sixteen sent at once at 16)
alternate between them in ABBA order, so every pair of groups shares the machine's state of that
moment. Reported per concurrency: every group's mean TPOT, the median per server and the ratio of
medians. ``--tp 2 --ep 2`` pairs two TP2 + EP2 servers on two GPUs (about 23 GB of weights per
GPU each, so the pair fits two H100s; at TP1 the pair needs an H200).

    scripts/gpu/run.sh exec python benchmarks/e2e_gpu_paired.py --out $OUT [--rounds 8] [--tp 2 --ep 2] [--concurrency 1 16]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading

sys.path.insert(0, os.path.dirname(__file__))
from e2e_gpu import IMPLS, THROUGHPUT_OUTPUT, THROUGHPUT_PROMPT, commit, gpu_name, start_server, stop_server, warm_up  # noqa: E402
from midsize_m3 import midsize_text_config, write_midsize_checkpoint  # noqa: E402
from serving_client import random_prompt, run_group  # noqa: E402

#: KV slots per server: two pools fit on one H100 beside both models, and a 2K request needs few
KV_TOKENS_PER_SERVER = 262144


def start_both(model_dir: str, out_dir: str, tp: int = 1, ep: int = 1) -> dict[str, tuple]:
    """Both servers started at once (start-up is not measured here); raises if either fails."""
    started: dict[str, tuple] = {}
    errors: dict[str, BaseException] = {}

    def start(impl: str) -> None:
        try:
            started[impl] = start_server(impl, model_dir, out_dir, tp, ep, label=f"paired-{impl}",
                                         extra_args=("--max-total-tokens", str(KV_TOKENS_PER_SERVER)))
        except BaseException as error:  # reported below, after the other start ends
            errors[impl] = error

    threads = [threading.Thread(target=start, args=(impl,)) for impl in IMPLS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        for process, *_ in started.values():
            stop_server(process)
        raise RuntimeError(f"server start failed: {errors}")
    return started


def paired_rounds(urls: dict[str, str], rounds: int, seed, concurrency: int = 1) -> dict[str, list[float]]:
    """``rounds`` pairs of request groups in ABBA order; each request gets its own random prompt.
    Returns each group's mean TPOT in ms per server."""
    tpot_ms: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    for round_index in range(rounds):
        order = IMPLS if round_index % 2 == 0 else IMPLS[::-1]
        for impl in order:
            prompts = [random_prompt(THROUGHPUT_PROMPT, next(seed)) for _ in range(concurrency)]
            tpot_ms[impl].append(run_group(urls[impl], prompts, THROUGHPUT_OUTPUT).mean_tpot_ms)
        print(f"  c{concurrency} round {round_index}: " + ", ".join(f"{impl} {tpot_ms[impl][-1]:.2f} ms" for impl in IMPLS), flush=True)
    return tpot_ms


def summary(tpot_ms: dict[str, list[float]]) -> dict:
    """Medians, their ratio (upstream over ours: above 1 is ours faster) and the rounds ours won."""
    medians = {impl: statistics.median(values) for impl, values in tpot_ms.items()}
    return {
        "tpot_ms": tpot_ms, "median_tpot_ms": medians,
        "speedup_of_medians": medians["upstream"] / medians["ours"],
        "rounds_ours_faster": sum(o < u for o, u in zip(tpot_ms["ours"], tpot_ms["upstream"])),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the result and the server logs")
    parser.add_argument("--rounds", type=int, default=8, help="ABBA pairs of request groups per concurrency")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of both servers")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size of both servers (inside the TP group)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1], help="requests per group (default: 1)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"stopped by signal {signum}"))
    model_dir = write_midsize_checkpoint(tempfile.mkdtemp(prefix="m3-midsize-"), 1, 3)
    servers = start_both(model_dir, args.out, args.tp, args.ep)
    try:
        urls = {impl: server[1] for impl, server in servers.items()}
        seed = iter(range(10**6))
        for impl in IMPLS:
            warm_up(urls[impl], seed)
        by_concurrency = {c: summary(paired_rounds(urls, args.rounds, seed, c)) for c in args.concurrency}
    finally:
        for process, *_ in servers.values():
            stop_server(process)
    result = {
        "gpu": gpu_name(), "commit": commit(), "model": midsize_text_config(1, 3), "tp": args.tp, "ep": args.ep,
        "what": f"mean TPOT of groups of {THROUGHPUT_PROMPT}-token-prompt requests with {THROUGHPUT_OUTPUT} output tokens, "
                f"both servers alive on the same GPUs, ABBA order, {args.rounds} rounds per concurrency",
        "max_total_tokens": KV_TOKENS_PER_SERVER,
        "concurrency": {str(c): s for c, s in by_concurrency.items()},
    }
    path = os.path.join(args.out, f"e2e_gpu_paired_tp{args.tp}_ep{args.ep}.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
    for c, s in by_concurrency.items():
        medians = s["median_tpot_ms"]
        print(f"c{c} median tpot: ours {medians['ours']:.3f} ms, upstream {medians['upstream']:.3f} ms, "
              f"speed-up {s['speedup_of_medians']:.3f}x; ours faster in {s['rounds_ours_faster']} of {args.rounds} rounds", flush=True)
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
