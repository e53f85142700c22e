"""M3's router logits on the GPU: the fp32 linear against the GEMM over 16-bit parts of the weight.

At M3's widths (hidden 6,144, 128 experts) and a random fp32 router weight (three bf16 parts), for
the row counts a decode step, a chain-of-3 verify, a batch of 16 and prefill chunks give the
router: each path's time as a CUDA-graph replay, and the largest difference of the logits from a
float64 reference, for both paths (the parts' error must not exceed the fp32 linear's by more than
a rounding). JSON to ``--out``.

    scripts/gpu/run.sh exec python3 benchmarks/router_gemm.py --out $OUT/router_gemm.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(__file__))
from e2e_gpu import commit  # noqa: E402
from msa_kernel_bench import graph_replay_us  # noqa: E402

from sglang_m3.models.moe_routing import add_router_parameters, prepare_half_router, router_logits  # noqa: E402

EXPERTS, HIDDEN = 128, 6144
ROWS = (1, 4, 16, 64, 8192, 32768)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="result JSON")
    args = parser.parse_args()
    torch.manual_seed(0)
    block = torch.nn.Module()
    add_router_parameters(block, SimpleNamespace(num_experts=EXPERTS, hidden_size=HIDDEN, use_routing_bias=False))
    block.cuda()
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(EXPERTS, HIDDEN, device="cuda") * HIDDEN**-0.5)
    assert prepare_half_router(block, torch.bfloat16)
    parts = block.gate_half.shape[0] // EXPERTS
    rows = []
    with torch.inference_mode():
        for tokens in ROWS:
            x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
            reference = x.double() @ block.gate.weight.double().t()
            fp32 = router_logits(block.gate, x)
            split = router_logits(block.gate, x, block.gate_half)
            row = {
                "tokens": tokens,
                "fp32_linear_us": graph_replay_us(lambda i: router_logits(block.gate, x), 1),
                "bf16_parts_us": graph_replay_us(lambda i: router_logits(block.gate, x, block.gate_half), 1),
                "fp32_linear_max_err": (fp32.double() - reference).abs().max().item(),
                "bf16_parts_max_err": (split.double() - reference).abs().max().item(),
                "max_abs_logit": reference.abs().max().item(),
            }
            rows.append(row)
            print(f"T={tokens:6d}  fp32 linear {row['fp32_linear_us']:8.1f} us  bf16 x{parts} parts {row['bf16_parts_us']:7.1f} us  "
                  f"max err {row['fp32_linear_max_err']:.2e} / {row['bf16_parts_max_err']:.2e}", flush=True)
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump({"gpu": torch.cuda.get_device_name(), "commit": commit(), "experts": EXPERTS, "hidden": HIDDEN, "parts": parts, "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
