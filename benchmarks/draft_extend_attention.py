"""A draft's extend over the verify window, its attention alone: the MSA decode kernels against
SGLang's Triton extend kernel (GPU, through the harness).

At the mid-size EAGLE3 draft's heads (48 query heads over 8 KV heads, head dim 128, bf16, page =
MSA block = 128), for windows of 4 (chain of 3) and 8 (tree of 8) tokens, each in a CUDA graph:

* ``msa``: ``sglang_m3.speculative.draft_extend`` as SGLang's draft-extend graph runner drives
  it, the static plan's refresh (page ids, window positions) and the attention;
* ``sglang``: ``extend_attention_fwd`` called as SGLang's Triton backend calls it for these
  batches (prefix slots from ``req_to_token``, the window's K/V, causal, the KV page size); its
  index fill runs outside the graph, as the backend's does.

Per row and kernel: the median replay time over ``--replays`` replays, each timed with CUDA
events, after checking the output against the torch reference. One line per row; ``--out`` also
writes them as JSON.
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
from provenance import commit  # noqa: E402

HQ, HKV, D, BLOCK = 48, 8, 128, 128
PARAMS = MSAParams(block_size=BLOCK, topk=16, local_blocks=1, init_blocks=0)
CONTEXT = 131072
LAYER = SimpleNamespace(layer_id=0, tp_q_head_num=HQ, tp_k_head_num=HKV, qk_head_dim=D, v_head_dim=D, scaling=D**-0.5,
                        k_scale=None, v_scale=None)
DEVICE = "cuda"
ROWS = [(1, 2048, 4), (1, 32768, 4), (16, 2048, 4), (16, 32768, 4), (1, 2048, 8), (16, 2048, 8)]


def replay_us(step, replays: int) -> tuple[float, torch.Tensor]:
    """Median replay time of ``step`` captured in a CUDA graph, and the output of a replay."""
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times), out


def max_rel_err(batch, out: torch.Tensor) -> float:
    every_block = dataclasses.replace(PARAMS, topk=1 << 12)
    worst = 0.0
    for b in range(len(batch.seq_lens)):
        want, _, _ = reference_request(batch, b, every_block)
        got = out.view(-1, HQ, D)[batch.rows_of(b)].float().cpu()
        worst = max(worst, float(((got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)).max()))
    return worst


def msa_step(batch, seq_lens: list[int], window: int):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    pool = SimpleNamespace(head_num=HKV, get_key_buffer=lambda _: batch.k_cache, get_value_buffer=lambda _: batch.v_cache)
    plans = DraftExtendPlans(batch.req_to_token, pool, PARAMS, CONTEXT, torch.cuda.get_device_properties(0).multi_processor_count, DEVICE)
    plans.init_graph_state(64, 64 * window)
    fb = SimpleNamespace(
        forward_mode=ForwardMode.DRAFT_EXTEND_V2, batch_size=len(seq_lens),
        req_pool_indices=torch.arange(len(seq_lens), device=DEVICE), seq_lens=torch.tensor(seq_lens, device=DEVICE),
        seq_lens_cpu=torch.tensor(seq_lens), spec_info=SimpleNamespace(num_tokens_per_req=window, num_front_tokens=0),
    )
    plans.plan_graphed(fb)
    q = batch.q.reshape(batch.q.shape[0], -1)

    def step():
        plans.refresh_graphed(fb)
        return plans.attend(q, None, None, LAYER, fb, save_kv_cache=False)

    return step, plans.plan.dense_splits


def sglang_step(batch, seq_lens: list[int], window: int):
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    prefixes = [s - window for s in seq_lens]
    rows = batch.req_to_token.long()
    kv_indices = torch.cat([rows[b, :p] for b, p in enumerate(prefixes)])
    window_slots = torch.cat([rows[b, p : p + window] for b, p in enumerate(prefixes)])
    k_window, v_window = batch.k_cache[window_slots].contiguous(), batch.v_cache[window_slots].contiguous()
    qo_indptr = torch.arange(0, len(seq_lens) * window + 1, window, dtype=torch.int32, device=DEVICE)
    kv_indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    kv_indptr[1:] = torch.cumsum(torch.tensor(prefixes, device=DEVICE), 0)
    out = torch.empty_like(batch.q)

    def step():
        extend_attention_fwd(
            batch.q, k_window, v_window, out, batch.k_cache, batch.v_cache, qo_indptr, kv_indptr, kv_indices,
            None, True, None, window, 1.0, 1.0, sm_scale=LAYER.scaling, page_size=BLOCK,
            extend_seq_lens_cpu=[window] * len(seq_lens),
        )
        return out

    return step


def time_row(batch_size: int, context: int, window: int, replays: int) -> dict:
    seq_lens = [context] * batch_size
    batch = make_paged_batch(seq_lens, [window] * batch_size, HQ, HKV, D, D, BLOCK, torch.bfloat16, DEVICE,
                             decode_q_len=window, max_context=context + BLOCK, generator=torch.Generator().manual_seed(context))
    row = {"batch": batch_size, "context": context, "window": window}
    step, row["msa_dense_splits"] = msa_step(batch, seq_lens, window)
    for name, kernel in (("msa", step), ("sglang", sglang_step(batch, seq_lens, window))):
        row[f"{name}_us"], out = replay_us(kernel, replays)
        row[f"{name}_max_rel_err"] = max_rel_err(batch, out)
    row["sglang_over_msa"] = row["sglang_us"] / row["msa_us"]
    return row


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
            json.dump({"gpu": torch.cuda.get_device_name(), "commit": commit(), "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
