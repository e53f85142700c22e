"""EAGLE draft trees (``--speculative-eagle-topk`` > 1) of a TARGET_VERIFY batch, read from SGLang's tree mask.

SGLang 0.5.23 lays out request ``b``'s ``n`` verify tokens (token 0 the verified bonus token, the
root; the others drafts) at ``req_to_token[b, seq_len_b + j]``, at positions ``seq_len_b + depth(j)``,
and describes the tree in ``spec_info.custom_mask`` (its tree builder's output): per request, ``n``
rows of ``seq_len_b + n`` booleans (``TreeMaskMode.FULL_MASK``, what SGLang builds off its own CPU
engine) or of ``n`` booleans (``QLEN_ONLY``), row ``i`` marking what token ``i`` attends: the prefix,
its ancestors among the drafts and itself.

A draft token must be answered as a decode query at its position would be after its path is
accepted: its key sequence is the prefix followed by its ancestors in depth order, at positions
``seq_len .. seq_len + depth``. :func:`draft_paths` gives that path for every token, so the MSA
planner can hand each draft its own key sequence (its own index scores and top-k blocks, never a
sibling's keys) and the dense layers can mask the siblings out. That is the torch path's host-side
reading; the Triton path (CUDA graphs) reads the same rows on the device with
:func:`draft_visibility_rows`, in the layout :func:`tree_mask_qlen_only` names.
"""

from __future__ import annotations

import torch


def is_draft_tree(spec_info) -> bool:
    """Whether a verify batch's drafts branch (EAGLE top-k > 1)."""
    return getattr(spec_info, "tree_topk", getattr(spec_info, "topk", 1)) > 1


def draft_visibility(custom_mask: torch.Tensor, prefix_lens: list[int], q_len: int) -> list[torch.Tensor]:
    """Per request, a bool ``[q_len, q_len]``: row ``i`` marks the verify tokens token ``i`` attends."""
    bs = len(prefix_lens)
    full = sum(prefix_lens) * q_len + bs * q_len * q_len
    mask = custom_mask.reshape(-1)
    if mask.numel() >= full:
        widths = [prefix + q_len for prefix in prefix_lens]
    elif mask.numel() >= bs * q_len * q_len:
        widths = [q_len] * bs
    else:
        raise ValueError(
            f"spec_info.custom_mask holds {mask.numel()} entries, fewer than a tree mask of {bs} requests x "
            f"{q_len} verify tokens needs ({full} with prefix columns, {bs * q_len * q_len} without)"
        )
    rows, start = [], 0
    for width in widths:
        block = mask[start : start + q_len * width].view(q_len, width)
        rows.append(block[:, width - q_len :].to(device="cpu", dtype=torch.bool))
        start += q_len * width
    return rows


def draft_paths(visibility: torch.Tensor) -> list[list[int]]:
    """For each verify token, the tokens of its root-to-self path in depth order (itself last).

    ``visibility``: one request's ``[q_len, q_len]`` from :func:`draft_visibility`. A row whose
    marked tokens do not form such a path (each one level deeper than the last) is not an EAGLE
    tree and is refused rather than attended wrongly.
    """
    depths = visibility.sum(dim=1) - 1
    paths = []
    for token in range(visibility.shape[0]):
        members = visibility[token].nonzero().flatten().tolist()
        path = sorted(members, key=lambda member: int(depths[member]))
        if token not in members or [int(depths[m]) for m in path] != list(range(len(path))) or path[-1] != token:
            raise ValueError(
                f"spec_info.custom_mask row {token} marks verify tokens {members} (depths "
                f"{[int(depths[m]) for m in members]}): not a root-to-token path of a draft tree"
            )
        paths.append(path)
    return paths


def tree_mask_qlen_only(attn_backend) -> bool:
    """Whether SGLang's tree builder writes the QLEN_ONLY layout (else FULL_MASK) for this target.

    The builder writes the layout of the target attention backend's verify mask when it has one
    (SGLang's CUDA backends that read trees: FULL_MASK), else SGLang's default for the platform.
    """
    from sglang.srt.speculative.eagle_utils import TreeMaskMode, default_tree_mask_mode

    verify_mask = getattr(attn_backend, "verify_mask", None)
    mode = default_tree_mask_mode() if verify_mask is None else verify_mask.mode
    if mode not in (TreeMaskMode.FULL_MASK, TreeMaskMode.QLEN_ONLY):
        raise ValueError(f"tree mask layout {mode!r}: MSA reads FULL_MASK and QLEN_ONLY draft-tree masks only")
    return mode == TreeMaskMode.QLEN_ONLY


def draft_visibility_rows(custom_mask: torch.Tensor, seq_lens: torch.Tensor, q_len: int, qlen_only: bool) -> torch.Tensor:
    """Bool ``[batch * q_len, q_len]``: row ``b * q_len + i`` marks the verify tokens token ``i`` of
    request ``b`` attends, read from ``custom_mask`` on its device (fixed shapes, no host sync).

    ``seq_lens``: SGLang's, the drafts excluded (FULL_MASK rows are ``seq_len + q_len`` wide).
    Reads past the mask (a batch padded for a CUDA graph beyond the requests the mask holds) are
    clamped to its last entry: such rows are garbage and their outputs are discarded.
    """
    device = custom_mask.device
    token = torch.arange(q_len, device=device)
    if qlen_only:
        cells = (torch.arange(seq_lens.shape[0], device=device)[:, None, None] * q_len + token[None, :, None]) * q_len
    else:
        width = seq_lens.to(device=device, dtype=torch.int64) + q_len
        request_start = torch.cumsum(width * q_len, 0) - width * q_len
        cells = request_start[:, None, None] + token[None, :, None] * width[:, None, None] + (width - q_len)[:, None, None]
    cells = (cells + token[None, None, :]).clamp(max=custom_mask.numel() - 1)
    return custom_mask.reshape(-1)[cells.reshape(-1, q_len)] != 0
