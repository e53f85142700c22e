"""Random EAGLE draft passes formed the way SGLang's EAGLE worker forms them (shared by the tests)."""

from __future__ import annotations

import torch
from sglang.srt.speculative.eagle_utils import organize_draft_results
from sglang.srt.speculative.spec_utils import select_top_k_tokens


def random_draft_pass(gen: torch.Generator, bs: int, topk: int, num_steps: int, num_draft_tokens: int):
    """``(parent_list, top_scores_index)`` of one draft pass: SGLang's top-k-1 chain layout
    (parents ``-1 .. steps - 2``, drafts ``0 .. steps - 1``) for ``topk == 1``, otherwise random
    draft probabilities through its ``select_top_k_tokens`` and ``organize_draft_results``."""
    if topk == 1:
        parents = torch.arange(-1, num_steps - 1 if num_steps > 1 else -1, dtype=torch.long).repeat(bs, 1)
        return parents, torch.arange(num_steps, dtype=torch.long).repeat(bs, 1)
    scores, tokens, parents_list, probs = [], [], [], None
    with torch.compiler.set_stance("force_eager"):
        for step in range(num_steps):
            rows = bs if step == 0 else bs * topk
            step_probs = torch.rand(rows, 64, generator=gen).softmax(-1)
            topk_p, topk_index = step_probs.topk(topk, dim=-1)
            _, _, probs, tree_info = select_top_k_tokens(step, topk_p, topk_index, None, probs, topk)
            scores.append(tree_info[0])
            tokens.append(tree_info[1])
            parents_list.append(tree_info[2])
    parent_list, top_scores_index, _ = organize_draft_results(scores, tokens, parents_list, num_draft_tokens)
    return parent_list, top_scores_index
