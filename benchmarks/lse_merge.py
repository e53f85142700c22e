"""The dense prefix split's log-sum-exp merge: torch ops against ``triton_lse_merge``'s one pass (GPU).

A chunk of new tokens after a cached prefix is attended by the dense layers as two cuDNN calls
whose outputs are merged by their normalisers (``sglang_m3.msa.dense_prefill.prefix_split_sdpa``).
This times that merge at M3's widths per chunk size and TP size (64 heads of 128 at TP1, 32 at
TP2), as the torch ops (``merge_by_lse_reference``) and as the Triton pass (``merge_by_lse``),
eagerly (prefill runs attention outside CUDA graphs) and as graph replays, on partials laid out
as cuDNN returns them (heads-first, viewed token-major); each row records whether the two outputs
are bit-identical and the byte minimum of the pass (read both outputs, write one) at the GPU's
peak bandwidth.

    PYTHONPATH=.:kernels python benchmarks/lse_merge.py --out results.json
"""

from __future__ import annotations

import argparse
import json

import torch
from fused_add_rmsnorm import time_variants, timers
from provenance import commit

from msa_kernels.triton_lse_merge import merge_by_lse, merge_by_lse_reference
from sglang_m3.inspect.decode_floor import peak_bandwidth

HEAD_DIM = 128


def partials(tokens: int, heads: int, gen: torch.Generator):
    """Two bf16 outputs and fp32 normalisers as ``_tokens_first`` hands them over."""
    outs = [torch.randn(1, heads, tokens, HEAD_DIM, device="cuda", generator=gen).to(torch.bfloat16)[0].transpose(0, 1)
            for _ in range(2)]
    lses = [(torch.randn(1, heads, tokens, device="cuda", generator=gen) * 3).reshape(heads, tokens).transpose(0, 1)[..., None]
            for _ in range(2)]
    return outs[0], lses[0], outs[1], lses[1]


def measure(tokens: int, heads: int, rate: float | None, time_eager, time_graph) -> dict:
    """One row; ``rate`` is the GPU's peak HBM bytes per second (None: no byte minimum)."""
    gen = torch.Generator(device="cuda").manual_seed(tokens + heads)
    parts = partials(tokens, heads, gen)
    row = {"tokens": tokens, "heads": heads, "bit_identical": torch.equal(merge_by_lse(*parts), merge_by_lse_reference(*parts))}
    if rate is not None:
        row["byte_minimum_us"] = 1e6 * 3 * tokens * heads * HEAD_DIM * 2 / rate
    return time_variants(row, {"torch": lambda: merge_by_lse_reference(*parts), "fused": lambda: merge_by_lse(*parts)},
                         time_eager, time_graph)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for the rows")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 8192], help="new tokens per chunk")
    parser.add_argument("--heads", type=int, nargs="+", default=[64, 32], help="query heads per GPU (TP1, TP2)")
    args = parser.parse_args()
    time_eager, time_graph = timers()
    rate = peak_bandwidth(torch.cuda.get_device_name())
    rows = []
    for heads in args.heads:
        for tokens in args.tokens:
            rows.append(measure(tokens, heads, rate, time_eager, time_graph))
            print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump({"gpu": torch.cuda.get_device_name(), "commit": commit(), "head_dim": HEAD_DIM, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
