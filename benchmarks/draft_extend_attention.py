"""A draft's extend over the verify window on the MSA decode kernels, timed alone (GPU).

``sglang_m3.speculative.draft_extend`` as SGLang's draft-extend graph runner drives it: static
plans refreshed inside a CUDA graph, then the attention, at the mid-size EAGLE3 draft's heads
(48 query heads over 8 KV heads, head dim 128, bf16, page = MSA block = 128), for windows of 4
(chain of 3) and 8 (tree of 8) tokens. Per row: the median replay time of the graph over
``--replays`` replays, each replay timed with CUDA events. Checks every row against the torch
reference first. Prints one line per row; ``--out`` also writes them as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels"))
from msa_kernels.paged_batch import make_paged_batch, reference_request  # noqa: E402
from msa_kernels.reference import MSAParams  # noqa: E402

from sglang_m3.speculative.draft_extend import DraftExtendPlans  # noqa: E402

HQ, HKV, D, BLOCK = 48, 8, 128, 128
PARAMS = MSAParams(block_size=BLOCK, topk=16, local_blocks=1, init_blocks=0)
CONTEXT = 131072
LAYER = SimpleNamespace(layer_id=0, tp_q_head_num=HQ, tp_k_head_num=HKV, qk_head_dim=D, v_head_dim=D, scaling=D**-0.5,
                        k_scale=None, v_scale=None)
ROWS = [(1, 2048, 4), (1, 32768, 4), (16, 2048, 4), (16, 32768, 4), (1, 2048, 8), (16, 2048, 8)]


def time_row(batch_size: int, context: int, window: int, replays: int) -> dict:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    seq_lens = [context] * batch_size
    batch = make_paged_batch(seq_lens, [window] * batch_size, HQ, HKV, D, D, BLOCK, torch.bfloat16, "cuda",
                             decode_q_len=window, max_context=context + BLOCK, generator=torch.Generator().manual_seed(context))
    pool = SimpleNamespace(head_num=HKV, get_key_buffer=lambda _: batch.k_cache, get_value_buffer=lambda _: batch.v_cache)
    req_to_token = batch.req_to_token
    plans = DraftExtendPlans(req_to_token, pool, PARAMS, CONTEXT, torch.cuda.get_device_properties(0).multi_processor_count, "cuda")
    plans.init_graph_state(64, 64 * window)
    fb = SimpleNamespace(
        forward_mode=ForwardMode.DRAFT_EXTEND_V2, batch_size=batch_size,
        req_pool_indices=torch.arange(batch_size, device="cuda"), seq_lens=torch.tensor(seq_lens, device="cuda"),
        seq_lens_cpu=torch.tensor(seq_lens), spec_info=SimpleNamespace(num_tokens_per_req=window, num_front_tokens=0),
    )
    q = batch.q.reshape(batch.q.shape[0], -1)

    def step():
        plans.refresh_graphed(fb)
        return plans.attend(q, None, None, LAYER, fb, save_kv_cache=False)

    plans.plan_graphed(fb)
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    every_block = dataclasses.replace(PARAMS, topk=1 << 12)
    worst = 0.0
    for b in range(batch_size):
        want, _, _ = reference_request(batch, b, every_block)
        got = out.view(-1, HQ, D)[batch.rows_of(b)].float().cpu()
        worst = max(worst, float(((got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)).max()))
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return {"batch": batch_size, "context": context, "window": window, "us": statistics.median(times),
            "dense_splits": plans.plan.dense_splits, "max_rel_err": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replays", type=int, default=200, help="graph replays timed per row (default 200)")
    parser.add_argument("--out", help="folder for draft_extend_attention.json")
    args = parser.parse_args()
    rows = []
    for batch_size, context, window in ROWS:
        row = time_row(batch_size, context, window, args.replays)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "draft_extend_attention.json"), "w", encoding="utf-8") as handle:
            json.dump({"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("M3_COMMIT", "unknown"), "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
