"""Query-major against KV-block-major prefill (GPU), whole extend step as a server runs it
(``run_prefill``: indexer + attention), at the extends where ``plan_prefill`` picks its default
attention form. Random inputs, one request, after a cached prefix of ``--prefix`` tokens (none by default).

The two forms are timed in alternating rounds (query-major, block-major, query-major, ...), each
round a CUDA-event median, so drift of the GPU over the run falls on both.
Usage: PYTHONPATH=kernels python benchmarks/prefill_attention_forms.py (writes $OUT/
prefill_attention_forms.json).
"""

import argparse
import itertools
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import msa_kernel_bench as bench  # noqa: E402
from msa_kernels.api import run_prefill  # noqa: E402
from msa_kernels.plan import BLOCK_MAJOR_CHUNK_TOKENS, page_table_from_req_to_token, plan_prefill  # noqa: E402
from provenance import commit  # noqa: E402

K = 1024
NEW_TOKENS = [8 * K, 16 * K, 32 * K, 64 * K, 128 * K, 192 * K]
ROUNDS = 3
FORMS = ("query_major", "block_major")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=NEW_TOKENS, help="new tokens of the one request")
    parser.add_argument("--prefix", type=int, nargs="+", default=[0],
                        help="cached tokens before the new ones (every --n runs after every prefix)")
    parser.add_argument("--chunk", type=int, default=BLOCK_MAJOR_CHUNK_TOKENS, help="tokens per block-major pass")
    args = parser.parse_args()
    new_tokens = args.n
    pool = bench.Pool(tokens=((max(new_tokens) + max(args.prefix)) // K + 4) * K)
    rows = []
    for prefix, n in itertools.product(args.prefix, new_tokens):
        seq = prefix + n
        table = page_table_from_req_to_token(pool.req_to_token([seq], seq), torch.arange(1, device="cuda"), seq, bench.BLOCK)
        q = torch.randn(n, bench.HQ, bench.D, device="cuda", dtype=torch.bfloat16)
        iq = torch.randn(n, bench.HKV, bench.DI, device="cuda", dtype=torch.bfloat16)
        plans = {form: plan_prefill(bench.PARAMS, table, [seq], [n], num_index_heads=bench.HKV, block_major=form == "block_major",
                                   block_major_chunk=args.chunk)
                 for form in FORMS}
        outs = {form: run_prefill(plan, q, pool.k, pool.v, iq, pool.ik) for form, plan in plans.items()}
        same_blocks = torch.equal(outs["query_major"][1], outs["block_major"][1])
        max_abs_diff = (outs["query_major"][0].float() - outs["block_major"][0].float()).abs().max().item()
        ms = {form: [] for form in plans}
        for _ in range(ROUNDS):
            for form, plan in plans.items():
                ms[form].append(bench.bench_ms(lambda p=plan: run_prefill(p, q, pool.k, pool.v, iq, pool.ik), min_reps=3, budget_ms=300))
        row = {"N": n, "prefix": prefix, "block_major_chunk": args.chunk, "ms": ms, "median_ms": {form: statistics.median(v) for form, v in ms.items()},
               "same_blocks": same_blocks, "max_abs_diff": max_abs_diff}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del q, iq, outs
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "prefill_attention_forms.json"), "w") as handle:
        json.dump({"gpu": torch.cuda.get_device_name(), "commit": commit(), "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
