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
``--copy-draft chain3`` (or ``tree8``) serves the speculative benchmark's EAGLE3 lm-head-copy draft
with its settings and prompts (``speculative_gpu``), so a TPOT there is a draft-verify cycle over
its accepted tokens.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

import requests

sys.path.insert(0, os.path.dirname(__file__))
from e2e_gpu import THROUGHPUT_PROMPT, start_server, stop_server, warm_up  # noqa: E402
from midsize_draft import write_copy_draft  # noqa: E402
from midsize_m3 import midsize_text_config, write_midsize_checkpoint  # noqa: E402
from serving_client import random_prompt, single_stream_tpot_ms  # noqa: E402
from speculative_gpu import DRAFT_VOCAB, DRAFTS, hot_prompt, speculative_args  # noqa: E402


#: the project's own code, as py-spy names a frame's file (relative to the import path)
PROJECT_PACKAGES = ("sglang_m3/", "msa_kernels/")


def is_project_frame(frame: str) -> bool:
    """A frame of the plugin or its kernels (py-spy writes ``function (path:line)``)."""
    return any(f"({package}" in frame for package in PROJECT_PACKAGES)


def summarize(collapsed_path: str, top: int = 25) -> dict:
    """Per process, the functions with the most self and inclusive samples, and the samples whose
    stack passes through the project's code (``project``, with the outermost such frame of each:
    where SGLang called in). With ``--subprocesses`` py-spy roots each stack at its process chain
    (``process PID:"NAME"`` frames, parent first): a sample belongs to the innermost process of
    its chain."""
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
            process = processes.setdefault(name, {"samples": 0, "self": collections.Counter(), "inclusive": collections.Counter(),
                                                  "project": collections.Counter()})
            samples = int(count)
            process["samples"] += samples
            process["self"][calls[-1] if calls else "(no Python frame)"] += samples
            for frame in set(calls):
                process["inclusive"][frame] += samples
            entry = next((frame for frame in calls if is_project_frame(frame)), None)
            if entry is not None:
                process["project"][entry] += samples
    return {
        name: {"samples": p["samples"], "self": p["self"].most_common(top), "inclusive": p["inclusive"].most_common(top),
               "project_samples": sum(p["project"].values()), "project_entries": p["project"].most_common(top)}
        for name, p in sorted(processes.items(), key=lambda item: -item[1]["samples"])
    }


GC_ACCOUNTING_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gc_accounting")


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from ``/proc/*/stat`` parent links)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as handle:
                    fields = handle.read().rpartition(")")[2].split()
            except OSError:
                continue
            children[int(fields[1])].append(int(entry))
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        found.append(current)
        pending += children.get(current, [])
    return found


def thread_cpu(pid: int) -> dict[str, dict]:
    """CPU seconds (user + system) and the CPU last run on, per thread of the server's processes:
    two snapshots around a phase show which threads were busy and where they ran."""
    ticks = os.sysconf("SC_CLK_TCK")
    threads = {}
    for process in descendants(pid):
        try:
            with open(f"/proc/{process}/cmdline", "rb") as handle:
                command = handle.read().replace(b"\0", b" ").decode(errors="replace")[:60]
            tids = os.listdir(f"/proc/{process}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{process}/task/{tid}/stat", encoding="utf-8") as handle:
                    head, _, rest = handle.read().rpartition(")")
            except OSError:
                continue
            fields = rest.split()
            # after the name: state is field 3, utime 14, stime 15, processor 39 (1-based, man 5 proc)
            threads[f"{process}/{tid}"] = {"process": command, "thread": head.partition("(")[2],
                                           "cpu_s": (int(fields[11]) + int(fields[12])) / ticks, "cpu": int(fields[36])}
    return threads


def busy_threads(before: dict, after: dict, seconds: float, top: int = 12) -> list[dict]:
    """Threads by CPU share over the phase (CPU seconds / wall seconds), busiest first."""
    rows = []
    for key, end in after.items():
        used = end["cpu_s"] - before.get(key, {"cpu_s": 0.0})["cpu_s"]
        if used > 0:
            rows.append({"thread": key, "process": end["process"], "name": end["thread"], "share": round(used / seconds, 3),
                         "last_cpu": end["cpu"]})
    return sorted(rows, key=lambda row: -row["share"])[:top]


def gc_totals(directory: str) -> dict[str, dict]:
    """The latest per-process garbage-collector totals written by ``gc_accounting``."""
    totals = {}
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else ():
        if name.endswith(".json"):
            with open(os.path.join(directory, name), encoding="utf-8") as handle:
                snapshot = json.load(handle)
            totals[f"{snapshot['pid']} {snapshot['name'][:60]}"] = snapshot
    return totals


def gc_delta(before: dict, after: dict) -> dict[str, dict]:
    """Collections and seconds per generation spent in each process during a phase."""
    delta = {}
    for key, end in after.items():
        start = before.get(key, {"collections": [0, 0, 0], "seconds": [0.0, 0.0, 0.0]})
        collections_ = [e - s for e, s in zip(end["collections"], start["collections"])]
        if any(collections_):
            delta[key] = {"collections": collections_,
                          "ms": [round(1e3 * (e - s), 2) for e, s in zip(end["seconds"], start["seconds"])]}
    return delta


def start_py_spy(args, process, collapsed: str, seconds: int, label: str) -> subprocess.Popen:
    """``py-spy record`` over the server's processes for ``seconds`` into ``collapsed``, attached
    (returns after it had time to attach to each process)."""
    # py-spy's own messages (which processes it attached to, and why it could not) are kept: on
    # one lease it sampled the launcher alone and said nothing where it could be read.
    with open(os.path.join(args.out, f"py_spy_{label}.log"), "w", encoding="utf-8") as spy_log:
        recorder = subprocess.Popen([
            args.py_spy, "record", "--pid", str(process.pid), "--subprocesses", "--nonblocking", "--rate", str(args.rate),
            "--duration", str(seconds), "--format", "raw", "--output", collapsed,
        ], stdout=spy_log, stderr=subprocess.STDOUT)
    time.sleep(2)
    return recorder


def decode_phase(args, base_url: str, process, prompts: list, label: str, gc_dir: str) -> dict:
    """Lone requests one after another under py-spy; per-thread CPU and GC totals around them."""
    collapsed = os.path.join(args.out, f"host_profile_{label}.txt")
    # long enough for every request: a 2K prefill plus up to 4 ms a token on the mid-size model
    seconds = int(len(prompts) * (0.5 + args.tokens * 0.004)) + 5
    recorder = start_py_spy(args, process, collapsed, seconds, label)
    threads_before, gc_before, started = thread_cpu(process.pid), gc_totals(gc_dir), time.perf_counter()
    tpots = single_stream_tpot_ms(base_url, prompts, args.tokens)
    time.sleep(0.5)  # the accounting writes its totals at most every 0.2 s
    wall = time.perf_counter() - started
    threads_after, gc_after = thread_cpu(process.pid), gc_totals(gc_dir)
    recorder.wait(timeout=seconds + 60)
    return {"tpot_ms": tpots, "wall_s": wall, "busy_threads": busy_threads(threads_before, threads_after, wall),
            "gc": gc_delta(gc_before, gc_after), "processes": summarize(collapsed)}


def add_profiled_server_arguments(parser: argparse.ArgumentParser, rate: int) -> None:
    """The options of a tool that serves the mid-size model under py-spy (this one, the first-prompt one)."""
    parser.add_argument("--out", required=True)
    parser.add_argument("--py-spy", required=True, help="the py-spy executable")
    parser.add_argument("--impl", default="ours", choices=("ours", "upstream"))
    parser.add_argument("--rate", type=int, default=rate, help="py-spy samples per second")
    parser.add_argument("--env", nargs="*", default=[], help="KEY=VALUE for the server")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPUs)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (at most --tp)")


def report(label: str, phase: dict) -> None:
    print(f"[{label}] tpot ms per request: " + ", ".join(f"{t:.2f}" for t in phase["tpot_ms"]), flush=True)
    for row in phase["busy_threads"]:
        print(f"  cpu {row['share']:5.2f} on cpu {row['last_cpu']:3d}  {row['name']:<18} {row['process']}", flush=True)
    for name, gc_phase in phase["gc"].items():
        print(f"  gc {name}: collections {gc_phase['collections']} ms {gc_phase['ms']}", flush=True)
    for name, process_summary in list(phase["processes"].items())[:4]:
        share = process_summary["project_samples"] / max(process_summary["samples"], 1)
        print(f"  {name[:90]}: {process_summary['samples']} samples, {share:.1%} through the project's code; top self:", flush=True)
        for frame, samples in process_summary["self"][:12]:
            print(f"    {samples:6d} {frame[:150]}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_profiled_server_arguments(parser, rate=250)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--label", default="")
    parser.add_argument("--copy-draft", choices=[name for name in DRAFTS if name != "none"],
                        help="serve with the speculative benchmark's EAGLE3 copy draft in this shape, on its prompts")
    parser.add_argument("--server-arg", action="append", default=[], help="an extra server flag (repeat; e.g. --server-arg=--gc-warning-threshold-secs=0.001)")
    parser.add_argument("--freeze-gc", action="store_true", help="POST /freeze_gc after the warm-up (SGLang's own, after its start-up warm-up, is kept either way)")
    parser.add_argument("--then-freeze-gc", action="store_true",
                        help="after the profiled phase, POST /freeze_gc and profile a second phase on the same server")
    parser.add_argument("--gc-stats", action="store_true",
                        help="count every process's garbage collections and their time per phase (gc_accounting/)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    label = args.label or args.impl
    env = dict(pair.split("=", 1) for pair in args.env)
    gc_dir = os.path.join(args.out, f"gc-{label}")
    if args.gc_stats:
        # through this process's environment, which e2e_gpu.server_env filters per implementation
        os.environ["M3_GC_STATS_DIR"] = gc_dir
        os.environ["PYTHONPATH"] = os.pathsep.join([GC_ACCOUNTING_DIR, *filter(None, [os.environ.get("PYTHONPATH")])])
    model_dir = write_midsize_checkpoint(tempfile.mkdtemp(prefix="m3-midsize-"), 1, 3)
    extra_args, prompt = tuple(args.server_arg), functools.partial(random_prompt, THROUGHPUT_PROMPT)
    if args.copy_draft:
        draft_dir = write_copy_draft(tempfile.mkdtemp(prefix="m3-midsize-draft-"), midsize_text_config(1, 3), DRAFT_VOCAB)
        extra_args += speculative_args(args.copy_draft, draft_dir)
        prompt = functools.partial(hot_prompt, THROUGHPUT_PROMPT, draft_vocab=DRAFT_VOCAB)
    process, base_url, startup_s, _ = start_server(args.impl, model_dir, args.out, args.tp, args.ep, label=f"hostprof-{label}", env=env,
                                                    extra_args=extra_args)
    try:
        seed = iter(range(10**6))
        warm_up(base_url, seed)
        if args.freeze_gc:
            requests.post(f"{base_url}/freeze_gc", timeout=60).raise_for_status()
        phases = {label: decode_phase(args, base_url, process, [prompt(next(seed)) for _ in range(args.requests)], label, gc_dir)}
        if args.then_freeze_gc:
            requests.post(f"{base_url}/freeze_gc", timeout=60).raise_for_status()
            time.sleep(1)
            phases[f"{label}-frozen"] = decode_phase(args, base_url, process, [prompt(next(seed)) for _ in range(args.requests)],
                                                     f"{label}-frozen", gc_dir)
    finally:
        stop_server(process)
    for name, phase in phases.items():
        result = {"impl": args.impl, "tp": args.tp, "ep": args.ep, "env": env, "copy_draft": args.copy_draft, "startup_s": startup_s, "tokens": args.tokens, **phase}
        with open(os.path.join(args.out, f"host_profile_{name}.json"), "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)
        report(name, phase)
    return 0


if __name__ == "__main__":
    sys.exit(main())
