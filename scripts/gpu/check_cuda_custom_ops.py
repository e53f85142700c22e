"""On the lent GPU, in the harness: SGLang's norm, activation and rotary layers through the CUDA
forwards the harness routes them to (``M3_HARNESS_CUDA_CUSTOM_OPS``, on by default), against their
native torch forwards.

For each layer at the shapes an EAGLE3 draft of M3 and upstream's M3 run (hidden 6,144; 128-dim
heads, full and partial rotary) and at the GPU tests' tiny fp32 draft's rotary: the largest
difference of the two outputs, and each forward's time as a CUDA-graph replay. A routing that
changes what the layers compute, beyond the rounding of a different reduction order, must not
reach a benchmark: the script exits non-zero then.

    scripts/gpu/run.sh exec python3 scripts/gpu/check_cuda_custom_ops.py --out $OUT/custom_ops.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from e2e_gpu import commit  # noqa: E402
from msa_kernel_bench import graph_replay_us  # noqa: E402  (one graph-replay timer for every GPU script)

ROWS = (1, 4, 16)
BF16_TOLERANCE = dict(rtol=1.6e-2, atol=1.6e-2)  # one bf16 rounding apart (8 bits of mantissa)


def compare(name: str, rows: int, native, cuda) -> dict:
    """Run both forwards on fresh copies of the inputs; difference and times."""
    want = native()
    got = cuda()
    pairs = list(zip(want, got)) if isinstance(want, tuple) else [(want, got)]
    max_diff = max((w.float() - g.float()).abs().max().item() for w, g in pairs)
    close = all(torch.allclose(g.float(), w.float(), **BF16_TOLERANCE) for w, g in pairs)
    return {"op": name, "rows": rows, "max_abs_diff": max_diff, "close": close,
            "native_us": graph_replay_us(lambda i: native(), 1), "cuda_us": graph_replay_us(lambda i: cuda(), 1)}


def norm_cases(rows: int) -> list[dict]:
    from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm

    out = []
    for cls in (RMSNorm, GemmaRMSNorm):
        layer = cls(6144, eps=1e-6).cuda()
        layer.weight.data.normal_(0.0, 0.2 if cls is GemmaRMSNorm else 1.0)
        x = torch.randn(rows, 6144, device="cuda", dtype=torch.bfloat16)
        res = torch.randn_like(x)
        out.append(compare(cls.__name__, rows, lambda: layer.forward_native(x.clone()),
                           lambda: layer.forward_cuda(x.clone())))
        out.append(compare(cls.__name__ + "+residual", rows,
                           lambda: layer.forward_native(x.clone(), res.clone()),
                           lambda: layer.forward_cuda(x.clone(), res.clone())))
    return out


def activation_case(rows: int) -> dict:
    from sglang.srt.layers.activation import SiluAndMul

    layer = SiluAndMul()
    x = torch.randn(rows, 2 * 16384, device="cuda", dtype=torch.bfloat16)
    return compare("SiluAndMul", rows, lambda: layer.forward_native(x), lambda: layer.forward_cuda(x))


#: (name, head size, rotary dim, query heads, key heads, dtype): the mid-size EAGLE3 draft's full
#: rotary, upstream M3's partial one, and the GPU tests' tiny fp32 draft
ROPE_SHAPES = (
    ("draft", 128, 128, 64, 8, torch.bfloat16),
    ("upstream_m3_partial", 128, 64, 64, 4, torch.bfloat16),
    ("tiny_draft_fp32", 32, 32, 4, 2, torch.float32),
)


def rope_cases(rows: int) -> list[dict]:
    from sglang.srt.layers.rotary_embedding import get_rope

    out = []
    for name, head, rotary_dim, q_heads, kv_heads, dtype in ROPE_SHAPES:
        rope = get_rope(head, rotary_dim, 1 << 20, 5_000_000, is_neox_style=True, dtype=dtype).cuda()
        positions = torch.randint(0, 300_000, (rows,), device="cuda")
        q = torch.randn(rows, q_heads * head, device="cuda", dtype=dtype)
        k = torch.randn(rows, kv_heads * head, device="cuda", dtype=dtype)
        out.append(compare(f"RotaryEmbedding[{name}]", rows,
                           lambda: rope.forward_native(positions, q.clone(), k.clone()),
                           lambda: rope.forward_cuda(positions, q.clone(), k.clone())))
    return out


@torch.inference_mode()  # as the server runs: SGLang's custom ops skip the dispatcher only without grad
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON of every case")
    args = parser.parse_args()
    torch.manual_seed(0)
    cases = []
    for rows in ROWS:
        cases += norm_cases(rows) + [activation_case(rows)] + rope_cases(rows)
    for case in cases:
        print(f"{case['op']:36s} rows {case['rows']:3d}  native {case['native_us']:7.1f} us  "
              f"cuda {case['cuda_us']:6.1f} us  max diff {case['max_abs_diff']:.3g}  close {case['close']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "commit": commit(), "cases": cases}, indent=1))
    return 0 if all(c["close"] for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
