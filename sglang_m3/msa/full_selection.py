"""Extend requests whose every query selects every visible block: dense causal attention, exactly.

MSA (``msa_kernels.reference``) lets a query at position ``p`` see the blocks ``0 .. p // B``
and chooses the top-k of them, after forcing in its ``local_blocks`` newest and ``init_blocks``
first visible blocks; when at most ``topk`` blocks are visible all of them are chosen, whatever
the index scores (forced blocks are visible blocks, so they change nothing here). The chosen
blocks' keys at ``j <= p`` are then every key at ``j <= p``: the query attends densely and
causally. A request holding ``seq_len`` tokens (prefix and this extend's new tokens) has its
last query at ``seq_len - 1``, which sees the most blocks, ``ceil(seq_len / B)``; so the whole
extend is dense causal attention exactly when ``ceil(seq_len / B) <= topk``, i.e. ``seq_len <=
topk * B`` (2,048 tokens on M3: block 128, top-16). The condition is per request and per chunk:
the early chunks of a long prompt qualify while their ``seq_len`` is within the limit.

Such requests skip the index scan, the top-k and the query-major sparse kernel and run one
per-request SDPA call (:func:`sglang_m3.msa.dense_prefill.causal_sdpa`: cuDNN or
FlashAttention, chosen by the request's shape). The cache writes (K, V and
the index keys, which later decode steps score) are unchanged: the backend stores before it
attends. Keys and values are read back from the cache at the request's slots (the values the
sparse kernels would read, fp8 caches and their per-layer scales included), gathered once per
layer for all such requests of the batch.

The decision reads host-side lengths the extend plan already reads (no new host sync); decode
and verify (graphed) never take this path. ``SGLANG_M3_FULL_SELECTION_DENSE=0`` turns it off
(A/B measurements); ``1``, the default, keeps it on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from msa_kernels.reference import MSAParams, num_blocks

from sglang_m3.env_switch import env_choice
from sglang_m3.msa.dense_prefill import causal_sdpa

#: Environment switch: ``1`` (default) or ``0`` (every extend request on the sparse kernels).
ENV = "SGLANG_M3_FULL_SELECTION_DENSE"


def full_selection_dense_enabled() -> bool:
    return env_choice(ENV, ("1", "0"), "'1' (dense attention where MSA selects every block) or '0'") == "1"


def selects_every_block(seq_len: int, params: MSAParams) -> bool:
    """Whether every query of a request holding ``seq_len`` tokens (queries included) selects
    all its visible blocks, so that its MSA is dense causal attention."""
    return num_blocks(seq_len, params.block_size) <= params.topk


def full_selection_limit(params: MSAParams) -> int:
    """The most tokens a request may hold for :func:`selects_every_block` (2,048 on M3)."""
    return params.topk * params.block_size


@dataclass(frozen=True)
class DenseSpan:
    """One request attended densely: its rows of ``q`` and its keys in the batch's gathered slots."""

    q_start: int
    q_len: int
    kv_start: int
    kv_len: int  # prefix + q_len


@dataclass(frozen=True)
class FullSelectionPlan:
    """The dense requests of one extend batch, and where the others' rows are.

    ``sparse`` lists the batch indices of the requests left to the sparse kernels (their plan is
    the caller's); ``sparse_rows`` their rows of ``q``, request after request (None when empty).
    """

    spans: tuple[DenseSpan, ...]
    slots: torch.Tensor  # [sum kv_len] cache slots of the dense requests' tokens, request after request
    sparse: tuple[int, ...]
    sparse_rows: torch.Tensor | None

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, scale: float,
        k_scale: float = 1.0, v_scale: float = 1.0,
    ) -> None:
        """Dense causal attention of the dense requests' rows of ``q [rows, Hq, D]`` into ``out``.

        ``k_cache`` / ``v_cache [slots, Hkv, D]`` hold the requests' tokens (written before);
        their values are the stored ones times ``k_scale`` / ``v_scale`` (an fp8 cache's scales).
        """
        keys, values = _read(k_cache, self.slots, q.dtype, k_scale), _read(v_cache, self.slots, q.dtype, v_scale)
        for span in self.spans:
            if span.q_start >= q.shape[0]:
                break  # a padded batch hands over only its real tokens
            rows = slice(span.q_start, span.q_start + span.q_len)
            kv = slice(span.kv_start, span.kv_start + span.kv_len)
            out[rows] = causal_sdpa(q[rows], keys[kv], values[kv], scale)


def _read(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """The cached values at ``slots`` in ``dtype`` (SDPA wants one dtype), times ``scale``."""
    values = cache[slots].to(dtype)
    if scale != 1.0:
        values.mul_(scale)
    return values


def plan_full_selection(
    params: MSAParams,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: list[int],
    extend_lens: list[int],
) -> FullSelectionPlan | None:
    """The plan of an extend batch (host lengths, rows packed request after request), or None
    when no request qualifies (the batch stays whole on the sparse kernels).

    Device work only, besides two small host-to-device copies that do not wait for the stream.
    """
    dense = [b for b, s in enumerate(seq_lens) if selects_every_block(s, params)]
    if not dense:
        return None
    device = req_to_token.device
    starts = [0]
    for e in extend_lens:
        starts.append(starts[-1] + e)
    spans, which, columns, kv_start = [], [], [], 0
    for b in dense:
        spans.append(DenseSpan(starts[b], extend_lens[b], kv_start, seq_lens[b]))
        which.append(torch.full((seq_lens[b],), b, dtype=torch.int64))
        columns.append(torch.arange(seq_lens[b], dtype=torch.int64))
        kv_start += seq_lens[b]
    index = torch.stack((torch.cat(which), torch.cat(columns))).to(device, non_blocking=True)
    rows_of_tokens = req_pool_indices.to(device).long()[index[0]]
    slots = req_to_token[rows_of_tokens, index[1]].long()
    chosen = set(dense)
    sparse = tuple(b for b in range(len(seq_lens)) if b not in chosen)
    sparse_rows = None
    if sparse:
        rows = torch.cat([torch.arange(starts[b], starts[b + 1], dtype=torch.int64) for b in sparse])
        sparse_rows = rows.to(device, non_blocking=True)
    return FullSelectionPlan(tuple(spans), slots, sparse, sparse_rows)
