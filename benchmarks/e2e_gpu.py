"""End-to-end GPU serving benchmark: the project's M3 against upstream SGLang's own M3, same run.

A mid-size M3 at real widths (``midsize_m3.py``: 1 dense + 3 MoE/MSA layers by default, random
weights from ``--load-format dummy``) is served by the real ``sglang.launch_server`` twice, with
identical flags: once with the sglang-m3 plugin (its model classes, MSA Triton backend, fused
MoE) and once with upstream SGLang 0.5.23's own M3 classes and MiniMax sparse backend (the plugin
taken off the Python path). Measured per server: start-up time, KV tokens available, peak GPU
memory, TTFT of 8K/32K/128K-token prompts, output tok/s and TPOT at concurrency 1/16/64 with 2K
prompts and 256 output tokens (concurrency 1: the median of five lone requests; 16 and 64: the
median of three groups), and TPOT at concurrency 16 with 32K-token contexts.

Run on the lent GPU through the harness (``scripts/gpu/run.sh bench [ARGS]``), which provides
SGLang, the stand-ins and the platform; each server's partial result is written as soon as it is
done (``e2e_gpu_<impl>.json`` under ``--out``), and the merged result, markdown table and plot
come from ``benchmarks/e2e_gpu_report.py``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import requests

sys.path.insert(0, os.path.dirname(__file__))
from host_probe import host_probe, probed  # noqa: E402
from midsize_m3 import midsize_text_config, write_midsize_checkpoint  # noqa: E402
from provenance import commit  # noqa: E402
from serving_client import random_prompt, run_group, stream_generate  # noqa: E402
from trace_summary import idle_gaps, kernel_summary, launch_origins, load_events  # noqa: E402

sys.path.append(os.path.join(os.path.dirname(__file__), "..", "tests"))
from server_harness import free_port, process_start_ticks, stop_process_group  # noqa: E402  (the tests' port choice and group stop)

IMPLS = ("ours", "upstream")
TTFT_PROMPTS = (8192, 32768, 131072)
THROUGHPUT_PROMPT, THROUGHPUT_OUTPUT, THROUGHPUT_CONCURRENCY = 2048, 256, (1, 16, 64)
LONG_CONTEXT_PROMPT, LONG_CONTEXT_CONCURRENCY = 32768, 16
READY_TIMEOUT_S = 900
#: upstream M3's fused-MoE tables in SGLang's own layout (``tune_fused_moe.py --upstream --install``)
UPSTREAM_MOE_CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "upstream_moe_configs")


def server_args(model_dir: str, port: int, tp: int, ep: int) -> list[str]:
    """The flags both servers get (nothing implementation-specific)."""
    context = max(TTFT_PROMPTS) + THROUGHPUT_OUTPUT + 128
    return [
        "--model-path", model_dir, "--load-format", "dummy", "--skip-tokenizer-init",
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
        "--page-size", "128", "--context-length", str(context),
        "--mem-fraction-static", "0.85", "--max-running-requests", "64",
        "--cuda-graph-max-bs-decode", "64", "--tp-size", str(tp), "--ep-size", str(ep),
        # Prefill graphs up to 2,048 tokens (SGLang's default is 8,192): longer chunks run eagerly
        # either way at these sizes, and upstream's capture of the larger sizes took 137 s.
        "--cuda-graph-max-bs-prefill", "2048",
        # SGLang's custom all-reduce is a compiled sgl_kernel op the harness's stand-in lacks (a
        # stock GPU node has it): both servers all-reduce through NCCL on more than one GPU.
        *(("--disable-custom-all-reduce",) if tp > 1 else ()),
    ]


def server_env(impl: str, out_dir: str) -> dict[str, str]:
    """The harness environment for one implementation.

    ``ours``: the plugin's entry points (``M3_GPU_PLUGIN_DIR``, set by ``scripts/gpu/run.sh``)
    and its model package. ``upstream``: both removed, so SGLang's own classes serve the same
    architecture name, and the harness platform lets upstream's M3 KV pool be built.
    """
    env = dict(os.environ)
    env["M3_GPU_STANDIN_LOG"] = os.path.join(out_dir, f"standin_ops_{impl}.txt")
    plugin_dir = env.get("M3_GPU_PLUGIN_DIR", "")
    if impl == "ours":
        env["SGLANG_EXTERNAL_MODEL_PACKAGE"] = "sglang_m3.models"
        return env
    env.pop("SGLANG_EXTERNAL_MODEL_PACKAGE", None)
    if upstream_moe_tables():
        # Upstream tuned as ours is: SGLang reads its tables from here (its own lookup, no patch).
        env["SGLANG_MOE_CONFIG_DIR"] = UPSTREAM_MOE_CONFIG_DIR
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != plugin_dir)
    env["M3_HARNESS_UPSTREAM_M3"] = "1"
    return env


def upstream_moe_tables() -> list[str]:
    """The tuned tables upstream's server gets (empty: it runs SGLang's default tiles)."""
    return sorted(glob.glob(os.path.join(UPSTREAM_MOE_CONFIG_DIR, "configs", "triton_*", "*.json")))


def ours_moe_tables() -> list[str]:
    """The plugin's tuned tables (``sglang_m3/models/moe_kernel_configs/``)."""
    from sglang_m3.models.moe_kernel_configs import CONFIG_DIR

    return sorted(glob.glob(os.path.join(CONFIG_DIR, "*.json")))


def tables_for_gpu(paths: list[str], gpu: str) -> list[str]:
    """The tables among ``paths`` that SGLang reads on ``gpu``: their names carry
    ``device_name=`` and the GPU's name with spaces as underscores (a ``_down`` table too)."""
    wanted = gpu.replace(" ", "_")
    named = [(path, re.search(r"device_name=(.+?)(?:_down)?(?:,|\.json$)", os.path.basename(path))) for path in paths]
    return [path for path, match in named if match and match.group(1) == wanted]


class PeakGpuMemory:
    """Largest ``memory.used`` nvidia-smi reports while the server lives (sampled every 0.5 s)."""

    def __init__(self):
        self.peak_mib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while not self._stop.is_set():
            try:
                used = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=10,
                ).stdout.split()
                self.peak_mib = max([self.peak_mib, *(int(u) for u in used)])
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
            self._stop.wait(0.5)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def start_server(impl: str, model_dir: str, out_dir: str, tp: int, ep: int, extra_args: tuple[str, ...] = (), label: str = "",
                 env: dict[str, str] | None = None):
    """Start one server (``extra_args`` after the common flags; ``label`` names its log; ``env``
    added to the implementation's environment) and wait until it answers ``/health_generate``."""
    port = free_port()
    log_path = os.path.join(out_dir, f"server-{label or impl}-tp{tp}-ep{ep}.log")
    log = open(log_path, "w", encoding="utf-8")
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", *server_args(model_dir, port, tp, ep), *extra_args],
        stdout=log, stderr=subprocess.STDOUT, env={**server_env(impl, out_dir), **(env or {})}, start_new_session=True,
    )
    process.start_ticks = process_start_ticks(process.pid)  # so that a late stop cannot reach a reused pid
    base_url = f"http://127.0.0.1:{port}"
    try:
        while time.perf_counter() - started < READY_TIMEOUT_S:
            if process.poll() is not None:
                raise RuntimeError(f"{impl} server exited with {process.returncode}; log: {log_path}\n{tail(log_path)}")
            try:
                if requests.get(f"{base_url}/health_generate", timeout=30).status_code == 200:
                    return process, base_url, time.perf_counter() - started, log_path
            except requests.RequestException:
                pass
            time.sleep(2)
        raise TimeoutError(f"{impl} server not ready in {READY_TIMEOUT_S} s; log: {log_path}\n{tail(log_path)}")
    except BaseException:
        # The server runs in a session of its own, out of reach of a signal to the benchmark's
        # group, and the caller's ``finally`` only covers a server this function returned: a
        # device call's ``timeout`` (SIGTERM, an exception here) during a start once left
        # upstream's server holding 120 GB of the GPU into the next command, which then ran out
        # of memory. So a start that does not return stops its server, whatever ended it.
        stop_server(process)
        raise


def stop_server(process) -> None:
    """The server and all its processes (schedulers too), given a minute to exit on SIGTERM."""
    stop_process_group(process, grace_s=60)


def tail(path: str, lines: int = 40) -> str:
    with open(path, encoding="utf-8", errors="replace") as handle:
        return "".join(handle.readlines()[-lines:])


def graphs_captured(log_path: str) -> bool:
    with open(log_path, encoding="utf-8", errors="replace") as handle:
        return "CUDA graph end" in handle.read()


def warm_up(base_url: str, seed) -> None:
    """Kernel compilation and autotuning happen here, not in a measured request: single requests
    and full batches both, since kernels specialise on batch shape."""
    for length in (256, 2048, 8192):
        stream_generate(base_url, random_prompt(length, next(seed)), 8)
    for concurrency in (16, 64):
        run_group(base_url, [random_prompt(THROUGHPUT_PROMPT, next(seed)) for _ in range(concurrency)], 16)


#: Concurrency 1 is the median of this many requests sent one after another: one request's TPOT
#: varied by up to 40% between otherwise identical runs on the H100 (``serving_client``).
SINGLE_STREAM_RUNS = 5
#: The 2K rows at concurrency 16 and 64 are the median of this many groups: one group's TPOT moved
#: by about 5% between calls (c16 0.99x in the H200 TP1 run at c30a6ac, where the paired run of
#: the same servers gave 1.13x, ours faster in 6 of 6 rounds).
GROUP_RUNS = 3


def median_group(base_url: str, seed, output: int, concurrency: int) -> tuple:
    """The median (by TPOT) of ``SINGLE_STREAM_RUNS`` lone requests of a 2K prompt, or of
    ``GROUP_RUNS`` groups of ``concurrency`` of them sent at once, and every run's TPOT and host
    probe in the order they ran (``{"runs": [...], "host_loop_ms": [...]}``)."""
    count = SINGLE_STREAM_RUNS if concurrency == 1 else GROUP_RUNS
    runs = [probed(lambda: run_group(base_url, [random_prompt(THROUGHPUT_PROMPT, next(seed)) for _ in range(concurrency)], output))
            for _ in range(count)]
    print(f"  c{concurrency} 2K runs, tpot ms (host probe ms): "
          + ", ".join(f"{group.mean_tpot_ms:.2f} ({loop_ms:.0f})" for group, loop_ms in runs), flush=True)
    record = {"runs": [group.mean_tpot_ms for group, _ in runs], "host_loop_ms": [loop_ms for _, loop_ms in runs]}
    return sorted((group for group, _ in runs), key=lambda group: group.mean_tpot_ms)[len(runs) // 2], record


def measure(base_url: str, quick: bool, seed, rows: list[dict], saved, first_runs: dict) -> None:
    """Every workload of the benchmark against one running server, appended to ``rows`` as result
    rows; ``saved()`` after each workload writes what is there so far. ``first_runs`` gets the
    TTFT of each length's first run by prompt length (kept out of the rows: it includes whatever
    the server compiles or plans on first sight of that length, which a user's first such
    prompt pays)."""
    ttft_prompts = TTFT_PROMPTS[:1] if quick else TTFT_PROMPTS
    for length in ttft_prompts:
        first = stream_generate(base_url, random_prompt(length, next(seed)), 1)  # this length's first run
        first_runs[str(length)] = 1e3 * first.ttft_s
        runs = [stream_generate(base_url, random_prompt(length, next(seed)), 1).ttft_s for _ in range(2)]
        rows.append({"metric": "ttft_ms", "prompt_tokens": length, "concurrency": 1, "value": 1e3 * sum(runs) / len(runs)})
        print(f"  ttft {length}: {rows[-1]['value']:.1f} ms", flush=True)
        saved()
    output = 64 if quick else THROUGHPUT_OUTPUT
    for concurrency in THROUGHPUT_CONCURRENCY[:2] if quick else THROUGHPUT_CONCURRENCY:
        group, runs = median_group(base_url, seed, output, concurrency)
        common = {"prompt_tokens": THROUGHPUT_PROMPT, "concurrency": concurrency}
        rows.append({"metric": "tpot_ms", **common, "value": group.mean_tpot_ms, **runs})
        rows.append({"metric": "output_tok_s", **common, "value": group.output_tok_s})
        if concurrency > 1:
            rows.append({"metric": "ttft_ms", **common, "value": group.mean_ttft_ms})
        print(f"  c{concurrency} 2K: tpot {group.mean_tpot_ms:.2f} ms, {group.output_tok_s:.0f} tok/s, ttft {group.mean_ttft_ms:.0f} ms", flush=True)
        saved()
    if not quick:
        prompts = [random_prompt(LONG_CONTEXT_PROMPT, next(seed)) for _ in range(LONG_CONTEXT_CONCURRENCY)]
        group = run_group(base_url, prompts, THROUGHPUT_OUTPUT)
        common = {"prompt_tokens": LONG_CONTEXT_PROMPT, "concurrency": LONG_CONTEXT_CONCURRENCY}
        rows.append({"metric": "tpot_ms", **common, "value": group.mean_tpot_ms})
        rows.append({"metric": "ttft_ms", **common, "value": group.mean_ttft_ms})
        print(f"  c16 32K: tpot {group.mean_tpot_ms:.2f} ms, ttft {group.mean_ttft_ms:.0f} ms", flush=True)
        saved()


def profile_steps(base_url: str, out_dir: str, label: str, prompt_tokens: int, max_new_tokens: int, steps: int, delay_s: float,
                  prompt: list[int] | None = None) -> dict:
    """Per-kernel GPU time of ``steps`` forward steps of one greedy request (``prompt``, else a
    random one of ``prompt_tokens``), from SGLang's torch profiler (``/start_profile``), started
    ``delay_s`` after the request (0: before it)."""
    trace_dir = os.path.join(out_dir, f"profile-{label}")
    prompt = prompt or random_prompt(prompt_tokens, 10**7)
    request = threading.Thread(target=stream_generate, args=(base_url, prompt, max_new_tokens))
    if delay_s:
        request.start()
        time.sleep(delay_s)
    answer = requests.post(
        f"{base_url}/start_profile", json={"output_dir": trace_dir, "num_steps": steps, "activities": ["GPU"]}, timeout=60
    )
    answer.raise_for_status()
    if not delay_s:
        request.start()
    request.join()
    deadline = time.time() + 120
    while time.time() < deadline:
        traces = glob.glob(os.path.join(trace_dir, "*.trace.json*"))
        if traces:
            time.sleep(2)  # let the writer finish
            events = load_events(traces[0])
            return {"steps": steps, "trace": os.path.basename(traces[0]), **kernel_summary(events, steps), "idle": idle_gaps(events),
                    "origins": launch_origins(events, steps)}
        time.sleep(1)
    raise TimeoutError(f"no profiler trace under {trace_dir} after 120 s")


def profile_server(base_url: str, out_dir: str, impl: str, chunk_tokens: int) -> dict:
    """40 decode steps at concurrency 1 after a 2K prompt (TTFT there is ~50-150 ms, so the
    profile starts 0.5 s in), and the whole prefill of a 32K prompt (its chunks: one step each)."""
    steps = 40
    decode = profile_steps(base_url, out_dir, f"{impl}-decode", THROUGHPUT_PROMPT, 10 * steps, steps, 0.5)
    chunks = -(-LONG_CONTEXT_PROMPT // chunk_tokens)
    stream_generate(base_url, random_prompt(LONG_CONTEXT_PROMPT, 10**7 + 1), 1)  # compiles this length's kernels
    # 16 output tokens: the profiler stops after its step count, so steps must keep coming after the
    # last chunk (with one output token the server idles and the trace is never written).
    prefill = profile_steps(base_url, out_dir, f"{impl}-prefill32k", LONG_CONTEXT_PROMPT, 16, chunks, 0.0)
    return {"decode_c1": decode, "prefill_32k": prefill}


def bench_one(impl: str, model_dir: str, path: str, result: dict, quick: bool, profile: bool, measured: bool,
              fresh_triton_cache: bool = False) -> None:
    """Serve with one implementation and measure it, rewriting ``path`` (``result`` plus what is
    measured, ``"complete": false`` until the end) after every step, so a run cut short by its
    time limit keeps everything it measured. ``fresh_triton_cache``: the server compiles every
    Triton kernel anew (an empty ``TRITON_CACHE_DIR`` of its own), as on a new node, so its
    start-up and ``first_run_ttft_ms`` include what a first deployment pays."""
    tp, ep = result["tp"], result["ep"]
    out_dir = os.path.dirname(path)

    def saved() -> None:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=2)

    print(f"[{impl}] tp{tp} ep{ep}: starting the server", flush=True)
    rows: list[dict] = []
    result.update(impl=impl, complete=False, rows=rows)
    with PeakGpuMemory() as memory:
        env = {"TRITON_CACHE_DIR": tempfile.mkdtemp(prefix=f"triton-cache-{impl}-")} if fresh_triton_cache else None
        result["fresh_triton_cache"] = fresh_triton_cache
        process, base_url, startup_s, log_path = start_server(impl, model_dir, out_dir, tp, ep, env=env)
        try:
            info = requests.get(f"{base_url}/get_server_info", timeout=30).json()
            print(f"[{impl}] ready in {startup_s:.0f} s", flush=True)
            result.update(startup_s=startup_s, kv_tokens=info.get("max_total_num_tokens"), cuda_graphs=graphs_captured(log_path))
            saved()
            seed = iter(range(10**6))
            warm_up(base_url, seed)
            if measured:
                result["first_run_ttft_ms"] = {}
                measure(base_url, quick, seed, rows, saved, result["first_run_ttft_ms"])
            if profile:
                result["profiles"] = profile_server(base_url, out_dir, impl, info.get("chunked_prefill_size") or LONG_CONTEXT_PROMPT)
            result["complete"] = True
        finally:
            stop_server(process)
            for row in rows:
                row.update(tp=tp, ep=ep)
            result["peak_gpu_memory_gb"] = memory.peak_mib * 2**20 / 1e9
            saved()


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


def plugin_switches() -> dict[str, str]:
    """The plugin's environment switches (``SGLANG_M3_*``) and the harness's (``M3_HARNESS_*``,
    e.g. ``M3_HARNESS_CUDA_CUSTOM_OPS``) this run's servers inherit: an A/B run names the side it
    measured, and a result names the harness paths its anchor ran on."""
    return {name: value for name, value in sorted(os.environ.items()) if name.startswith(("SGLANG_M3_", "M3_HARNESS_"))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the partial results and server logs")
    parser.add_argument("--impl", choices=IMPLS, action="append", help="which servers to run (default: both, ours first)")
    parser.add_argument("--dense-layers", type=int, default=1)
    parser.add_argument("--sparse-layers", type=int, default=3)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (inside the TP group)")
    parser.add_argument("--quick", action="store_true", help="8K TTFT and concurrency 1/16 with 64 output tokens only (smoke run)")
    parser.add_argument("--profile", action="store_true", help="also record per-kernel GPU profiles: 40 decode steps at concurrency 1, a 32K prefill")
    parser.add_argument("--profile-only", action="store_true", help="warm up and profile, no timed workloads (implies --profile)")
    parser.add_argument("--fresh-triton-cache", action="store_true",
                        help="each server compiles its Triton kernels anew (own empty TRITON_CACHE_DIR): cold start-up and first prompts")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    model_dir = write_midsize_checkpoint(tempfile.mkdtemp(prefix="m3-midsize-"), args.dense_layers, args.sparse_layers)
    # ``timeout`` ends a device run with SIGTERM: turn it into an exception so each ``finally``
    # stops its server (a server left running holds the GPU for the next call) and saves.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"stopped by signal {signum}"))
    failures = 0
    gpu = gpu_name()
    for impl in args.impl or IMPLS:
        path = os.path.join(args.out, f"e2e_gpu_{impl}_tp{args.tp}_ep{args.ep}.json")
        result = {
            "tp": args.tp, "ep": args.ep, "gpu": gpu, "commit": commit(), "quick": args.quick, "switches": plugin_switches(),
            "host": host_probe(),  # before this server starts: the host's own speed and load
            "model": midsize_text_config(args.dense_layers, args.sparse_layers),
            "moe_tables": [os.path.basename(p) for p in tables_for_gpu(ours_moe_tables() if impl == "ours" else upstream_moe_tables(), gpu)],
        }
        try:
            bench_one(impl, model_dir, path, result, args.quick, args.profile or args.profile_only, not args.profile_only,
                      args.fresh_triton_cache)
        except Exception as error:  # one server failing must not lose the other's numbers
            print(f"[{impl}] FAILED: {error}; what it measured is in {path}", flush=True)
            failures += 1
            continue
        print(f"[{impl}] wrote {path}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
