"""``msa_kernels.prepare``: the extend kernels compiled before the first request needs them.

Under the interpreter (CPU) the preparation runs every variant over a pool and leaves the pool
as it was. On a GPU, after it, extend batches of every shape a server meets (a first chunk, later
chunks, a radix hit of one token after a long prefix, ragged batches of 1 to 5 requests, tile
counts that are and are not multiples of 4) compile no further variant of any extend kernel.
"""

import pytest
import torch

from msa_kernels.reference import MSAParams

PARAMS = MSAParams(block_size=128, topk=16, local_blocks=1, init_blocks=0)


def _pool(slots: int, kv_heads: int, dtype: torch.dtype, device: str):
    gen = torch.Generator().manual_seed(7)
    k, v = (torch.randn(slots, kv_heads, 128, generator=gen).to(dtype).to(device) for _ in range(2))
    ik = torch.randn(slots, 1, 128, generator=gen).to(dtype).to(device)
    return k, v, ik


def test_prepare_runs_every_variant_and_leaves_the_pool_unchanged(interpreted_api):
    from msa_kernels import api
    from msa_kernels.prepare import prepare_prefill

    k, v, ik = _pool(8 * 128, 2, torch.float32, "cpu")
    before = [t.clone() for t in (k, v, ik)]
    launched = []
    real_select, real_attention = api.prefill_select, api.prefill_attention

    def select(plan, *args, **kwargs):
        launched.append(("index", plan.index_splits))
        return real_select(plan, *args, **kwargs)

    def attention(plan, *args, **kwargs):
        launched.append(("attention", "block_major" if plan.block_major else "query_major"))
        return real_attention(plan, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(api, "prefill_select", select)
        patch.setattr(api, "prefill_attention", attention)
        seconds = prepare_prefill(PARAMS, 32, k, v, ik, dtype=torch.float32)
    assert seconds > 0
    assert sorted(set(launched)) == [("attention", "block_major"), ("attention", "query_major"), ("index", 1), ("index", 2)]
    for tensor, kept in zip((k, v, ik), before):
        assert torch.equal(tensor, kept)


def test_prepare_refuses_caches_smaller_than_its_batch(interpreted_api):
    from msa_kernels.prepare import prepare_prefill

    k, v, ik = _pool(128, 2, torch.float32, "cpu")
    with pytest.raises(ValueError, match="the caches hold 128 slots, the synthetic batch reads 256"):
        prepare_prefill(PARAMS, 32, k, v, ik, dtype=torch.float32)


def _compiled_variants(kernel) -> int:
    import triton

    device = triton.runtime.driver.active.get_current_device()
    return len(kernel.device_caches[device][0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv_heads, kv_dtype", [  # TP1, TP2, TP4 of M3's four KV heads; an fp8 KV cache
    (4, torch.bfloat16), (2, torch.bfloat16), (1, torch.bfloat16), (4, torch.float8_e4m3fn),
])
def test_no_extend_batch_compiles_after_prepare(kv_heads, kv_dtype):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("measured on Hopper: before it every extend takes the general attention kernel")
    from msa_kernels import triton_attention, triton_block_major, triton_index, triton_prefill_attention
    from msa_kernels.api import run_prefill
    from msa_kernels.plan import plan_prefill
    from msa_kernels.prepare import prepare_prefill

    q_heads = 16 * kv_heads
    pages = 800
    k, v, ik = _pool(pages * 128, kv_heads, torch.bfloat16, "cuda")
    k, v = k.to(kv_dtype), v.to(kv_dtype)  # fp8: extends take the general attention kernel
    scales = {"k_scale": 0.5, "v_scale": 2.0} if kv_dtype != torch.bfloat16 else {}
    prepare_prefill(PARAMS, q_heads, k, v, ik, dtype=torch.bfloat16, **scales)
    kernels = [triton_index.prefill_index_topk_kernel, triton_index.prefill_index_merge_kernel,
               triton_attention.sparse_attention_kernel, triton_prefill_attention.prefill_attention_kernel,
               triton_block_major.block_major_attention_kernel,
               triton_block_major.merge_block_partials_kernel]
    prepared = [_compiled_variants(kernel) for kernel in kernels]
    gen = torch.Generator().manual_seed(kv_heads)
    batches = [  # (seq_lens, extend_lens): chunks of a long prompt, radix hits, ragged batches
        ([8192], [8192]), ([16384], [8192]), ([32768], [8192]), ([32769], [1]), ([20000], [3]),
        ([600, 5000, 131], [600, 77, 131]), ([70000], [66000]), ([3000, 2600, 130, 5000, 64], [3000, 700, 1, 129, 64]),
    ]
    for seq_lens, extend_lens in batches:
        blocks = -(-max(seq_lens) // 128)
        width = 1 << (blocks - 1).bit_length()  # the Triton backend's power-of-two page-table width
        page_table = torch.randint(0, pages, (len(seq_lens), width), generator=gen, dtype=torch.int32).cuda()
        plan = plan_prefill(PARAMS, page_table, seq_lens, extend_lens, num_index_heads=kv_heads)
        tokens = sum(extend_lens)
        q = torch.randn(tokens, q_heads, 128, device="cuda", dtype=torch.bfloat16)
        iq = torch.randn(tokens, kv_heads, 128, device="cuda", dtype=torch.bfloat16)
        run_prefill(plan, q, k, v, iq, ik, **scales)
    torch.cuda.synchronize()
    after = [_compiled_variants(kernel) for kernel in kernels]
    assert after == prepared, [kernel.__name__ for kernel, a, b in zip(kernels, after, prepared) if a != b]
