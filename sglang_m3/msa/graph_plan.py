"""Decode / verify kernel plans for CUDA graphs: the same tensors at capture and at every replay.

A captured graph replays its kernels with the addresses they were captured with, so the plan
that the sparse layers read must live in buffers allocated once (at ``init_cuda_graph_state``)
and be refreshed in place. :class:`GraphDecodePlans` owns those buffers, sized for the largest
captured batch and the whole context the model can hold:

* the host side (:meth:`GraphDecodePlans.plan`) checks a batch against that size and hands out
  the plan of ``(batch, q_len)``: views of the buffers, built once per shape;
* the device side (:meth:`GraphDecodePlans.refresh`) is what the graph records: gather each
  request's page ids from ``req_to_token`` and write every tile's first query position. Fixed
  shapes, no host sync, so it replays with the runner's freshly copied inputs.

Verify graphs of draft trees (EAGLE top-k > 1) also hold each token's depth, ancestors and slot
(:class:`msa_kernels.plan.DraftTree`). Those come from the batch's tree mask, which the graph
runner does not keep in its input buffers: :meth:`GraphDecodePlans.refresh_tree` copies them in
from the host side, before every replay, where the real ``spec_info`` is at hand.

Rows the runner pads a batch with (``seq_len`` = the dense backend's fill value, some pool row)
are clamped to hold at least their query tokens, so positions never go negative, and to the
captured context, so no kernel reads past the page table; such rows only write their own
output rows, which the runner discards.
"""

from __future__ import annotations

import torch
from msa_kernels.plan import DecodePlan, DraftTree, Tiles, assemble_decode_plan, draft_tree, page_table_from_req_to_token
from msa_kernels.reference import MSAParams

from sglang_m3.msa.batch_shape import attended_lens


def graph_context_tokens(req_to_token_width: int, context_len: int, max_bs: int, max_num_tokens: int) -> int:
    """Tokens a request of a graph of up to ``max_bs`` requests and ``max_num_tokens`` tokens may hold.

    The model's ``context_len`` (a decode token is one of them) plus, in graphs of more than one
    query token per request (verify drafts, a draft extend's window), that many, as far as
    ``req_to_token`` reaches. The width sets the top-k kernel's block range, so decode does not
    round it past ``context_len``.
    """
    per_request = max_num_tokens // max_bs
    return min(req_to_token_width, context_len + (per_request if per_request > 1 else 0))


class GraphDecodePlans:
    """Static plan buffers for decode batches of up to ``max_bs`` requests of ``max_tokens`` tokens."""

    def __init__(self, params: MSAParams, max_bs: int, max_tokens: int, num_kv_heads: int, num_sms: int, device):
        if max_bs < 1 or max_tokens < 1:
            raise ValueError(f"max_bs ({max_bs}) and max_tokens ({max_tokens}) must be >= 1")
        self.params = params
        self.max_bs = max_bs
        self.max_tokens = max_tokens
        self.num_kv_heads = num_kv_heads
        self.num_sms = num_sms
        self.device = torch.device(device)
        max_blocks = -(-max_tokens // params.block_size)
        self.page_table = torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=self.device)
        self.pos0 = torch.zeros(max_bs, dtype=torch.int32, device=self.device)
        self.req = torch.arange(max_bs, dtype=torch.int32, device=self.device)
        self._tickets: dict[int, torch.Tensor] = {}  # q_len -> the attention's merge tickets (zero between launches)
        self._tok0: dict[int, torch.Tensor] = {}  # q_len -> first q row of each request
        self._ntok: dict[int, torch.Tensor] = {}  # q_len -> query tokens of each request
        self._trees: dict[int, DraftTree] = {}  # q_len -> draft-tree buffers of max_bs requests
        self._plans: dict[tuple[int, int, bool], DecodePlan] = {}

    def plan(self, batch: int, q_len: int, longest_kv: int | None = None, tree: bool = False) -> DecodePlan:
        """The plan of a ``batch`` x ``q_len`` batch (host side: may allocate, never syncs).

        ``longest_kv`` (the longest request's tokens, queries included), when the caller knows
        it from host-side lengths, is checked against the captured context. ``tree``: the
        verify tokens form draft trees (see :meth:`refresh_tree`).
        """
        if batch > self.max_bs:
            raise ValueError(f"batch of {batch} requests exceeds the CUDA-graph max_bs {self.max_bs} given to init_cuda_graph_state")
        if longest_kv is not None and longest_kv > self.max_tokens:
            raise ValueError(
                f"a request of {longest_kv} tokens (seq_lens plus draft tokens) exceeds the CUDA-graph context of "
                f"{self.max_tokens} tokens (model context_len, plus the drafts in verify graphs, within req_to_token)"
            )
        key = (batch, q_len, tree)
        if key not in self._plans:
            if q_len not in self._tok0:
                self._tok0[q_len] = self.req * q_len
                self._ntok[q_len] = torch.full_like(self.req, q_len)
                self._tickets[q_len] = torch.zeros(self.max_bs * q_len * self.num_kv_heads, dtype=torch.int32, device=self.device)
            if tree and q_len not in self._trees:
                rows = self.max_bs * q_len
                self._trees[q_len] = DraftTree(
                    depth=torch.zeros(rows, dtype=torch.int32, device=self.device),
                    ancestors=torch.zeros(rows, dtype=torch.int64, device=self.device),
                    slots=torch.zeros(rows, dtype=torch.int64, device=self.device),
                )
            tiles = Tiles(
                req=self.req[:batch],
                tok0=self._tok0[q_len][:batch],
                pos0=self.pos0[:batch],
                ntok=self._ntok[q_len][:batch],
                max_tokens=q_len,
            )
            self._plans[key] = assemble_decode_plan(
                self.params, self.page_table[:batch], tiles, self._tickets[q_len], self.num_kv_heads, self.num_sms,
                tree=self._tree_rows(q_len, batch * q_len) if tree else None,
            )
        return self._plans[key]

    def _tree_rows(self, q_len: int, rows: int) -> DraftTree:
        whole = self._trees[q_len]
        return DraftTree(depth=whole.depth[:rows], ancestors=whole.ancestors[:rows], slots=whole.slots[:rows])

    def refresh_tree(self, plan: DecodePlan, visible: torch.Tensor, slots: torch.Tensor) -> None:
        """Write this batch's draft trees into ``plan`` (device copies, no host sync).

        ``visible [batch * q_len, q_len]`` and ``slots [batch * q_len]`` as
        :func:`msa_kernels.plan.draft_tree` takes them.
        """
        fresh = draft_tree(visible, slots)
        plan.tree.depth.copy_(fresh.depth)
        plan.tree.ancestors.copy_(fresh.ancestors)
        plan.tree.slots.copy_(fresh.slots)

    def refresh(
        self,
        plan: DecodePlan,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        queries_in_seq_lens: bool,
    ) -> None:
        """Write this batch's page ids and query positions into ``plan`` (graph-recordable).

        ``queries_in_seq_lens``: decode counts the new token in ``seq_lens``; SGLang's target
        verify does not (see :mod:`sglang_m3.msa.batch_shape`).
        """
        batch, q_len = plan.tiles.count, plan.tiles.max_tokens
        kv_lens = attended_lens(seq_lens[:batch], q_len, queries_in_seq_lens)
        plan.tiles.pos0.copy_(kv_lens.clamp(q_len, self.max_tokens) - q_len)
        plan.page_table.copy_(
            page_table_from_req_to_token(req_to_token, req_pool_indices[:batch], self.max_tokens, self.params.block_size)
        )
