"""Query and attended lengths of an SGLang ``ForwardBatch``: the one reading of SGLang's conventions.

SGLang 0.5.23 counts a request's tokens differently per forward mode:

* DECODE: ``seq_lens`` counts the new token; the one query is the last of ``seq_lens`` tokens.
* TARGET_VERIFY (speculative verification): ``seq_lens`` excludes the draft tokens. Each request
  verifies ``spec_info.num_tokens_per_req`` drafts (``draft_token_num`` where that is unset),
  whose cache slots sit in ``req_to_token`` at ``seq_len .. seq_len + q_len - 1``
  (``eagle_prepare_for_verify`` allocates them from ``start_offset=seq_lens``) and whose
  positions continue from ``seq_len``; ``extend_seq_lens`` / ``extend_seq_lens_cpu`` stay None.
* EXTEND: ``seq_lens`` counts every token; the new ones are the last ``extend_seq_lens[i]``.
* DRAFT_EXTEND_V2 (the draft model over the verify window, after every verify of SGLang's EAGLE
  worker v2): ``prepare_for_draft_extend`` sets ``seq_lens`` to the length after the window, so it
  counts the ``spec_info.num_tokens_per_req`` window tokens of each request, which attend causally
  after its prefix at the window's slots of ``req_to_token`` (the verify window's); a widened window
  (``spec_info.num_front_tokens`` > 0) also re-runs tokens before it.

Every MSA planner (the torch path, the eager Triton plans, the CUDA-graph plans) goes through
these functions, so the three agree on what a verify batch holds.
"""

from __future__ import annotations

import torch


def is_target_verify(forward_mode) -> bool:
    return bool(getattr(forward_mode, "is_target_verify", lambda: False)())


def verify_q_len(spec_info, trees: bool = False) -> int:
    """Draft tokens per request of a TARGET_VERIFY batch, from its ``spec_info``.

    EAGLE draft trees (top-k > 1) are accepted from callers that read SGLang's tree mask
    (``trees=True``: every MSA path does, the torch planner and the Triton plans, see
    :mod:`sglang_m3.msa.verify_tree`); a caller that would attend the drafts as a chain leaves
    ``trees`` False and has trees refused. NGRAM's irregular trees (``tree_topk`` -1) and
    per-request verify lengths (a ragged verify layout) are refused everywhere rather than
    answered wrongly (neither is tested here).
    """
    if spec_info is None:
        raise ValueError("a TARGET_VERIFY batch without forward_batch.spec_info: the draft count per request is unknown")
    branching = getattr(spec_info, "tree_topk", getattr(spec_info, "topk", 1))
    if branching < 1:
        raise ValueError(
            f"spec_info.tree_topk = {branching}: irregular draft trees (NGRAM) are not verified by MSA; "
            "use EAGLE/EAGLE3 speculative decoding"
        )
    if branching > 1 and not trees:
        raise ValueError(
            f"spec_info.tree_topk = {branching}: this caller attends the drafts as a chain and does not "
            "read the tree mask (run EAGLE with --speculative-eagle-topk 1)"
        )
    if getattr(spec_info, "ragged_verify_layout", None) is not None:
        raise ValueError("spec_info.ragged_verify_layout is set: MSA plans verify batches of one draft count per request only")
    per_req = getattr(spec_info, "num_tokens_per_req", -1)
    q_len = per_req if per_req is not None and per_req > 0 else getattr(spec_info, "draft_token_num", None)
    if q_len is None or q_len < 1:
        raise ValueError(
            "a TARGET_VERIFY batch whose spec_info has neither num_tokens_per_req > 0 nor draft_token_num >= 1: "
            "the draft count per request is unknown"
        )
    return int(q_len)


def uniform_query_shape(forward_batch, trees: bool = False) -> tuple[int, bool] | None:
    """(query tokens per request, whether ``seq_lens`` counts them), or None for extend-like batches.

    Decode (and idle): one token, counted. Target verify: the draft count, not counted. Other
    modes have per-request query lengths (``extend_seq_lens``). ``trees``: see :func:`verify_q_len`.
    """
    mode = forward_batch.forward_mode
    if mode.is_decode_or_idle():
        return 1, True
    if is_target_verify(mode):
        return verify_q_len(forward_batch.spec_info, trees), False
    return None


def draft_extend_q_len(forward_batch) -> int | None:
    """Window tokens per request of a DRAFT_EXTEND_V2 batch (``seq_lens`` counts them), None for
    any other batch and for a widened window, whose extra front tokens the caller does not plan."""
    if not getattr(forward_batch.forward_mode, "is_draft_extend_v2", lambda: False)():
        return None
    spec_info = forward_batch.spec_info
    if spec_info is None or getattr(spec_info, "num_front_tokens", 0):
        return None
    per_req = getattr(spec_info, "num_tokens_per_req", -1)
    return int(per_req) if per_req is not None and per_req > 0 else None


def attended_lens(seq_lens: torch.Tensor, q_len: int, queries_in_seq_lens: bool) -> torch.Tensor:
    """Tokens each request's attention covers (its queries included), from SGLang's ``seq_lens``."""
    return seq_lens if queries_in_seq_lens else seq_lens + q_len


def host_extend_lens(forward_batch) -> list[int]:
    """New tokens per request of an extend batch, on the host (prefill plans size tiles from them)."""
    lens = forward_batch.extend_seq_lens_cpu
    if lens is None:
        raise ValueError(
            f"forward_batch.extend_seq_lens_cpu is None in a {forward_batch.forward_mode} batch: MSA prefill "
            "plans need the host-side new-token count of every request"
        )
    return list(lens)
