"""What bounds the decode index scan with fp8 index keys: forms of the scan, timed alone (GPU).

``msa_kernel_bench.py`` at 0b689c7 timed the selection (scan + top-k) at B8 L128K at 87.8 us with
bf16 index keys and 78.9 us with fp8 ones: half the bytes, 10% less time. The bf16 scan runs at
~0.86 of copy bandwidth; the fp8 one at about half that. This script times forms of the scan alone
(graph replays of several input sets, as the kernel benchmark does) to find where the fp8 scan's
time goes and what removes it:

* ``bf16``: the shipped scan over bf16 keys (the reference rate);
* ``fp8_widen``: the shipped fp8 form, keys widened to bf16 in registers for the MMA, scores
  multiplied by the per-token scales;
* ``fp8_noscale``: the same without the scale load and multiply (timing only, wrong scores);
* ``fp8_dot``: keys fed to the MMA as fp8 straight from shared memory; the query split once per
  program into two fp8 terms (``q * s ~ hi + lo / 16``, s a per-row power of two), two MMAs per
  block, so the query keeps about bf16's precision;
* ``fp8_dot1``: one fp8 term of the query (timing only: the query rounded to 4 significant bits);
* ``fp8_dot_k64`` / ``fp8_dot_k32``: ``fp8_dot`` with the 128-long dot products cut into 2 or 4
  MMAs of their own whose results add in fp32: Hopper's fp8 MMA keeps only about 14 bits while it
  accumulates, so shorter sums each rounded once should err less (``fp8_dot_k64`` ships);
* ``bf16_whole`` / ``fp8_dot_k64_whole`` (``_tma``): the two shipped forms with the blocks that end
  at or before the query read without masks (all but the last), by pointer or (``_tma``) by tensor
  descriptor, as the prefill scan has done since 0374202 (there it took 30% off). No gain here
  (H200, best launches, B8 L128K: bf16 77.2 / 77.5 against 76.1 us, fp8 57.0 / 55.6 against
  55.6 us; B32 L32K and B1 L32K even or slower; ``results/decode_index_scan_fp8_mma_h200/
  variants_whole_aaeaef9.json``): the decode scan's masks are 16 query columns per block, hidden
  behind its loads, where the prefill scan's are 128 x 128 per block;
* ``bf16_pairs`` / ``fp8_dot_k64_pairs``: the two shipped forms stepping two blocks per loop
  iteration (256 keys on M, one cross-warp max for both), since at half the bytes per block the fp8
  scan's fixed cost per block (page load, MMAs, max, store) outweighs its bytes. Measured slower
  (H200, B8 L128K at their best launches: 92.2 against 76.3 us bf16, 71.2 against 55.8 us fp8;
  ``results/decode_index_scan_fp8_mma_h200/variants_pairs_04f9a71wip.json``).

Each form runs over a sweep of pipeline stages, warps (``--warps``) and programs per SM at B8 L128K,
then at its best and at the shipped launch over the other decode shapes. Fewer than 4 warps gained
nothing (bf16 76.0-76.5 against 75.5 us; fp8 64-125 against 56 us, without the warpgroup MMA:
``results/decode_index_scan_fp8_mma_h200/variants_warps_e81896e.json``). Scores of the exact forms are checked
against a torch reference over the same (dequantized) keys before anything is timed.

Usage: PYTHONPATH=kernels python benchmarks/decode_index_scan_variants.py --out DIR [--commit REV]
Writes DIR/decode_index_scan_variants.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(__file__))
import msa_kernel_bench as bench  # noqa: E402
from msa_kernels.plan import page_table_from_req_to_token, plan_decode  # noqa: E402
from msa_kernels.triton_index import decode_query_columns, split_block_range  # noqa: E402
from msa_kernels.triton_select import load_tile  # noqa: E402
from provenance import commit  # noqa: E402

WHOLE_FORMS = ("bf16_whole", "bf16_whole_tma", "fp8_dot_k64_whole", "fp8_dot_k64_whole_tma")
FORMS = ("bf16", "fp8_widen", "fp8_noscale", "fp8_dot", "fp8_dot1", "fp8_dot_k64", "fp8_dot_k32", "bf16_pairs", "fp8_dot_k64_pairs",
         *WHOLE_FORMS)
EXACT_FORMS = ("bf16", "fp8_widen", "fp8_dot", "fp8_dot_k64", "fp8_dot_k32", "bf16_pairs", "fp8_dot_k64_pairs", *WHOLE_FORMS)
SHIPPED_LAUNCH = {"num_stages": 2, "num_warps": 4, "programs_per_sm": 32}
SWEEP = {"num_stages": (2, 3), "num_warps": (4, 8), "programs_per_sm": (16, 32)}
SHAPES = ((8, 131072), (8, 32768), (32, 32768), (1, 32768))  # (batch, context)


def keys_fp8(form: str) -> bool:
    """Whether ``form`` reads the fp8 pool (every form but the bf16 ones)."""
    return not form.startswith("bf16")


@triton.jit
def _query_chunk_terms(q_ptrs, row_ok, q_scale):
    """fp8 ``hi``, ``lo`` of one chunk of the query's dimensions, scaled by the whole column's ``q_scale``."""
    qs = tl.load(q_ptrs, mask=row_ok[None, :], other=0.0).to(tl.float32) * q_scale[None, :]
    hi = qs.to(tl.float8e4nv)
    return hi, ((qs - hi.to(tl.float32)) * 16.0).to(tl.float8e4nv)


@triton.jit
def _scan_pairs(ik_ptr, iks_ptr, page_ptr, score_ptr, b, start, end, last_pos, row_pos, rows, row_ok, s_ik_slot, s_pg_b,
                s_sc_b, s_sc_r, q_t, hi0, lo0, hi1, lo1, unscale,
                FORM: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Blocks ``start .. end - 1`` two per iteration: 256 keys on the MMA's M side, one max for both."""
    keys = tl.arange(0, 2 * BLOCK)
    pair = tl.arange(0, 2)
    half = tl.arange(0, D // 2)
    for blk in range(start, end, 2):
        second = blk + 1 < end
        page0 = tl.load(page_ptr + b * s_pg_b + blk).to(tl.int64)
        page1 = tl.load(page_ptr + b * s_pg_b + blk + 1, mask=second, other=0).to(tl.int64)
        slot = tl.where(keys < BLOCK, page0 * BLOCK + keys, page1 * BLOCK + keys - BLOCK)
        kpos = blk * BLOCK + keys
        k_ok = (kpos <= last_pos) & ((keys < BLOCK) | second)
        if FORM == "bf16":
            k = tl.load(ik_ptr + slot[:, None] * s_ik_slot + tl.arange(0, D)[None, :], mask=k_ok[:, None], other=0.0)
            s = tl.dot(k, q_t)
        else:
            k_half = ik_ptr + slot[:, None] * s_ik_slot + half[None, :]
            k0 = tl.load(k_half, mask=k_ok[:, None], other=0.0)
            k1 = tl.load(k_half + D // 2, mask=k_ok[:, None], other=0.0)
            s = tl.dot(k0, hi0) + tl.dot(k1, hi1) + (tl.dot(k0, lo0) + tl.dot(k1, lo1)) * 0.0625
            s *= tl.load(iks_ptr + slot, mask=k_ok, other=0.0)[:, None] * unscale[None, :]
        s = tl.where(k_ok[:, None] & (kpos[:, None] <= row_pos[None, :]), s, float("-inf"))
        block_max = tl.max(tl.reshape(s, [2, BLOCK, ROWS]), axis=1)  # [2, ROWS]
        tl.store(score_ptr + b * s_sc_b + rows[None, :] * s_sc_r + (blk + pair)[:, None], block_max,
                 mask=row_ok[None, :] & ((pair == 0) | second)[:, None])


@triton.jit
def _whole_block_scores(ik_ptr, ik_desc, iks_ptr, page, keys, d, q_t, hi0, lo0, hi1, lo1, unscale, s_ik_slot,
                        FORM: tl.constexpr, BLOCK: tl.constexpr, KC: tl.constexpr, DESC: tl.constexpr):
    """Scores ``[BLOCK, ROWS]`` of a block whose every key the query sees: no masks (``FORM`` "bf16" or "fp8_dot_k64")."""
    if FORM == "bf16":
        if DESC:
            k = ik_desc.load([page.to(tl.int32) * BLOCK, 0])
        else:
            k = tl.load(ik_ptr + (page * BLOCK + keys)[:, None] * s_ik_slot + d[None, :])
        s = tl.dot(k, q_t)
    else:
        if DESC:
            k0 = ik_desc.load([page.to(tl.int32) * BLOCK, 0])
            k1 = ik_desc.load([page.to(tl.int32) * BLOCK, KC])
        else:
            k_ptrs = ik_ptr + (page * BLOCK + keys)[:, None] * s_ik_slot + tl.arange(0, KC)[None, :]
            k0 = tl.load(k_ptrs)
            k1 = tl.load(k_ptrs + KC)
        s = tl.dot(k0, hi0) + tl.dot(k1, hi1) + (tl.dot(k0, lo0) + tl.dot(k1, lo1)) * 0.0625
        s *= tl.load(iks_ptr + page * BLOCK + keys)[:, None] * unscale[None, :]
    return s


@triton.jit
def scan_form_kernel(
    iq_ptr, ik_ptr, ik_desc, iks_ptr, page_ptr, score_ptr,
    tile_tok0_ptr, tile_pos0_ptr, tile_ntok_ptr,
    s_iq_t, s_iq_h, s_ik_slot, s_pg_b, s_sc_b, s_sc_r,
    NUM_HEADS: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    SPLITS: tl.constexpr, FORM: tl.constexpr, KC: tl.constexpr, PAIRS: tl.constexpr, WHOLE: tl.constexpr,
):
    """The decode scan of ``triton_index.decode_index_scores_kernel`` (q_len 1, no tree) in one of ``FORMS``;
    ``PAIRS``: two blocks per loop iteration; ``WHOLE`` 1 / 2: the blocks before the query's own
    unmasked, by pointer / by descriptor (``FORM`` "bf16" or "fp8_dot_k64" only, for both)."""
    b = tl.program_id(0)
    split = tl.program_id(1)
    tok0, pos0, ntok = load_tile(tile_tok0_ptr, tile_pos0_ptr, tile_ntok_ptr, b)
    rows = tl.arange(0, ROWS)
    t = rows // NUM_HEADS
    row_ok = t < ntok
    d = tl.arange(0, D)
    q_t = decode_query_columns(iq_ptr, tok0, ntok, s_iq_t, s_iq_h, 0, NUM_HEADS, ROWS, D)
    if FORM != "bf16" and FORM != "fp8_widen" and FORM != "fp8_noscale":
        qf = q_t.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(qf), axis=0), 1e-30)
        # power of two bringing the row's largest |value| to at most 448
        q_scale = tl.exp2(tl.floor(tl.log2(448.0 / amax)))
        qs = qf * q_scale[None, :]
        q_hi = qs.to(tl.float8e4nv)
        q_lo = ((qs - q_hi.to(tl.float32)) * 16.0).to(tl.float8e4nv)
        unscale = 1.0 / q_scale
    if FORM == "fp8_dot_k64" or FORM == "fp8_dot_k32":
        dc = tl.arange(0, KC)
        q_ptrs = iq_ptr + (tok0 + t)[None, :] * s_iq_t + (rows % NUM_HEADS)[None, :] * s_iq_h + dc[:, None]
        hi0, lo0 = _query_chunk_terms(q_ptrs, row_ok, q_scale)
        hi1, lo1 = _query_chunk_terms(q_ptrs + KC, row_ok, q_scale)
        if KC == 32:
            hi2, lo2 = _query_chunk_terms(q_ptrs + 2 * KC, row_ok, q_scale)
            hi3, lo3 = _query_chunk_terms(q_ptrs + 3 * KC, row_ok, q_scale)
    last_pos = pos0 + ntok - 1
    row_pos = pos0 + t
    start, end = split_block_range(last_pos, split, SPLITS, BLOCK)
    if PAIRS and FORM == "bf16":
        _scan_pairs(ik_ptr, iks_ptr, page_ptr, score_ptr, b, start, end, last_pos, row_pos, rows, row_ok, s_ik_slot, s_pg_b,
                    s_sc_b, s_sc_r, q_t, q_t, q_t, q_t, q_t, row_pos, FORM, D, BLOCK, ROWS)
    elif PAIRS:
        _scan_pairs(ik_ptr, iks_ptr, page_ptr, score_ptr, b, start, end, last_pos, row_pos, rows, row_ok, s_ik_slot, s_pg_b,
                    s_sc_b, s_sc_r, q_t, hi0, lo0, hi1, lo1, unscale, FORM, D, BLOCK, ROWS)
    else:
        keys = tl.arange(0, BLOCK)
        if WHOLE > 0:
            whole_end = tl.minimum(tl.maximum((pos0 + 1) // BLOCK, start), end)
            for blk in range(start, whole_end):
                page = tl.load(page_ptr + b * s_pg_b + blk).to(tl.int64)
                if FORM == "bf16":
                    s = _whole_block_scores(ik_ptr, ik_desc, iks_ptr, page, keys, d, q_t, q_t, q_t, q_t, q_t, row_pos, s_ik_slot,
                                            FORM, BLOCK, KC, WHOLE == 2)
                else:
                    s = _whole_block_scores(ik_ptr, ik_desc, iks_ptr, page, keys, d, q_t, hi0, lo0, hi1, lo1, unscale, s_ik_slot,
                                            FORM, BLOCK, KC, WHOLE == 2)
                tl.store(score_ptr + b * s_sc_b + rows * s_sc_r + blk, tl.max(s, axis=0), mask=row_ok)
        else:
            whole_end = start
        for blk in range(whole_end, end):
            page = tl.load(page_ptr + b * s_pg_b + blk).to(tl.int64)
            kpos = blk * BLOCK + keys
            if FORM == "fp8_dot_k64" or FORM == "fp8_dot_k32":
                k_ptrs = ik_ptr + (page * BLOCK + keys)[:, None] * s_ik_slot + dc[None, :]
                k_ok = (kpos <= last_pos)[:, None]
                k0 = tl.load(k_ptrs, mask=k_ok, other=0.0)
                k1 = tl.load(k_ptrs + KC, mask=k_ok, other=0.0)
                s = tl.dot(k0, hi0) + tl.dot(k1, hi1) + (tl.dot(k0, lo0) + tl.dot(k1, lo1)) * 0.0625
                if KC == 32:
                    k2 = tl.load(k_ptrs + 2 * KC, mask=k_ok, other=0.0)
                    k3 = tl.load(k_ptrs + 3 * KC, mask=k_ok, other=0.0)
                    s += tl.dot(k2, hi2) + tl.dot(k3, hi3) + (tl.dot(k2, lo2) + tl.dot(k3, lo3)) * 0.0625
                s *= tl.load(iks_ptr + page * BLOCK + keys, mask=kpos <= last_pos, other=0.0)[:, None] * unscale[None, :]
            else:
                k = tl.load(ik_ptr + (page * BLOCK + keys)[:, None] * s_ik_slot + d[None, :], mask=(kpos <= last_pos)[:, None], other=0.0)
                if FORM == "bf16":
                    s = tl.dot(k, q_t)
                elif FORM == "fp8_noscale":
                    s = tl.dot(k.to(q_t.dtype), q_t)
                elif FORM == "fp8_widen":
                    s = tl.dot(k.to(q_t.dtype), q_t)
                    s *= tl.load(iks_ptr + page * BLOCK + keys, mask=kpos <= last_pos, other=0.0)[:, None]
                else:
                    s = tl.dot(k, q_hi)
                    if FORM == "fp8_dot":
                        s += tl.dot(k, q_lo) * 0.0625
                    s *= tl.load(iks_ptr + page * BLOCK + keys, mask=kpos <= last_pos, other=0.0)[:, None] * unscale[None, :]
            s = tl.where(kpos[:, None] <= row_pos[None, :], s, float("-inf"))
            tl.store(score_ptr + b * s_sc_b + rows * s_sc_r + blk, tl.max(s, axis=0), mask=row_ok)


class Shape:
    """Input sets of one decode shape over the shared pool, and the scan of each over them."""

    def __init__(self, pool: bench.Pool, batch: int, context: int, sets: int):
        self.pool, self.batch, self.context = pool, batch, context
        self.sets = []
        for _ in range(sets):
            req_to_token = pool.req_to_token([context] * batch, context)
            table = page_table_from_req_to_token(req_to_token, torch.arange(batch, device="cuda"), context, bench.BLOCK)
            iq = torch.randn(batch, bench.HKV, bench.DI, device="cuda", dtype=torch.bfloat16)
            self.sets.append((table, iq))
        self.scores = torch.empty(sets, batch, 16, context // bench.BLOCK, device="cuda", dtype=torch.float32)

    def launcher(self, form: str, num_stages: int, num_warps: int, programs_per_sm: int):
        fp8 = keys_fp8(form)
        base = form.removesuffix("_pairs").removesuffix("_tma").removesuffix("_whole")
        whole = 2 if form.endswith("_whole_tma") else 1 if form.endswith("_whole") else 0
        ik = (self.pool.ik8 if fp8 else self.pool.ik).reshape(-1, bench.DI)
        iks = self.pool.iks if fp8 else ik
        kc = {"fp8_dot_k64": 64, "fp8_dot_k32": 32}.get(base, bench.DI)
        ik_desc = TensorDescriptor.from_tensor(ik, [bench.BLOCK, kc]) if whole == 2 else ik
        plans = [plan_decode(bench.PARAMS, table, torch.full((self.batch,), self.context, device="cuda"), q_len=1,
                             num_kv_heads=bench.HKV, index_programs_per_sm=programs_per_sm) for table, _ in self.sets]

        def run(i: int) -> None:
            plan, (_, iq), scores = plans[i], self.sets[i], self.scores[i]
            tiles = plan.tiles
            scan_form_kernel[(self.batch, plan.index_splits)](
                iq, ik, ik_desc, iks, plan.page_table, scores, tiles.tok0, tiles.pos0, tiles.ntok,
                iq.stride(0), iq.stride(1), ik.stride(0), plan.page_table.stride(0), scores.stride(0), scores.stride(1),
                NUM_HEADS=bench.HKV, ROWS=16, D=bench.DI, BLOCK=bench.BLOCK, SPLITS=plan.index_splits, FORM=base,
                KC=kc, PAIRS=form.endswith("_pairs"), WHOLE=whole,
                num_warps=num_warps, num_stages=num_stages,
            )
        return run

    def reference_scores(self, i: int, fp8: bool) -> torch.Tensor:
        """``[batch, heads, blocks]`` block maxima in fp32 over the keys the form reads (fp8 ones dequantized)."""
        table, iq = self.sets[i]
        keys = self.pool.ik8.float().reshape(-1, bench.DI) * self.pool.iks[:, None] if fp8 else self.pool.ik.float().reshape(-1, bench.DI)
        slots = (table.long()[:, :, None] * bench.BLOCK + torch.arange(bench.BLOCK, device="cuda")).reshape(self.batch, -1)
        scores = torch.einsum("bld,bhd->bhl", keys[slots], iq.float())
        return scores.reshape(self.batch, bench.HKV, -1, bench.BLOCK).amax(-1)


def precision(shape: Shape, form: str, launch: dict = SHIPPED_LAUNCH) -> dict:
    """Score errors against the reference at a served-like shape, and the top-16 sets they change."""
    shape.launcher(form, **launch)(0)
    ref = shape.reference_scores(0, fp8=keys_fp8(form))
    got = shape.scores[0][:, : bench.HKV]
    rel = (got - ref).abs() / ref.abs().amax(-1, keepdim=True)
    top_ref = ref.topk(bench.TOPK, dim=-1).indices.sort(-1).values
    top_got = got.topk(bench.TOPK, dim=-1).indices.sort(-1).values
    return {"form": form, "batch": shape.batch, "context": shape.context, "max_rel_err": float(rel.max()),
            "mean_rel_err": float(rel.mean()), "rows": ref.shape[0] * ref.shape[1],
            "rows_with_another_top16": int((top_ref != top_got).any(-1).sum())}


def check(shape: Shape, form: str, launch: dict = SHIPPED_LAUNCH) -> dict:
    """:func:`precision` at a small shape; a form passes when no score is 2e-2 (of its row's largest) off the reference."""
    row = precision(shape, form, launch)
    return {**row, **launch, "ok": row["max_rel_err"] < 2e-2}


def scan_bytes(batch: int, context: int, form: str) -> int:
    return batch * context * (bench.DI + 4 if keys_fp8(form) else 2 * bench.DI)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for decode_index_scan_variants.json")
    parser.add_argument("--commit", default=commit(), help="commit of the script's checkout")
    parser.add_argument("--forms", nargs="+", choices=FORMS, default=FORMS, help="forms to check and time (default: all)")
    parser.add_argument("--warps", nargs="+", type=int, default=SWEEP["num_warps"],
                        help=f"warps per program the B8 L128K sweep tries (default: {' '.join(map(str, SWEEP['num_warps']))})")
    parser.add_argument("--stages", nargs="+", type=int, default=SWEEP["num_stages"],
                        help=f"pipeline stages the sweep tries (default: {' '.join(map(str, SWEEP['num_stages']))})")
    parser.add_argument("--programs-per-sm", nargs="+", type=int, default=SWEEP["programs_per_sm"],
                        help="scan programs per SM the sweep tries (fewer programs: more blocks each) "
                             f"(default: {' '.join(map(str, SWEEP['programs_per_sm']))})")
    args = parser.parse_args()
    sweep_space = {"num_stages": tuple(args.stages), "num_warps": tuple(args.warps), "programs_per_sm": tuple(args.programs_per_sm)}
    forms = tuple(args.forms)
    exact_forms = tuple(form for form in EXACT_FORMS if form in forms)
    torch.manual_seed(0)
    pool = bench.Pool(1 << 21)
    copy = bench.measure_ceilings()["copy_bytes_per_s"]
    record = {"commit": args.commit, "gpu": torch.cuda.get_device_name(), "triton": triton.__version__,
              "copy_bytes_per_s": copy, "shipped_launch": SHIPPED_LAUNCH}
    small = Shape(pool, 2, 4096, 1)
    record["checks"] = [check(small, form) for form in exact_forms]
    print(json.dumps(record["checks"]))
    if not all(c["ok"] for c in record["checks"]):
        raise SystemExit("a scan form disagrees with the reference; nothing timed")

    def timed(shape: Shape, form: str, launch: dict) -> dict:
        us = bench.graph_replay_us(shape.launcher(form, **launch), len(shape.sets))
        bw = scan_bytes(shape.batch, shape.context, form) / (us * 1e-6)
        return {"batch": shape.batch, "context": shape.context, "form": form, **launch, "us": us, "of_copy_bandwidth": bw / copy}

    served_like = Shape(pool, 32, 32768, 1)
    record["precision"] = [precision(served_like, form) for form in exact_forms]
    for row in record["precision"]:
        print(json.dumps(row))
    del served_like
    big = Shape(pool, *SHAPES[0], sets=1)
    sweep = []
    for form in forms:
        for values in itertools.product(*sweep_space.values()):
            launch = dict(zip(sweep_space, values))
            try:
                sweep.append(timed(big, form, launch))
            except Exception as error:  # a launch Triton cannot compile for this GPU (e.g. too few warps for an MMA form)
                sweep.append({"batch": big.batch, "context": big.context, "form": form, **launch, "error": repr(error)[:300]})
            print(json.dumps(sweep[-1]))
    record["sweep_b8_l128k"] = sweep
    best = {form: min((r for r in sweep if r["form"] == form and "us" in r), key=lambda r: r["us"]) for form in forms}
    # the best launch computes the same scores (another warp count is another MMA layout)
    record["best_launch_checks"] = [check(small, form, {k: best[form][k] for k in SWEEP}) for form in exact_forms]
    print(json.dumps(record["best_launch_checks"]))
    rows = []
    for batch, context in SHAPES[1:]:
        shape = Shape(pool, batch, context, sets=max(1, min(4, int(400e6 // scan_bytes(batch, context, "bf16")))))
        for form in forms:
            for launch in (SHIPPED_LAUNCH, {k: best[form][k] for k in SWEEP}):
                rows.append(timed(shape, form, launch))
                print(json.dumps(rows[-1]))
    record["rows"] = rows
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "decode_index_scan_variants.json"), "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=1)
    for form in forms:
        r = best[form]
        print(f"B8 L128K {form}: best {r['us']:.1f} us ({r['of_copy_bandwidth']:.2f} of copy) at "
              f"stages {r['num_stages']} warps {r['num_warps']} programs/SM {r['programs_per_sm']}")


if __name__ == "__main__":
    main()
