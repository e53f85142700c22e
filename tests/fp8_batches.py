"""Paged MSA batches with fp8 index keys, shared by the interpreter and GPU tests of fp8 index keys."""

import torch

from msa_kernels.paged_batch import PagedBatch, make_paged_batch
from msa_kernels.plan import page_table_from_req_to_token


def fp8_batch(seq_lens, extend_lens, seed, *, hq, hkv, dim, block, dtype, device, decode_q_len=0, max_context=None) -> PagedBatch:
    """A random paged batch whose index keys are quantized as the fp8 pool stores them."""
    gen = torch.Generator().manual_seed(seed)
    batch = make_paged_batch(
        seq_lens, extend_lens, hq, hkv, head_dim=dim, index_dim=dim, block_size=block,
        dtype=dtype, device=device, decode_q_len=decode_q_len, max_context=max_context, generator=gen,
    )
    return batch.with_fp8_index_keys()


def page_table(batch: PagedBatch, max_context: int, block: int) -> torch.Tensor:
    reqs = torch.arange(len(batch.seq_lens), device=batch.req_to_token.device)
    return page_table_from_req_to_token(batch.req_to_token, reqs, max_context, block)
