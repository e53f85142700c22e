"""Both prefill attention forms at once (GPU experiment): does KV-block-major work on a few SMs
beside query-major work on the rest finish a long extend sooner than either form alone?

Query-major attention is bound by L2-to-SM bandwidth (each token re-reads its 16 blocks, 64 KB per
(token, block) from L2); block-major reads each block once per tile but pays ~20 KB of Q gather and
partial traffic per (token, block) and runs one register-file-filling program per SM at about half
the copy rate (benchmarks/KERNEL_NOTES.md, v8). Their bounds differ, so sharing the GPU between them
may beat both. This times, at one request of ``N`` new tokens (random inputs, no prefix, the
selection computed once): query-major alone, block-major alone, and co-runs where block-major takes
the first ``share`` of the tokens on ``programs`` persistent programs, launched first on a
high-priority stream, and query-major the rest on the current stream.

Each co-run's output is checked against the forms alone: its block-major rows bit-equal to
block-major's, its query-major rows to query-major's.
``--alone`` times the forms alone and block-major's launch variants (rows per tile, warps,
pipeline stages, programs per SM) instead of the co-runs.
Usage: PYTHONPATH=kernels python benchmarks/prefill_attention_corun.py [--n 131072 ...] [--alone]
(writes $OUT/prefill_attention_corun.json).
"""

import argparse
import dataclasses
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
import msa_kernel_bench as bench  # noqa: E402
from msa_kernels import api  # noqa: E402
from msa_kernels.plan import Tiles, page_table_from_req_to_token, plan_prefill  # noqa: E402
from provenance import commit  # noqa: E402

SHARES = (0.15, 0.25, 0.35, 0.5)
PROGRAMS = (16, 33, 66)
#: (rows per tile, warps, pipeline stages, programs per SM); the first is the shipped launch
BLOCK_MAJOR_LAUNCHES = ((64, 4, 2, 2), (64, 4, 2, 3), (64, 4, 3, 2), (64, 4, 3, 3), (64, 8, 2, 2), (128, 8, 2, 1),
                        (128, 8, 2, 2))


def query_major(plan, q, pool, selected, out, tiles: Tiles | None = None) -> None:
    """Query-major one-token tiles over ``tiles`` (default: every token of the plan)."""
    api._attention_one_token_tiles(tiles or plan.attn_tiles, plan.page_table, q, pool.k, pool.v, selected, out,
                                   api._scale(None, q.shape[-1]), bench.BLOCK)


def block_major(plan, q, pool, selected, out, tokens=None) -> None:
    api._attention_block_major(plan, q, pool.k, pool.v, selected, out, api._scale(None, q.shape[-1]), bench.BLOCK,
                               tokens=tokens)


def corun_parts(plan, share: float, programs: int):
    """``(block-major plan on programs, query-major tiles of tokens split .. N - 1, split)``, split =
    ``share * N``: made once per co-run shape, outside its timed calls."""
    n = plan.num_tokens
    split = int(n * share)
    # one request, tiles sorted by position descending: tokens split .. n-1 are the first n - split tiles
    t = plan.attn_tiles
    rest = Tiles(req=t.req[: n - split], tok0=t.tok0[: n - split], pos0=t.pos0[: n - split],
                 ntok=t.ntok[: n - split], max_tokens=t.max_tokens)
    return dataclasses.replace(plan, block_major_programs=programs), rest, split


def corun(plan, bm_plan, rest: Tiles, split: int, q, pool, selected, out, side: torch.cuda.Stream) -> None:
    """Block-major (``bm_plan``) over tokens ``[0, split)`` on ``side``, query-major over ``rest`` here."""
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        block_major(bm_plan, q, pool, selected, out, tokens=(0, split))
    query_major(plan, q, pool, selected, out, tiles=rest)
    main.wait_stream(side)


def block_major_variants(plan, q, pool, selected, ref) -> list[dict]:
    """Block-major alone under each launch variant: (rows per tile, warps, stages, programs per SM).
    Rows per tile set the pairs a tile takes (rows / the padded group); the plan's programs are
    its programs per SM times the SMs."""
    shipped = (api._BLOCK_MAJOR_ROWS, api._BLOCK_MAJOR_WARPS, api._BLOCK_MAJOR_STAGES)
    per_sm_shipped = plan.block_major_programs // torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    try:
        for tile_rows, warps, stages, per_sm in BLOCK_MAJOR_LAUNCHES:
            api._BLOCK_MAJOR_ROWS, api._BLOCK_MAJOR_WARPS, api._BLOCK_MAJOR_STAGES = tile_rows, warps, stages
            variant = dataclasses.replace(plan, block_major_programs=per_sm * plan.block_major_programs // per_sm_shipped)
            out = torch.zeros_like(q)
            try:
                block_major(variant, q, pool, selected, out)
            except triton.runtime.errors.OutOfResources as error:  # e.g. 3 stages of 128-row tiles
                rows.append({"n": plan.num_tokens, "tile_rows": tile_rows, "warps": warps, "stages": stages,
                             "programs_per_sm": per_sm, "error": str(error).splitlines()[0]})
                print(json.dumps(rows[-1]), flush=True)
                continue
            ms = bench.bench_ms(lambda v=variant: block_major(v, q, pool, selected, out), min_reps=3, budget_ms=400)
            rows.append({"n": plan.num_tokens, "form": "block_major", "tile_rows": tile_rows, "warps": warps,
                         "stages": stages, "programs_per_sm": per_sm, "ms": ms,
                         "max_abs_diff": (out.float() - ref.float()).abs().max().item()})
            print(json.dumps(rows[-1]), flush=True)
    finally:  # the module constants are the shipped launch for every later measurement
        api._BLOCK_MAJOR_ROWS, api._BLOCK_MAJOR_WARPS, api._BLOCK_MAJOR_STAGES = shipped
    return rows


def measure(pool: bench.Pool, n: int, side: torch.cuda.Stream, alone: bool) -> dict:
    """Every form and co-run at ``n`` new tokens (``alone``: the forms alone, block-major's launch
    variants instead of the co-runs)."""
    table = page_table_from_req_to_token(pool.req_to_token([n], n), torch.arange(1, device="cuda"), n, bench.BLOCK)
    q = torch.randn(n, bench.HQ, bench.D, device="cuda", dtype=torch.bfloat16)
    iq = torch.randn(n, bench.HKV, bench.DI, device="cuda", dtype=torch.bfloat16)
    plan = plan_prefill(bench.PARAMS, table, [n], [n], num_index_heads=bench.HKV, block_major=True)
    selected = api.prefill_select(plan, iq, pool.ik)
    ref = {form: torch.zeros_like(q) for form in ("query_major", "block_major")}
    query_major(plan, q, pool, selected, ref["query_major"])
    block_major(plan, q, pool, selected, ref["block_major"])
    out = torch.empty_like(q)
    rows = [{"n": n, "form": form, "ms": bench.bench_ms(lambda f=fn: f(plan, q, pool, selected, out),
                                                 min_reps=3, budget_ms=400)}
            for form, fn in (("query_major", query_major), ("block_major", block_major))]
    print(json.dumps(rows), flush=True)
    if alone:
        return {"n": n, "rows": rows + block_major_variants(plan, q, pool, selected, ref["block_major"])}
    for share in SHARES:
        for programs in PROGRAMS:
            bm_plan, rest, split = corun_parts(plan, share, programs)
            out.zero_()
            corun(plan, bm_plan, rest, split, q, pool, selected, out, side)
            torch.cuda.synchronize()
            exact = (torch.equal(out[:split], ref["block_major"][:split])
                     and torch.equal(out[split:], ref["query_major"][split:]))
            ms = bench.bench_ms(lambda b=bm_plan, r=rest, s=split: corun(plan, b, r, s, q, pool, selected, out, side),
                                min_reps=3, budget_ms=400)
            row = {"n": n, "form": "corun", "share": share, "programs": programs, "ms": ms, "exact": exact}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return {"n": n, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[128 * bench.K], help="new tokens of the one request")
    parser.add_argument("--alone", action="store_true",
                        help="the forms alone and block-major's launch variants, no co-runs")
    args = parser.parse_args()
    pool = bench.Pool(tokens=(max(args.n) // bench.K + 4) * bench.K)
    side = torch.cuda.Stream(priority=-1)
    results = [measure(pool, n, side, args.alone) for n in args.n]
    with open(os.path.join(os.environ.get("OUT", "."), "prefill_attention_corun.json"), "w") as handle:
        json.dump({"gpu": torch.cuda.get_device_name(), "commit": commit(), "runs": results}, handle, indent=1)


if __name__ == "__main__":
    main()
