"""Block-selection quality of fp8 (e4m3, per-token scale) index keys against bf16 ones (CPU).

For M3's index geometry (4 index heads x 128 dims, blocks of 128 tokens, top-16 with the
query's own block forced, block score = max over the block's visible tokens, one selection per
index head), the bf16 selection comes from the torch reference on bf16 keys and the fp8 one from
the same reference on the same keys quantized as the KV pool stores them
(``msa_kernels.reference.quantize_index_keys``). Queries are bf16 in both. Reported per case and
context length, over (query, head) selections:

* ``recall``: |fp8 set & bf16 set| / |bf16 set| (the forced own block included);
* ``ranked_recall``: the same over the blocks chosen by score only (forced block left out);
* ``identical``: share of selections that are the same set;
* ``score_loss``: mean over selections of (sum of the bf16 block scores of the bf16 set minus
  that of the fp8 set) / (sum of the bf16 set's |scores|): how much score the swaps give up;
* ``bf16_recall_vs_fp32``: for scale, the recall of the bf16 selection against fp32 keys and
  queries, the rounding bf16 already costs.

Cases: ``random`` (i.i.d. normal keys and queries, every block a near-tie: the worst case),
``planted`` (each head's queries share a direction, 8 blocks per head hold 4 keys near it),
``smooth`` (keys drift slowly along the sequence, AR(1) with 0.995 correlation, queries drawn
near earlier keys), ``rope`` (random unit-RMS keys/queries with M3's NeoX partial RoPE on the
first 64 dims, theta 5e6), ``outliers`` (random keys whose per-token magnitude spans 0.05x-20x).

    python benchmarks/index_fp8_quality.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

# provenance lives in this folder, which the next lines drop from sys.path
from provenance import commit  # noqa: E402
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

from msa_kernels.reference import MSAParams, block_scores, quantize_index_keys, select_blocks  # noqa: E402

HEADS, DIM, BLOCK, TOPK = 4, 128, 128, 16
PARAMS = MSAParams(block_size=BLOCK, topk=TOPK, local_blocks=1, init_blocks=0)
K = 1024


def _unit_rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _rope(x: torch.Tensor, pos: torch.Tensor, rotary: int = 64, theta: float = 5e6) -> torch.Tensor:
    half = rotary // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float64) / half)
    angle = pos.double()[:, None] * freq[None, :]
    cos, sin = angle.cos().float(), angle.sin().float()
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    a, b, rest = x[..., :half], x[..., half:rotary], x[..., rotary:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)


def make_case(case: str, length: int, q_pos: torch.Tensor, gen: torch.Generator):
    """(iq [n, heads, dim], ik [length, dim]) in float32 before the bf16 cast."""
    n = q_pos.numel()
    iq = _unit_rms(torch.randn(n, HEADS, DIM, generator=gen))
    if case == "random":
        ik = _unit_rms(torch.randn(length, DIM, generator=gen))
    elif case == "planted":
        # each head's queries share a direction; 8 blocks per head hold 4 keys close to it
        ik = _unit_rms(torch.randn(length, DIM, generator=gen))
        directions = torch.randn(HEADS, DIM, generator=gen)
        iq = _unit_rms(directions + 0.5 * torch.randn(n, HEADS, DIM, generator=gen))
        for h in range(HEADS):
            blocks = torch.randperm(int(q_pos.min()) // BLOCK, generator=gen)[:8]
            for blk in blocks.tolist():
                tokens = blk * BLOCK + torch.randperm(BLOCK, generator=gen)[:4]
                ik[tokens] = _unit_rms(directions[h] + 0.5 * torch.randn(4, DIM, generator=gen))
    elif case == "smooth":
        noise = torch.randn(length, DIM, generator=gen)
        ik = torch.empty(length, DIM)
        ik[0] = noise[0]
        rho = 0.995
        for j in range(1, length):  # AR(1) drift along the sequence
            ik[j] = rho * ik[j - 1] + (1 - rho**2) ** 0.5 * noise[j]
        ik = _unit_rms(ik)
        anchors = torch.randint(0, int(q_pos.min()), (n, HEADS), generator=gen)
        iq = _unit_rms(ik[anchors] + 0.7 * torch.randn(n, HEADS, DIM, generator=gen))
    elif case == "rope":
        ik = _rope(_unit_rms(torch.randn(length, DIM, generator=gen)), torch.arange(length))
        iq = _rope(iq, q_pos)
    elif case == "outliers":
        magnitude = torch.exp(torch.empty(length).uniform_(-3.0, 3.0, generator=gen))
        ik = _unit_rms(torch.randn(length, DIM, generator=gen)) * magnitude[:, None]
    else:
        raise ValueError(f"unknown case {case!r}")
    return iq, ik


def _recall(want: torch.Tensor, got: torch.Tensor) -> float:
    hits = total = 0
    for w, g in zip(want.reshape(-1, TOPK).tolist(), got.reshape(-1, TOPK).tolist()):
        w, g = {b for b in w if b >= 0}, {b for b in g if b >= 0}
        hits += len(w & g)
        total += len(w)
    return hits / total


def compare(iq: torch.Tensor, ik: torch.Tensor, q_pos: torch.Tensor) -> dict:
    iq16, ik16 = iq.to(torch.bfloat16), ik.to(torch.bfloat16)
    ref_scores = block_scores(iq16, ik16, q_pos, BLOCK)
    ref = select_blocks(ref_scores, q_pos, PARAMS)
    keys, scales = quantize_index_keys(ik16)
    fp8 = select_blocks(block_scores(iq16, keys, q_pos, BLOCK, scales), q_pos, PARAMS)
    exact = select_blocks(block_scores(iq, ik, q_pos, BLOCK), q_pos, PARAMS)
    own = (q_pos // BLOCK)[:, None, None]
    hits = ranked_hits = total = ranked_total = identical = 0
    loss = []
    for i in range(ref.shape[0]):
        for h in range(HEADS):
            want = {int(b) for b in ref[i, h] if b >= 0}
            got = {int(b) for b in fp8[i, h] if b >= 0}
            forced = {int(own[i, 0, 0])}
            hits += len(want & got)
            total += len(want)
            ranked_hits += len((want & got) - forced)
            ranked_total += len(want - forced)
            identical += want == got
            row = ref_scores[i, h]
            ranked_want, ranked_got = sorted(want - forced), sorted(got - forced)
            denominator = float(row[ranked_want].abs().sum()) or 1.0
            loss.append((float(row[ranked_want].sum()) - float(row[ranked_got].sum())) / denominator)
    selections = ref.shape[0] * HEADS
    return {
        "selections": selections,
        "recall": hits / total,
        "ranked_recall": ranked_hits / max(1, ranked_total),
        "identical": identical / selections,
        "score_loss": sum(loss) / len(loss),
        "max_score_loss": max(loss),
        "bf16_recall_vs_fp32": _recall(exact, ref),
    }


CASES = ("random", "planted", "smooth", "rope", "outliers")
LENGTHS = (8 * K, 32 * K, 64 * K)


def run(queries: int, seeds: int, lengths=LENGTHS, cases=CASES) -> list[dict]:
    rows = []
    for case in cases:
        for length in lengths:
            parts = []
            for seed in range(seeds):
                gen = torch.Generator().manual_seed(seed)
                # decode-like queries in the last 4K tokens, each seeing every earlier block
                q_pos = length - 1 - torch.randperm(min(4 * K, length // 2), generator=gen)[:queries]
                iq, ik = make_case(case, length, q_pos, gen)
                parts.append(compare(iq, ik, q_pos))
            n = sum(p["selections"] for p in parts)
            row = {"case": case, "L": length, "selections": n}
            for key in ("recall", "ranked_recall", "identical", "score_loss", "bf16_recall_vs_fp32"):
                row[key] = sum(p[key] * p["selections"] for p in parts) / n
            row["min_seed_recall"] = min(p["recall"] for p in parts)
            row["max_score_loss"] = max(p["max_score_loss"] for p in parts)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def write_markdown(path: str, meta: dict, rows: list[dict]) -> None:
    lines = [
        "# fp8 index keys: block-selection quality against bf16",
        "",
        f"Measured on the CPU with the torch reference, commit {meta['commit']}, torch {meta['torch']}; "
        f"{meta['queries']} queries x {HEADS} index heads x {meta['seeds']} seeds per row; "
        f"M3 index geometry ({HEADS} heads x {DIM} dims, blocks of {BLOCK}, top-{TOPK}, own block forced). "
        "Method and cases: `benchmarks/index_fp8_quality.py`.",
        "",
        "| case | L | selections | recall | ranked recall | identical sets | score loss (mean / max) | bf16 recall vs fp32 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['L'] // K}K | {r['selections']} | {r['recall']:.4f} | {r['ranked_recall']:.4f} | "
            f"{r['identical']:.3f} | {r['score_loss']:.2e} / {r['max_score_loss']:.2e} | {r['bf16_recall_vs_fp32']:.4f} |"
        )
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for index_fp8_quality.json and .md")
    parser.add_argument("--queries", type=int, default=32, help="query positions per context and seed")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--commit", default=commit(), help="commit of the benchmarked code (default: M3_COMMIT, else HEAD)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    start = time.time()
    rows = run(args.queries, args.seeds)
    meta = {"commit": args.commit, "torch": torch.__version__, "queries": args.queries, "seeds": args.seeds,
            "seconds": round(time.time() - start, 1), "heads": HEADS, "dim": DIM, "block": BLOCK, "topk": TOPK}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "index_fp8_quality.json"), "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    write_markdown(os.path.join(args.out, "index_fp8_quality.md"), meta, rows)


if __name__ == "__main__":
    main()
