"""Benchmark the MSA Triton kernels against SGLang 0.5.23's MSA kernels and dense attention (GPU).

Method (../shared/BENCHMARKS.md): ceilings first (device copy bandwidth, bf16 matmul rate) in the
same run; correctness of ours and of SGLang's kernels against the torch reference at small shapes
on fresh random data before any timing; then the same shapes and inputs for every contender.
Decode is timed as CUDA-graph replays of the whole MSA step (indexer + top-k + attention), with
several input sets captured back to back so that L2 does not hold them; prefill with CUDA events.

Dense anchor: every row times each dense attention available on the GPU, on the same shapes and
the KV layout SGLang caches (tokens, heads, dim): torch SDPA restricted to one backend at a time
(cuDNN, FlashAttention, memory-efficient) and FlashInfer's decode/prefill when ``flashinfer``
imports; each row records them all (``dense_backends``, microseconds; a backend that refuses the
shape is null with its reason in ``dense_backend_errors``) and takes the fastest as ``dense_us``
(``dense_backend`` names it). Causal masks are lower-right aligned where queries are fewer than
keys (a chunk after a prefix, speculative rows). Speculative rows (decode, q_len > 1) also time
two dense forms that read the K/V once (``verify_dense``), since SDPA's backends have no fast path
for a few queries under that mask: FlexAttention with the mask as a block mask, the serving
path's cuDNN prefix split (unmasked over the shared keys, causal over the queries' own, merged),
and the MSA decode kernels reading every block (what ``SGLANG_M3_DENSE_VERIFY=msa`` serves M3's
dense layers with; the project's own kernel, listed beside the others, the fastest the anchor). Decode rows come twice, ``index_dtype`` "bf16"
and "fp8" (our kernels with fp8 index keys + per-token scales; the SGLang and dense anchors do
not depend on it and are shared).

SGLang's kernels are imported from an unmodified copy of
``sglang/kernels/ops/attention/minimax_sparse/`` placed on ``--sglang-path`` with tiny stand-ins for
the few SGLang helpers it imports; its decode top-k runs the Triton 2-stage path of the same file
(the JIT radix top-k needs SGLang's JIT stack).

Usage: PYTHONPATH=kernels python benchmarks/msa_kernel_bench.py --out DIR [--sglang-path DIR] [--quick]
Writes DIR/msa_kernels_<gpu>.json, .md and .png. A full run split over two device calls
(``--decode-only`` then ``--prefill-only``, same GPU and commit) becomes one file with
``--merge DIR1 DIR2 --out DIR`` (no GPU needed; each part's ceilings and checks are kept).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import triton

from msa_kernels.api import decode_select, prefill_select, run_decode, run_prefill
from msa_kernels.paged_batch import compare_with_reference, make_paged_batch
from msa_kernels.plan import page_table_from_req_to_token, plan_decode, plan_prefill
from msa_kernels.reference import MSAParams, quantize_index_keys
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from verify_dense import CudnnPrefixSplitDense, FlexDense, MsaDenseDecode  # noqa: E402  (beside this script)
from provenance import commit  # noqa: E402

HQ, HKV, D, DI, BLOCK, TOPK = 64, 4, 128, 128, 128, 16
PARAMS = MSAParams(block_size=BLOCK, topk=TOPK, local_blocks=1, init_blocks=0)
K = 1024


# ---------------------------------------------------------------- cost model (M3_FACTS s.3)
def decode_model_bytes(L: int, batch: int, q_len: int, index_dtype: str = "bf16") -> int:
    """Index-key scan (256 B/token bf16, 128 + 4 fp8 + scale) + 16 blocks x 4 KV heads of K and V + q/iq/out rows, per request."""
    index_scan = (2 * DI if index_dtype == "bf16" else DI + 4) * L
    kv_blocks = TOPK * HKV * BLOCK * D * 2 * 2
    rows = q_len * (2 * HQ * D * 2 + HKV * DI * 2)
    return batch * (index_scan + kv_blocks + rows)


def prefill_model_flops(n: int, prefix: int) -> float:
    """Indexer: 4 heads x 128 x 2 per visible key; main attention ~67.1e6 per query (16 blocks)."""
    visible_keys = n * prefix + n * (n + 1) / 2
    return 2 * HKV * DI * visible_keys + 4 * HQ * D * TOPK * BLOCK * n


def prefill_index_flops(n: int, prefix: int) -> float:
    return 2 * HKV * DI * (n * prefix + n * (n + 1) / 2)


def prefill_model_bytes(n: int, prefix: int) -> int:
    """Each input read once, output written once: q, out, iq rows, and all K, V, index keys."""
    total = n + prefix
    return n * (2 * HQ * D * 2 + HKV * DI * 2) + total * (2 * HKV * D * 2 + DI * 2)


# ---------------------------------------------------------------- timing
def bench_ms(fn, min_reps: int = 5, budget_ms: float = 400.0) -> float:
    """Median of CUDA-event timings after a warm-up call; repetitions fit a time budget."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    first = start.elapsed_time(end)
    reps = max(min_reps, min(200, int(budget_ms / max(first, 1e-3))))
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def graph_replay_us(step, sets: int) -> float:
    """Capture ``step(i)`` for every input set back to back in one graph; time per step (us)."""
    for i in range(sets):
        step(i)  # compile / autotune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(sets):
            step(i)
    return 1000.0 * triton.testing.do_bench(graph.replay, warmup=50, rep=300, return_mode="median") / sets


def measure_ceilings() -> dict:
    n = 1 << 30  # 2 GiB of bf16 each way
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), min_reps=10)
    copy_bw = 2 * n * 2 / (ms * 1e-3)
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b, min_reps=20)
    flops = 2 * 8192**3 / (ms * 1e-3)
    return {"copy_bytes_per_s": copy_bw, "bf16_matmul_flops_per_s": flops}


# ---------------------------------------------------------------- SGLang's kernels
@dataclass
class SGLang:
    decode_index: object
    decode_attn: object
    prefill_index: object
    prefill_attn: object

    @classmethod
    def load(cls, path: str | None):
        if path:
            sys.path.insert(0, path)
        try:
            from sglang.kernels.ops.attention.minimax_sparse.decode.flash_with_topk_idx import flash_decode_with_topk_idx
            from sglang.kernels.ops.attention.minimax_sparse.decode.topk_sparse import flash_decode_with_gqa_share_sparse
            from sglang.kernels.ops.attention.minimax_sparse.prefill.flash_with_topk_idx import flash_prefill_with_topk_index
            from sglang.kernels.ops.attention.minimax_sparse.prefill.topk_sparse import flash_prefill_with_gqa_share_sparse
        except ImportError as err:
            print(f"SGLang kernels unavailable: {err}")
            return None
        return cls(flash_decode_with_topk_idx, flash_decode_with_gqa_share_sparse,
                   flash_prefill_with_topk_index, flash_prefill_with_gqa_share_sparse)

    def decode(self, q, iq, k_cache, v_cache, ik_cache, req_to_token, slot_ids, seq_lens, max_seqlen):
        _, topk_idx, _ = self.decode_index(
            q=iq, sink=None, k_cache=ik_cache, v_cache=None, req_to_token=req_to_token, seq_lens=seq_lens,
            max_seqlen=max_seqlen, slot_ids=slot_ids, block_size=BLOCK, topk=TOPK, init_blocks=PARAMS.init_blocks,
            local_blocks=PARAMS.local_blocks, disable_index_value=True, page_size=BLOCK,
        )
        out = self.decode_attn(
            q=q, sink=None, k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token, seq_lens=seq_lens,
            slot_ids=slot_ids, block_size=BLOCK, topk_idx=topk_idx, page_size=BLOCK,
        )
        return out, topk_idx

    def prefill_topk(self, iq, ik_cache, req_to_token, slot_ids, cu_seqlens, seq_lens, prefix_lens, max_q, max_k):
        _, topk_idx = self.prefill_index(
            q=iq, k_cache=ik_cache, v_cache=None, sink=None, req_to_token=req_to_token, slot_ids=slot_ids,
            cu_seqlens=cu_seqlens, seq_lens=seq_lens, prefix_lens=prefix_lens, max_seqlen_q=max_q,
            max_seqlen_k=max_k, block_size_q=1, block_size_k=BLOCK, topk=TOPK, init_blocks=PARAMS.init_blocks,
            local_blocks=PARAMS.local_blocks, disable_index_value=True, page_size=BLOCK,
        )
        return topk_idx

    def prefill(self, q, iq, k_cache, v_cache, ik_cache, req_to_token, slot_ids, cu_seqlens, seq_lens, prefix_lens, max_q, max_k):
        topk_idx = self.prefill_topk(iq, ik_cache, req_to_token, slot_ids, cu_seqlens, seq_lens, prefix_lens, max_q, max_k)
        out = self.prefill_attn(
            q=q, k_cache=k_cache, v_cache=v_cache, sink=None, req_to_token=req_to_token, slot_ids=slot_ids,
            topk_idx=topk_idx, block_size_q=1, block_size_k=BLOCK, cu_seqlens=cu_seqlens, seq_lens=seq_lens,
            prefix_lens=prefix_lens, max_seqlen_q=max_q,
        )
        return out, topk_idx


def _sorted_ids(topk_idx: torch.Tensor) -> torch.Tensor:
    """SGLang's ``[heads, rows, topk]`` -> ours ``[rows, heads, topk]``, ascending with -1 last."""
    x = topk_idx.transpose(0, 1).long()
    big = torch.iinfo(torch.int64).max
    x = torch.where(x < 0, big, x).sort(dim=-1).values
    return torch.where(x == big, -1, x)


# ---------------------------------------------------------------- correctness before timing
def check_correctness(sgl: SGLang | None, seed: int) -> dict:
    """Ours and SGLang's, bf16, against the reference on random ragged batches drawn from ``seed``
    (kept in the results' meta, so a failed check can be replayed with ``--check-seed``)."""
    results = {}
    gen = torch.Generator().manual_seed(seed)
    seq_lens, ext = [3000, 2600, 5000, 200], [3000, 700, 129, 200]
    pb = make_paged_batch(seq_lens, ext, HQ, HKV, D, DI, BLOCK, torch.bfloat16, "cuda", generator=gen)
    reqs = torch.arange(len(seq_lens), device="cuda")
    table = page_table_from_req_to_token(pb.req_to_token, reqs, max(seq_lens), BLOCK)
    plan = plan_prefill(PARAMS, table, seq_lens, ext, num_index_heads=HKV)
    out, sel = run_prefill(plan, pb.q, pb.k_cache, pb.v_cache, pb.iq, pb.ik_cache)
    results["ours_prefill"] = _agreement(compare_with_reference(pb, PARAMS, out, sel, rel_tol=2e-2))
    if sgl:
        cu = torch.tensor([0] + list(torch.tensor(ext).cumsum(0)), dtype=torch.int32, device="cuda")
        seq = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        prefix = seq - torch.tensor(ext, dtype=torch.int32, device="cuda")
        out, topk_idx = sgl.prefill(pb.q, pb.iq, pb.k_cache, pb.v_cache, pb.ik_cache, pb.req_to_token, reqs.int(), cu, seq, prefix, max(ext), max(seq_lens))
        results["sglang_prefill"] = _agreement(compare_with_reference(pb, PARAMS, out, _sorted_ids(topk_idx), rel_tol=2e-2))
    seq_lens = [300, 2049, 20000, 70000]
    pb = make_paged_batch(seq_lens, [1] * 4, HQ, HKV, D, DI, BLOCK, torch.bfloat16, "cuda", decode_q_len=1, max_context=72 * K, generator=gen)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    table = page_table_from_req_to_token(pb.req_to_token, reqs, 72 * K, BLOCK)
    out, sel = run_decode(plan_decode(PARAMS, table, seq, num_kv_heads=HKV), pb.q, pb.k_cache, pb.v_cache, pb.iq, pb.ik_cache)
    results["ours_decode"] = _agreement(compare_with_reference(pb, PARAMS, out, sel, rel_tol=2e-2))
    pb8 = pb.with_fp8_index_keys()
    out, sel = run_decode(plan_decode(PARAMS, table, seq, num_kv_heads=HKV), pb8.q, pb8.k_cache, pb8.v_cache, pb8.iq,
                          pb8.ik_cache, ik_scale=pb8.ik_scale)
    results["ours_decode_fp8"] = _agreement(compare_with_reference(pb8, PARAMS, out, sel, rel_tol=2e-2))
    if sgl:
        out, topk_idx = sgl.decode(pb.q, pb.iq, pb.k_cache, pb.v_cache, pb.ik_cache, pb.req_to_token, reqs.int(), seq, 72 * K)
        results["sglang_decode"] = _agreement(compare_with_reference(pb, PARAMS, out, _sorted_ids(topk_idx), rel_tol=2e-2))
    return results


def _agreement(a) -> dict:
    return {"ok": a.ok, "rows": a.rows, "tie_swaps": a.tie_swaps, "max_rel_err": a.max_rel_err, "failures": a.failures[:3]}


# ---------------------------------------------------------------- shared inputs
class Pool:
    """One large paged cache; every input set draws its pages from it at random."""

    def __init__(self, tokens: int):
        self.pages = tokens // BLOCK
        slots = self.pages * BLOCK
        self.k = torch.randn(slots, HKV, D, device="cuda", dtype=torch.bfloat16)
        self.v = torch.randn(slots, HKV, D, device="cuda", dtype=torch.bfloat16)
        self.ik = torch.randn(slots, 1, DI, device="cuda", dtype=torch.bfloat16)
        # the same keys as the fp8 pool stores them, quantized in slices to bound the fp32 temporaries
        self.ik8 = torch.empty(slots, 1, DI, device="cuda", dtype=torch.float8_e4m3fn)
        self.iks = torch.empty(slots, device="cuda", dtype=torch.float32)
        for start in range(0, slots, 1 << 20):
            part = slice(start, start + (1 << 20))
            self.ik8[part], scales = quantize_index_keys(self.ik[part])
            self.iks[part] = scales.reshape(-1)

    def req_to_token(self, seq_lens: list[int], max_context: int) -> torch.Tensor:
        need = [math.ceil(s / BLOCK) for s in seq_lens]
        pages = torch.randperm(self.pages, device="cuda")[: sum(need)]
        table = torch.zeros(len(seq_lens), max_context, dtype=torch.int32, device="cuda")
        offs = torch.arange(BLOCK, device="cuda", dtype=torch.int32)
        start = 0
        for b, (s, n) in enumerate(zip(seq_lens, need)):
            slots = (pages[start : start + n, None].int() * BLOCK + offs[None, :]).reshape(-1)[:s]
            table[b, :s] = slots
            start += n
        return table


SDPA_BACKENDS = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
                 "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}


def _flashinfer():
    try:
        import flashinfer
    except ImportError:
        return None
    return flashinfer


def sdpa_attention(backend, q, k, v):
    """Causal GQA, lower-right aligned: ``q [B, Lq, HQ, D]``, ``k/v [B, L, HKV, D]`` (views, no copies)."""
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    lq, lk = q.shape[1], k.shape[1]
    with sdpa_kernel([backend]):
        if lq == 1:  # one query at the end sees every key
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        if lq == lk:
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=causal_lower_right(lq, lk), enable_gqa=True)


class FlashInferDense:
    """FlashInfer over the same tensors: each request's K/V is one page of ``L`` tokens (NHD)."""

    def __init__(self, fi, batch: int, q_len: int, length: int):
        dev = "cuda"
        self.workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=dev)
        indptr = torch.arange(batch + 1, dtype=torch.int32, device=dev)
        pages = torch.arange(batch, dtype=torch.int32, device=dev)
        last = torch.full((batch,), length, dtype=torch.int32, device=dev)
        if q_len == 1:
            self.wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")
            self.wrapper.plan(indptr, pages, last, HQ, HKV, D, length, q_data_type=torch.bfloat16)
        else:
            self.wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
            self.wrapper.plan(indptr * q_len, indptr, pages, last, HQ, HKV, D, length, causal=True, q_data_type=torch.bfloat16)

    def __call__(self, q, k, v):
        """``q [B, q_len, HQ, D]``, ``k/v [B, L, HKV, D]``; returns ``[B * q_len, HQ, D]``."""
        return self.wrapper.run(q.reshape(-1, HQ, D), (k, v))


def _first_line(err: Exception) -> str:
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"


#: largest output difference (absolute, bf16 outputs of unit-variance inputs) between dense backends
#: computing the same attention; they agreed within 3.9e-3 over every row of the H200 run at bca5572
DENSE_AGREEMENT = 1e-2


def time_dense(row: dict, make_fns, timer) -> None:
    """Time every dense backend on the row's inputs; record all, keep the fastest as the anchor.

    ``make_fns()`` -> {name: zero-argument callable on the first input set, or an Exception};
    ``timer(name, fn)`` times one backend. Outputs are compared with the first backend that ran
    (``dense_backend_max_abs_diff``); one further than :data:`DENSE_AGREEMENT` from it computes
    something else (another mask) and is not timed, its difference named in the errors.
    """
    times, errors, diffs, first = {}, {}, {}, None
    for name, fn in make_fns().items():
        if isinstance(fn, Exception):
            times[name], errors[name] = None, _first_line(fn)
            continue
        try:
            out = fn().reshape(-1, HQ, D) if name == "flashinfer" else fn().transpose(1, 2).reshape(-1, HQ, D)
            if first is None:
                first = out.float()
            diffs[name] = float((out.float() - first).abs().max())
            del out
            if diffs[name] > DENSE_AGREEMENT:
                times[name], errors[name] = None, f"output differs from the first backend's by {diffs[name]:.3g}"
                continue
            times[name] = timer(name, fn)
        except (RuntimeError, ValueError, TypeError, NotImplementedError, ImportError) as err:  # a backend refusing the shape
            times[name], errors[name] = None, _first_line(err)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    ran = {name: us for name, us in times.items() if us is not None}
    row["dense_backends"] = times
    row["dense_backend_errors"] = errors
    row["dense_backend_max_abs_diff"] = diffs
    row["dense_backend"] = min(ran, key=ran.get) if ran else None
    row["dense_us"] = ran[row["dense_backend"]] if ran else None


def bench_decode(pool: Pool, sgl: SGLang | None, batch: int, L: int, q_len: int) -> list[dict]:
    """Two rows, index_dtype "bf16" and "fp8"; the SGLang and dense anchors are timed once and shared."""
    step_bytes = decode_model_bytes(L, batch, q_len)
    sets = max(1, min(4, int(400e6 // step_bytes)))
    seq_lens = [L] * batch
    max_context = L
    inputs = []
    for _ in range(sets):
        rtt = pool.req_to_token(seq_lens, max_context)
        reqs = torch.arange(batch, device="cuda")
        plan = plan_decode(PARAMS, page_table_from_req_to_token(rtt, reqs, max_context, BLOCK),
                           torch.tensor(seq_lens, device="cuda"), q_len=q_len, num_kv_heads=HKV)
        q = torch.randn(batch * q_len, HQ, D, device="cuda", dtype=torch.bfloat16)
        iq = torch.randn(batch * q_len, HKV, DI, device="cuda", dtype=torch.bfloat16)
        inputs.append((rtt, plan, q, iq))
    row = {"phase": "decode", "index_dtype": "bf16", "L": L, "batch": batch, "q_len": q_len, "model_bytes": step_bytes,
           "input_sets": sets}
    ours = graph_replay_us(lambda i: run_decode(inputs[i][1], inputs[i][2], pool.k, pool.v, inputs[i][3], pool.ik), sets)
    row["ours_us"] = ours
    row["ours_index_topk_us"] = graph_replay_us(lambda i: decode_select(inputs[i][1], inputs[i][3], pool.ik), sets)
    fp8 = {"index_dtype": "fp8", "model_bytes": decode_model_bytes(L, batch, q_len, "fp8")}
    fp8["ours_us"] = graph_replay_us(
        lambda i: run_decode(inputs[i][1], inputs[i][2], pool.k, pool.v, inputs[i][3], pool.ik8, ik_scale=pool.iks), sets)
    fp8["ours_index_topk_us"] = graph_replay_us(lambda i: decode_select(inputs[i][1], inputs[i][3], pool.ik8, pool.iks), sets)
    row["sglang_us"] = None
    if sgl:
        # Speculative rows go to SGLang's decode as one row per token (its own seq length, same slots).
        slot_ids = torch.arange(batch, device="cuda", dtype=torch.int32).repeat_interleave(q_len)
        lens = (torch.tensor(seq_lens, device="cuda", dtype=torch.int32).repeat_interleave(q_len)
                - (q_len - 1) + torch.arange(q_len, device="cuda", dtype=torch.int32).repeat(batch))

        def sgl_step(i):
            rtt, _, q, iq = inputs[i]
            return sgl.decode(q, iq, pool.k, pool.v, pool.ik, rtt, slot_ids, lens, max_context)

        row["sglang_us"] = graph_replay_us(sgl_step, sets)
    dense_sets = max(1, min(sets, int(8e9 // (batch * L * HKV * D * 4))))
    dense = [(torch.randn(batch, q_len, HQ, D, device="cuda", dtype=torch.bfloat16),
              torch.randn(batch, L, HKV, D, device="cuda", dtype=torch.bfloat16),
              torch.randn(batch, L, HKV, D, device="cuda", dtype=torch.bfloat16)) for _ in range(dense_sets)]

    flex = FlexDense(q_len, L, "cuda") if q_len > 1 else None
    split = CudnnPrefixSplitDense(dense) if q_len > 1 else None
    msa_dense = MsaDenseDecode(dense, PARAMS, torch.cuda.get_device_properties(0).multi_processor_count) if q_len > 1 else None

    def make_fns():
        fns = {name: (lambda b=backend: sdpa_attention(b, *dense[0])) for name, backend in SDPA_BACKENDS.items()}
        if q_len > 1:
            fns["flex"] = lambda: flex(*dense[0])
            fns["cudnn_prefix_split"] = lambda: split(0)
            fns["msa_dense_decode"] = lambda: msa_dense(0)
        fi = _flashinfer()
        if fi is not None:
            try:
                fns["flashinfer"] = (lambda f=FlashInferDense(fi, batch, q_len, L): f(*dense[0]))
            except (RuntimeError, ValueError, TypeError) as err:
                fns["flashinfer"] = err
        return fns

    def timer(name, fn):
        if name == "flashinfer":
            fi_run = FlashInferDense(_flashinfer(), batch, q_len, L)
            return graph_replay_us(lambda i: fi_run(*dense[i]), dense_sets)
        if name == "flex":
            return graph_replay_us(lambda i: flex(*dense[i]), dense_sets)
        if name == "cudnn_prefix_split":
            return graph_replay_us(split, dense_sets)
        if name == "msa_dense_decode":
            return graph_replay_us(msa_dense, dense_sets)
        backend = SDPA_BACKENDS[name]
        return graph_replay_us(lambda i: sdpa_attention(backend, *dense[i]), dense_sets)

    time_dense(row, make_fns, timer)
    del dense, split, msa_dense
    rows = [row, {**row, **fp8}]
    for r in rows:
        r["frac_bw"] = r["model_bytes"] / (r["ours_us"] * 1e-6) / CEILINGS["copy_bytes_per_s"]
        r["byte_min_us"] = r["model_bytes"] / CEILINGS["copy_bytes_per_s"] * 1e6
    return rows


def bench_prefill(pool: Pool, sgl: SGLang | None, n: int, prefix: int) -> dict:
    total = n + prefix
    rtt = pool.req_to_token([total], total)
    reqs = torch.arange(1, device="cuda")
    plan = plan_prefill(PARAMS, page_table_from_req_to_token(rtt, reqs, total, BLOCK), [total], [n], num_index_heads=HKV)
    q = torch.randn(n, HQ, D, device="cuda", dtype=torch.bfloat16)
    iq = torch.randn(n, HKV, DI, device="cuda", dtype=torch.bfloat16)
    flops = prefill_model_flops(n, prefix)
    row = {"phase": "prefill", "index_dtype": "bf16", "L": total, "N": n, "prefix": prefix, "q_len": n,
           "model_flops": flops, "model_bytes": prefill_model_bytes(n, prefix)}
    row["ours_us"] = 1000 * bench_ms(lambda: run_prefill(plan, q, pool.k, pool.v, iq, pool.ik))
    row["ours_attention_form"] = "block_major" if plan.block_major else "query_major"
    row["ours_us_by_attention_form"] = {}
    for form in (True, False):
        fplan = plan_prefill(PARAMS, plan.page_table, [total], [n], num_index_heads=HKV, block_major=form)
        row["ours_us_by_attention_form"]["block_major" if form else "query_major"] = 1000 * bench_ms(
            lambda: run_prefill(fplan, q, pool.k, pool.v, iq, pool.ik), min_reps=3, budget_ms=200
        )
    row["ours_index_splits"] = plan.index_splits
    row["ours_index_us"] = 1000 * bench_ms(lambda: prefill_select(plan, iq, pool.ik))
    if plan.index_splits > 1:
        one = plan_prefill(PARAMS, plan.page_table, [total], [n], num_index_heads=HKV, index_splits=1)
        row["ours_index_us_unsplit"] = 1000 * bench_ms(lambda: prefill_select(one, iq, pool.ik))
    row["sglang_us"] = row["sglang_index_us"] = None
    if sgl:
        cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        seq = torch.tensor([total], dtype=torch.int32, device="cuda")
        pre = torch.tensor([prefix], dtype=torch.int32, device="cuda")
        args = (rtt, reqs.int(), cu, seq, pre, n, total)
        row["sglang_us"] = 1000 * bench_ms(lambda: sgl.prefill(q, iq, pool.k, pool.v, pool.ik, *args))
        row["sglang_index_us"] = 1000 * bench_ms(lambda: sgl.prefill_topk(iq, pool.ik, *args))
    dq = q.unsqueeze(0)
    dk = torch.randn(1, total, HKV, D, device="cuda", dtype=torch.bfloat16)
    dv = torch.randn(1, total, HKV, D, device="cuda", dtype=torch.bfloat16)

    def make_fns():
        fns = {name: (lambda b=backend: sdpa_attention(b, dq, dk, dv)) for name, backend in SDPA_BACKENDS.items()}
        fi = _flashinfer()
        if fi is not None:  # causal is aligned to the last key when queries are fewer than keys
            fns["flashinfer"] = lambda: fi.single_prefill_with_kv_cache(q, dk[0], dv[0], causal=True)
        return fns

    time_dense(row, make_fns, lambda name, fn: 1000 * bench_ms(fn))
    del dq, dk, dv
    row["frac_flops"] = flops / (row["ours_us"] * 1e-6) / CEILINGS["bf16_matmul_flops_per_s"]
    row["index_frac_flops"] = prefill_index_flops(n, prefix) / (row["ours_index_us"] * 1e-6) / CEILINGS["bf16_matmul_flops_per_s"]
    row["frac_bw"] = row["model_bytes"] / (row["ours_us"] * 1e-6) / CEILINGS["copy_bytes_per_s"]
    return row


#: (index programs per SM, attention programs per SM) that ``--sweep`` times; the plan's defaults
#: are (32, 2). The attention's count sets its splits per (token, kv head): at 2, a B8 step gives
#: each program one or two of the 16 blocks, a B32 step five or six.
DECODE_GRID_SWEEP = ((32, 1), (32, 2), (32, 3), (32, 4), (32, 6), (32, 8), (32, 16), (16, 2), (64, 2))


def sweep_decode_grids(pool: Pool, shapes) -> list[dict]:
    """Decode step time for several grid sizings (results do not depend on them; speed does)."""
    out = []
    for batch, L, q_len in shapes:
        rtt = pool.req_to_token([L] * batch, L)
        table = page_table_from_req_to_token(rtt, torch.arange(batch, device="cuda"), L, BLOCK)
        seq = torch.full((batch,), L, device="cuda")
        q = torch.randn(batch * q_len, HQ, D, device="cuda", dtype=torch.bfloat16)
        iq = torch.randn(batch * q_len, HKV, DI, device="cuda", dtype=torch.bfloat16)
        for ipsm, apsm in DECODE_GRID_SWEEP:
            plan = plan_decode(PARAMS, table, seq, q_len=q_len, num_kv_heads=HKV, index_programs_per_sm=ipsm, attn_programs_per_sm=apsm)
            us = graph_replay_us(lambda i: run_decode(plan, q, pool.k, pool.v, iq, pool.ik), 1)
            out.append({"batch": batch, "L": L, "q_len": q_len, "index_programs_per_sm": ipsm, "attn_programs_per_sm": apsm, "ours_us": us})
            print(json.dumps(out[-1]), flush=True)
    return out


def breakdown() -> dict:
    """Ablation evidence: each decode kernel alone (graph replay), index-scan launch variants, the
    replay floor of a one-kernel graph, and the prefill attention alone (its K/V read rate)."""
    from msa_kernels import api
    from msa_kernels.triton_index import decode_index_scores_kernel
    from msa_kernels.triton_select import decode_topk_kernel

    P, res = PARAMS, {}

    def graph_us(fn):
        return graph_replay_us(lambda i: fn(), 1)

    for B, L, T in ((8, 128 * 1024, 1), (1, 32 * 1024, 1), (8, 32 * 1024, 4)):
        slots = B * L
        ik = torch.randn(slots, 1, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(slots, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        pages = torch.randperm(slots // 128, device="cuda").int().view(B, L // 128)
        plan = plan_decode(P, pages, torch.full((B,), L, device="cuda"), q_len=T, num_kv_heads=HKV)
        q = torch.randn(B * T, HQ, D, device="cuda", dtype=torch.bfloat16)
        iq = torch.randn(B * T, HKV, 128, device="cuda", dtype=torch.bfloat16)
        tiles = plan.tiles
        rows = max(16, triton.next_power_of_2(HKV * T))
        scores = torch.empty(B, rows, plan.max_blocks, device="cuda")
        ik2 = ik.view(slots, 128)
        key = f"B{B}_L{L // 1024}K_q{T}"
        r = {"index_bytes_min_us": B * L * 256 / 3.0e12 * 1e6}
        def index(nw, ns, splits):
            return lambda: decode_index_scores_kernel[(B, splits)](
                iq, ik2, ik2, plan.page_table, scores, tiles.tok0, tiles.pos0, tiles.ntok,
                iq.stride(0), iq.stride(1), ik2.stride(0), plan.page_table.stride(0), scores.stride(0), scores.stride(1),
                NUM_HEADS=HKV, ROWS=rows, D=128, BLOCK=128, SPLITS=splits, KEY_FP8=False, num_warps=nw, num_stages=ns)
        for nw, ns in ((4, 3), (4, 2), (4, 4), (8, 3)):
            r[f"index_w{nw}_s{ns}"] = graph_us(index(nw, ns, plan.index_splits))
        sel = torch.empty(B * T, HKV, 16, dtype=torch.int32, device="cuda")
        nbp = triton.next_power_of_2(plan.max_blocks)
        r["topk"] = graph_us(lambda: decode_topk_kernel[(B, HKV, T)](
            scores, sel, tiles.tok0, tiles.pos0, tiles.ntok, scores.stride(0), scores.stride(1), sel.stride(0), sel.stride(1),
            NUM_HEADS=HKV, BLOCK=128, NBP=nbp, TOPK=16, KP=16, LOCAL=1, INIT=0, **api.topk_widths(nbp),
            num_warps=api.topk_num_warps(nbp)))
        r["select_total"] = graph_us(lambda: api.decode_select(plan, iq, ik))
        r["step_total"] = graph_us(lambda: api.run_decode(plan, q, k, v, iq, ik))
        out = torch.empty_like(q)
        selected = api.decode_select(plan, iq, ik)
        r["attention_and_merge"] = graph_us(lambda: api._attention(
            tiles, plan.page_table, q, k, v, selected, out, plan.attn_splits, D ** -0.5, 128, tickets=plan.tickets,
            per_token=True))
        r["empty_graph_kernel_us"] = graph_us(lambda: scores[:1, :1, :1].zero_())
        res[key] = r
        print(key, json.dumps({a: round(b, 1) for a, b in r.items()}), flush=True)
        del ik, k, v, scores
        torch.cuda.empty_cache()

    # prefill attention alone at N=32K (T=1): bytes moved from L2 vs time
    N = 32 * 1024
    k = torch.randn(N, HKV, D, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
    ik = torch.randn(N, 1, 128, device="cuda", dtype=torch.bfloat16)
    pages = torch.randperm(N // 128, device="cuda").int().view(1, -1)
    q = torch.randn(N, HQ, D, device="cuda", dtype=torch.bfloat16); iq = torch.randn(N, HKV, 128, device="cuda", dtype=torch.bfloat16)
    for T in (1, 2):
        plan = plan_prefill(P, pages, [N], [N], num_index_heads=HKV, attn_tile_tokens=T)
        selected = api.prefill_select(plan, iq, ik)
        out = torch.empty_like(q)
        fn = lambda: api._attention(plan.attn_tiles, plan.page_table, q, k, v, selected, out, 1, D ** -0.5, 128)
        fn(); torch.cuda.synchronize()
        ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
        kv_l2_bytes = N * HKV * 16 * 128 * D * 2 * 2
        res[f"prefill32K_attn_T{T}"] = {"ms": ms, "kv_bytes_per_token_quads_GB": kv_l2_bytes / 1e9, "kv_read_rate_TBps_if_T1": kv_l2_bytes / (ms * 1e-3) / 1e12}
        print(f"prefill32K_attn_T{T}", json.dumps(res[f"prefill32K_attn_T{T}"]), flush=True)
    return res


CEILINGS: dict = {}


def _fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def merge_runs(run_files: list[str]) -> tuple[dict, list[dict]]:
    """One results file from runs of the same GPU and commit (say ``--decode-only`` and
    ``--prefill-only`` in two device calls, whose limit one full run can exceed).

    The first run's meta heads the file; every run's ceilings and correctness checks stay under
    ``meta["parts"]``, since each part measured its own; rows keep the values their run computed."""
    runs = []
    for path in run_files:
        with open(path) as f:
            runs.append(json.load(f))
    first = runs[0]["meta"]
    for path, run in zip(run_files, runs):
        for key in ("gpu", "commit", "torch", "triton"):
            if run["meta"][key] != first[key]:
                raise SystemExit(f"--merge: {path} has {key}={run['meta'][key]!r}, the first run {first[key]!r}")
    meta = dict(first)
    meta["parts"] = [
        {"file": os.path.basename(os.path.dirname(os.path.abspath(path))) + "/" + os.path.basename(path),
         "phases": sorted({r["phase"] for r in run["rows"]}), "ceilings": run["meta"]["ceilings"],
         "checks": run["meta"]["checks"]}
        for path, run in zip(run_files, runs)
    ]
    return meta, [row for run in runs for row in run["rows"]]


def results_base(out: str, gpu: str) -> str:
    """``OUT/msa_kernels_<gpu tag>``: the path stem of a run's JSON, markdown and PNG."""
    tag = "h100" if "H100" in gpu else "h200" if "H200" in gpu else gpu.replace(" ", "_").lower()
    return os.path.join(out, f"msa_kernels_{tag}")


def write_results(out: str, meta: dict, rows: list[dict]) -> str:
    """The JSON, markdown and PNG of one run under ``out``; returns the markdown's path."""
    base = results_base(out, meta["gpu"])
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    write_markdown(base + ".md", meta, rows)
    write_plot(base + ".png", rows)
    return base + ".md"


def write_markdown(path: str, meta: dict, rows: list[dict]) -> None:
    c = meta["ceilings"]
    lines = [
        f"# MSA kernels on {meta['gpu']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, driver {meta['driver']}, commit {meta['commit']}.",
        f"Ceilings measured in {'the first part' if meta.get('parts') else 'the same run'}: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
        f"bf16 matmul {c['bf16_matmul_flops_per_s'] / 1e12:.0f} TFLOP/s. SGLang top-k: {meta['sglang_topk']}.",
        *[f"Part {p['file']} ({', '.join(p['phases'])}): copy {p['ceilings']['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"bf16 matmul {p['ceilings']['bf16_matmul_flops_per_s'] / 1e12:.0f} TFLOP/s, its own correctness checks below."
          for p in meta.get("parts", [])],
        "",
        "## Decode (CUDA-graph replay of indexer + top-k + attention, per layer, us)",
        "",
        "Dense = the fastest of the dense backends timed on the row (named); every backend's time is in the JSON.",
        "",
        "| batch | L | q_len | index keys | ours | SGLang | dense (fastest) | byte min | SGLang/ours | dense/ours | frac_bw |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["phase"] != "decode":
            continue
        sg = r["sglang_us"] / r["ours_us"] if r["sglang_us"] else None
        dense_ratio = r["dense_us"] / r["ours_us"] if r["dense_us"] else None
        lines.append(
            f"| {r['batch']} | {r['L'] // K}K | {r['q_len']} | {r['index_dtype']} | {_fmt(r['ours_us'])} | {_fmt(r['sglang_us'])} | "
            f"{_fmt(r['dense_us'])} {r['dense_backend'] or ''} | {_fmt(r['byte_min_us'])} | {_fmt(sg, 2)} | {_fmt(dense_ratio, 2)} | "
            f"{_fmt(r['frac_bw'], 2)} |"
        )
    lines += [
        "",
        "## Prefill (CUDA events, per layer, ms)",
        "",
        "| N | prefix | ours | ours indexer | ours block-major / query-major | SGLang | SGLang indexer | dense (fastest) | SGLang/ours | dense/ours | frac_flops | indexer frac_flops |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["phase"] != "prefill":
            continue
        ms = lambda x: None if x is None else x / 1000  # noqa: E731
        sg = r["sglang_us"] / r["ours_us"] if r["sglang_us"] else None
        forms = r["ours_us_by_attention_form"]
        dense_ratio = r["dense_us"] / r["ours_us"] if r["dense_us"] else None
        lines.append(
            f"| {r['N'] // K}K | {r['prefix'] // K}K | {_fmt(ms(r['ours_us']), 2)} | {_fmt(ms(r['ours_index_us']), 2)} | "
            f"{_fmt(ms(forms['block_major']), 2)} / {_fmt(ms(forms['query_major']), 2)} | "
            f"{_fmt(ms(r['sglang_us']), 2)} | {_fmt(ms(r['sglang_index_us']), 2)} | {_fmt(ms(r['dense_us']), 2)} {r['dense_backend'] or ''} | "
            f"{_fmt(sg, 2)} | {_fmt(dense_ratio, 2)} | {_fmt(r['frac_flops'], 3)} | {_fmt(r['index_frac_flops'], 3)} |"
        )
    lines += ["", "## Dense backends per row (us; - = refused, reason in the JSON, or not run: flex, cudnn_prefix_split and msa_dense_decode run on q_len > 1 only)", ""]
    names = sorted({name for r in rows for name in r.get("dense_backends", {})})
    lines += ["| phase | batch | L | q_len / N | " + " | ".join(names) + " |", "|---|---|---|---|" + "---|" * len(names)]
    for r in rows:
        if r["index_dtype"] != "bf16":
            continue
        times = [_fmt(r["dense_backends"].get(name)) for name in names]
        lines.append(f"| {r['phase']} | {r.get('batch', 1)} | {r['L'] // K}K | {r['q_len']} | " + " | ".join(times) + " |")
    lines += ["", "## Correctness checks run before timing", ""]
    parts = meta.get("parts") or [{"file": None, "checks": meta["checks"]}]
    for part in parts:
        prefix = f"{part['file']}: " if part["file"] else ""
        for name, a in part["checks"].items():
            lines.append(f"- {prefix}{name}: ok={a['ok']} rows={a['rows']} tie_swaps={a['tie_swaps']} "
                         f"max_rel_err={a['max_rel_err']:.2e}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_plot(path: str, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, batch in zip(axes[:2], (1, 8)):
        sel = sorted((r for r in rows if r["phase"] == "decode" and r["batch"] == batch and r["q_len"] == 1
                      and r["index_dtype"] == "bf16"), key=lambda r: r["L"])
        fp8 = sorted((r for r in rows if r["phase"] == "decode" and r["batch"] == batch and r["q_len"] == 1
                      and r["index_dtype"] == "fp8"), key=lambda r: r["L"])
        xs = [r["L"] for r in sel]
        for key, label in (("ours_us", "ours, bf16 index keys"), ("sglang_us", "SGLang 0.5.23"),
                           ("dense_us", "dense, fastest backend"), ("byte_min_us", "byte minimum (bf16 keys)")):
            ys = [r[key] for r in sel]
            if any(y is not None for y in ys):
                ax.plot(xs, ys, marker="o", label=label)
        if fp8:
            ax.plot([r["L"] for r in fp8], [r["ours_us"] for r in fp8], marker="s", label="ours, fp8 index keys")
        ax.set(xscale="log", yscale="log", xlabel="context L (tokens)", ylabel="us per layer (graph replay)", title=f"decode, batch {batch}, q_len 1")
        ax.legend()
    sel = sorted((r for r in rows if r["phase"] == "prefill" and r["prefix"] == 0), key=lambda r: r["N"])
    xs = [r["N"] for r in sel]
    for key, label in (("ours_us", "ours"), ("sglang_us", "SGLang 0.5.23"), ("dense_us", "dense causal, fastest backend")):
        ys = [None if r[key] is None else r[key] / 1000 for r in sel]
        if any(y is not None for y in ys):
            axes[2].plot(xs, ys, marker="o", label=label)
    axes[2].set(xscale="log", yscale="log", xlabel="new tokens N (no prefix)", ylabel="ms per layer", title="prefill")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


DECODE_SHAPES = [  # (batch, L, q_len)
    (1, 8 * K, 1), (1, 32 * K, 1), (1, 128 * K, 1), (1, 512 * K, 1), (1, 1024 * K, 1),
    (8, 8 * K, 1), (8, 32 * K, 1), (8, 128 * K, 1), (8, 512 * K, 1),
    (32, 8 * K, 1), (32, 32 * K, 1), (32, 128 * K, 1),
    (1, 32 * K, 4), (8, 32 * K, 4), (8, 128 * K, 4),
]
PREFILL_SHAPES = [(2 * K, 0), (8 * K, 0), (32 * K, 0), (128 * K, 0), (4 * K, 124 * K)]  # (N, prefix)
QUICK_DECODE = [(1, 32 * K, 1), (8, 128 * K, 1), (8, 32 * K, 1), (8, 32 * K, 4), (32, 32 * K, 1), (1, 32 * K, 4)]
QUICK_PREFILL = [(2 * K, 0), (8 * K, 0), (4 * K, 124 * K)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the JSON, markdown and PNG results")
    parser.add_argument("--sglang-path", help="folder holding the stand-in 'sglang' package with SGLang's MSA kernels")
    parser.add_argument("--quick", action="store_true", help="a few headline shapes only")
    parser.add_argument("--decode-only", action="store_true", help="skip the prefill shapes")
    parser.add_argument("--prefill-only", action="store_true", help="skip the decode shapes")
    parser.add_argument("--sweep", action="store_true", help="also time decode grid sizings at headline shapes")
    parser.add_argument("--breakdown", action="store_true", help="only the per-kernel ablation; writes msa_kernels_breakdown.json")
    parser.add_argument("--commit", default=commit(), help="commit of the benchmarked code")
    parser.add_argument("--check-seed", type=int, default=None,
                        help="seed of the correctness checks' random batches (default: the clock; the results keep it)")
    parser.add_argument("--merge", nargs="+", metavar="DIR",
                        help="write one results file from these runs' folders (same GPU and commit) and time nothing")
    args = parser.parse_args()
    if args.merge:
        os.makedirs(args.out, exist_ok=True)
        files = []
        for folder in args.merge:
            found = sorted(f for f in os.listdir(folder) if f.startswith("msa_kernels_") and f.endswith(".json"))
            if len(found) != 1:
                parser.error(f"--merge: {folder} holds {len(found)} msa_kernels_<gpu>.json files, not one")
            files.append(os.path.join(folder, found[0]))
        print(open(write_results(args.out, *merge_runs(files))).read())
        return
    if args.decode_only and args.prefill_only:
        parser.error("--decode-only and --prefill-only exclude each other")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    if args.breakdown:
        with open(os.path.join(args.out, "msa_kernels_breakdown.json"), "w") as f:
            json.dump(breakdown(), f, indent=1)
        return
    CEILINGS.update(measure_ceilings())
    print("ceilings", CEILINGS, flush=True)
    sgl = SGLang.load(args.sglang_path)
    check_seed = int(time.time()) if args.check_seed is None else args.check_seed
    checks = check_correctness(sgl, check_seed)
    print("checks", json.dumps(checks), flush=True)
    if not all(checks[name]["ok"] for name in ("ours_prefill", "ours_decode", "ours_decode_fp8")):
        print("WARNING: our kernels failed the correctness check; timings below are of wrong code")
    for name in ("sglang_prefill", "sglang_decode"):
        if name in checks and not checks[name]["ok"]:
            print(f"WARNING: {name} failed the correctness check")
    pool = Pool(tokens=9 * 1024 * K)
    rows = []
    for batch, L, q_len in [] if args.prefill_only else QUICK_DECODE if args.quick else DECODE_SHAPES:
        try:
            pair = bench_decode(pool, sgl, batch, L, q_len)
        except torch.OutOfMemoryError as err:
            print(f"decode B={batch} L={L} q_len={q_len}: out of memory ({err})")
            torch.cuda.empty_cache()
            continue
        rows.extend(pair)
        for r in pair:
            print(json.dumps(r), flush=True)
    for n, prefix in [] if args.decode_only else QUICK_PREFILL if args.quick else PREFILL_SHAPES:
        rows.append(bench_prefill(pool, sgl, n, prefix))
        print(json.dumps(rows[-1]), flush=True)
    sweep = sweep_decode_grids(pool, QUICK_DECODE) if args.sweep else []
    props = torch.cuda.get_device_properties(0)
    gpu = props.name
    try:
        import subprocess

        # one line per GPU on a machine of several: the driver is the same for all
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True).stdout.split("\n")[0].strip()
    except OSError:
        driver = "unknown"
    meta = {
        "gpu": gpu, "driver": driver, "torch": torch.__version__, "triton": triton.__version__, "commit": args.commit,
        "sms": props.multi_processor_count, "ceilings": CEILINGS, "checks": checks, "check_seed": check_seed,
        "decode_grid_sweep": sweep,
        "sglang_topk": "SGLang's Triton 2-stage top-k (its JIT radix top-k needs SGLang's JIT stack)" if sgl else "not run",
        "timing": "decode: CUDA-graph replay, median, input sets rotated; prefill: CUDA events, median",
    }
    print(open(write_results(args.out, meta, rows)).read())


if __name__ == "__main__":
    main()
