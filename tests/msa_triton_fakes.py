"""SGLang-shaped stand-ins for driving ``MSATritonBackend`` on the CPU (kernel tests).

A model runner with a KV pool that serves a :class:`msa_kernels.paged_batch.PagedBatch`'s
caches, and ForwardBatch doubles over that pool (:mod:`forward_batch_doubles`).
"""

from types import SimpleNamespace

import torch

from forward_batch_doubles import forward_batch_for
from msa_kernels.reference import MSAParams

BLOCK, HQ, HKV, D = 16, 4, 2, 32
PARAMS = MSAParams(block_size=BLOCK, topk=4, local_blocks=1, init_blocks=0)
SPEC = SimpleNamespace(index_block_size=BLOCK, index_topk_blocks=4, index_local_blocks=1, index_init_blocks=0)
LAYER = SimpleNamespace(layer_id=0, tp_q_head_num=HQ, qk_head_dim=D, v_head_dim=D, scaling=D**-0.5, k_scale=None, v_scale=None)


def fake_runner(req_to_token, caches, context_len=None):
    """A CPU model runner; ``caches()`` returns the current batch (its KV caches are the pool)."""
    pool = SimpleNamespace(
        head_num=HKV,
        get_key_buffer=lambda layer_id: caches().k_cache,
        get_value_buffer=lambda layer_id: caches().v_cache,
        get_index_k_buffer=lambda layer_id: caches().ik_cache,
    )
    return SimpleNamespace(
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        token_to_kv_pool=pool,
        device="cpu",
        page_size=BLOCK,
        model_config=SimpleNamespace(context_len=context_len or req_to_token.shape[1]),
    )


def make_backend(module, batch):
    """A backend over ``batch`` whose request ``b`` lives in pool row ``B-1-b``."""
    return module.MSATritonBackend(fake_runner(batch.req_to_token.flip(0), lambda: batch), SPEC)


def forward_batch(mode, batch):
    """The eager ForwardBatch of ``make_backend``'s pool layout, as SGLang builds one for ``mode``.

    ``batch.seq_lens`` are the tokens each request attends to (queries included): a
    TARGET_VERIFY double keeps its ``batch.extend_lens`` drafts out of ``seq_lens``.
    """
    n = len(batch.seq_lens)
    pool = batch.req_to_token.flip(0)
    return forward_batch_for(mode, pool, torch.arange(n - 1, -1, -1), batch.seq_lens, batch.extend_lens)


def attend(backend, batch) -> torch.Tensor:
    """One sparse layer over the backend's current plan: ``[rows, HQ, D]``."""
    return backend._attend(batch.q.reshape(batch.q.shape[0], -1), LAYER, batch.iq).view(-1, HQ, D)
