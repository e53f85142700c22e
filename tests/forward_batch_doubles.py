"""Eager ``ForwardBatch`` doubles with the fields an attention backend reads, as SGLang 0.5.23 fills them.

Every builder takes what each request *attends to*: ``kv_lens[b]`` tokens, its queries
included, held in ``req_to_token[req_pool_indices[b], :kv_lens[b]]`` (the layout
``msa_kernels.paged_batch`` builds), and renders SGLang's view of that batch:

* EXTEND: ``seq_lens`` = kv_lens, the last ``extend_lens[b]`` tokens new (``extend_seq_lens``
  on the device and ``extend_seq_lens_cpu`` on the host), positions ``prefix + i``.
* DECODE: ``seq_lens`` = kv_lens (the new token counted), position ``seq_len - 1``.
* TARGET_VERIFY: as ``eagle_prepare_for_verify`` + ``ForwardBatch.init_new`` build it:
  ``seq_lens`` excludes the ``q_len`` drafts, which sit in ``req_to_token`` right after
  (``out_cache_loc`` from ``start_offset=seq_lens``); ``extend_seq_lens`` / ``_cpu`` are None;
  ``spec_info`` is SGLang's own ``EagleVerifyInput`` of a chain (``topk`` 1), whose positions
  (``seq_len + depth``) become the batch's.
* DRAFT_EXTEND_V2: as ``prepare_for_draft_extend`` builds it after a verify: ``seq_lens`` counts
  the ``q_len`` window tokens, which are the last of each request; ``spec_info`` is SGLang's own
  ``EagleDraftExtendInput`` with ``num_tokens_per_req`` = ``q_len``; ``extend_seq_lens_cpu`` its
  host mirror.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


def _mode(name: str):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return getattr(ForwardMode, name)


def _rows(req_to_token, req_pool_indices, starts, counts) -> torch.Tensor:
    """Cache slots of tokens ``starts[b] .. starts[b] + counts[b] - 1`` of every request, packed."""
    return torch.cat(
        [req_to_token[row, s : s + n] for row, s, n in zip(req_pool_indices.tolist(), starts, counts)]
    ).to(torch.int64)


def _positions(starts, counts) -> torch.Tensor:
    return torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts)])


def extend_batch(req_to_token, req_pool_indices, kv_lens, extend_lens):
    prefixes = [kv - e for kv, e in zip(kv_lens, extend_lens)]
    return SimpleNamespace(
        forward_mode=_mode("EXTEND"),
        seq_lens=torch.tensor(kv_lens),
        seq_lens_cpu=torch.tensor(kv_lens),
        req_pool_indices=req_pool_indices,
        extend_seq_lens=torch.tensor(extend_lens, dtype=torch.int32),
        extend_seq_lens_cpu=list(extend_lens),
        extend_prefix_lens_cpu=prefixes,
        positions=_positions(prefixes, extend_lens),
        out_cache_loc=_rows(req_to_token, req_pool_indices, prefixes, extend_lens),
        spec_info=None,
    )


def decode_batch(req_to_token, req_pool_indices, kv_lens):
    ones = [1] * len(kv_lens)
    last = [kv - 1 for kv in kv_lens]
    return SimpleNamespace(
        forward_mode=_mode("DECODE"),
        seq_lens=torch.tensor(kv_lens),
        seq_lens_cpu=torch.tensor(kv_lens),
        req_pool_indices=req_pool_indices,
        extend_seq_lens=None,
        extend_seq_lens_cpu=None,
        positions=_positions(last, ones),
        out_cache_loc=_rows(req_to_token, req_pool_indices, last, ones),
        spec_info=None,
    )


def eagle_chain_verify_input(seq_lens: list[int], q_len: int, topk: int = 1):
    """SGLang's ``EagleVerifyInput`` for a chain of ``q_len`` tokens (the bonus token + drafts) per request."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    bs = len(seq_lens)
    unused = torch.full((bs, q_len), -1, dtype=torch.long)
    return EagleVerifyInput(
        draft_token=torch.zeros(bs * q_len, dtype=torch.long),
        custom_mask=None,
        positions=_positions(seq_lens, [q_len] * bs),
        retrieve_index=unused,
        retrieve_next_token=unused,
        retrieve_next_sibling=unused,
        retrieve_cum_len=None,
        spec_steps=q_len - 1,
        topk=topk,
        draft_token_num=q_len,
        capture_hidden_mode=CaptureHiddenMode.FULL,
        seq_lens_sum=sum(seq_lens),
        seq_lens_cpu=torch.tensor(seq_lens),
    )


def verify_batch(req_to_token, req_pool_indices, kv_lens, q_len, topk: int = 1):
    seq_lens = [kv - q_len for kv in kv_lens]
    spec_info = eagle_chain_verify_input(seq_lens, q_len, topk)
    return SimpleNamespace(
        forward_mode=_mode("TARGET_VERIFY"),
        seq_lens=torch.tensor(seq_lens),
        seq_lens_cpu=torch.tensor(seq_lens),
        req_pool_indices=req_pool_indices,
        extend_seq_lens=None,
        extend_seq_lens_cpu=None,
        positions=spec_info.positions,
        out_cache_loc=_rows(req_to_token, req_pool_indices, seq_lens, [q_len] * len(seq_lens)),
        spec_info=spec_info,
    )


def draft_extend_input(bs: int, q_len: int, num_front_tokens: int = 0):
    """SGLang's ``EagleDraftExtendInput`` of a draft extend over ``q_len`` window tokens per request."""
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput

    return EagleDraftExtendInput(
        hidden_states=torch.zeros(bs * q_len, 8),
        num_correct_drafts=torch.full((bs,), q_len - 1),
        num_accept_tokens=torch.full((bs,), q_len),
        num_tokens_per_req=q_len,
        num_tokens_for_logprob_per_req=q_len,
        num_front_tokens=num_front_tokens,
    )


def draft_extend_batch(req_to_token, req_pool_indices, kv_lens, q_len):
    """An extend of ``q_len`` tokens per request, in SGLang's draft-extend mode and spec_info."""
    batch = extend_batch(req_to_token, req_pool_indices, kv_lens, [q_len] * len(kv_lens))
    batch.forward_mode = _mode("DRAFT_EXTEND_V2")
    batch.spec_info = draft_extend_input(len(kv_lens), q_len)
    return batch


def forward_batch_for(mode: str, req_to_token, req_pool_indices, kv_lens, query_lens):
    """The double of ``mode`` over requests attending to ``kv_lens``, the last ``query_lens`` of them queried."""
    if mode == "EXTEND":
        return extend_batch(req_to_token, req_pool_indices, kv_lens, query_lens)
    if mode == "DECODE":
        if set(query_lens) != {1}:
            raise ValueError(f"a DECODE batch queries one token per request, got query_lens {query_lens}")
        return decode_batch(req_to_token, req_pool_indices, kv_lens)
    if mode == "TARGET_VERIFY":
        if len(set(query_lens)) != 1:
            raise ValueError(f"SGLang verifies the same draft count in every request, got query_lens {query_lens}")
        return verify_batch(req_to_token, req_pool_indices, kv_lens, query_lens[0])
    if mode == "DRAFT_EXTEND_V2":
        if len(set(query_lens)) != 1:
            raise ValueError(f"SGLang's draft extend runs the same window in every request, got query_lens {query_lens}")
        return draft_extend_batch(req_to_token, req_pool_indices, kv_lens, query_lens[0])
    raise ValueError(f"no ForwardBatch double for mode {mode}")
