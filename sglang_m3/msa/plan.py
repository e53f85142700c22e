"""Per-batch MSA metadata: which cache slots and query positions each request has.

Built once per forward from SGLang's ``ForwardBatch`` and reused by every sparse layer. The
query positions are absolute (``prefix_len + i`` for extend, ``seq_len - 1`` for decode,
``seq_len + i`` for draft ``i`` of speculative verification), which is what makes chunked
prefill with a prefix that is not a multiple of the block size, and several query tokens per
request (speculative verification), come out right. A verify batch of draft trees plans every
draft as its own one-query request over its root-to-draft path (:mod:`sglang_m3.msa.verify_tree`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_m3.msa.batch_shape import attended_lens, uniform_query_shape
from sglang_m3.msa.verify_tree import draft_paths, draft_visibility, is_draft_tree


@dataclass(frozen=True)
class RequestPlan:
    query_start: int
    query_len: int
    kv_slots: torch.Tensor  # [kv_len] cache slot of every token 0 .. kv_len-1
    query_positions: torch.Tensor  # [query_len] absolute positions of this request's queries


@dataclass(frozen=True)
class MSABatchPlan:
    requests: tuple[RequestPlan, ...]

    @property
    def num_queries(self) -> int:
        return sum(r.query_len for r in self.requests)


def plan_batch(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
) -> MSABatchPlan:
    """Plan a batch whose request ``i`` has ``seq_lens[i]`` cached tokens, the last ``query_lens[i]`` of them queried."""
    requests = []
    start = 0
    for pool_index, seq_len, query_len in zip(req_pool_indices.tolist(), seq_lens.tolist(), query_lens.tolist()):
        if query_len > seq_len:
            raise ValueError(f"a request queries {query_len} tokens but holds only {seq_len}")
        positions = torch.arange(seq_len - query_len, seq_len, device=req_to_token.device)
        requests.append(RequestPlan(start, query_len, req_to_token[pool_index, :seq_len], positions))
        start += query_len
    return MSABatchPlan(tuple(requests))


def plan_tree_verify(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: list[int],
    visibilities: list[torch.Tensor],
) -> MSABatchPlan:
    """Plan a verify batch of draft trees: each verify token is a one-query request.

    Request ``i``'s token ``j`` (query row ``i * q_len + j``, slot ``req_to_token[.., prefix + j]``)
    attends the prefix followed by the tokens of its root-to-token path, at position
    ``prefix + depth``: exactly the key sequence a decode query at that position would see once
    the path is accepted, so it scores and selects blocks from those keys alone.
    """
    requests = []
    for b, (pool_index, prefix, visibility) in enumerate(zip(req_pool_indices.tolist(), prefix_lens, visibilities)):
        q_len = visibility.shape[0]
        row = req_to_token[pool_index]
        for token, path in enumerate(draft_paths(visibility)):
            slots = torch.cat((row[:prefix], row[prefix + torch.tensor(path, device=row.device)]))
            position = torch.tensor([prefix + len(path) - 1], device=row.device)
            requests.append(RequestPlan(b * q_len + token, 1, slots, position))
    return MSABatchPlan(tuple(requests))


def plan_forward_batch(forward_batch, req_to_token: torch.Tensor) -> MSABatchPlan:
    """Plan from SGLang's ``ForwardBatch``: decode, speculative verify or extend.

    Decode queries the last token of ``seq_lens``; verify queries its drafts, which follow the
    ``seq_lens`` tokens (see :mod:`sglang_m3.msa.batch_shape`), as a chain or as a draft tree;
    extend the new tokens.
    """
    shape = uniform_query_shape(forward_batch, trees=True)
    if shape is None:
        query_lens = forward_batch.extend_seq_lens
        if query_lens is None:
            raise ValueError(f"forward_batch.extend_seq_lens is None in a {forward_batch.forward_mode} batch: the new tokens per request are unknown")
        return plan_batch(req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens, query_lens)
    q_len, queries_in_seq_lens = shape
    if not queries_in_seq_lens and is_draft_tree(forward_batch.spec_info):
        prefix_lens = forward_batch.seq_lens.tolist()
        visibilities = draft_visibility(forward_batch.spec_info.custom_mask, prefix_lens, q_len)
        return plan_tree_verify(req_to_token, forward_batch.req_pool_indices, prefix_lens, visibilities)
    kv_lens = attended_lens(forward_batch.seq_lens, q_len, queries_in_seq_lens)
    return plan_batch(req_to_token, forward_batch.req_pool_indices, kv_lens, torch.full_like(kv_lens, q_len))
