"""Torch versions of SGLang's speculative-decoding kernels for the CPU platform.

On an out-of-tree platform SGLang 0.5.23 runs Triton for the EAGLE bookkeeping: the draft's
cache-location copy (``assign_draft_cache_locs_contiguous``), the slot-table update before a
speculative decode step (``assign_req_to_token_pool``), the tree builder
(``sgl_build_tree_kernel_efficient_triton``), the greedy verifier
(``verify_tree_greedy_kernel_triton``) and the bonus-token pick after it
(``fill_bonus_tokens``), and after a draft tree's verify the packing of the accepted path's slots
(``fill_front_out_cache_loc``, ``fill_accept_out_cache_loc``). Without a GPU those run only in Triton's interpreter, which a user's
plain ``sglang-m3 serve`` does not enable; the verify batch's cache locations of a draft tree
(``assign_extend_cache_locs_func``) find no implementation at all off CUDA/NPU/SGLang's CPU engine
unless the platform supplies one. These functions compute the same outputs with torch
on the host, for chains and for trees, written from the semantics of SGLang's kernels (their
docstrings say which outputs and which layout); the tests compare them with the Triton kernels
run in the interpreter.

The tree functions walk each request's few draft tokens in Python: a verify step has at most
a few dozen of them, so the walk costs microseconds beside the model's forward passes.
"""

from __future__ import annotations

import torch

#: ``TreeMaskMode`` values of SGLang's tree builder that these functions produce.
FULL_MASK, QLEN_ONLY = 0, 1


def assign_draft_cache_locs(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    topk: int,
    num_cols: int,
    positions: torch.Tensor | None = None,
    mrope: torch.Tensor | None = None,
) -> None:
    """Request ``i``'s ``topk * num_cols`` slots from ``req_to_token`` starting at ``seq_lens[i]``
    go to ``out_cache_loc[i * topk * num_cols:]``; ``positions`` (and each of ``mrope``'s 3 rows)
    get ``seq_lens[i]`` at ``i * topk .. i * topk + topk - 1``. All in place."""
    bs = seq_lens.shape[0]
    width = topk * num_cols
    if bs == 0 or width == 0:
        return
    columns = seq_lens.long().view(-1, 1) + torch.arange(width, device=seq_lens.device)
    slots = req_to_token[req_pool_indices.long()].gather(1, columns)
    out_cache_loc[: bs * width].copy_(slots.reshape(-1))
    if positions is not None:
        starts = seq_lens.repeat_interleave(topk)
        positions[: bs * topk].copy_(starts)
        if mrope is not None:
            mrope.view(3, -1)[:, : bs * topk].copy_(starts.expand(3, -1))


def _window_cells(req_pool_indices, start_offset, end_offset, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, columns)`` of ``req_to_token`` covering request ``i``'s columns ``start_offset[i]
    .. end_offset[i] - 1``, requests one after another."""
    lengths = (end_offset[:batch_size] - start_offset[:batch_size]).long()
    first = torch.cumsum(lengths, 0) - lengths  # where request i's cells start
    within = torch.arange(int(lengths.sum()), device=lengths.device) - first.repeat_interleave(lengths)
    rows = req_pool_indices[:batch_size].long().repeat_interleave(lengths)
    columns = start_offset[:batch_size].long().repeat_interleave(lengths) + within
    return rows, columns


def assign_req_to_token(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    batch_size: int,
) -> None:
    """Request ``i``'s new slots go into ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]``,
    taken in order from ``out_cache_loc`` (the requests' slots one after another). In place."""
    rows, columns = _window_cells(req_pool_indices, start_offset, end_offset, batch_size)
    if rows.numel():
        req_to_token[rows, columns] = out_cache_loc[: rows.numel()].to(req_to_token.dtype)


def assign_extend_cache_locs(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
    device=None,
) -> torch.Tensor:
    """The slots ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` of every
    request, one after another (int64): where a verify batch writes its drafts' K/V."""
    rows, columns = _window_cells(req_pool_indices, start_offset, end_offset, batch_size)
    return req_to_token[rows, columns].to(torch.int64)


def fill_front_out_cache_loc(num_front: torch.Tensor, out_cache_loc: torch.Tensor, front_out_cache_loc: torch.Tensor) -> None:
    """The first ``num_front[i]`` slots of request ``i``'s window of ``out_cache_loc`` (equal windows,
    one per request), packed one after another into ``front_out_cache_loc``. In place."""
    bs = num_front.numel()
    window = out_cache_loc.view(bs, -1)
    rows, columns = _window_cells(torch.arange(bs, device=window.device), torch.zeros_like(num_front), num_front, bs)
    front_out_cache_loc[: rows.numel()] = window[rows, columns].to(front_out_cache_loc.dtype)


def fill_accept_out_cache_loc(
    accept_index: torch.Tensor, out_cache_loc: torch.Tensor, accept_out_cache_loc: torch.Tensor, size: int
) -> None:
    """``out_cache_loc`` at the first ``size`` entries of ``accept_index`` that are not -1, packed in
    order into ``accept_out_cache_loc``. In place."""
    index = accept_index.reshape(-1)[:size]
    kept = index[index != -1].long()
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def fill_bonus_tokens(
    accept_tokens: torch.Tensor,
    accept_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    accept_stride: int,
    batch_size: int,
) -> None:
    """``bonus_tokens[i]`` = request ``i``'s last accepted token, ``accept_tokens`` holding
    ``accept_stride`` tokens per request of which ``accept_lens[i]`` (bonus included) count. In place."""
    if batch_size == 0:
        return
    last = torch.arange(batch_size, device=accept_lens.device) * accept_stride + accept_lens[:batch_size].long() - 1
    bonus_tokens[:batch_size] = accept_tokens.reshape(-1)[last].to(bonus_tokens.dtype)


def build_tree(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int = FULL_MASK,
) -> None:
    """EAGLE's verify tree from the draft steps' top-k choices, written in place.

    Per request ``b`` with ``n = draft_token_num`` tokens (token 0 is the verified bonus token,
    token ``j >= 1`` is draft ``selected_index[b, j - 1]``), as SGLang's builder does:

    - ``retrieve_index[b, j] = b * n + j``;
    - ``retrieve_next_token[b, p]`` is ``p``'s first child and ``retrieve_next_sibling[b, j]``
      the next child of ``j``'s parent (both ``-1``-initialized by the caller), children in
      increasing order; a draft whose parent was not selected stays unlinked;
    - ``positions[b * n + j] = seq_len + depth of j`` (ancestors counted up to ``depth`` hops);
    - the mask row of ``j`` marks the root and ``j``'s ancestors among the drafts (and ``j``):
      in FULL_MASK only the draft columns ``seq_len .. seq_len + n - 1`` of its row of
      ``seq_len + n`` are written (the prefix columns keep the caller's fill); in QLEN_ONLY
      the rows are ``n`` wide.
    """
    if tree_mask_mode not in (FULL_MASK, QLEN_ONLY):
        raise NotImplementedError(f"tree_mask_mode {tree_mask_mode}: only FULL_MASK (0) and QLEN_ONLY (1) are built")
    n = draft_token_num
    seq_lens = verified_seq_len.tolist()
    mask_offset = 0  # FULL_MASK: rows of the earlier requests, (seq_len + n) wide each
    for b, seq_len in enumerate(seq_lens):
        selected = selected_index[b, : n - 1].tolist()
        parents = parent_list[b].tolist() if parent_list.dim() > 1 else parent_list.tolist()
        parent_of = [None] + [_parent_position(selected[j - 1], selected, parents, topk) for j in range(1, n)]
        retrieve_index[b] = torch.arange(b * n, b * n + n, dtype=retrieve_index.dtype, device=retrieve_index.device)
        for j in range(n - 1, 0, -1):
            parent = parent_of[j]
            if parent is None:
                continue
            first_child = int(retrieve_next_token[b, parent])
            retrieve_next_token[b, parent] = j
            if first_child != -1:
                retrieve_next_sibling[b, j] = first_child

        row_width = seq_len + n if tree_mask_mode == FULL_MASK else n
        draft_column = seq_len if tree_mask_mode == FULL_MASK else 0
        rows = torch.zeros(n, n, dtype=torch.bool)
        rows[:, 0] = True
        depths = [0] * n
        for j in range(1, n):
            node, hops = j, 0
            while hops < depth:
                hops += 1
                rows[j, node] = True
                node = parent_of[node]
                if not node:  # the root (0) or an unselected parent (None) ends the path
                    break
            depths[j] = hops
        mask = tree_mask.view(-1)[mask_offset : mask_offset + n * row_width].view(n, row_width)
        mask[:, draft_column : draft_column + n] = rows.to(tree_mask.dtype)
        mask_offset += n * row_width
        positions[b * n : b * n + n] = torch.tensor(depths, dtype=positions.dtype, device=positions.device) + seq_len


def _parent_position(choice: int, selected: list[int], parents: list[int], topk: int) -> int | None:
    """The tree position (0 = root, ``p + 1`` = ``selected[p]``) of the parent of draft
    ``choice`` (an index into the draft steps' flattened top-k), None when no selected draft is it."""
    parent_step_index = choice // topk
    if parent_step_index == 0:
        return 0
    parent_token = parents[parent_step_index]
    for p, candidate in enumerate(selected):
        if candidate == parent_token:
            return p + 1
    return None


def verify_tree_greedy(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance down the verify tree, in place, as SGLang's greedy verifier.

    From the root of request ``b``, each level takes the first child (in sibling order) whose
    draft token equals the target's greedy token at the last accepted node, and stops at the
    first level where none does or after ``accept_index.shape[1] - 1`` levels. ``accept_index[b]``
    gets the accepted nodes' retrieve indices (root first; later entries keep the caller's fill),
    ``accept_token_num[b]`` the number of accepted drafts, and ``predicts`` at each accepted node
    the target's token there (the next accepted draft, or the bonus token at the last one).
    """
    bs, n = candidates.shape
    max_accept = accept_index.shape[1]
    targets = target_predict.reshape(-1, n)
    for b in range(bs):
        candidate = candidates[b].tolist()
        retrieve = retrieve_index[b].tolist()
        next_token = retrieve_next_token[b].tolist()
        next_sibling = retrieve_next_sibling[b].tolist()
        last = retrieve[0]
        accept_index[b, 0] = last
        accepted, node = 0, 0
        for _ in range(1, max_accept):
            target = int(targets[last // n, last % n])
            node = _matching_child(next_token[node], target, candidate, next_sibling)
            if node == -1:
                break
            predicts[last] = target
            accepted += 1
            accept_index[b, accepted] = retrieve[node]
            last = retrieve[node]
        accept_token_num[b] = accepted
        predicts[last] = targets[last // n, last % n]
    return predicts, accept_index, accept_token_num


def _matching_child(first_child: int, target: int, candidate: list[int], next_sibling: list[int]) -> int:
    """The first node of the sibling list from ``first_child`` whose token is ``target``, else -1
    (at most as many steps as there are nodes, as SGLang's verifier bounds its walk)."""
    node = first_child
    for _ in range(len(candidate)):
        if node == -1 or candidate[node] == target:
            return node
        node = next_sibling[node]
    return -1
