"""MSA (MiniMax Sparse Attention) Triton kernels for Hopper and their torch reference.

Depends on torch (and triton for the GPU kernels) only, never on SGLang, so it imports and
benchmarks on a GPU machine without SGLang installed. ``reference`` states the semantics
(M3_FACTS s.2); every kernel is tested against it.

API (plan once per batch, run once per sparse layer; FlashInfer style)::

    from msa_kernels.plan import page_table_from_req_to_token, plan_decode, plan_prefill
    from msa_kernels.api import run_decode, run_prefill

    table = page_table_from_req_to_token(req_to_token, req_pool_indices, max_context, 128)

    # decode / speculative verify: q_len rows per request, request-major
    plan = plan_decode(params, table, seq_lens, q_len=1, q_lens=None, num_kv_heads=4)
    out, selected = run_decode(plan, q, k_cache, v_cache, iq, ik_cache, sm_scale)

    # verify of EAGLE draft trees: each row's path among its request's q_len rows, and their slots
    plan = plan_decode(params, table, seq_lens, q_len=8, num_kv_heads=4, tree=draft_tree(visible, slots))

    # extend / chunked prefill: rows packed request after request; lengths on the host
    plan = plan_prefill(params, table, seq_lens_cpu, extend_lens_cpu, num_index_heads=4)
    out, selected = run_prefill(plan, q, k_cache, v_cache, iq, ik_cache, sm_scale)

Shapes: ``q [rows, Hq, D]``, ``iq [rows, Hkv, Di]`` (one index head per KV group),
``k_cache/v_cache [slots, Hkv, D]``, ``ik_cache [slots, Di]`` or ``[slots, 1, Di]``;
``out [rows, Hq, D]``; ``selected [rows, Hkv, topk]`` int32, ascending, -1 padded. The KV pool
must use page size == MSA block size (128 on M3): a block is one page, addressed by its page id.
``seq_lens`` count every cached token including the new ones, which must already be in the
caches. ``params`` is :class:`MSAParams` (block, top-k, local and init blocks).

Kernels (see each module): decode = index scan with the block's keys on the MMA's M side split
over blocks -> top-k per (request, head, token) -> sparse attention, one tile per query token
(verify tokens too), split over the token's chosen blocks with the log-sum-exp merge in each
(token, head)'s last split (3 launches; the plan holds its self-resetting arrival tickets); fixed
grids for CUDA-graph capture. Draft trees (``plan.tree``): the scan and the attention's block loop read each
request's prefix, one more launch scores every token's own path into its blocks, and the
attention adds the path's keys (ancestors only) from their slots; every token is answered as the
decode query at the end of its root-to-token path (position prefix + depth). Prefill = fused index scan + causal block-max + running top-k (no score
matrix; a short chunk after a long prefix splits each index tile's blocks over several programs
and merges their candidates) -> sparse attention, query-major per token for short extends or
KV-block-major from 1-4K new tokens (pairs grouped by block with a counting sort,
``triton_pair_plan``; one K/V load per run of tiles of 4 pairs x 16 heads, per-block partials,
log-sum-exp merge). ``decode_select`` / ``prefill_select`` return
the selection alone; ``decode_attention`` / ``prefill_attention`` run the attention half on a
selection, optionally through another page table of the same shape over other K/V pages (sparse
offload's block cache or staging buffer) and, for decode, over a range of the plan's requests.
``triton_offload`` moves K/V pages between a page-locked host store and device caches.
Measured speed and what bounds it: ``benchmarks/KERNEL_NOTES.md``.

Per-layer helpers of the model's GPU path (import them from their modules; this package's import
stays free of Triton): ``triton_qk_norm_rope.qk_norm_rope`` (per-head RMSNorm + NeoX partial RoPE
of up to four head groups in one launch) and ``triton_cache_insert.insert_kv_and_index`` (K, V and
index key written to their cache slots in one launch); ``triton_add_rmsnorm.add_rmsnorm`` (a decoder
layer's residual add and the RMSNorm after it in one pass per row).
"""

from msa_kernels.reference import MSAParams, block_scores, msa_attention, select_blocks, sparse_attention

__all__ = ["MSAParams", "block_scores", "msa_attention", "select_blocks", "sparse_attention"]
