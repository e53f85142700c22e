"""Sparse offload served on one GPU (issue 16 item 4): capacity, TPOT, cache statistics, 512K context.

The mid-size M3 of ``e2e_gpu.py`` (real widths, 1 dense + 3 MoE/MSA layers, dummy weights, bf16,
page 128, decode CUDA graphs) is served by the plugin with every K/V on the GPU and with sparse
offload (``SGLANG_M3_SPARSE_OFFLOAD_BLOCKS``: the sparse layers' K/V in page-locked host memory, a
block cache of ``--cache-blocks`` blocks per sparse layer on the GPU). Parts (``--part``, all by
default; each writes its fields as soon as it has them):

* ``tpot``: 8 requests with 128K-token contexts (prompts of 130,048 tokens) at once, prefilled
  once with one output token, then sent again (radix hits: all 8 start decoding together) for
  ``OUT_TPOT`` tokens: mean TPOT, gpu-only vs offload (``tpot_ms_128k_c8``); the offload server's
  block-cache hit rate and host->device bytes per decode step over that window (its counter log
  lines, every ``LOG_STEPS`` steps; a step is one forward of the batch through every sparse layer);
  greedy tokens of the 8 prompts sent one at a time afterwards (radix hits), both servers.
* ``capacity``: a fixed GPU KV budget, one rank of the full 60-layer model (below), served once
  without and once with offload: ``n + 1`` concurrent 128K-context requests are sent, ``n`` being
  what the budget should hold, and ``max_concurrent_128k`` is the largest decode batch the server
  logged (``--decode-log-interval 1``); every request must complete. Greedy tokens of the first 2
  prompts, sent again one at a time after a radix-cache flush, are compared between the two servers.
* ``512k``: a 523,264-token prompt (512K context with its 16 output tokens) on the offload server
  of the same budget (``context_512k_served``: it answered all its tokens).

**GPU memory budget** (``budget`` in the results): the mid-size model has 4 layers, so the H100's
memory would hold millions of its tokens; the budget is instead that of one GPU rank of the full
model in the published Hopper deployment, ``recipes/h200-bf16-tp8.yaml`` (8x H200, BF16, TP8,
context 128K), as the project's memory fit (``sglang_m3.recipe.fit.estimate_fit``) computes it:
the KV pool bytes that rank has after weights and reserve, and the tokens they hold, without
offload (45,312 B per token per rank: 60 layers' K/V of one KV head + 57 index keys) and with
sparse offload of the same recipe (``hostOffload: sparse-offload``, ``cacheBlocks`` = this run's
``--cache-blocks``, 64 GB of host per rank; 16,128 B per token on the GPU, the block caches taken
off the same bytes first). The mid-size servers are capped at exactly those token counts with
``--max-total-tokens`` (SGLang admits by tokens), so they admit what that rank would; their own
per-token bytes (4 layers) are smaller, which the cap makes irrelevant. The same budget is the
"budget sized for 128K" of the 512K part: that recipe is sized for 128K contexts (two of them).

Timing (H100, ~75 s per server start): ``tpot`` ~4 min (two servers, 2 x 8 x 128K prefill),
``capacity`` ~3.5 min (3 + 7 128K prefills), ``512k`` ~1 min more on the capacity run's offload
server (~2.5 min alone). Split them over device calls and merge the files:

    scripts/gpu/run.sh exec python benchmarks/offload_gpu.py --out $OUT --part tpot
    scripts/gpu/run.sh exec python benchmarks/offload_gpu.py --out $OUT --part capacity --part 512k
    python benchmarks/offload_gpu.py --merge A/offload_gpu_h100.json B/offload_gpu_h100.json --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from contextlib import contextmanager

import requests
import yaml

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from midsize_m3 import midsize_text_config, write_midsize_checkpoint  # noqa: E402
from serving_client import random_prompt, run_group, stream_generate  # noqa: E402

PARTS = ("tpot", "capacity", "512k")
FIELDS = ("gpu", "commit", "max_concurrent_128k", "tpot_ms_128k_c8", "block_cache_hit_rate", "h2d_bytes_per_step",
          "context_512k_served", "greedy_identical")
REFERENCE_RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "h200-bf16-tp8.yaml")
REFERENCE_HOST_GB = 64
CACHE_BLOCKS = 512  # per sparse layer: 8 requests x 4 KV heads x top-16 fit one fetch round
CONTEXT_128K, CONTEXT_512K = 131072, 524288
PROMPT_128K = CONTEXT_128K - 1024  # 130,048 tokens: room for the outputs inside a 128K context
PROMPT_512K = CONTEXT_512K - 1024
OUT_TPOT, OUT_TPOT_QUICK, OUT_CAPACITY, OUT_512K, OUT_GREEDY = 256, 64, 64, 16, 32
CONCURRENCY = 8
LOG_STEPS = 16
#: tokens a TPOT server holds: 8 contexts of prompt + output, and a little for the warm-up
TPOT_POOL_TOKENS = CONCURRENCY * (PROMPT_128K + OUT_TPOT) + 16384
COMMON_FLAGS = (
    "--chunked-prefill-size", "16384", "--max-running-requests", "16", "--cuda-graph-max-bs-decode", "16",
    # decode graphs only (the prefill graphs' capture would cost start-up time and 128K prefills run eagerly)
    "--cuda-graph-backend-prefill", "disabled",
)
COUNTER_LINE = re.compile(r"M3 sparse offload after (\d+) decode/verify steps: block-cache hits (\d+), misses (\d+)"
                          r".*?host->device (\d+) bytes")
DECODE_LINE = re.compile(r"Decode batch\S*, #running-req: (\d+)")
QUEUE = re.compile(r"#queue-req: (\d+)")


# -- the budget ------------------------------------------------------------------------------------


def reference_budget(cache_blocks: int, recipe_path: str = REFERENCE_RECIPE, host_gb: int = REFERENCE_HOST_GB) -> dict:
    """Token capacities of one rank of ``recipe_path`` without and with sparse offload (same GPU bytes)."""
    from sglang_m3.recipe.fit import estimate_fit
    from sglang_m3.recipe.loader import parse_recipe

    with open(recipe_path, encoding="utf-8") as handle:
        document = yaml.safe_load(handle)
    plain = estimate_fit(parse_recipe(document, source=recipe_path))
    document["spec"]["hostOffload"] = {"mode": "sparse-offload", "sizeGbPerRank": host_gb, "cacheBlocks": cache_blocks}
    offload = estimate_fit(parse_recipe(document, source=recipe_path))
    name = document["metadata"]["name"]
    return {
        "recipe": name,
        "kv_budget_bytes": plain.kv_pool_bytes,
        "no_offload_tokens": plain.pool_tokens,
        "offload_tokens": offload.pool_tokens,
        "gpu_bytes_per_token": {"no_offload": plain.kv_bytes_per_token, "offload": offload.kv_bytes_per_token},
        "block_cache_bytes": offload.block_cache_bytes,
        "host_bytes_per_token": offload.host_store_bytes_per_token,
        "derivation": (
            f"one GPU rank of {name} (the project's memory fit): {plain.kv_pool_bytes:,} B of KV pool after weights "
            f"and reserve; without offload {plain.kv_bytes_per_token:,} B per token -> {plain.pool_tokens:,} tokens; "
            f"with sparse offload (cacheBlocks {cache_blocks}, {host_gb} GB host per rank) the block caches take "
            f"{offload.block_cache_bytes:,} B of it and a token costs the GPU {offload.kv_bytes_per_token:,} B "
            f"-> {offload.pool_tokens:,} tokens; the mid-size servers get these as --max-total-tokens"
        ),
    }


def expected_concurrency(pool_tokens: int, prompt: int, output: int) -> int:
    """Requests of ``prompt + output`` tokens a pool of ``pool_tokens`` holds at once."""
    return pool_tokens // (prompt + output)


# -- server logs -----------------------------------------------------------------------------------


def log_size(path: str) -> int:
    return os.path.getsize(path)


def log_since(path: str, offset: int) -> str:
    with open(path, encoding="utf-8", errors="replace") as handle:
        handle.seek(offset)
        return handle.read()


def counter_totals(text: str) -> dict | None:
    """The last block-cache counter line in ``text``: cumulative steps, hits, misses, host->device bytes."""
    lines = COUNTER_LINE.findall(text)
    if not lines:
        return None
    steps, hits, misses, h2d = map(int, lines[-1])
    return {"steps": steps, "hits": hits, "misses": misses, "h2d_bytes": h2d}


def counter_window(before: dict | None, after: dict | None) -> dict | None:
    """Hit rate and bytes per step between two counter lines (None when no step passed between them)."""
    if after is None:
        return None
    before = before or {"steps": 0, "hits": 0, "misses": 0, "h2d_bytes": 0}
    delta = {key: after[key] - before[key] for key in after}
    looked_up = delta["hits"] + delta["misses"]
    if delta["steps"] <= 0 or looked_up <= 0:
        return None
    return {**delta, "hit_rate": delta["hits"] / looked_up, "h2d_bytes_per_step": delta["h2d_bytes"] / delta["steps"]}


def largest_decode_batch(text: str) -> int:
    return max((int(n) for n in DECODE_LINE.findall(text)), default=0)


def largest_queue(text: str) -> int:
    return max((int(n) for n in QUEUE.findall(text)), default=0)


# -- requests --------------------------------------------------------------------------------------


def greedy_ids(base_url: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Output token ids of one non-streamed greedy request."""
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}}
    response = requests.post(f"{base_url}/generate", json=body, timeout=1800)
    if response.status_code != 200:
        raise RuntimeError(f"/generate answered {response.status_code}: {response.text[:500]}")
    return response.json()["output_ids"]


def warm_up(base_url: str, seed: int) -> None:
    """Kernels compile outside the measurements: one request, then a batch of 8."""
    stream_generate(base_url, random_prompt(2048, seed), 8)
    run_group(base_url, [random_prompt(2048, seed + 1 + i) for i in range(CONCURRENCY)], 8)


# -- servers ---------------------------------------------------------------------------------------


def offload_env(cache_blocks: int) -> dict[str, str]:
    from sglang_m3.cache.offload_settings import SPARSE_OFFLOAD_BLOCKS_ENV, SPARSE_OFFLOAD_LOG_STEPS_ENV

    return {SPARSE_OFFLOAD_BLOCKS_ENV: str(cache_blocks), SPARSE_OFFLOAD_LOG_STEPS_ENV: str(LOG_STEPS)}


@contextmanager
def serving(model_dir: str, out_dir: str, label: str, pool_tokens: int, context: int, cache_blocks: int | None,
            extra: tuple[str, ...] = ()):
    """One plugin server (offload when ``cache_blocks``), its info, stopped on exit."""
    from e2e_gpu import PeakGpuMemory, graphs_captured, start_server, stop_server

    args = (*COMMON_FLAGS, "--context-length", str(context), "--max-total-tokens", str(pool_tokens), *extra)
    env = offload_env(cache_blocks) if cache_blocks else {}
    info = {"label": label, "offload": bool(cache_blocks), "cache_blocks": cache_blocks, "max_total_tokens": pool_tokens,
            "context_length": context}
    print(f"[{label}] starting ({'offload, %d cache blocks' % cache_blocks if cache_blocks else 'all K/V on the GPU'}, "
          f"{pool_tokens:,} tokens)", flush=True)
    with PeakGpuMemory() as memory:
        process, base_url, startup_s, log_path = start_server("ours", model_dir, out_dir, 1, 1, args, label=label, env=env)
        try:
            server_info = requests.get(f"{base_url}/get_server_info", timeout=30).json()
            info.update(startup_s=startup_s, log=os.path.basename(log_path), cuda_graphs=graphs_captured(log_path),
                        kv_tokens=server_info.get("max_total_num_tokens"))
            if cache_blocks:
                with open(log_path, encoding="utf-8", errors="replace") as handle:
                    log = handle.read()
                info["offload_path"] = "M3 sparse offload: MSA Triton path" in log
            print(f"[{label}] ready in {startup_s:.0f} s, {info['kv_tokens']} KV tokens", flush=True)
            yield base_url, log_path, info
        finally:
            stop_server(process)
    info["peak_gpu_memory_gb"] = memory.peak_mib * 2**20 / 1e9


# -- parts -----------------------------------------------------------------------------------------


def tpot_server(model_dir: str, out_dir: str, cache_blocks: int | None, quick: bool) -> dict:
    label = "tpot-offload" if cache_blocks else "tpot-gpu-only"
    output = OUT_TPOT_QUICK if quick else OUT_TPOT
    prompts = [random_prompt(PROMPT_128K, 1000 + i) for i in range(CONCURRENCY)]
    with serving(model_dir, out_dir, label, TPOT_POOL_TOKENS, CONTEXT_128K + 256, cache_blocks) as (base_url, log_path, info):
        warm_up(base_url, 10)
        prefill = run_group(base_url, prompts, 1)
        info["prefill_8x128k_wall_s"] = prefill.wall_s
        print(f"[{label}] 8 x 128K prefilled in {prefill.wall_s:.1f} s", flush=True)
        before = counter_totals(log_since(log_path, 0))
        timed = run_group(base_url, prompts, output)
        after = counter_totals(log_since(log_path, 0))
        info.update(tpot_ms=timed.mean_tpot_ms, output_tokens=output, decode_wall_s=timed.wall_s,
                    tpot_ms_per_request=[1e3 * r.tpot_s for r in timed.requests])
        info["counters"] = counter_window(before, after) if cache_blocks else None
        print(f"[{label}] c8 128K: TPOT {timed.mean_tpot_ms:.2f} ms; counters {info['counters']}", flush=True)
        info["greedy"] = [greedy_ids(base_url, p, OUT_GREEDY) for p in prompts]
    return info


def capacity_server(model_dir: str, out_dir: str, budget: dict, cache_blocks: int | None, serve_512k: bool) -> dict:
    offload = bool(cache_blocks)
    label = "capacity-offload" if offload else "capacity-no-offload"
    tokens = budget["offload_tokens"] if offload else budget["no_offload_tokens"]
    expected = expected_concurrency(tokens, PROMPT_128K, OUT_CAPACITY)
    context = CONTEXT_512K + 512 if serve_512k else CONTEXT_128K + 256
    prompts = [random_prompt(PROMPT_128K, 2000 + i) for i in range(expected + 1)]
    with serving(model_dir, out_dir, label, tokens, context, cache_blocks, ("--decode-log-interval", "1")) as (
        base_url, log_path, info,
    ):
        stream_generate(base_url, random_prompt(2048, 20), 4)
        start = log_size(log_path)
        burst = run_group(base_url, prompts, OUT_CAPACITY)  # raises unless every request answered in full
        text = log_since(log_path, start)
        info.update(expected_concurrency=expected, sent=len(prompts), max_concurrent=largest_decode_batch(text),
                    largest_queue=largest_queue(text), burst_wall_s=burst.wall_s,
                    completed=all(r.output_tokens == OUT_CAPACITY for r in burst.requests))
        print(f"[{label}] {len(prompts)} x 128K sent: at most {info['max_concurrent']} decoding at once "
              f"(expected {expected}), largest queue {info['largest_queue']}, {burst.wall_s:.0f} s", flush=True)
        # the same computation on both servers: no radix hits (whatever each kept), prompts prefilled whole
        info["cache_flushed_for_greedy"] = requests.post(f"{base_url}/flush_cache", timeout=60).ok
        info["greedy"] = [greedy_ids(base_url, p, OUT_GREEDY) for p in prompts[:2]]
        if serve_512k:
            info["context_512k"] = serve_long(base_url)
    return info


def serve_long(base_url: str) -> dict:
    """One 512K-context request; served means every output token came back."""
    started = time.perf_counter()
    try:
        timing = stream_generate(base_url, random_prompt(PROMPT_512K, 3000), OUT_512K, timeout_s=1800)
    except Exception as error:  # noqa: BLE001 - the failure is the result
        print(f"[512k] FAILED: {error}", flush=True)
        return {"served": False, "error": str(error)[-1000:], "wall_s": time.perf_counter() - started}
    served = timing.output_tokens == OUT_512K
    print(f"[512k] {PROMPT_512K:,}-token prompt: TTFT {timing.ttft_s:.1f} s, {timing.output_tokens} tokens", flush=True)
    return {"served": served, "prompt_tokens": PROMPT_512K, "output_tokens": timing.output_tokens,
            "ttft_s": timing.ttft_s, "tpot_ms": None if timing.tpot_s is None else 1e3 * timing.tpot_s}


# -- results ---------------------------------------------------------------------------------------


def empty_result(gpu: str, commit: str) -> dict:
    return {
        "gpu": gpu, "commit": commit,
        "max_concurrent_128k": {"offload": None, "no_offload": None},
        "tpot_ms_128k_c8": {"offload": None, "gpu_only": None},
        "block_cache_hit_rate": None, "h2d_bytes_per_step": None,
        "context_512k_served": None, "greedy_identical": None,
        "details": {"servers": {}, "comparisons": {}},
    }


def summarize(result: dict) -> dict:
    """Fill the issue's fields from ``details`` (what ran; the rest stays null)."""
    servers, comparisons = result["details"]["servers"], result["details"]["comparisons"]
    get = lambda label, key: servers.get(label, {}).get(key)  # noqa: E731
    result["tpot_ms_128k_c8"] = {"offload": get("tpot-offload", "tpot_ms"), "gpu_only": get("tpot-gpu-only", "tpot_ms")}
    counters = get("tpot-offload", "counters")
    result["block_cache_hit_rate"] = counters["hit_rate"] if counters else None
    result["h2d_bytes_per_step"] = counters["h2d_bytes_per_step"] if counters else None
    result["max_concurrent_128k"] = {"offload": get("capacity-offload", "max_concurrent"),
                                     "no_offload": get("capacity-no-offload", "max_concurrent")}
    long = get("capacity-offload", "context_512k") or get("long-offload", "context_512k")
    result["context_512k_served"] = None if long is None else bool(long.get("served"))
    for name, (a, b) in {"tpot": ("tpot-gpu-only", "tpot-offload"), "capacity": ("capacity-no-offload", "capacity-offload")}.items():
        if get(a, "greedy") is not None and get(b, "greedy") is not None:
            comparisons[name] = get(a, "greedy") == get(b, "greedy")
    verdicts = [v for v in comparisons.values() if v is not None]
    result["greedy_identical"] = all(verdicts) if verdicts else None
    return result


def merge_results(results: list[dict]) -> dict:
    """Later files' servers replace earlier ones of the same label; the fields are recomputed."""
    merged = empty_result(results[-1]["gpu"], results[-1]["commit"])
    commits = []
    for result in results:
        details = result.get("details", {})
        merged["details"]["servers"].update(details.get("servers", {}))
        for key, value in details.items():
            if key not in ("servers", "comparisons"):
                merged["details"][key] = value
        commits.append(result["commit"])
    if len(set(commits)) > 1:
        merged["details"]["commits"] = commits
    return summarize(merged)


def ratio(a, b):
    return None if not a or not b else a / b


def markdown(result: dict) -> str:
    d = result["details"]
    servers = d["servers"]
    capacity, tpot = result["max_concurrent_128k"], result["tpot_ms_128k_c8"]
    cap_ratio = ratio(capacity["offload"], capacity["no_offload"])
    tpot_ratio = ratio(tpot["offload"], tpot["gpu_only"])
    fmt = lambda x, spec="{:.2f}": "n/a" if x is None else spec.format(x)  # noqa: E731
    lines = [
        f"# Sparse offload on the {result['gpu']}, mid-size M3 (issue 16 item 4)",
        "",
        f"`benchmarks/offload_gpu.py` at {result['commit']}; mid-size M3 (1 dense + 3 MSA/MoE layers, real widths, "
        "dummy weights, bf16, page 128, decode CUDA graphs); offload = `SGLANG_M3_SPARSE_OFFLOAD_BLOCKS`"
        f"={d.get('cache_blocks')} (block cache per sparse layer), the sparse layers' K/V in page-locked host memory.",
        "",
        "| field | value | target |",
        "|---|---|---|",
        f"| max_concurrent_128k (offload / no offload) | {capacity['offload']} / {capacity['no_offload']} "
        f"({fmt(cap_ratio, '{:.2f}x')}) | >= 3x |",
        f"| tpot_ms_128k_c8 (offload / GPU only) | {fmt(tpot['offload'])} / {fmt(tpot['gpu_only'])} "
        f"({fmt(tpot_ratio, '{:.2f}x')}) | <= 1.5x |",
        f"| block_cache_hit_rate | {fmt(result['block_cache_hit_rate'], '{:.3f}')} | |",
        f"| h2d_bytes_per_step | {fmt(result['h2d_bytes_per_step'], '{:,.0f}')} | |",
        f"| context_512k_served | {result['context_512k_served']} | true |",
        f"| greedy_identical | {result['greedy_identical']} ({d.get('comparisons')}) | true |",
        "",
        "## GPU memory budget",
        "",
        d.get("budget", {}).get("derivation", "(capacity part not run)"),
        "",
        "## Servers",
        "",
        "| server | offload | max tokens | start-up s | peak GPU GB | notes |",
        "|---|---|---|---|---|---|",
    ]
    for label, s in sorted(servers.items()):
        notes = []
        if "tpot_ms" in s:
            notes.append(f"TPOT {s['tpot_ms']:.2f} ms over {s['output_tokens']} tokens, 8x128K prefill {s['prefill_8x128k_wall_s']:.1f} s")
        if s.get("counters"):
            c = s["counters"]
            notes.append(f"{c['steps']} steps: hits {c['hits']}, misses {c['misses']}")
        if "max_concurrent" in s:
            notes.append(f"{s['sent']} sent, {s['max_concurrent']} decoding at once (expected {s['expected_concurrency']}), "
                         f"largest queue {s['largest_queue']}")
        if s.get("context_512k"):
            long = s["context_512k"]
            notes.append(f"512K: served {long.get('served')}, TTFT {fmt(long.get('ttft_s'), '{:.1f}')} s" +
                         (f", error {long['error'][:120]}" if long.get("error") else ""))
        if s.get("failed"):
            notes.append(f"FAILED: {s['failed'][:200]}")
        lines.append(f"| {label} | {s.get('offload')} | {s.get('max_total_tokens')} | {fmt(s.get('startup_s'), '{:.0f}')} | "
                     f"{fmt(s.get('peak_gpu_memory_gb'), '{:.1f}')} | {'; '.join(notes)} |")
    lines += ["", "TPOT: mean over the 8 requests of (latency - TTFT) / (tokens - 1), the second send of 8 prompts of "
              f"{PROMPT_128K:,} tokens (radix hits, so all 8 decode together). Hit rate and bytes per step: the offload "
              f"server's counter log lines (every {LOG_STEPS} decode steps) around that send; bytes are whole pages "
              "(128 tokens x 4 KV heads x K and V) fetched host->device over the 3 sparse layers.", ""]
    return "\n".join(lines)


def write(result: dict, out_dir: str) -> str:
    from e2e_gpu_report import gpu_key
    from offload_gpu_plot import plot

    path = os.path.join(out_dir, f"offload_gpu_{gpu_key(result['gpu'])}.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(summarize(result), handle, indent=2)
    with open(path[:-5] + ".md", "w", encoding="utf-8") as handle:
        handle.write(markdown(result))
    plot(result, path[:-5] + ".png")
    return path


def run_parts(parts: list[str], out_dir: str, cache_blocks: int, quick: bool) -> int:
    from e2e_gpu import gpu_name
    from provenance import commit

    result = empty_result(gpu_name(), commit())
    result["details"].update(cache_blocks=cache_blocks, quick=quick, parts=parts, model=midsize_text_config(),
                             prompts={"tpot": PROMPT_128K, "capacity": PROMPT_128K, "512k": PROMPT_512K})
    model_dir = write_midsize_checkpoint(tempfile.mkdtemp(prefix="m3-midsize-offload-"))
    servers = result["details"]["servers"]
    failures = 0

    def attempt(label: str, run) -> None:
        nonlocal failures
        try:
            servers[label] = run()
        except Exception as error:  # one server failing must not lose the others' numbers
            print(f"[{label}] FAILED: {error}", flush=True)
            servers[label] = {"failed": str(error)[-2000:]}
            failures += 1
        write(result, out_dir)

    if "tpot" in parts:
        attempt("tpot-gpu-only", lambda: tpot_server(model_dir, out_dir, None, quick))
        attempt("tpot-offload", lambda: tpot_server(model_dir, out_dir, cache_blocks, quick))
    if "capacity" in parts or "512k" in parts:
        budget = reference_budget(cache_blocks)
        result["details"]["budget"] = budget
        print(f"[budget] {budget['derivation']}", flush=True)
    if "capacity" in parts:
        attempt("capacity-no-offload", lambda: capacity_server(model_dir, out_dir, budget, None, False))
        attempt("capacity-offload", lambda: capacity_server(model_dir, out_dir, budget, cache_blocks, "512k" in parts))
    elif "512k" in parts:
        def long_only():
            with serving(model_dir, out_dir, "long-offload", budget["offload_tokens"], CONTEXT_512K + 512, cache_blocks) as (
                base_url, _, info,
            ):
                stream_generate(base_url, random_prompt(2048, 20), 4)
                info["context_512k"] = serve_long(base_url)
            return info

        attempt("long-offload", long_only)
    path = write(result, out_dir)
    print(f"wrote {path}", flush=True)
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the result JSON/markdown and the server logs")
    parser.add_argument("--part", choices=PARTS, action="append", help="parts to run (default: all)")
    parser.add_argument("--cache-blocks", type=int, default=CACHE_BLOCKS, help="block-cache entries per sparse layer")
    parser.add_argument("--quick", action="store_true", help=f"{OUT_TPOT_QUICK} timed output tokens instead of {OUT_TPOT}")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="merge result files of separate runs (no GPU)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.merge:
        results = []
        for path in args.merge:
            with open(path, encoding="utf-8") as handle:
                results.append(json.load(handle))
        print(f"wrote {write(merge_results(results), args.out)}")
        return 0
    # ``timeout`` ends a device run with SIGTERM: turn it into an exception so each server is stopped
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"stopped by signal {signum}"))
    return run_parts(args.part or list(PARTS), args.out, args.cache_blocks, args.quick)


if __name__ == "__main__":
    sys.exit(main())
