"""Dense-layer prefill attention at M3 shapes: SGLang's Triton extend kernel against torch SDPA.

M3's dense layers (3 of 60 in the real model, 1 of 4 in the mid-size benchmark model) attend
every earlier token. Under chunked prefill each chunk of new tokens attends the cached prefix
plus itself causally (lower-right aligned). This times one chunk at several prefix lengths, and a
whole prompt as the sum of its chunks, for SGLang's Triton extend kernel (what SGLang's ``triton``
attention backend runs) and for each SDPA backend torch offers on the GPU (cuDNN,
FlashAttention, memory-efficient) and for the plugin's path (``sglang_m3.msa.dense_prefill``:
cuDNN square causal on the first chunk, prefix and chunk as two cuDNN calls merged by
log-sum-exp after it), with GQA (64 query heads over 4 KV heads, head dim 128, bf16).

    scripts/gpu/run.sh exec python benchmarks/dense_prefill.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

HEADS, KV_HEADS, HEAD_DIM = 64, 4, 128
SDPA_BACKENDS = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}


def time_ms(fn, iters: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def sdpa_chunk(backend, q, k_all, v_all):
    """q [chunk, H, D]; k/v_all [prefix + chunk, Hkv, D]; lower-right causal."""
    qt, kt, vt = q.transpose(0, 1)[None], k_all.transpose(0, 1)[None], v_all.transpose(0, 1)[None]
    mask = causal_lower_right(q.shape[0], k_all.shape[0])
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True, scale=HEAD_DIM**-0.5)


def triton_chunk(q, k_new, v_new, k_buf, v_buf, prefix: int):
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    chunk = q.shape[0]
    dev = q.device
    out = torch.empty_like(q)
    extend_attention_fwd(
        q, k_new, v_new, out, k_buf, v_buf,
        torch.tensor([0, chunk], dtype=torch.int32, device=dev),
        torch.tensor([0, prefix], dtype=torch.int32, device=dev),
        torch.arange(prefix, dtype=torch.int64, device=dev),
        None, True, None, chunk, 1.0, 1.0, sm_scale=HEAD_DIM**-0.5, page_size=1, extend_seq_lens_cpu=[chunk],
    )
    return out


def split_chunk(q, k_all, v_all):
    """The plugin's path: a chunk after a prefix as two cuDNN calls merged by log-sum-exp."""
    from sglang_m3.msa.dense_prefill import causal_sdpa

    return causal_sdpa(q, k_all, v_all, HEAD_DIM**-0.5)


def chunk_attentions(k_cache, v_cache, chunk: int) -> dict:
    """Each implementation as ``(q, prefix) -> [chunk, H, D]``: the chunk of new tokens at ``prefix``
    attending the cache up to its own end."""

    def visible(prefix):
        return k_cache[: prefix + chunk], v_cache[: prefix + chunk]

    def new(prefix):
        return k_cache[prefix:prefix + chunk], v_cache[prefix:prefix + chunk]

    attentions = {"sglang_triton_extend": lambda q, prefix: triton_chunk(q, *new(prefix), k_cache, v_cache, prefix)}
    for name, backend in SDPA_BACKENDS.items():
        attentions[name] = lambda q, prefix, b=backend: sdpa_chunk(b, q, *visible(prefix))[0].transpose(0, 1)
    attentions["plugin_prefix_split"] = lambda q, prefix: split_chunk(q, *visible(prefix))
    return attentions


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--prompt", type=int, default=131072)
    args = parser.parse_args(argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    total = args.prompt
    k_cache = torch.randn(total, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q_all = torch.randn(total, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    attentions = chunk_attentions(k_cache, v_cache, args.chunk)
    # check agreement with SGLang's kernel on one chunk with a prefix before timing
    prefix = min(total - args.chunk, 3 * args.chunk)
    q = q_all[prefix:prefix + args.chunk]
    ref = attentions["sglang_triton_extend"](q, prefix)
    errors = {}
    for name, attend in attentions.items():
        if name == "sglang_triton_extend":
            continue
        try:
            errors[name] = float((attend(q, prefix).float() - ref.float()).abs().max())
        except RuntimeError as error:
            errors[name] = f"unsupported: {str(error).splitlines()[0][:200]}"
    print("max |impl - triton| on one chunk:", errors, flush=True)
    timed = [name for name in attentions if not isinstance(errors.get(name), str)]
    rows, sums = [], {name: 0.0 for name in timed}
    for prefix in range(0, total, args.chunk):
        q = q_all[prefix:prefix + args.chunk]
        row = {"prefix": prefix, "chunk": args.chunk}
        for name in timed:
            row[name] = time_ms(lambda attend=attentions[name]: attend(q, prefix))
            sums[name] += row[name]
        rows.append(row)
        print(row, flush=True)
    result = {"gpu": torch.cuda.get_device_name(0), "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16"},
              "prompt": total, "chunk": args.chunk, "whole_prompt_ms": sums, "max_abs_diff_vs_triton": errors, "rows": rows}
    print("whole prompt (sum of chunks) ms:", {k: round(v, 1) for k, v in sums.items()}, flush=True)
    with open(os.path.join(args.out, "dense_prefill.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
