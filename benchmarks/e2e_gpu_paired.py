"""Concurrency-1 decode of ours and upstream's M3 paired on one GPU: both servers live at once.

``e2e_gpu.py`` serves the two implementations one after the other, so its concurrency-1 row
compares two stretches of the machine's life. At concurrency 1 a graphed decode step of the
mid-size model is as long as the scheduler's host work per step (about 2.4 ms on the H100 for both
servers), and that host work ran at different speeds from one device call to the next: the same
server decoded lone requests at 2.38 ms in one call and at 2.65-3.03 ms in another, upstream's at
2.40 in one call and 2.52-2.65 in another (``results/e2e_gpu_h100.md``). Here both servers run
side by side (same flags, the KV pool capped by ``--max-total-tokens`` so two fit), each warmed
up, and lone 2K-prompt requests alternate between them in ABBA order, so every pair of requests
shares the machine's state of that moment. Reported: every request's TPOT, the median per server
and the ratio of medians.

    scripts/gpu/run.sh exec python benchmarks/e2e_gpu_paired.py --out $OUT [--rounds 8]
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
from serving_client import random_prompt, stream_generate  # noqa: E402

#: KV slots per server: two pools fit on one H100 beside both models, and a 2K request needs few
KV_TOKENS_PER_SERVER = 262144


def start_both(model_dir: str, out_dir: str) -> dict[str, tuple]:
    """Both servers started at once (start-up is not measured here); raises if either fails."""
    started: dict[str, tuple] = {}
    errors: dict[str, BaseException] = {}

    def start(impl: str) -> None:
        try:
            started[impl] = start_server(impl, model_dir, out_dir, 1, 1, label=f"paired-{impl}",
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


def paired_rounds(urls: dict[str, str], rounds: int, seed) -> dict[str, list[float]]:
    """``rounds`` pairs of lone requests in ABBA order; each request gets its own random prompt."""
    tpot_ms: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    for round_index in range(rounds):
        order = IMPLS if round_index % 2 == 0 else IMPLS[::-1]
        for impl in order:
            timing = stream_generate(urls[impl], random_prompt(THROUGHPUT_PROMPT, next(seed)), THROUGHPUT_OUTPUT)
            tpot_ms[impl].append(1e3 * timing.tpot_s)
        print(f"  round {round_index}: " + ", ".join(f"{impl} {tpot_ms[impl][-1]:.2f} ms" for impl in IMPLS), flush=True)
    return tpot_ms


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the result and the server logs")
    parser.add_argument("--rounds", type=int, default=8, help="ABBA pairs of lone requests")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"stopped by signal {signum}"))
    model_dir = write_midsize_checkpoint(tempfile.mkdtemp(prefix="m3-midsize-"), 1, 3)
    servers = start_both(model_dir, args.out)
    try:
        urls = {impl: server[1] for impl, server in servers.items()}
        seed = iter(range(10**6))
        for impl in IMPLS:
            warm_up(urls[impl], seed)
        tpot_ms = paired_rounds(urls, args.rounds, seed)
    finally:
        for process, *_ in servers.values():
            stop_server(process)
    medians = {impl: statistics.median(values) for impl, values in tpot_ms.items()}
    result = {
        "gpu": gpu_name(), "commit": commit(), "model": midsize_text_config(1, 3),
        "what": f"TPOT of lone {THROUGHPUT_PROMPT}-token-prompt requests with {THROUGHPUT_OUTPUT} output tokens, "
                f"both servers alive on one GPU, ABBA order, {args.rounds} rounds",
        "max_total_tokens": KV_TOKENS_PER_SERVER,
        "tpot_ms": tpot_ms, "median_tpot_ms": medians,
        "speedup_of_medians": medians["upstream"] / medians["ours"],
        "rounds_ours_faster": sum(o < u for o, u in zip(tpot_ms["ours"], tpot_ms["upstream"])),
    }
    path = os.path.join(args.out, "e2e_gpu_paired_c1.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
    print(f"median tpot: ours {medians['ours']:.3f} ms, upstream {medians['upstream']:.3f} ms, "
          f"speed-up {result['speedup_of_medians']:.3f}x; ours faster in {result['rounds_ours_faster']} of {args.rounds} rounds; "
          f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
