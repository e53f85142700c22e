"""The dense layers' attention of a draft-tree verify batch on CUDA: SGLang's backend with the tree mask.

On CUDA ``M3HybridAttnBackend`` hands the dense (non-MSA) layers of a TARGET_VERIFY batch to
SGLang's own attention backend (fa3 / triton / flashinfer: the ones SGLang verifies trees with at
page size > 1), never to the project's SDPA prefill path, which serves plain extend batches and
masks causally. SGLang's backend reads ``spec_info.custom_mask``, the tree mask its tree builder
writes into the verify mask buffer the hybrid exposes (``verify_mask``, tested with the graph
hooks in ``tests/kernels/test_msa_graph_metadata.py``). Here: the routing, and SGLang's Triton
extend kernel (what its triton backend runs for TARGET_VERIFY) given that mask and the arguments
its backend builds, under the interpreter, against the path oracle of
``test_tree_verify_attention`` (each token attends the prefix and its root-to-token path).
fa3 and flashinfer need a GPU: ``tests/gpu/test_eagle3_tree_gpu.py`` serves trees end to end.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.speculative.test_tree_verify_attention import D, GROUP, HKV, _new_tokens, _oracle_rows, _tree_batch


def test_dense_layers_of_a_verify_batch_go_to_sglangs_backend():
    from sglang_m3.msa.dense_prefill import SDPADensePrefill
    from sglang_m3.msa.hybrid import M3HybridAttnBackend

    forward_batch = _tree_batch(0, 3, 3, 8)[0]
    calls = []
    dense = SimpleNamespace(
        kv_index_translator=None,
        init_forward_metadata=lambda fb: None,
        forward=lambda *args, **kwargs: calls.append("dense"),
        forward_extend=lambda *args, **kwargs: calls.append("dense"),
    )
    runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=None), token_to_kv_pool=None)
    sparse = SimpleNamespace(init_forward_metadata=lambda fb: None, takes_dense_layer=lambda layer, fb, extra: False)
    hybrid = M3HybridAttnBackend(dense, sparse, [1], SDPADensePrefill(runner))
    hybrid.init_forward_metadata(forward_batch)
    layer = SimpleNamespace(layer_id=0, k_scale=None)
    hybrid.forward(None, None, None, layer, forward_batch)
    hybrid.forward_extend(None, None, None, layer, forward_batch)
    assert calls == ["dense", "dense"]


@pytest.mark.parametrize("seed", range(2))
def test_sglang_triton_extend_kernel_attends_each_token_path(seed):
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    forward_batch, req_to_token, links, caches, queries = _tree_batch(seed, 3, 3, 8)
    caches = {name: cache.float() for name, cache in caches.items()}
    want = {name: cache.clone() for name, cache in caches.items()}
    arriving = _new_tokens(forward_batch, caches)
    n = forward_batch.spec_info.draft_token_num
    seq_lens = forward_batch.seq_lens
    prefix_slots = [req_to_token[row, :prefix] for row, prefix in zip(forward_batch.req_pool_indices.tolist(), seq_lens.tolist())]
    q = queries["q"].float()
    out = torch.empty_like(q)
    extend_attention_fwd(
        q, arriving["k"], arriving["v"], out, caches["k"], caches["v"],
        torch.arange(0, (seq_lens.numel() + 1) * n, n, dtype=torch.int32),  # qo_indptr
        torch.nn.functional.pad(torch.cumsum(seq_lens, 0), (1, 0)).to(torch.int32),  # kv_indptr: the prefixes
        torch.cat(prefix_slots),
        forward_batch.spec_info.custom_mask, True,
        torch.nn.functional.pad(torch.cumsum(n * (seq_lens + n), 0), (1, 0)),  # mask_indptr, FULL_MASK rows
        n, 1.0, 1.0, D**-0.5,
    )
    for row, slots, _ in _oracle_rows(forward_batch, req_to_token, links):
        k, v = want["k"][slots], want["v"][slots]
        for head in range(HKV * GROUP):
            weights = torch.softmax(k[:, head // GROUP] @ q[row, head] * D**-0.5, dim=0)
            torch.testing.assert_close(out[row, head], weights @ v[:, head // GROUP], rtol=1e-4, atol=1e-4)
