"""Fused vs unfused per-layer attention ops of M3 on a CUDA GPU (issue 13, deliverable 3).

Per layer at real widths (TP1: 64 q heads, 4 KV heads, head dim 128, rotary 64, 4 index heads
of 128, bf16, theta 5e6), for T new tokens:

* ``sparse`` layer: q/k norms + partial RoPE of the main and index branches, then the K, V and
  index-key cache insert. Unfused = the model's torch path (``M3RMSNorm`` + ``PartialNeoxRotary``
  modules, ``.contiguous()`` copies of index_q and v, index assignments into the cache); when
  SGLang is importable, also ``unfused_sglang_store``: the same torch ops with K/V stored by
  SGLang's own ``store_cache`` kernel (what ``set_kv_buffer`` runs on CUDA) plus the index
  assignment. Fused = ``qk_norm_rope`` (one launch) + ``insert_kv_and_index`` (one launch).
* ``dense`` layer: the q/k norms + RoPE only (dense layers' KV store belongs to SGLang's backend).

Each variant is timed eagerly (CUDA events around 100 calls: what prefill pays, launch overhead
included) and as CUDA-graph replays (20 calls captured back to back: what decode pays). Outputs
are checked against the torch path before timing.

Usage: PYTHONPATH=kernels python benchmarks/fused_attn_ops.py --out DIR_OR_FILE.json [--tokens 1 16 64 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch

# provenance lives in this folder, which the next lines drop from sys.path
from provenance import commit  # noqa: E402
# This file's folder is first on sys.path: drop it so that packages resolve to the project's.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

from msa_kernels.triton_cache_insert import insert_kv_and_index  # noqa: E402
from msa_kernels.triton_qk_norm_rope import HeadGroup, qk_norm_rope  # noqa: E402
from sglang_m3.models.layers import M3RMSNorm, PartialNeoxRotary  # noqa: E402

HQ, HKV, D, ROT, HI, DI, THETA, EPS = 64, 4, 128, 64, 4, 128, 5e6, 1e-6
DTYPE = torch.bfloat16
EAGER_CALLS, GRAPH_CALLS, GRAPH_REPLAYS = 100, 20, 20


class Layer:
    """One layer's weights and inputs for T tokens, plus a KV cache with room for them."""

    def __init__(self, tokens: int, seed: int):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        randn = lambda *shape: torch.randn(*shape, generator=gen, device="cuda")  # noqa: E731
        self.tokens = tokens
        self.norms = []
        for dim in (D, D, DI, DI):
            norm = M3RMSNorm(dim, EPS, gemma=True).cuda()
            with torch.no_grad():
                norm.weight.copy_(0.3 * randn(dim))
            self.norms.append(norm)
        self.rotary = PartialNeoxRotary(ROT, THETA).cuda()
        self.qkv = randn(tokens, (HQ + 2 * HKV) * D).to(DTYPE)
        self.iq = randn(tokens, HI * DI).to(DTYPE)
        self.ik = randn(tokens, DI).to(DTYPE)
        self.positions = torch.randint(0, 131072, (tokens,), generator=gen, device="cuda")
        slots = max(2 * tokens, 4096)
        self.loc = torch.randperm(slots, generator=gen, device="cuda")[:tokens]
        self.k_buf = torch.zeros(slots, HKV, D, dtype=DTYPE, device="cuda")
        self.v_buf = torch.zeros(slots, HKV, D, dtype=DTYPE, device="cuda")
        self.ik_buf = torch.zeros(slots, DI, dtype=DTYPE, device="cuda")

    def split(self):
        q, k, v = self.qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
        t = self.tokens
        return q.view(t, HQ, D), k.view(t, HKV, D), v.view(t, HKV, D)

    # ------------------------------------------------------------ the model's torch path
    def torch_heads(self, sparse: bool):
        q, k, _ = self.split()
        qn, kn, iqn, ikn = self.norms
        q, k = self.rotary(self.positions, qn(q), kn(k))
        if not sparse:
            return q, k, None, None
        t = self.tokens
        iq = iqn(self.iq.view(t, HI, DI))
        ik = ikn(self.ik.view(t, 1, DI))
        iq, ik = self.rotary(self.positions, iq, ik)
        return q, k, iq.contiguous(), ik.view(t, DI)

    def torch_sparse(self):
        q, k, iq, ik = self.torch_heads(sparse=True)
        v = self.split()[2].contiguous()
        self.k_buf[self.loc] = k
        self.v_buf[self.loc] = v
        self.ik_buf[self.loc] = ik
        return q, k, iq, ik

    def torch_sparse_sglang_store(self, store_cache):
        q, k, iq, ik = self.torch_heads(sparse=True)
        v = self.split()[2].contiguous()
        row = HKV * D
        store_cache(k.view(-1, row), v.view(-1, row), self.k_buf.view(-1, row), self.v_buf.view(-1, row), self.loc,
                    row_bytes=row * 2, v_row_bytes=row * 2, size_limit=self.k_buf.shape[0])
        self.ik_buf[self.loc] = ik
        return q, k, iq, ik

    # ------------------------------------------------------------ the fused GPU path
    def fused_heads(self, sparse: bool):
        q, k, _ = self.split()
        t = self.tokens
        groups = [HeadGroup(q, self.norms[0].weight), HeadGroup(k, self.norms[1].weight)]
        if sparse:
            groups += [HeadGroup(self.iq.view(t, HI, DI), self.norms[2].weight), HeadGroup(self.ik.view(t, 1, DI), self.norms[3].weight)]
        outs = qk_norm_rope(self.positions, self.rotary.inv_freq, groups, rotary_dim=ROT, eps=EPS, weight_offset=1.0)
        return (*outs, None, None) if not sparse else outs

    def fused_sparse(self):
        q, k, iq, ik = self.fused_heads(sparse=True)
        insert_kv_and_index(self.loc, k, self.split()[2], ik.view(self.tokens, DI), self.k_buf, self.v_buf, self.ik_buf)
        return q, k, iq, ik


def sglang_store_cache():
    """SGLang's ``store_cache`` (the K/V store ``set_kv_buffer`` runs on CUDA), or (None, why)."""
    try:
        from sglang.kernels.ops.kvcache.kvcache import can_use_store_cache, store_cache

        if not can_use_store_cache(HKV * D * 2, HKV * D * 2):
            return None, "can_use_store_cache refused the row size"
        return store_cache, None
    except Exception as exc:  # noqa: BLE001 - any import/JIT failure means "not measured", reported as such
        return None, f"{type(exc).__name__}: {exc}"[:300]


def time_eager(fn) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(EAGER_CALLS):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / EAGER_CALLS


def time_graph(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(GRAPH_REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (GRAPH_REPLAYS * GRAPH_CALLS)


def max_bf16_error(got, want) -> float:
    """Largest |got - want| in units of 2^-7 of the head's largest magnitude (~bf16 ulps)."""
    scale = want.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    return ((got.float() - want.float()).abs() / (scale * 2.0**-7)).max().item()


def check(layer: Layer) -> dict:
    """Fused vs torch outputs (within 2 bf16 ulps of the head's scale, as the GPU tests), and the
    fused insert's cache against index assignment of the fused path's own k / v / index key.

    The caches are not compared across paths: a k element that rounds differently (the outputs
    may differ by under an ulp, measured 0.77 at T=8192) is stored differently, as it should be.
    """
    want = layer.torch_sparse()
    for b in (layer.k_buf, layer.v_buf, layer.ik_buf):
        b.zero_()
    got = layer.fused_sparse()
    fused_cache = [b.clone() for b in (layer.k_buf, layer.v_buf, layer.ik_buf)]
    for b in (layer.k_buf, layer.v_buf, layer.ik_buf):
        b.zero_()
    layer.k_buf[layer.loc] = got[1].reshape(layer.k_buf[layer.loc].shape)
    layer.v_buf[layer.loc] = layer.split()[2].reshape(layer.v_buf[layer.loc].shape)
    layer.ik_buf[layer.loc] = got[3].reshape(layer.ik_buf[layer.loc].shape)
    errors = [max_bf16_error(g.reshape(w.shape), w) for g, w in zip(got, want)]
    identical = sum((g.reshape(w.shape) == w).sum().item() for g, w in zip(got, want)) / sum(w.numel() for w in want)
    cache_equal = all(torch.equal(a, b) for a, b in zip(fused_cache, (layer.k_buf, layer.v_buf, layer.ik_buf)))
    if max(errors) > 2 or not cache_equal:
        raise SystemExit(f"fused path disagrees with the torch path: errors {errors} (ulps), cache equal {cache_equal}")
    return {"max_error_bf16_ulps": max(errors), "identical_fraction": identical, "cache_equal": cache_equal}


@torch.no_grad()  # as in the server: SGLang's custom ops run their CUDA function directly only without autograd
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file, or a directory for fused_attn_ops_<gpu>.json")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 8192])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    gpu = torch.cuda.get_device_name()
    store_cache, store_missing = sglang_store_cache()
    rows = []
    for tokens in args.tokens:
        layer = Layer(tokens, seed=tokens)
        row = {"tokens": tokens, "check": check(layer)}
        variants = {
            "sparse_fused": layer.fused_sparse,
            "sparse_unfused": layer.torch_sparse,
            "dense_fused": lambda: layer.fused_heads(sparse=False),
            "dense_unfused": lambda: layer.torch_heads(sparse=False),
        }
        if store_cache is not None:
            variants["sparse_unfused_sglang_store"] = lambda: layer.torch_sparse_sglang_store(store_cache)
        for name, fn in variants.items():
            row[name] = {"eager_us": time_eager(fn), "graph_us": time_graph(fn)}
        for kind in ("sparse", "dense"):
            for mode in ("eager_us", "graph_us"):
                row[f"{kind}_speedup_{mode[:-3]}"] = row[f"{kind}_unfused"][mode] / row[f"{kind}_fused"][mode]
        rows.append(row)
        print(
            f"T={tokens:5d}  sparse layer: fused {row['sparse_fused']['eager_us']:8.1f} us eager "
            f"{row['sparse_fused']['graph_us']:7.1f} us graph | unfused {row['sparse_unfused']['eager_us']:8.1f} / "
            f"{row['sparse_unfused']['graph_us']:7.1f} us | dense layer: fused {row['dense_fused']['graph_us']:6.1f} "
            f"unfused {row['dense_unfused']['graph_us']:6.1f} us graph | check {row['check']}",
            flush=True,
        )
    result = {
        "gpu": gpu,
        "commit": commit(),
        "widths": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "rotary_dim": ROT, "index_heads": HI, "index_head_dim": DI, "dtype": "bf16"},
        "sglang_store_cache": "measured" if store_cache is not None else f"not measured: {store_missing}",
        "rows": rows,
    }
    out = args.out
    if os.path.isdir(out):
        model = next((word.lower() for word in gpu.split() if re.fullmatch(r"[A-Z]+\d+[A-Z]*", word)), "gpu")
        out = os.path.join(out, f"fused_attn_ops_{model}.json")
    with open(out, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
