"""The GPU benchmark's CPU-side pieces: the mid-size model, the trace summary and the report merge.

The benchmark itself needs the GPU harness; what it measures depends on these pieces being right
(the model at the shipped widths, speed-ups pointing the right way, kernel time per step), and they
run anywhere.
"""

from __future__ import annotations

import gzip
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import e2e_gpu_report  # noqa: E402
from prefill_host_probe import host_work_in_gaps  # noqa: E402
from midsize_m3 import midsize_text_config, shipped_text_config, write_midsize_checkpoint  # noqa: E402
from trace_summary import collective_waits, idle_gaps, kernel_summary, launch_origins, load_events  # noqa: E402

from sglang_m3.config import M3TextSpec  # noqa: E402


@pytest.mark.parametrize("dense, sparse", [(1, 3), (0, 2), (3, 4)])
def test_midsize_model_keeps_the_shipped_widths_and_layer_kinds(tmp_path, dense, sparse):
    spec = M3TextSpec.from_config(None, write_midsize_checkpoint(str(tmp_path), dense, sparse))
    full = M3TextSpec.from_config(None, _shipped_dir(tmp_path))
    assert spec.num_layers == dense + sparse
    assert spec.sparse_layers == (False,) * dense + (True,) * sparse
    assert spec.moe_layers == spec.sparse_layers
    for field in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "rotary_dim", "num_experts",
                  "experts_per_token", "moe_intermediate_size", "dense_intermediate_size", "vocab_size",
                  "index_heads", "index_head_dim", "index_block_size", "index_topk_blocks", "hidden_act"):
        assert getattr(spec, field) == getattr(full, field), field


def test_midsize_refuses_more_dense_layers_than_the_real_model():
    real_dense = shipped_text_config()["moe_layer_freq"].index(1)
    with pytest.raises(ValueError, match="dense layers"):
        midsize_text_config(real_dense + 1, 1)
    with pytest.raises(ValueError, match="sparse layer"):
        midsize_text_config(1, 0)


def _shipped_dir(tmp_path):
    directory = tmp_path / "shipped"
    directory.mkdir()
    config = dict(shipped_text_config(), architectures=["MiniMaxM3SparseForCausalLM"], model_type="minimax_m2")
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def test_trace_summary_totals_gpu_kernels_per_step(tmp_path):
    events = [
        {"ph": "X", "cat": "kernel", "name": "gemm", "dur": 30.0},
        {"ph": "X", "cat": "kernel", "name": "gemm", "dur": 10.0},
        {"ph": "X", "cat": "kernel", "name": "norm", "dur": 4.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 500.0},  # host side: not GPU time
        {"ph": "i", "cat": "kernel", "name": "marker"},  # not a duration event
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        json.dump({"traceEvents": events}, handle)
    summary = kernel_summary(load_events(str(path)), steps=2)
    assert summary["kernel_us_total"] == 44.0
    assert summary["kernel_us_per_step"] == 22.0
    assert summary["launches_per_step"] == 1.5
    assert [k["name"] for k in summary["kernels"]] == ["gemm", "norm"]
    assert summary["kernels"][0] == {"name": "gemm", "us_per_step": 20.0, "calls_per_step": 1.0, "us_per_call": 20.0, "share": 40 / 44}
    with pytest.raises(ValueError, match="steps"):
        kernel_summary([], steps=0)


def test_idle_gaps_group_gpu_idle_time_by_neighbouring_kernels():
    def kernel(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}

    events = [
        kernel("gemm", 0.0, 10.0),
        kernel("attn", 110.0, 10.0),  # 100 us idle after gemm
        kernel("moe", 120.0, 50.0),
        kernel("overlap", 130.0, 5.0),  # inside moe: busy, no gap
        kernel("gemm", 175.0, 5.0),  # 5 us: under the threshold
        kernel("attn", 230.0, 10.0),  # 50 us after gemm
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 900.0},
    ]
    idle = idle_gaps(events, min_us=20.0)
    assert idle["idle_us_total"] == 150.0
    assert idle["gaps"] == [{"after": "gemm", "before": "attn", "count": 2, "us_total": 150.0, "us_max": 100.0}]
    # the gap is measured from the latest end among overlapping kernels (moe, not overlap)
    assert idle_gaps([kernel("moe", 0.0, 50.0), kernel("x", 10.0, 5.0), kernel("y", 80.0, 1.0)])["gaps"][0]["after"] == "moe"


def test_launch_origins_split_graph_replays_from_eager_launches():
    def api(name, correlation):
        return {"ph": "X", "cat": "cuda_runtime" if name.startswith("cuda") else "cuda_driver", "name": name,
                "args": {"correlation": correlation}}

    def gpu(name, correlation, dur=2.0, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "dur": dur, "args": {"correlation": correlation}}

    events = []
    for step in range(2):
        base = 100 * step
        events += [
            api("cudaGraphLaunch", base + 1), gpu("gemm", base + 1), gpu("attn", base + 1), gpu("moe", base + 1),
            api("cudaLaunchKernel", base + 2), gpu("_small_copy_kernel", base + 2, dur=3.0),
            api("cuLaunchKernelEx", base + 3), gpu("triton_plan_kernel", base + 3),
            api("cudaMemcpyAsync", base + 4), gpu("Memcpy HtoD (Pinned -> Device)", base + 4, cat="gpu_memcpy"),
            api("cudaLaunchKernel", base + 5), gpu("_small_copy_kernel", base + 5, dur=1.0),
        ]
    events.append(gpu("orphan", 999))  # its host call fell outside the trace
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 5.0, "args": {"correlation": 1}})
    origins = launch_origins(events, steps=2)
    assert origins["graph_per_step"] == 3.0
    assert origins["eager_per_step"] == 4.0
    assert origins["unmatched_per_step"] == 0.5
    assert origins["eager"][0] == {"name": "_small_copy_kernel", "calls_per_step": 2.0, "us_per_step": 4.0}
    assert {row["name"] for row in origins["eager"]} == {"_small_copy_kernel", "triton_plan_kernel", "Memcpy HtoD (Pinned -> Device)"}
    with pytest.raises(ValueError, match="steps"):
        launch_origins(events, steps=0)


def test_collective_waits_split_each_steps_first_collective_from_the_rest():
    def kernel(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}

    events = [
        kernel("ncclDevKernel_AllReduce", 0.0, 99.0),  # before the first step: not counted
        kernel("embedding_kernel", 10.0, 1.0),
        kernel("ncclDevKernel_AllReduce", 12.0, 400.0),  # waits for the other rank
        kernel("gemm", 420.0, 5.0),
        kernel("ncclDevKernel_AllReduce", 430.0, 8.0),
        kernel("embedding_kernel", 500.0, 1.0),
        kernel("ncclDevKernel_AllReduce", 502.0, 6.0),
        kernel("ncclDevKernel_AllGather", 520.0, 10.0),
        kernel("embedding_kernel", 600.0, 1.0),  # a step without collectives is left out
        {"ph": "X", "cat": "cpu_op", "name": "nccl:all_reduce", "ts": 700.0, "dur": 50.0},
    ]
    waits = collective_waits(events, "embedding")
    assert waits["steps"] == 2
    assert waits["first_us"] == [400.0, 6.0]
    assert waits["first_us_median"] == 203.0
    assert waits["later_us_median"] == 9.0
    assert waits["later_per_step"] == 1.0
    with pytest.raises(ValueError, match="no step"):
        collective_waits(events, "lm_head")


def test_host_work_in_gaps_gives_each_moment_to_its_innermost_function():
    def event(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    events = [
        event("kernel", "a", 0.0, 10.0),
        event("kernel", "b", 1010.0, 10.0),  # a 1,000 us gap after a
        event("kernel", "c", 1030.0, 10.0),  # 10 us: under the threshold
        event("kernel", "d", 3040.0, 10.0),  # a 2,000 us gap after c
        event("python_function", "scheduler_loop", 0.0, 100000.0),  # longer than longest_us: no inclusive row
        event("python_function", "run_batch", 0.0, 1100.0),
        event("python_function", "plan", 100.0, 800.0),
        event("python_function", "prepare", 1500.0, 1000.0),
        event("python_function", "between_kernels", 1015.0, 10.0),  # outside every gap
        event("cpu_op", "aten::sort", 200.0, 100.0),  # aten ops count only when there are no Python events
    ]
    work = host_work_in_gaps(events, min_gap_us=500.0, longest_us=50000.0)
    assert (work["gaps"], work["gap_ms"]) == (2, 3.0)
    self_ms = {row["name"]: row["ms_in_gaps"] for row in work["self"]}
    # gap 1 (10-1010): run_batch 10-100 and 900-1010, plan 100-900; gap 2 (1040-3040): run_batch
    # 1040-1100, the loop 1100-1500, prepare 1500-2500, the loop 2500-3040
    assert self_ms == {"scheduler_loop": 0.94, "prepare": 1.0, "plan": 0.8, "run_batch": 0.26}
    inclusive = {row["name"]: row["ms_in_gaps"] for row in work["inclusive"]}
    assert inclusive == {"run_batch": 1.06, "plan": 0.8, "prepare": 1.0}
    aten_only = host_work_in_gaps([e for e in events if e["cat"] != "python_function"], min_gap_us=500.0)
    assert aten_only["self"] == [{"name": "aten::sort", "ms_in_gaps": 0.1}]


def _server(impl, rows, commit="c"):
    return {"impl": impl, "tp": 1, "ep": 1, "startup_s": 1.0, "kv_tokens": 10, "peak_gpu_memory_gb": 1.0,
            "cuda_graphs": True, "quick": False, "commit": commit, "gpu": "NVIDIA H100 80GB HBM3",
            "model": midsize_text_config(), "rows": [{"tp": 1, "ep": 1, **r} for r in rows]}


def test_report_pairs_servers_and_speed_up_points_the_right_way(tmp_path):
    ours = _server("ours", [{"metric": "ttft_ms", "prompt_tokens": 8192, "concurrency": 1, "value": 100.0},
                            {"metric": "output_tok_s", "prompt_tokens": 2048, "concurrency": 16, "value": 300.0}])
    upstream = _server("upstream", [{"metric": "ttft_ms", "prompt_tokens": 8192, "concurrency": 1, "value": 150.0},
                                    {"metric": "output_tok_s", "prompt_tokens": 2048, "concurrency": 16, "value": 200.0}], "u")
    old, new = tmp_path / "a", tmp_path / "b"
    old.mkdir(), new.mkdir()
    (old / "e2e_gpu_upstream_tp1_ep1.json").write_text(json.dumps(upstream))
    (old / "e2e_gpu_ours_tp1_ep1.json").write_text(json.dumps(_server("ours", [], "stale")))
    (new / "e2e_gpu_ours_tp1_ep1.json").write_text(json.dumps(ours))
    (new / "standin_ops_ours.txt").write_text("12 moe_sum_reduce\n13 moe_sum_reduce\n12 weak_ref_tensor\n")
    (old / "standin_ops_ours.txt").write_text("7 gemma_rmsnorm\n")
    dirs = [str(old), str(new)]
    result = e2e_gpu_report.merge(e2e_gpu_report.load_servers(dirs), e2e_gpu_report.standin_ops(dirs), "two runs")
    assert result["commit"] == "c" and result["note"] == "two runs" and result["cuda_graphs"]
    assert {s["impl"]: s["commit"] for s in result["servers"]} == {"ours": "c", "upstream": "u"}
    # the union over the merged runs: each run's rows are in the table
    assert result["standin_ops"] == {"ours": ["gemma_rmsnorm", "moe_sum_reduce", "weak_ref_tensor"]}
    ratios = {row["metric"]: e2e_gpu_report.ratio(row) for row in result["rows"]}
    assert ratios == {"ttft_ms": 1.5, "output_tok_s": 1.5}
    assert e2e_gpu_report.gpu_key(result["gpu"]) == "h100"
    assert "| ttft_ms | 8192 | 1 | 1 | 1 | 100.00 | 150.00 | 1.50x |" in e2e_gpu_report.markdown(result)


def test_report_title_names_each_commit_with_the_shapes_it_served():
    one = {"commit": "a", "servers": [{"commit": "a", "tp": 1, "ep": 1}, {"commit": "a", "tp": 2, "ep": 2}]}
    assert e2e_gpu_report.commits_label(one) == "commit a"
    mixed = {"commit": "a", "servers": [
        {"commit": "a", "tp": 1, "ep": 1}, {"commit": "a", "tp": 1, "ep": 1},
        {"commit": "b", "tp": 2, "ep": 1}, {"commit": "b", "tp": 2, "ep": 2},
    ]}
    assert e2e_gpu_report.commits_label(mixed) == "commits a (TP1), b (TP2 / TP2 + EP2)"


def test_report_marks_a_server_cut_short(tmp_path):
    cut = {**_server("upstream", [{"metric": "ttft_ms", "prompt_tokens": 8192, "concurrency": 1, "value": 150.0}]), "complete": False}
    (tmp_path / "e2e_gpu_upstream_tp1_ep1.json").write_text(json.dumps(cut))
    (tmp_path / "e2e_gpu_ours_tp1_ep1.json").write_text(json.dumps(_server("ours", [])))
    result = e2e_gpu_report.merge(e2e_gpu_report.load_servers([str(tmp_path)]), {}, "")
    assert {s["impl"]: s["complete"] for s in result["servers"]} == {"ours": True, "upstream": False}
    assert "| 1.0 | True | no (cut short) |" in e2e_gpu_report.markdown(result)


def test_report_names_a_server_rebuilt_from_its_log(tmp_path):
    rebuilt = {**_server("upstream", []), "peak_gpu_memory_gb": None, "reconstructed": "rebuilt from bench.log"}
    (tmp_path / "e2e_gpu_upstream_tp1_ep1.json").write_text(json.dumps(rebuilt))
    (tmp_path / "e2e_gpu_ours_tp1_ep1.json").write_text(json.dumps(_server("ours", [])))
    result = e2e_gpu_report.merge(e2e_gpu_report.load_servers([str(tmp_path)]), {}, "")
    text = e2e_gpu_report.markdown(result)
    assert "| upstream | c | 1 | 1 | 1 | 10 | - | True | yes |" in text
    assert "- upstream tp1 ep1: rebuilt from bench.log" in text
    assert "reconstructed" not in next(s for s in result["servers"] if s["impl"] == "ours")


def test_report_names_the_switches_each_server_ran_under(tmp_path):
    switched = {**_server("upstream", []), "switches": {"M3_HARNESS_CUDA_CUSTOM_OPS": "1"}}
    (tmp_path / "e2e_gpu_upstream_tp1_ep1.json").write_text(json.dumps(switched))
    (tmp_path / "e2e_gpu_ours_tp1_ep1.json").write_text(json.dumps(_server("ours", [])))
    result = e2e_gpu_report.merge(e2e_gpu_report.load_servers([str(tmp_path)]), {}, "")
    assert {s["impl"]: s.get("switches") for s in result["servers"]} == {
        "ours": None, "upstream": {"M3_HARNESS_CUDA_CUSTOM_OPS": "1"}}
    assert "- upstream tp1 ep1: `M3_HARNESS_CUDA_CUSTOM_OPS=1`" in e2e_gpu_report.markdown(result)


def test_host_probe_names_the_cpu_and_times_its_python_loop():
    import host_probe

    probe = host_probe.host_probe(repeats=3)
    assert probe["cpu"] and probe["cpus"] >= 1 and probe["load_avg_1m"] >= 0
    assert len(probe["python_loop_ms_runs"]) == 3 and all(ms > 0 for ms in probe["python_loop_ms_runs"])
    assert probe["python_loop_ms"] == sorted(probe["python_loop_ms_runs"])[1]
    # sixteen times the iterations take longer: the probe measures work, not a constant
    assert host_probe.python_loop_ms(host_probe.PROBE_ITERATIONS) > host_probe.python_loop_ms(host_probe.PROBE_ITERATIONS // 16)


def test_report_names_each_servers_host(tmp_path):
    host = {"cpu": "Some CPU", "cpus": 16, "load_avg_1m": 1.5, "python_loop_ms": 31.25, "python_loop_ms_runs": [31.25]}
    (tmp_path / "e2e_gpu_upstream_tp1_ep1.json").write_text(json.dumps({**_server("upstream", []), "host": host}))
    (tmp_path / "e2e_gpu_ours_tp1_ep1.json").write_text(json.dumps(_server("ours", [])))
    result = e2e_gpu_report.merge(e2e_gpu_report.load_servers([str(tmp_path)]), {}, "")
    assert next(s for s in result["servers"] if s["impl"] == "upstream")["host"] == host
    assert "- upstream tp1 ep1: Some CPU, 16 CPUs, load 1.50, Python probe 31.2 ms" in e2e_gpu_report.markdown(result)


def test_each_workload_is_saved_as_soon_as_it_is_measured(monkeypatch):
    """A device run cut by its time limit keeps every row measured before the cut; concurrency 1
    is the median of its lone requests, a higher 2K concurrency the median of its groups."""
    import e2e_gpu
    from serving_client import RequestTiming

    class Group:
        def __init__(self, tpot_ms, ttft_ms=40.0):
            self.mean_tpot_ms, self.output_tok_s, self.mean_ttft_ms = tpot_ms, 1e3 / tpot_ms, ttft_ms

    lone_tpots = [3.1, 2.4, 2.9, 2.5, 2.6]  # median 2.6
    c16_groups = [Group(8.4, 90.0), Group(7.9, 80.0), Group(8.1, 85.0)]  # median by TPOT: 8.1, with its own TTFT
    assert len(lone_tpots) == e2e_gpu.SINGLE_STREAM_RUNS and len(c16_groups) == e2e_gpu.GROUP_RUNS
    calls = {"single": 0, "group": 0}
    sizes = []

    def single(*args, **kwargs):
        calls["single"] += 1
        return RequestTiming(0.1, 0.2, 1)

    def group(base_url, prompts, output):
        calls["group"] += 1
        sizes.append(len(prompts))
        if calls["group"] <= len(lone_tpots):
            return Group(lone_tpots[calls["group"] - 1])
        if calls["group"] <= len(lone_tpots) + len(c16_groups):
            return c16_groups[calls["group"] - len(lone_tpots) - 1]
        raise SystemExit("stopped by signal 15")  # the first c64 group is cut

    probes = iter([70.0, 75.0, 150.0, 160.0, 155.0, 80.0, 81.0, 82.0, 83.0])  # the host slowed between the second and third lone request

    def probed(run):
        loop_ms = next(probes)
        return run(), loop_ms

    monkeypatch.setattr(e2e_gpu, "stream_generate", single)
    monkeypatch.setattr(e2e_gpu, "run_group", group)
    monkeypatch.setattr(e2e_gpu, "probed", probed)
    monkeypatch.setattr(e2e_gpu, "random_prompt", lambda length, seed: [seed] * 4)
    rows, snapshots, first_runs = [], [], {}
    with pytest.raises(SystemExit):
        e2e_gpu.measure("http://unused", False, iter(range(1000)), rows, lambda: snapshots.append(len(rows)), first_runs)
    assert sizes == [1] * 5 + [16] * 3 + [64]
    # each TTFT length's first (discarded) run is kept beside the rows
    assert first_runs == {str(length): 1e3 * 0.1 for length in e2e_gpu.TTFT_PROMPTS}
    # three TTFT lengths, then c1 (tpot + tok/s) and c16 (+ its ttft) before the cut at c64
    assert snapshots == [1, 2, 3, 5, 8]
    c16 = {r["metric"]: r for r in rows if r["concurrency"] == 16}
    assert c16["tpot_ms"]["value"] == 8.1 and c16["output_tok_s"]["value"] == 1e3 / 8.1 and c16["ttft_ms"]["value"] == 85.0
    assert c16["tpot_ms"]["runs"] == [8.4, 7.9, 8.1] and c16["tpot_ms"]["host_loop_ms"] == [80.0, 81.0, 82.0]
    c1 = {r["metric"]: r["value"] for r in rows if r["concurrency"] == 1 and r["prompt_tokens"] == 2048}
    assert c1 == {"tpot_ms": 2.6, "output_tok_s": 1e3 / 2.6}
    # every lone request is kept in the order it ran, beside the probe taken just before it
    c1_tpot = next(r for r in rows if r["metric"] == "tpot_ms" and r["concurrency"] == 1)
    assert c1_tpot["runs"] == lone_tpots and c1_tpot["host_loop_ms"] == [70.0, 75.0, 150.0, 160.0, 155.0]


@pytest.mark.parametrize("ending", [SystemExit("stopped by signal 15"), KeyboardInterrupt(), "exits"])
def test_a_server_start_that_does_not_return_leaves_no_process(monkeypatch, tmp_path, ending):
    """A signal (``timeout`` ending a device call: SIGTERM, SystemExit in the benchmarks), an
    interrupt or the server's own exit while ``start_server`` waits for it: the server's session,
    a child it forked included, is gone when the exception leaves the call."""
    import subprocess

    import e2e_gpu
    from server_harness import live_group_members

    real_popen = subprocess.Popen
    started = []
    # a stand-in server: a leader that forks a child (SGLang's schedulers) and sleeps, or exits at once
    script = "import os, sys, time\nif os.fork() == 0:\n    time.sleep(600)\n" + (
        "sys.exit(3)\n" if ending == "exits" else "time.sleep(600)\n"
    )

    def popen(argv, **kwargs):
        assert kwargs.get("start_new_session"), "the server must run in a session of its own"
        started.append(real_popen([sys.executable, "-c", script], **kwargs))
        return started[-1]

    def health(url, timeout):
        if ending == "exits":
            raise e2e_gpu.requests.ConnectionError("not up")
        raise ending

    monkeypatch.setattr(e2e_gpu.subprocess, "Popen", popen)
    monkeypatch.setattr(e2e_gpu.requests, "get", health)
    monkeypatch.setattr(e2e_gpu, "server_env", lambda impl, out_dir: dict(os.environ))
    expected = RuntimeError if ending == "exits" else type(ending)
    with pytest.raises(expected):
        e2e_gpu.start_server("ours", str(tmp_path), str(tmp_path), 1, 1)
    (server,) = started
    assert server.poll() is not None
    assert live_group_members(server.pid) == []


def test_probed_times_the_host_before_the_measurement_it_wraps(monkeypatch):
    import host_probe

    order = []
    monkeypatch.setattr(host_probe, "python_loop_ms", lambda: order.append("probe") or 80.0)
    assert host_probe.probed(lambda: order.append("run") or 2.5) == (2.5, 80.0)
    assert order == ["probe", "run"]


def test_report_lists_each_lone_request_with_its_host_probe(tmp_path):
    c1 = {"metric": "tpot_ms", "prompt_tokens": 2048, "concurrency": 1, "value": 2.6,
          "runs": [1.95, 2.61], "host_loop_ms": [72.0, 151.0]}
    (tmp_path / "e2e_gpu_ours_tp1_ep1.json").write_text(json.dumps(_server("ours", [c1])))
    (tmp_path / "e2e_gpu_upstream_tp1_ep1.json").write_text(json.dumps(_server("upstream", [{**c1, "runs": None, "host_loop_ms": None}])))
    result = e2e_gpu_report.merge(e2e_gpu_report.load_servers([str(tmp_path)]), {}, "")
    servers = {s["impl"]: s for s in result["servers"]}
    assert servers["ours"]["c1_runs"] == {"tpot_ms": [1.95, 2.61], "host_loop_ms": [72.0, 151.0]}
    assert "c1_runs" not in servers["upstream"]  # a run that did not record them lists nothing
    assert "- ours tp1 ep1: 1.95 ms (probe 72 ms), 2.61 ms (probe 151 ms)" in e2e_gpu_report.markdown(result)


def test_report_sets_each_c1_tpot_against_the_steps_byte_minimum(tmp_path):
    """c1 TPOT rows get the busiest rank's decode floor (``sglang-m3 inspect``) on the run's GPU
    (H100 here), EP rows their own; other concurrencies do not."""
    from sglang_m3.inspect.report import inspect_config

    rows = [{"metric": "tpot_ms", "prompt_tokens": 2048, "concurrency": 1, "value": 3.0},
            {"metric": "tpot_ms", "prompt_tokens": 2048, "concurrency": 16, "value": 6.0}]
    ep2 = {**_server("ours", rows), "tp": 2, "ep": 2}
    ep2["rows"] = [{**r, "tp": 2, "ep": 2} for r in ep2["rows"]]
    (tmp_path / "e2e_gpu_ours_tp1_ep1.json").write_text(json.dumps(_server("ours", rows)))
    (tmp_path / "e2e_gpu_upstream_tp1_ep1.json").write_text(json.dumps(_server("upstream", [{**rows[0], "value": 4.0}])))
    (tmp_path / "e2e_gpu_ours_tp2_ep2.json").write_text(json.dumps(ep2))
    result = e2e_gpu_report.merge(e2e_gpu_report.load_servers([str(tmp_path)]), {}, "")
    tp1, ep2_entry = result["byte_minimum"]
    config_dir = tmp_path / "model"
    write_midsize_checkpoint(str(config_dir))
    floors = {(tp, ep): inspect_config(str(config_dir), tp, ep)["per_rank"]["decode_floor"]["bf16"]["total"] for tp, ep in ((1, 1), (2, 2))}
    minimum = 1e3 * floors[1, 1] / 3.35e12
    assert (tp1["tp"], tp1["ep"], tp1["bytes_per_gpu"]) == (1, 1, floors[1, 1]) and tp1["minimum_ms"] == pytest.approx(minimum)
    assert tp1["ours_over_minimum"] == pytest.approx(3.0 / minimum) and tp1["upstream_over_minimum"] == pytest.approx(4.0 / minimum)
    assert (ep2_entry["tp"], ep2_entry["ep"], ep2_entry["bytes_per_gpu"]) == (2, 2, floors[2, 2]) and "upstream_over_minimum" not in ep2_entry
    text = e2e_gpu_report.markdown(result)
    assert f"| 1 | 1 | 2048 | {floors[1, 1] / 1e9:.2f} | {minimum:.3f} | {3.0 / minimum:.2f}x | {4.0 / minimum:.2f}x |" in text


def test_host_profile_gives_each_sample_to_its_innermost_process(tmp_path):
    from decode_host_profile import summarize

    collapsed = tmp_path / "stacks.txt"
    collapsed.write_text(
        'process 1:"launch_server";process 2:"sglang::scheduler";loop (s.py:1);step (s.py:9) 6\n'
        'process 1:"launch_server";process 2:"sglang::scheduler";loop (s.py:1) 2\n'
        'process 1:"launch_server";process 2:"sglang::scheduler" 1\n'
        'process 1:"launch_server";serve (h.py:3) 3\n'
    )
    summary = summarize(str(collapsed))
    assert list(summary) == ['process 2:"sglang::scheduler"', 'process 1:"launch_server"']
    scheduler = summary['process 2:"sglang::scheduler"']
    assert scheduler["samples"] == 9
    assert scheduler["self"] == [("step (s.py:9)", 6), ("loop (s.py:1)", 2), ("(no Python frame)", 1)]
    assert scheduler["inclusive"] == [("loop (s.py:1)", 8), ("step (s.py:9)", 6)]
    assert summary['process 1:"launch_server"']["inclusive"] == [("serve (h.py:3)", 3)]
    assert scheduler["project_samples"] == 0


def test_host_profile_counts_samples_through_the_projects_code_at_their_entry(tmp_path):
    from decode_host_profile import summarize

    collapsed = tmp_path / "stacks.txt"
    collapsed.write_text(
        'process 2:"sched";loop (s.py:1);init (sglang_m3/msa/hybrid.py:47);plan (msa_kernels/plan.py:9);mm (t.py:2) 5\n'
        'process 2:"sched";loop (s.py:1);init (sglang_m3/msa/hybrid.py:47) 1\n'
        'process 2:"sched";loop (s.py:1);run (msa_kernels/api.py:3) 2\n'
        'process 2:"sched";loop (s.py:1);step (not_sglang_m3/x.py:1) 4\n'
    )
    scheduler = summarize(str(collapsed))['process 2:"sched"']
    assert scheduler["samples"] == 12
    assert scheduler["project_samples"] == 8
    assert scheduler["project_entries"] == [("init (sglang_m3/msa/hybrid.py:47)", 6), ("run (msa_kernels/api.py:3)", 2)]


def test_host_profile_phase_deltas_name_busy_threads_and_collections():
    from decode_host_profile import busy_threads, gc_delta

    before = {"7/7": {"process": "sched", "thread": "main", "cpu_s": 1.0, "cpu": 3},
              "7/8": {"process": "sched", "thread": "idle", "cpu_s": 0.5, "cpu": 4}}
    after = {"7/7": {"process": "sched", "thread": "main", "cpu_s": 3.0, "cpu": 5},
             "7/8": {"process": "sched", "thread": "idle", "cpu_s": 0.5, "cpu": 4},
             "9/9": {"process": "new", "thread": "late", "cpu_s": 0.4, "cpu": 1}}  # started during the phase
    rows = busy_threads(before, after, seconds=2.0)
    assert [(r["thread"], r["share"], r["last_cpu"]) for r in rows] == [("7/7", 1.0, 5), ("9/9", 0.2, 1)]

    start = {"1 sched": {"collections": [10, 1, 0], "seconds": [0.01, 0.002, 0.0]},
             "2 detok": {"collections": [4, 0, 0], "seconds": [0.001, 0.0, 0.0]}}
    end = {"1 sched": {"collections": [13, 1, 1], "seconds": [0.013, 0.002, 0.05]},
           "2 detok": {"collections": [4, 0, 0], "seconds": [0.001, 0.0, 0.0]}}
    assert gc_delta(start, end) == {"1 sched": {"collections": [3, 0, 1], "ms": [3.0, 0.0, 50.0]}}


def test_gc_accounting_writes_per_process_totals(tmp_path):
    """The sitecustomize the GC statistics rely on, in a fresh interpreter that collects."""
    import subprocess

    folder = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gc_accounting")
    code = "import gc, time\nfor _ in range(3):\n    gc.collect(); time.sleep(0.25)\n"
    env = {**os.environ, "PYTHONPATH": folder, "M3_GC_STATS_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    (snapshot,) = [json.loads(p.read_text()) for p in tmp_path.glob("gc-*.json")]
    assert snapshot["collections"][2] >= 2  # written from inside the collections, at most every 0.2 s
    assert all(seconds >= 0 for seconds in snapshot["seconds"])


@pytest.mark.parametrize("concurrency", [1, 3])
def test_paired_rounds_alternate_abba(monkeypatch, concurrency):
    import e2e_gpu_paired
    from serving_client import GroupTiming, RequestTiming

    calls = []

    def fake_group(url, prompts, tokens):
        calls.append((url, len(prompts)))
        tpot_s = {"u-ours": 0.002, "u-up": 0.003}[url]
        ttft_s = {"u-ours": 0.05, "u-up": 0.04}[url]
        return GroupTiming([RequestTiming(ttft_s, ttft_s + tpot_s * (tokens - 1), tokens) for _ in prompts], 1.0)

    monkeypatch.setattr(e2e_gpu_paired, "run_group", fake_group)
    monkeypatch.setattr(e2e_gpu_paired, "random_prompt", lambda length, seed: [seed])
    tpot, ttft = e2e_gpu_paired.paired_rounds({"ours": "u-ours", "upstream": "u-up"}, 4, iter(range(100)), concurrency)
    assert calls == [(url, concurrency) for url in ["u-ours", "u-up", "u-up", "u-ours"] * 2]
    assert tpot == {"ours": pytest.approx([2.0] * 4), "upstream": pytest.approx([3.0] * 4)}
    assert ttft == {"ours": pytest.approx([50.0] * 4), "upstream": pytest.approx([40.0] * 4)}
    assert e2e_gpu_paired.summary(ttft, "ttft_ms")["speedup_of_medians"] == pytest.approx(0.8)
    result = e2e_gpu_paired.summary(tpot)
    assert result["speedup_of_medians"] == pytest.approx(1.5) and result["rounds_ours_faster"] == 4


def test_a_paired_run_cut_short_keeps_the_rounds_both_servers_completed(monkeypatch, tmp_path):
    """A timeout's SIGTERM (a SystemExit from the handler) in the second round: the servers are
    stopped, the result file holds round 0 under "complete": false, and the exit goes on."""
    import e2e_gpu_paired
    from serving_client import GroupTiming, RequestTiming

    calls, stopped = [], []

    def fake_group(url, prompts, tokens):
        calls.append(url)
        if len(calls) == 4:  # round 1 runs upstream, then ours: cut in ours' group
            raise SystemExit("stopped by signal 15")
        tpot_s = {"u-ours": 0.002, "u-up": 0.003}[url] * (1 + len(calls) / 100)
        return GroupTiming([RequestTiming(0.05, 0.05 + tpot_s * (tokens - 1), tokens) for _ in prompts], 1.0)

    monkeypatch.setattr(e2e_gpu_paired, "run_group", fake_group)
    monkeypatch.setattr(e2e_gpu_paired, "random_prompt", lambda length, seed: [seed])
    monkeypatch.setattr(e2e_gpu_paired, "host_probe", lambda: {"probe_ms": 1.0})
    monkeypatch.setattr(e2e_gpu_paired, "start_both", lambda *a, **k: {"ours": ("p-ours", "u-ours"), "upstream": ("p-up", "u-up")})
    monkeypatch.setattr(e2e_gpu_paired, "warm_up", lambda url, seed: None)
    monkeypatch.setattr(e2e_gpu_paired, "stop_server", stopped.append)
    monkeypatch.setattr(e2e_gpu_paired, "gpu_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(e2e_gpu_paired.signal, "signal", lambda *a: None)
    with pytest.raises(SystemExit, match="signal 15"):
        e2e_gpu_paired.main(["--out", str(tmp_path), "--rounds", "3", "--concurrency", "1", "16", "--ttft-tokens", "32768"])
    assert calls == ["u-ours", "u-up", "u-up", "u-ours"] and stopped == ["p-ours", "p-up"]
    result = json.loads((tmp_path / "e2e_gpu_paired_tp1_ep1.json").read_text())
    assert result["complete"] is False and "cut short" in result["what"]
    assert list(result["concurrency"]) == ["1"] and result["ttft_prompt_tokens"] == {}
    c1 = result["concurrency"]["1"]
    assert c1["tpot_ms"] == {"ours": pytest.approx([2.0 * 1.01]), "upstream": pytest.approx([3.0 * 1.02])}
    assert c1["rounds_ours_faster"] == 1
    entries = e2e_gpu_report.load_paired([str(tmp_path / "e2e_gpu_paired_tp1_ep1.json")])
    assert {e["complete"] for e in entries} == {False}
    assert "e2e_gpu_paired_tp1_ep1.json (cut short) |" in "\n".join(e2e_gpu_report.paired_markdown(entries))


def test_paired_summary_counts_only_rounds_both_servers_completed():
    import e2e_gpu_paired

    result = e2e_gpu_paired.summary({"ours": [2.0, 2.0, 9.0], "upstream": [3.0, 3.0]})
    assert result["tpot_ms"] == {"ours": [2.0, 2.0], "upstream": [3.0, 3.0]} and result["rounds_ours_faster"] == 2


def test_paired_ttft_keeps_each_servers_first_prompt_apart_then_alternates_abba(monkeypatch):
    import e2e_gpu_paired
    from serving_client import RequestTiming

    calls = []
    cold = {"u-ours", "u-up"}

    def fake_stream(url, prompt, tokens):
        calls.append((url, len(prompt), tokens))
        ttft_s = 5.0 if url in cold else {"u-ours": 0.2, "u-up": 0.3}[url]
        cold.discard(url)
        return RequestTiming(ttft_s, ttft_s, tokens)

    monkeypatch.setattr(e2e_gpu_paired, "stream_generate", fake_stream)
    monkeypatch.setattr(e2e_gpu_paired, "random_prompt", lambda length, seed: [seed] * length)
    first, ttfts = e2e_gpu_paired.paired_ttft_rounds({"ours": "u-ours", "upstream": "u-up"}, 2, iter(range(100)), 7)
    assert [url for url, _, _ in calls] == ["u-ours", "u-up", "u-ours", "u-up", "u-up", "u-ours"]
    assert all(length == 7 and tokens == 1 for _, length, tokens in calls)
    assert first == {"ours": pytest.approx(5000.0), "upstream": pytest.approx(5000.0)}
    assert ttfts == {"ours": pytest.approx([200.0, 200.0]), "upstream": pytest.approx([300.0, 300.0])}
    result = e2e_gpu_paired.summary(ttfts, "ttft_ms")
    assert result["median_ttft_ms"] == {"ours": pytest.approx(200.0), "upstream": pytest.approx(300.0)}
    assert result["speedup_of_medians"] == pytest.approx(1.5) and result["rounds_ours_faster"] == 2


@pytest.mark.parametrize("name", ["chain3", "tree8", "chain7", "adaptive"])
def test_speculative_benchmark_draft_shapes_are_what_their_names_say(name):
    """A chain of N drafts verifies N + 1 tokens (SGLang serves a chain with any other count, but
    not as a chain); a tree's verify tokens fit the MSA plans' ancestor mask; the adaptive shape
    starts as chain3 (SGLang adapts chains only). The recipe rules refuse the same mistakes in a
    user's recipe."""
    from speculative_gpu import DRAFTS

    from sglang_m3.recipe.rules import MAX_DRAFT_TREE_TOKENS

    args = list(DRAFTS[name])
    if name == "adaptive":
        args.remove("--speculative-adaptive")
        assert tuple(args) == DRAFTS["chain3"]
        return
    flags = dict(zip(args[::2], args[1::2]))
    steps, topk, tokens = (int(flags[f"--speculative-{key}"]) for key in ("num-steps", "eagle-topk", "num-draft-tokens"))
    if name.startswith("chain"):
        assert (topk, steps, tokens) == (1, int(name[len("chain"):]), steps + 1)
    else:
        assert topk > 1 and tokens == int(name[len("tree"):]) <= MAX_DRAFT_TREE_TOKENS


def test_paired_draft_puts_the_drafted_server_first_with_the_speculative_benchmarks_flags(monkeypatch):
    """``--draft``: the speed-up (second over first) is TPOT without the draft over TPOT with it, and
    the drafted server starts with the speculative benchmark's flags beside the pair's KV cap."""
    import e2e_gpu_paired
    from speculative_gpu import speculative_args

    drafted, plain = e2e_gpu_paired.draft_contenders("chain3", "/tmp/draft")
    assert (drafted.label, drafted.impl, drafted.server_args) == ("chain3", "ours", speculative_args("chain3", "/tmp/draft"))
    assert (plain.label, plain.impl, plain.server_args) == ("none", "ours", ())
    for bad in ("none", "tree3"):
        with pytest.raises(ValueError, match="--draft takes one of"):
            e2e_gpu_paired.draft_contenders(bad, "/tmp/draft")
    default, switched = e2e_gpu_paired.draft_contenders("chain3", "/tmp/draft", "SGLANG_M3_DENSE_VERIFY=msa")
    assert (default.label, default.env, default.server_args) == ("chain3", {}, drafted.server_args)
    assert (switched.label, switched.env, switched.server_args) == (
        "chain3_SGLANG_M3_DENSE_VERIFY_msa", {"SGLANG_M3_DENSE_VERIFY": "msa"}, drafted.server_args)
    with pytest.raises(ValueError, match="KEY=VALUE"):
        e2e_gpu_paired.draft_contenders("chain3", "/tmp/draft", "SGLANG_M3_DENSE_VERIFY")

    started = {}

    def fake_start(impl, model_dir, out_dir, tp, ep, label="", extra_args=(), env=None):
        started[label] = extra_args
        return (object(), f"url-{label}", 1.0, "log")

    monkeypatch.setattr(e2e_gpu_paired, "start_server", fake_start)
    servers = e2e_gpu_paired.start_both("model", "out", pair=(drafted, plain))
    assert set(servers) == {"chain3", "none"}
    cap = ("--max-total-tokens", str(e2e_gpu_paired.KV_TOKENS_PER_SERVER))
    assert started == {"paired-chain3": (*cap, *drafted.server_args), "paired-none": cap}

    tpot = {"chain3": [1.0, 1.1, 0.9], "none": [2.0, 2.1, 1.9]}
    result = e2e_gpu_paired.summary(tpot)
    assert result["speedup_of_medians"] == pytest.approx(2.0) and result["rounds_ours_faster"] == 3


def test_paired_rounds_draw_each_prompt_from_the_given_maker(monkeypatch):
    import e2e_gpu_paired
    from serving_client import GroupTiming, RequestTiming

    sent = []

    def fake_group(url, prompts, tokens):
        sent.append((url, prompts))
        return GroupTiming([RequestTiming(0.1, 0.2, tokens) for _ in prompts], 1.0)

    monkeypatch.setattr(e2e_gpu_paired, "run_group", fake_group)
    e2e_gpu_paired.paired_rounds({"a": "u-a", "b": "u-b"}, 2, iter(range(100)), 2, make_prompt=lambda seed: [-seed])
    assert sent == [("u-a", [[0], [-1]]), ("u-b", [[-2], [-3]]), ("u-b", [[-4], [-5]]), ("u-a", [[-6], [-7]])]


def test_draft_checks_compare_greedy_outputs_and_measure_acceptance(monkeypatch):
    import e2e_gpu_paired

    def fake_generate(url, prompt, tokens):
        differs = url == "u-draft" and len(prompt) == e2e_gpu_paired.IDENTITY_LENGTHS[-1] and broken
        return {"output_ids": [prompt[-1]] * tokens if not differs else [0] * tokens}

    verify_steps = {"u-draft": 16, "u-switched": 32}  # 64 tokens in 16 or 32 verify steps
    asked = []

    def fake_concurrently(url, prompts, tokens):
        asked.append((url, [p[-1] for p in prompts]))
        return [{"output_ids": [1] * 64, "meta_info": {"spec_verify_ct": verify_steps[url]}} for _ in prompts]

    monkeypatch.setattr(e2e_gpu_paired, "generate", fake_generate)
    monkeypatch.setattr(e2e_gpu_paired, "generate_concurrently", fake_concurrently)
    urls = {"chain3": "u-draft", "none": "u-plain"}
    broken = False
    assert e2e_gpu_paired.draft_checks(urls, ["chain3"]) == {"greedy_identical": True, "accept_len": {"chain3": 4.0}}
    assert [url for url, _ in asked] == ["u-draft"]  # the server without a draft has no acceptance to measure
    broken = True
    assert e2e_gpu_paired.draft_checks(urls, ["chain3"])["greedy_identical"] is False
    # an A/B of a switch: both servers draft, and each one's acceptance is measured on the same prompts
    asked.clear()
    broken = False
    both = {"chain3": "u-draft", "chain3_SWITCH_1": "u-switched"}
    checks = e2e_gpu_paired.draft_checks(both, ["chain3", "chain3_SWITCH_1"])
    assert checks == {"greedy_identical": True, "accept_len": {"chain3": 4.0, "chain3_SWITCH_1": 2.0}}
    assert asked[0][1] == asked[1][1]


def test_runs_record_the_plugin_switches_their_servers_inherit(monkeypatch):
    import e2e_gpu

    monkeypatch.setenv("SGLANG_M3_DENSE_VERIFY", "msa")
    monkeypatch.setenv("SGLANG_OTHER", "1")
    assert e2e_gpu.plugin_switches().get("SGLANG_M3_DENSE_VERIFY") == "msa"
    monkeypatch.setenv("M3_HARNESS_CUDA_CUSTOM_OPS", "1")
    assert e2e_gpu.plugin_switches().get("M3_HARNESS_CUDA_CUSTOM_OPS") == "1"
    assert "SGLANG_OTHER" not in e2e_gpu.plugin_switches()


def test_paired_contenders_default_to_upstream_and_take_one_environment_variable():
    import e2e_gpu_paired

    assert [(c.label, c.impl, c.env) for c in e2e_gpu_paired.contenders(None)] == [("ours", "ours", {}), ("upstream", "upstream", {})]
    ours, switched = e2e_gpu_paired.contenders("SGLANG_M3_MOE_OVERLAP=0")
    assert (ours.impl, ours.env) == ("ours", {})
    assert (switched.impl, switched.env) == ("ours", {"SGLANG_M3_MOE_OVERLAP": "0"})
    assert switched.label == "ours_SGLANG_M3_MOE_OVERLAP_0"
    for bad in ("SGLANG_M3_MOE_OVERLAP", "=0"):
        with pytest.raises(ValueError, match="KEY=VALUE"):
            e2e_gpu_paired.contenders(bad)


def test_paired_summary_is_over_the_first_contender_whatever_the_labels():
    import e2e_gpu_paired

    result = e2e_gpu_paired.summary({"ours": [2.0, 4.0, 3.0], "ours_X_0": [3.0, 3.5, 6.0]})
    assert result["median_tpot_ms"] == {"ours": 3.0, "ours_X_0": 3.5}
    assert result["speedup_of_medians"] == pytest.approx(3.5 / 3.0)
    assert result["rounds_ours_faster"] == 2


def test_report_keeps_paired_runs_and_notes_beside_the_rows(tmp_path):
    """The committed TP2 + EP2 paired result renders as its own table and the notes file is appended,
    so regenerating the table loses neither."""
    results_dir = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results")
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "e2e_gpu_ours_tp1_ep1.json").write_text(json.dumps(_server("ours", [])))
    (runs / "e2e_gpu_upstream_tp1_ep1.json").write_text(json.dumps(_server("upstream", [])))
    notes = tmp_path / "notes.md"
    notes.write_text("## Notes on this run\n\n- a note\n")
    out = tmp_path / "out"
    out.mkdir()
    paired = os.path.join(results_dir, "e2e_gpu_h100_paired_tp2_ep2.json")
    assert e2e_gpu_report.main([str(runs), "--results", str(out), "--paired", paired, "--notes", str(notes)]) == 0
    result = json.loads((out / "e2e_gpu_h100.json").read_text())
    by_concurrency = {e["concurrency"]: e for e in result["paired"]}
    assert sorted(by_concurrency) == [1, 16] and {e["metric"] for e in result["paired"]} == {"tpot_ms"}
    c1 = by_concurrency[1]
    assert (c1["first"], c1["second"], c1["tp"], c1["ep"], c1["commit"], c1["rounds"]) == ("ours", "upstream", 2, 2, "0346eec", 6)
    assert c1["speedup_of_medians"] == pytest.approx(c1["second_ms"] / c1["first_ms"])
    text = (out / "e2e_gpu_h100.md").read_text()
    assert f"| 0346eec | 2 | 2 | tpot_ms | 2048 | 1 | ours | upstream | {c1['first_ms']:.2f} |" in text
    assert text.rstrip().endswith("- a note")
    assert text.index("## Paired runs") < text.index("## Notes on this run")


def test_report_renders_paired_ttft_with_each_servers_first_prompt(tmp_path):
    """A paired run with TTFT (``--ttft-tokens``) gives one entry per prompt length beside the decode
    ones, with the first prompt of each server kept apart."""
    summary = {"ttft_ms": {"ours": [400.0, 402.0], "upstream": [575.0, 571.0]}, "median_ttft_ms": {"ours": 401.0, "upstream": 573.0},
               "speedup_of_medians": 573.0 / 401.0, "rounds_ours_faster": 2, "first_ttft_ms": {"ours": 2500.0, "upstream": 580.0}}
    decode = {"tpot_ms": {"ours": [1.8], "upstream": [1.9]}, "median_tpot_ms": {"ours": 1.8, "upstream": 1.9},
              "speedup_of_medians": 1.9 / 1.8, "rounds_ours_faster": 1}
    paired = tmp_path / "paired.json"
    paired.write_text(json.dumps({"commit": "abc1234", "tp": 1, "ep": 1, "concurrency": {"1": decode}, "ttft_prompt_tokens": {"32768": summary}}))
    entries = e2e_gpu_report.load_paired([str(paired)])
    assert [(e["metric"], e["prompt_tokens"], e["concurrency"]) for e in entries] == [("tpot_ms", 2048, 1), ("ttft_ms", 32768, 1)]
    ttft = entries[1]
    assert (ttft["first_ms"], ttft["second_ms"], ttft["rounds"], ttft["first_prompt_ms"]) == (401.0, 573.0, 2, {"ours": 2500.0, "upstream": 580.0})
    text = "\n".join(e2e_gpu_report.paired_markdown(entries))
    assert "| abc1234 | 1 | 1 | ttft_ms | 32768 | 1 | ours | upstream | 401.00 | 573.00 | 1.43x | 2 of 2 | 2500 / 580 | paired.json |" in text
    assert "| abc1234 | 1 | 1 | tpot_ms | 2048 | 1 | ours | upstream | 1.80 | 1.90 | 1.06x | 1 of 1 | - | paired.json |" in text


def test_report_renders_a_groups_paired_ttft_as_a_2k_ttft_row_of_its_concurrency(tmp_path):
    """A run that recorded each group's TTFT beside its TPOT (``group_ttft``) gives a TTFT entry of
    2K-token prompts at that concurrency, after the TPOT one."""
    decode = {"tpot_ms": {"ours": [5.0, 5.2], "upstream": [5.5, 5.4]}, "median_tpot_ms": {"ours": 5.1, "upstream": 5.45},
              "speedup_of_medians": 5.45 / 5.1, "rounds_ours_faster": 2,
              "group_ttft": {"ttft_ms": {"ours": [90.0, 92.0], "upstream": [88.0, 99.0]}, "median_ttft_ms": {"ours": 91.0, "upstream": 93.5},
                             "speedup_of_medians": 93.5 / 91.0, "rounds_ours_faster": 1}}
    paired = tmp_path / "paired.json"
    paired.write_text(json.dumps({"commit": "abc1234", "tp": 2, "ep": 1, "concurrency": {"16": decode}}))
    entries = e2e_gpu_report.load_paired([str(paired)])
    assert [(e["metric"], e["prompt_tokens"], e["concurrency"]) for e in entries] == [("tpot_ms", 2048, 16), ("ttft_ms", 2048, 16)]
    ttft = entries[1]
    assert (ttft["first_ms"], ttft["second_ms"], ttft["rounds"], ttft["rounds_first_faster"]) == (91.0, 93.5, 2, 1)
    assert "first_prompt_ms" not in ttft


def test_moe_tables_are_listed_for_the_gpu_that_reads_them():
    """A result names only the tuned tables SGLang would read on that GPU (an H100 table on an H200
    is not read: both servers then run SGLang's default tiles)."""
    import e2e_gpu

    paths = [
        "/t/E=128,N=1536,K=6144,device_name=NVIDIA_H100_80GB_HBM3,triton=3.6.0.json",
        "/t/E=129,N=3072,device_name=NVIDIA_H100_80GB_HBM3.json",
        "/t/E=129,N=3072,device_name=NVIDIA_H100_80GB_HBM3_down.json",
        "/t/E=129,N=3072,device_name=NVIDIA_H200.json",
        "/t/E=64,N=3072,K=6144,device_name=NVIDIA_H200,triton=3.6.0.json",
    ]
    assert e2e_gpu.tables_for_gpu(paths, "NVIDIA H100 80GB HBM3") == paths[:3]
    assert e2e_gpu.tables_for_gpu(paths, "NVIDIA H200") == paths[3:]
    assert e2e_gpu.tables_for_gpu(paths, "NVIDIA B200") == []
    shipped = e2e_gpu.ours_moe_tables()
    h100, h200 = (e2e_gpu.tables_for_gpu(shipped, gpu) for gpu in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"))
    assert h100 and h200 and sorted(h100 + h200) == sorted(shipped)  # every shipped table names one of them


def _lower_right_sdpa(q, k, v):
    """SDPA's answer in the benchmark layout: ``q [B, lq, HQ, D]``, ``k/v [B, L, HKV, D]`` -> ``[B, HQ, lq, D]``."""
    from torch.nn.attention.bias import causal_lower_right

    lq, lk = q.shape[1], k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=causal_lower_right(lq, lk), enable_gqa=True)


def _verify_inputs(batch, q_len, kv_len, seed, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_len, 8, 64, generator=generator, dtype=dtype)
    k, v = (torch.randn(batch, kv_len, 2, 64, generator=generator, dtype=dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("q_len, kv_len", [(4, 300), (3, 257), (1, 200), (8, 8)])
def test_flex_dense_anchor_is_lower_right_causal_gqa(q_len, kv_len):
    """The speculative rows' Flex anchor computes what SDPA computes under ``causal_lower_right``."""
    from verify_dense import FlexDense

    q, k, v = _verify_inputs(2, q_len, kv_len, seed=q_len * 1000 + kv_len)
    got = FlexDense(q_len, kv_len, "cpu", compiled=False)(q, k, v)
    assert got.shape == (2, 8, q_len, 64)
    torch.testing.assert_close(got, _lower_right_sdpa(q, k, v), atol=2e-6, rtol=2e-6)


def test_flex_dense_refuses_shapes_it_was_not_built_for():
    from verify_dense import FlexDense, lower_right_causal_mask

    with pytest.raises(ValueError, match="q_len <= kv_len"):
        lower_right_causal_mask(5, 4, "cpu")
    flex = FlexDense(2, 64, "cpu", compiled=False)
    q, kv = torch.zeros(1, 3, 4, 16), torch.zeros(1, 64, 2, 16)
    with pytest.raises(ValueError, match=r"built for \(q_len, kv_len\) \(2, 64\)"):
        flex(q, kv, kv)


def test_folding_the_batch_into_heads_keeps_each_requests_attention():
    """Requests folded into heads (queries and keys alike) attend as they did one by one, GQA included."""
    from verify_dense import fold_batch_into_heads

    q, k, v = _verify_inputs(3, 5, 40, seed=7)
    folded = [fold_batch_into_heads(x) for x in (q, k, v)]
    assert folded[0].shape == (5, 3 * 8, 64) and folded[1].shape == (40, 3 * 2, 64)
    torch.testing.assert_close(folded[1][:, 2:4], k[1])  # request 1's two key heads
    got = _lower_right_sdpa(*(x[None] for x in folded))[0]  # [B * HQ, lq, D]
    torch.testing.assert_close(got.view(3, 8, 5, 64), _lower_right_sdpa(q, k, v), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("batch, q_len, kv_len", [(1, 4, 300), (3, 4, 129), (2, 8, 64)])
def test_cudnn_prefix_split_anchor_is_lower_right_causal_gqa(monkeypatch, batch, q_len, kv_len):
    """The prefix-split anchor over folded requests is each request's verify attention (its cuDNN
    call stood in by the definition, as in tests/msa/test_dense_prefill.py; on the GPU the
    benchmark compares its output with SDPA's on every row)."""
    from attention_definitions import math_attention_with_lse
    from verify_dense import CudnnPrefixSplitDense

    from sglang_m3.msa import dense_prefill

    monkeypatch.setattr(dense_prefill, "_cudnn_attention_with_lse", math_attention_with_lse)
    sets = [_verify_inputs(batch, q_len, kv_len, seed=seed, dtype=torch.float64) for seed in (1, 2)]
    split = CudnnPrefixSplitDense(sets)
    for index, (q, k, v) in enumerate(sets):
        got = split(index)
        assert got.shape == (batch, 8, q_len, 64)
        torch.testing.assert_close(got, _lower_right_sdpa(q, k, v), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("batch, q_len, kv_len", [(1, 4, 64), (3, 2, 48)])
def test_msa_dense_decode_anchor_is_lower_right_causal_gqa(batch, q_len, kv_len):
    """The MSA kernels reading every block (under the Triton interpreter) over the rows' K/V laid
    out as consecutive pages give SDPA's lower-right causal answer."""
    from verify_dense import MsaDenseDecode

    from msa_kernels.reference import MSAParams

    sets = [_verify_inputs(batch, q_len, kv_len, seed=seed) for seed in (3, 4)]
    dense = MsaDenseDecode(sets, MSAParams(block_size=16, topk=2), num_sms=8)
    assert dense.plan.dense_splits > 1
    for index, (q, k, v) in enumerate(sets):
        got = dense(index)
        assert got.shape == (batch, 8, q_len, 64)
        torch.testing.assert_close(got, _lower_right_sdpa(q, k, v), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="whole number of 16-token pages"):
        MsaDenseDecode([_verify_inputs(1, 2, 40, seed=1)], MSAParams(block_size=16, topk=2), num_sms=8)


def test_dense_anchor_skips_a_backend_that_computes_something_else():
    """A dense backend whose output differs from the first one's (another mask) is not timed, so it
    cannot become the anchor however fast it is."""
    import msa_kernel_bench as bench

    reference = torch.zeros(1, bench.HQ, 2, bench.D)
    fns = {"first": lambda: reference, "same": lambda: reference + 1e-4, "wrong": lambda: reference + 0.5}
    times = {"first": 30.0, "same": 20.0, "wrong": 1.0}
    row = {}
    bench.time_dense(row, lambda: fns, lambda name, fn: times[name])
    assert row["dense_backends"] == {"first": 30.0, "same": 20.0, "wrong": None}
    assert row["dense_backend"] == "same" and row["dense_us"] == 20.0
    assert "differs from the first backend's by 0.5" in row["dense_backend_errors"]["wrong"]


def test_paired_servers_under_tensor_parallelism_start_one_after_the_other(monkeypatch):
    """Two TP servers starting at once failed SGLang's per-rank memory-balance check on the H200s;
    on one GPU they still start together. A failed first start leaves the second unstarted."""
    import threading
    import time

    import e2e_gpu_paired

    events, lock = [], threading.Lock()

    def fake_start(impl, model_dir, out_dir, tp, ep, label="", extra_args=(), env=None):
        with lock:
            events.append(("begin", label))
        time.sleep(0.05)
        with lock:
            events.append(("end", label))
        if label == "paired-fails":
            raise RuntimeError("unbalanced")
        return (object(), f"url-{label}", 1.0, "log")

    monkeypatch.setattr(e2e_gpu_paired, "start_server", fake_start)
    monkeypatch.setattr(e2e_gpu_paired, "stop_server", lambda process: None)
    e2e_gpu_paired.start_both("model", "out", tp=2)
    assert [kind for kind, _ in events] == ["begin", "end", "begin", "end"]
    events.clear()
    e2e_gpu_paired.start_both("model", "out", tp=1)
    assert [kind for kind, _ in events[:2]] == ["begin", "begin"], "on one GPU both start at once"
    events.clear()
    failing = (e2e_gpu_paired.Contender("fails", "ours"), e2e_gpu_paired.Contender("other", "upstream"))
    with pytest.raises(RuntimeError, match="server start failed"):
        e2e_gpu_paired.start_both("model", "out", tp=2, pair=failing)
    assert events == [("begin", "paired-fails"), ("end", "paired-fails")]


def test_kernel_bench_merge_joins_a_split_run_and_keeps_each_parts_checks(tmp_path):
    """The committed H200 run at a19960a came in two device calls; merged, it holds every row of
    both, in order, and each part's ceilings and correctness checks; parts of another commit are
    refused by name."""
    import msa_kernel_bench

    parts = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "msa_kernels_h200_parts_a19960a")
    files = [os.path.join(parts, "decode.json"), os.path.join(parts, "prefill.json")]
    runs = [json.load(open(f)) for f in files]
    meta, rows = msa_kernel_bench.merge_runs(files)
    assert rows == runs[0]["rows"] + runs[1]["rows"]
    assert [p["phases"] for p in meta["parts"]] == [["decode"], ["prefill"]]
    assert [p["checks"] for p in meta["parts"]] == [r["meta"]["checks"] for r in runs]
    markdown = msa_kernel_bench.write_results(str(tmp_path), meta, rows)
    text = open(markdown).read()
    assert "| 8K | 0K | 3.23 |" in text and "| 8 | 128K | 1 | fp8 | 80.2 |" in text
    assert text.count("ours_prefill: ok=True") == 2
    other = dict(runs[1], meta=dict(runs[1]["meta"], commit="0000000"))
    other_file = tmp_path / "other.json"
    other_file.write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="commit='0000000'"):
        msa_kernel_bench.merge_runs([files[0], str(other_file)])
