"""Each kernel of one MSA decode step as a served step runs it: inside the step's CUDA graph.

``msa_kernel_bench.py`` times a whole step; this splits it. For each shape it captures three graphs
over the same inputs: the whole step (``run_decode``: index scan, top-k, attention), the selection
alone (``decode_select``) and the attention alone (``decode_attention`` over the step's choice),
times each as a graph replay (``msa_kernel_bench.graph_replay_us``, L2 flushed before each replay)
and records each kernel's duration inside each graph with the torch profiler (CUPTI).

A kernel that takes longer inside the step than inside its own part's graph pays for what the
kernels around it leave behind. That is how the decode top-k's regression of 82690c4 showed: behind
the previous step's attention kernel it ran at twice its time alone, by every sign because its
unrolled picks at three widths no longer stayed in the instruction cache
(``results/decode_topk_icache_h200/``).

Where ``run_decode`` chains its launches (Hopper on, ``msa_kernels.api.chains_decode_launches``),
a chained kernel's duration inside the step includes the time it sits resident waiting for the
kernel before it: compare the step's time there, not its kernels'.

Run once per revision of the kernels, the one first on ``sys.path`` (``--label`` names it):

    PYTHONPATH=OLD/kernels:kernels python benchmarks/decode_graph_kernels.py --label OLD --out rows.jsonl
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
import msa_kernel_bench as bench  # noqa: E402
import msa_kernels  # noqa: E402
from msa_kernels.api import decode_attention, decode_select, run_decode  # noqa: E402
from msa_kernels.plan import page_table_from_req_to_token, plan_decode  # noqa: E402
from provenance import commit  # noqa: E402

SHAPES = ((8, 131072), (8, 32768), (1, 32768))  # (batch, context)
POOL_TOKENS = 1 << 21  # the largest shape's 1M tokens, drawn at random from twice as many
PROFILED_REPLAYS = 30


def decode_inputs(pool: bench.Pool, batch: int, context: int, sets: int) -> list[tuple]:
    """``sets`` input sets of one shape: (plan, q, index q, the blocks the step chooses)."""
    inputs = []
    for _ in range(sets):
        req_to_token = pool.req_to_token([context] * batch, context)
        table = page_table_from_req_to_token(req_to_token, torch.arange(batch, device="cuda"), context, bench.BLOCK)
        plan = plan_decode(bench.PARAMS, table, torch.tensor([context] * batch, device="cuda"), q_len=1, num_kv_heads=bench.HKV)
        q = torch.randn(batch, bench.HQ, bench.D, device="cuda", dtype=torch.bfloat16)
        iq = torch.randn(batch, bench.HKV, bench.DI, device="cuda", dtype=torch.bfloat16)
        inputs.append((plan, q, iq, decode_select(plan, iq, pool.ik)))
    return inputs


@functools.cache
def l2_flush_buffer() -> torch.Tensor:
    """256 MB written before each profiled replay (more than the GPU's L2), allocated once."""
    return torch.empty(256 << 20, dtype=torch.int8, device="cuda")


def kernel_durations(step) -> dict[str, float]:
    """Median duration (us) of each kernel of ``step`` captured alone in a graph, replayed after an L2 flush."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    flush = l2_flush_buffer()
    for _ in range(5):
        flush.zero_()
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_REPLAYS):
            flush.zero_()
            graph.replay()
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and "elementwise" not in event.name:
            times.setdefault(event.name, []).append(event.device_time_total)
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def measure(pool: bench.Pool, batch: int, context: int) -> dict:
    sets = max(1, min(4, int(400e6 // bench.decode_model_bytes(context, batch, 1))))
    inputs = decode_inputs(pool, batch, context, sets)
    graphs = {
        "step": lambda i: run_decode(inputs[i][0], inputs[i][1], pool.k, pool.v, inputs[i][2], pool.ik),
        "select": lambda i: decode_select(inputs[i][0], inputs[i][2], pool.ik),
        "attention": lambda i: decode_attention(inputs[i][0], inputs[i][1], pool.k, pool.v, inputs[i][3]),
    }
    row = {"batch": batch, "context": context, "input_sets": sets}
    for name, step in graphs.items():
        row[f"{name}_us"] = [bench.graph_replay_us(step, sets) for _ in range(3)]
        row[f"{name}_kernels_us"] = kernel_durations(lambda: step(0))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True, help="which revision of the kernels this is (recorded)")
    parser.add_argument("--out", required=True, help="JSON-lines file; one line per run is appended")
    parser.add_argument("--commit", default=commit(), help="commit of the script's checkout")
    args = parser.parse_args()
    torch.manual_seed(0)
    pool = bench.Pool(POOL_TOKENS)
    record = {"label": args.label, "commit": args.commit, "gpu": torch.cuda.get_device_name(), "kernels": os.path.dirname(msa_kernels.__file__),
              "triton": bench.triton.__version__, "rows": [measure(pool, batch, context) for batch, context in SHAPES]}
    with open(args.out, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")
    for row in record["rows"]:
        topk = {graph: row[f"{graph}_kernels_us"].get("decode_topk_kernel") for graph in ("step", "select")}
        print(f"{args.label} B{row['batch']} L{row['context']}: step {min(row['step_us']):.1f} us, "
              f"top-k in the step {topk['step']} us, alone {topk['select']} us")


if __name__ == "__main__":
    main()
