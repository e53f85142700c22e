"""Random paged MSA batches and their per-request reference results (for tests and benchmarks).

Builds what SGLang hands an MSA layer: K/V/index-key caches in pages of ``block_size`` slots,
handed out in a shuffled order (so a request's blocks are not contiguous), a ``req_to_token``
table, sequence and extend lengths, and the new tokens' q / index q rows packed request after
request. The reference result comes from :mod:`msa_kernels.reference`, one request at a time;
for a decode batch whose new tokens form draft trees (:meth:`PagedBatch.with_draft_trees`), one
token at a time, as the decode query at the end of its root-to-token path.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from msa_kernels.plan import DraftTree, draft_tree
from msa_kernels.reference import MSAParams, block_scores, msa_attention, quantize_index_keys


@dataclass
class PagedBatch:
    q: torch.Tensor  # [rows, Hq, D]
    iq: torch.Tensor  # [rows, Hkv, Di]
    k_cache: torch.Tensor  # [slots, Hkv, D]
    v_cache: torch.Tensor
    ik_cache: torch.Tensor  # [slots, 1, Di]
    req_to_token: torch.Tensor  # [batch, max_context] int32
    seq_lens: list[int]
    extend_lens: list[int]
    row_stride: int  # rows of q per request in decode layout (0: packed extend layout)
    ik_scale: torch.Tensor | None = None  # [slots] fp32 when ik_cache holds fp8 keys
    k_scale: float = 1.0  # per-layer scales when k_cache / v_cache hold fp8 (values = stored * scale)
    v_scale: float = 1.0
    # per request, the parent of each new token (-1 for token 0, the root) when they form a draft
    # tree; None: the new tokens are a chain (each follows the one before)
    parents: list[list[int]] | None = None

    def with_draft_trees(self, parents: list[list[int]]) -> PagedBatch:
        """The same decode batch with request ``b``'s new tokens forming the tree ``parents[b]``."""
        if not self.row_stride or set(self.extend_lens) != {self.row_stride}:
            raise ValueError(f"draft trees need a decode layout of {self.row_stride} new tokens in every request, got {self.extend_lens}")
        for b, tree in enumerate(parents):
            if len(tree) != self.extend_lens[b] or tree[0] != -1 or any(not 0 <= p < i for i, p in enumerate(tree) if i):
                raise ValueError(f"request {b}: parents {tree} are not a tree over its {self.extend_lens[b]} new tokens rooted at 0")
        return replace(self, parents=[list(tree) for tree in parents])

    def paths_of(self, b: int) -> list[list[int]]:
        """Request ``b``'s root-to-token path of every new token (itself last)."""
        paths: list[list[int]] = []
        for token, parent in enumerate(self.parents[b]):
            paths.append((paths[parent] if parent >= 0 else []) + [token])
        return paths

    def draft_tree(self) -> DraftTree:
        """The trees as the decode plan takes them (``row_stride`` rows per request)."""
        n = self.row_stride
        visible = torch.zeros(len(self.seq_lens) * n, n, dtype=torch.bool)
        slots = torch.zeros(len(self.seq_lens) * n, dtype=torch.int64)
        for b, (s, e) in enumerate(zip(self.seq_lens, self.extend_lens)):
            for token, path in enumerate(self.paths_of(b)):
                visible[b * n + token, path] = True
            slots[b * n : b * n + e] = self.req_to_token[b, s - e : s].cpu()
        device = self.req_to_token.device
        return draft_tree(visible.to(device), slots.to(device))

    def with_fp8_index_keys(self) -> PagedBatch:
        """The same batch with its index keys quantized to fp8 + per-token scales (NaN poison kept)."""
        keys, scales = quantize_index_keys(self.ik_cache)
        return replace(self, ik_cache=keys, ik_scale=scales.reshape(-1))

    def with_fp8_kv(self, k_scale: float = 1.0, v_scale: float = 1.0, dtype: torch.dtype = torch.float8_e4m3fn) -> PagedBatch:
        """The same batch with its main K/V stored as SGLang's fp8 KV pool stores them: ``x / scale``
        cast to ``dtype`` with ``.to`` (``set_kv_buffer``'s cast); NaN poison kept."""
        return replace(
            self,
            k_cache=(self.k_cache.float() / k_scale).to(dtype),
            v_cache=(self.v_cache.float() / v_scale).to(dtype),
            k_scale=k_scale,
            v_scale=v_scale,
        )

    def rows_of(self, b: int) -> torch.Tensor:
        """Rows of ``q`` that request ``b``'s new tokens occupy."""
        if self.row_stride:
            start = b * self.row_stride
        else:
            start = sum(self.extend_lens[:b])
        return torch.arange(start, start + self.extend_lens[b])


def make_paged_batch(
    seq_lens: list[int],
    extend_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    index_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    decode_q_len: int = 0,
    max_context: int | None = None,
    spare_pages: int = 3,
    generator: torch.Generator | None = None,
) -> PagedBatch:
    """A random batch; ``decode_q_len > 0`` lays q out as ``decode_q_len`` rows per request.

    Pages are shuffled; slots of unused pages and of the unused tail of each last page hold NaN
    (when the dtype has one) so that a kernel that reads past a sequence end cannot pass.
    """
    batch = len(seq_lens)
    max_context = max_context or max(seq_lens)
    pages_per_req = [(s + block_size - 1) // block_size for s in seq_lens]
    total_pages = sum(pages_per_req) + spare_pages
    order = torch.randperm(total_pages, generator=generator)
    slots = total_pages * block_size

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).to(device)

    k_cache, v_cache = rand(slots, num_kv_heads, head_dim), rand(slots, num_kv_heads, head_dim)
    ik_cache = rand(slots, 1, index_dim)
    req_to_token = torch.zeros(batch, max_context, dtype=torch.int32)
    poisoned = torch.ones(slots, dtype=torch.bool)
    next_page = 0
    for b, s in enumerate(seq_lens):
        pages = order[next_page : next_page + pages_per_req[b]]
        next_page += pages_per_req[b]
        token_slots = (pages[:, None] * block_size + torch.arange(block_size)[None, :]).reshape(-1)[:s]
        req_to_token[b, :s] = token_slots.to(torch.int32)
        poisoned[token_slots] = False
    if dtype.is_floating_point:
        for cache in (k_cache, v_cache, ik_cache):
            cache[poisoned.to(device)] = float("nan")
    rows = batch * decode_q_len if decode_q_len else sum(extend_lens)
    return PagedBatch(
        q=rand(rows, num_q_heads, head_dim),
        iq=rand(rows, num_kv_heads, index_dim),
        k_cache=k_cache,
        v_cache=v_cache,
        ik_cache=ik_cache,
        req_to_token=req_to_token.to(device),
        seq_lens=list(seq_lens),
        extend_lens=list(extend_lens),
        row_stride=decode_q_len,
    )


def reference_request(batch: PagedBatch, b: int, params: MSAParams, scale: float | None = None):
    """(output, selected blocks, block scores) of request ``b`` from the torch reference, in fp32.

    Computed on the batch's device (a GPU makes long requests affordable), returned on the CPU.
    Draft trees: every token over the request's prefix and its path, at ``prefix + depth``
    (scores padded with -inf to the longest token's blocks).
    """
    if batch.parents is None:
        s, e = batch.seq_lens[b], batch.extend_lens[b]
        return _reference_rows(batch, batch.req_to_token[b, :s].long(), batch.rows_of(b), torch.arange(s - e, s), params, scale)
    prefix = batch.seq_lens[b] - batch.extend_lens[b]
    row = batch.req_to_token[b].long()
    results = [
        _reference_rows(batch, torch.cat((row[:prefix], row[prefix + torch.tensor(path, device=row.device)])), batch.rows_of(b)[token : token + 1],
                        torch.tensor([prefix + len(path) - 1]), params, scale)
        for token, path in enumerate(batch.paths_of(b))
    ]
    width = max(scores.shape[-1] for _, _, scores in results)
    scores = [torch.nn.functional.pad(x, (0, width - x.shape[-1]), value=float("-inf")) for _, _, x in results]
    return torch.cat([out for out, _, _ in results]), torch.cat([sel for _, sel, _ in results]), torch.cat(scores)


def _reference_rows(batch: PagedBatch, slots: torch.Tensor, rows: torch.Tensor, q_pos: torch.Tensor, params, scale):
    """The reference for query ``rows`` at ``q_pos`` over the keys in cache ``slots`` (positions 0 ..)."""
    device = batch.q.device
    slots, rows = slots.to(device), rows.to(device)

    def take(x):
        return x.detach().float()

    k = take(batch.k_cache)[slots]
    v = take(batch.v_cache)[slots]
    if batch.ik_scale is None:
        ik, ik_scale = take(batch.ik_cache)[slots, 0], None
    else:
        ik, ik_scale = batch.ik_cache.detach()[slots, 0], batch.ik_scale[slots]
    q = take(batch.q)[rows]
    iq = take(batch.iq)[rows]
    q_pos = q_pos.to(device)
    out, selected = msa_attention(q, k, v, iq, ik, q_pos, params, scale, ik_scale, batch.k_scale, batch.v_scale)
    return out.cpu(), selected.cpu(), block_scores(iq, ik, q_pos, params.block_size, ik_scale).cpu()


@dataclass
class Agreement:
    """How a kernel's results compare with the reference over a whole batch."""

    rows: int  # (token, kv head) selections compared
    tie_swaps: int  # selections that differ only by blocks whose scores are near-ties
    max_rel_err: float  # largest ||out - ref|| / ||ref|| over (token, kv head) groups with equal selections
    failures: list[str]

    @property
    def ok(self) -> bool:
        return not self.failures


def compare_with_reference(
    batch: PagedBatch,
    params: MSAParams,
    out: torch.Tensor,
    selected: torch.Tensor,
    rel_tol: float,
    tie_tol: float = 1e-3,
    scale: float | None = None,
) -> Agreement:
    """Compare selections as sets (swaps allowed only at near-ties) and outputs where selections agree.

    ``selected`` is ``[rows, kv_heads, topk]`` in the batch's row layout (SGLang's
    ``[kv_heads, rows, topk]`` must be transposed first). A swap counts as a near-tie when every
    differing block's reference score is within ``tie_tol`` (relative) of the k-th chosen score.
    """
    failures: list[str] = []
    rows = swaps = 0
    worst = 0.0
    group = out.shape[1] // selected.shape[1]
    for b in range(len(batch.seq_lens)):
        ref_out, ref_sel, scores = reference_request(batch, b, params, scale)
        mine_sel = selected[batch.rows_of(b)].long().cpu()
        mine_out = out[batch.rows_of(b)].float().cpu()
        for i in range(ref_sel.shape[0]):
            for h in range(ref_sel.shape[1]):
                rows += 1
                want = {int(x) for x in ref_sel[i, h] if x >= 0}
                got = {int(x) for x in mine_sel[i, h] if x >= 0}
                if sorted(got) != [int(x) for x in mine_sel[i, h] if x >= 0] or (mine_sel[i, h] >= 0).sum() != len(got):
                    failures.append(f"req {b} token {i} head {h}: ids not ascending-unique {mine_sel[i, h].tolist()}")
                    continue
                if got != want:
                    row_scores = scores[i, h]
                    kth = min(float(row_scores[j]) for j in want) if want else float("-inf")
                    near = all(abs(float(row_scores[j]) - kth) <= tie_tol * max(1.0, abs(kth)) for j in got ^ want)
                    if not near or len(got) != len(want):
                        failures.append(f"req {b} token {i} head {h}: chose {sorted(got)}, reference {sorted(want)}")
                    swaps += 1
                    continue
                heads = slice(h * group, (h + 1) * group)
                diff = (mine_out[i, heads] - ref_out[i, heads]).norm() / ref_out[i, heads].norm().clamp_min(1e-6)
                worst = max(worst, float(diff))
                if not torch.isfinite(mine_out[i, heads]).all() or diff > rel_tol:
                    failures.append(f"req {b} token {i} head {h}: output rel err {float(diff):.3g} > {rel_tol}")
    return Agreement(rows=rows, tie_swaps=swaps, max_rel_err=worst, failures=failures[:20])
