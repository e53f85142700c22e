"""``benchmarks/offload_gpu.py``'s CPU-side pieces: the GPU budget, the log readings, the result fields.

The benchmark needs the GPU harness; its budget (one rank of the published H200 recipe, by the
project's memory fit), what it reads from the servers' logs and how it fills the issue's fields
run anywhere.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import offload_gpu  # noqa: E402


def test_budget_is_one_rank_of_the_h200_recipe_with_and_without_offload():
    budget = offload_gpu.reference_budget(512)
    assert budget["recipe"] == "h200-bf16-tp8"
    # the recipe's own note: about 15 GB of KV per GPU, 334,208 tokens, two 128K requests
    assert budget["no_offload_tokens"] == 334208 and budget["gpu_bytes_per_token"] == {"no_offload": 45312, "offload": 16128}
    assert budget["block_cache_bytes"] == (512 + 1) * 128 * 57 * 2 * 128 * 2  # the entries and the scratch entry
    assert budget["offload_tokens"] == (budget["kv_budget_bytes"] - budget["block_cache_bytes"]) // 16128 // 128 * 128
    assert offload_gpu.expected_concurrency(budget["no_offload_tokens"], offload_gpu.PROMPT_128K, offload_gpu.OUT_CAPACITY) == 2
    assert offload_gpu.expected_concurrency(budget["offload_tokens"], offload_gpu.PROMPT_128K, offload_gpu.OUT_CAPACITY) == 6
    assert budget["offload_tokens"] >= offload_gpu.CONTEXT_512K + 512  # the 512K request fits the same budget
    assert "--max-total-tokens" in budget["derivation"]


LOG = """\
[x] M3 sparse offload after 16 decode/verify steps: block-cache hits 10, misses 90 (hit rate 0.100), host->device 23592960 bytes (1474560 per step); extend staging 5 bytes
[x] Decode batch, #running-req: 3, #token: 1, token usage: 0.50, cuda graph: True
[x] Prefill batch, #new-seq: 1, #new-token: 16384, #cached-token: 0, token usage: 0.9, #running-req: 5, #queue-req: 2, #pending-token: 0,
[x] Decode batch, #running-req: 6, #token: 1, token usage: 0.96, cuda graph: True
[x] M3 sparse offload after 48 decode/verify steps: block-cache hits 410, misses 290 (hit rate 0.586), host->device 76021760 bytes (1583786 per step); extend staging 5 bytes
"""


def test_log_readings():
    first = offload_gpu.counter_totals(LOG.splitlines()[0])
    last = offload_gpu.counter_totals(LOG)
    assert first == {"steps": 16, "hits": 10, "misses": 90, "h2d_bytes": 23592960}
    window = offload_gpu.counter_window(first, last)
    assert window["steps"] == 32 and window["hits"] == 400 and window["misses"] == 200
    assert window["hit_rate"] == 400 / 600 and window["h2d_bytes_per_step"] == (76021760 - 23592960) / 32
    assert offload_gpu.counter_window(last, last) is None and offload_gpu.counter_totals("nothing") is None
    assert offload_gpu.largest_decode_batch(LOG) == 6 and offload_gpu.largest_queue(LOG) == 2


def servers(greedy_offload):
    return {
        "tpot-gpu-only": {"offload": False, "tpot_ms": 5.0, "greedy": [[1, 2]], "output_tokens": 256, "prefill_8x128k_wall_s": 20.0},
        "tpot-offload": {"offload": True, "tpot_ms": 6.0, "greedy": [greedy_offload], "output_tokens": 256,
                         "prefill_8x128k_wall_s": 22.0,
                         "counters": {"steps": 32, "hits": 400, "misses": 200, "h2d_bytes": 1, "hit_rate": 0.5,
                                      "h2d_bytes_per_step": 1234.0}},
        "capacity-no-offload": {"offload": False, "max_concurrent": 2, "expected_concurrency": 2, "sent": 3,
                                "largest_queue": 1, "greedy": [[7]]},
        "capacity-offload": {"offload": True, "max_concurrent": 6, "expected_concurrency": 6, "sent": 7,
                             "largest_queue": 1, "greedy": [[7]], "context_512k": {"served": True, "ttft_s": 40.0}},
    }


def test_fields_are_filled_from_what_ran_and_runs_merge(tmp_path):
    result = offload_gpu.empty_result("NVIDIA H100 80GB HBM3", "abc1234")
    result["details"]["servers"] = {k: v for k, v in servers([1, 2]).items() if k.startswith("tpot")}
    tpot_only = offload_gpu.summarize(result)
    assert tpot_only["tpot_ms_128k_c8"] == {"offload": 6.0, "gpu_only": 5.0}
    assert tpot_only["block_cache_hit_rate"] == 0.5 and tpot_only["h2d_bytes_per_step"] == 1234.0
    assert tpot_only["max_concurrent_128k"] == {"offload": None, "no_offload": None}
    assert tpot_only["context_512k_served"] is None and tpot_only["greedy_identical"] is True

    capacity = offload_gpu.empty_result("NVIDIA H100 80GB HBM3", "abc1234")
    capacity["details"]["servers"] = {k: v for k, v in servers([1, 2]).items() if k.startswith("capacity")}
    capacity["details"]["budget"] = {"derivation": "one rank"}
    merged = offload_gpu.merge_results([json.loads(json.dumps(tpot_only)), capacity])
    assert list(merged)[: len(offload_gpu.FIELDS)] == list(offload_gpu.FIELDS)
    assert merged["max_concurrent_128k"] == {"offload": 6, "no_offload": 2}
    assert merged["context_512k_served"] is True and merged["greedy_identical"] is True
    path = offload_gpu.write(merged, str(tmp_path))
    assert os.path.basename(path) == "offload_gpu_h100.json"
    with open(path[:-5] + ".png", "rb") as figure:
        assert figure.read(8) == b"\x89PNG\r\n\x1a\n"
    report = open(path[:-5] + ".md", encoding="utf-8").read()
    assert "| max_concurrent_128k (offload / no offload) | 6 / 2 (3.00x) | >= 3x |" in report
    assert "| tpot_ms_128k_c8 (offload / GPU only) | 6.00 / 5.00 (1.20x) | <= 1.5x |" in report and "one rank" in report

    result["details"]["servers"] = servers([1, 3])
    assert offload_gpu.summarize(result)["greedy_identical"] is False
