"""The MSA Triton kernels under the Triton interpreter (CPU, float32, tiny shapes) vs the torch reference.

Drives the whole CUDA code path: plan from ``req_to_token`` (shuffled, non-contiguous pages) ->
indexer -> top-k -> union -> sparse attention (-> split merge for decode). Geometry is scaled
down (block 16, top-4) so that several blocks compete for the top-k at ~100-token contexts.
"""

import pytest
import torch
import triton

from msa_kernels.paged_batch import compare_with_reference, make_paged_batch, reference_request
from msa_kernels.plan import page_table_from_req_to_token, plan_decode, plan_prefill
from msa_kernels.reference import MSAParams

BLOCK = 16


def _batch(seq_lens, extend_lens, hq, hkv, seed, decode_q_len=0, max_context=None):
    gen = torch.Generator().manual_seed(seed)
    return make_paged_batch(
        seq_lens, extend_lens, hq, hkv, head_dim=32, index_dim=32, block_size=BLOCK,
        dtype=torch.float32, device="cpu", decode_q_len=decode_q_len, max_context=max_context, generator=gen,
    )


def _page_table(batch, max_context):
    reqs = torch.arange(len(batch.seq_lens))
    return page_table_from_req_to_token(batch.req_to_token, reqs, max_context, BLOCK)


@pytest.mark.parametrize(
    "init_blocks, hq, hkv, seq_lens, extend_lens, attn_tile_tokens",
    [
        (0, 4, 2, [70, 130, 33], [70, 50, 5], 4),  # fresh prefill, prefix 80 and 28 (not block multiples)
        (1, 4, 2, [97, 40], [1, 40], 1),  # one-token extend; context <= topk blocks (dense)
        (0, 2, 1, [150], [23], 1),  # per-rank geometry under TP: one KV head
    ],
)
def test_prefill_matches_reference(interpreted_api, init_blocks, hq, hkv, seq_lens, extend_lens, attn_tile_tokens):
    params = MSAParams(block_size=BLOCK, topk=4, local_blocks=1, init_blocks=init_blocks)
    batch = _batch(seq_lens, extend_lens, hq, hkv, seed=len(seq_lens) + init_blocks)
    plan = plan_prefill(
        params, _page_table(batch, max(seq_lens)), seq_lens, extend_lens,
        num_index_heads=hkv, attn_tile_tokens=attn_tile_tokens, index_rows=16,
    )
    out, selected = interpreted_api.run_prefill(plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache)
    agreement = compare_with_reference(batch, params, out, selected, rel_tol=1e-4)
    assert agreement.ok, agreement.failures
    assert agreement.rows == sum(extend_lens) * hkv


@pytest.mark.parametrize(
    "init_blocks, hq, hkv, seq_lens, extend_lens, chunk",
    [
        (0, 4, 2, [70, 130, 33], [70, 50, 5], 8192),  # one pass; prefixes 80 and 28
        (1, 6, 2, [97, 40, 150], [60, 40, 23], 37),  # group of 3 (padded rows), passes cutting requests
        (0, 4, 1, [150, 64], [150, 64], 100),  # one KV head (TP); block-multiple lengths
    ],
)
def test_prefill_block_major_matches_reference(interpreted_api, init_blocks, hq, hkv, seq_lens, extend_lens, chunk):
    """KV-block-major attention: sorted (token, head, block) pairs, per-block partials, merge."""
    params = MSAParams(block_size=BLOCK, topk=4, local_blocks=1, init_blocks=init_blocks)
    batch = _batch(seq_lens, extend_lens, hq, hkv, seed=11 + len(seq_lens) + init_blocks)
    plan = plan_prefill(
        params, _page_table(batch, max(seq_lens)), seq_lens, extend_lens,
        num_index_heads=hkv, index_rows=16, block_major=True, block_major_chunk=chunk,
    )
    out, selected = interpreted_api.run_prefill(plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache)
    agreement = compare_with_reference(batch, params, out, selected, rel_tol=1e-4)
    assert agreement.ok, agreement.failures
    assert agreement.rows == sum(extend_lens) * hkv
    query_major = plan_prefill(
        params, plan.page_table, seq_lens, extend_lens, num_index_heads=hkv, index_rows=16, block_major=False
    )
    out_q, selected_q = interpreted_api.run_prefill(query_major, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache)
    assert torch.equal(selected_q, selected)
    torch.testing.assert_close(out_q, out, rtol=1e-5, atol=1e-5)


def test_block_major_over_token_ranges_writes_those_rows_as_the_whole_batch_does(interpreted_api):
    """``tokens=(first, last)``: two ranges cutting a request and a pass give the whole run's rows
    and leave the other rows alone (``benchmarks/prefill_attention_corun.py`` runs the forms side
    by side this way). The first range's rows are the whole run's bit for bit; a range that starts
    inside a pass cuts its sorted pairs at other tile boundaries, so its rows merge the same
    partials in another grouping and agree to fp32 rounding (3e-7 here, with torch 2.14.1 and
    Triton 3.8's interpreter; an earlier environment happened to give equal bits)."""
    params = MSAParams(block_size=BLOCK, topk=4, local_blocks=1, init_blocks=0)
    seq_lens, extend_lens = [97, 150], [60, 90]
    batch = _batch(seq_lens, extend_lens, 4, 2, seed=23)
    plan = plan_prefill(params, _page_table(batch, max(seq_lens)), seq_lens, extend_lens,
                        num_index_heads=2, index_rows=16, block_major=True, block_major_chunk=40)
    selected = interpreted_api.prefill_select(plan, batch.iq, batch.ik_cache)
    scale = 32 ** -0.5
    whole = torch.zeros_like(batch.q)
    interpreted_api._attention_block_major(plan, batch.q, batch.k_cache, batch.v_cache, selected, whole, scale, BLOCK)
    parts = torch.full_like(batch.q, 7.0)
    interpreted_api._attention_block_major(plan, batch.q, batch.k_cache, batch.v_cache, selected, parts, scale, BLOCK,
                                           tokens=(0, 71))
    assert torch.equal(parts[:71], whole[:71]) and bool((parts[71:] == 7.0).all())
    interpreted_api._attention_block_major(plan, batch.q, batch.k_cache, batch.v_cache, selected, parts, scale, BLOCK,
                                           tokens=(71, 150))
    assert torch.equal(parts[:71], whole[:71])
    torch.testing.assert_close(parts, whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "init_blocks, hq, hkv, seq_lens, extend_lens, index_splits",
    [
        (0, 4, 2, [150, 70, 45], [7, 70, 3], 3),  # prefixes 143, 0, 42; tiles of 10, 5 and 3 blocks
        (1, 2, 1, [200, 38], [20, 5], 4),  # prefixes 180, 33; a 3-block tile leaves one split empty
    ],
)
def test_split_index_matches_reference(interpreted_api, init_blocks, hq, hkv, seq_lens, extend_lens, index_splits):
    """The split scan + merge chooses the reference's blocks, forced ones included."""
    params = MSAParams(block_size=BLOCK, topk=4, local_blocks=1, init_blocks=init_blocks)
    batch = _batch(seq_lens, extend_lens, hq, hkv, seed=10 + init_blocks)
    plan = plan_prefill(
        params, _page_table(batch, max(seq_lens)), seq_lens, extend_lens,
        num_index_heads=hkv, index_rows=16, index_splits=index_splits,
    )
    assert plan.index_splits == index_splits
    out, selected = interpreted_api.run_prefill(plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache)
    agreement = compare_with_reference(batch, params, out, selected, rel_tol=1e-4)
    assert agreement.ok, agreement.failures
    assert agreement.rows == sum(extend_lens) * hkv


@pytest.mark.parametrize("index_splits, local_blocks", [(1, 0), (3, 0), (3, 1)])
def test_prefill_index_scan_by_pointer_and_by_descriptor_choose_the_reference_blocks(interpreted_api, index_splits, local_blocks):
    """The index scan reads the blocks that end before a tile's first token unmasked, by tensor
    descriptor where the key rows allow it and by pointer where they do not (here: keys in a padded
    cache); the tile's own blocks masked. Tiles of 8 tokens start at positions 110 and 126 (their
    block ends one key past them), at 31 and 47 (their block ends with them), and inside a fresh
    prefill. Without a local block a row's own block competes on its visible keys' scores, so a
    mask dropped from it shows."""
    params = MSAParams(block_size=BLOCK, topk=4, local_blocks=local_blocks, init_blocks=0)
    seq_lens, extend_lens = [150, 70, 48], [40, 70, 17]  # prefixes 110, 0 and 31
    batch = _batch(seq_lens, extend_lens, 4, 2, seed=23)
    plan = plan_prefill(
        params, _page_table(batch, max(seq_lens)), seq_lens, extend_lens,
        num_index_heads=2, index_rows=16, index_splits=index_splits,
    )
    padded = torch.zeros(*batch.ik_cache.shape[:2], 2 * batch.ik_cache.shape[2])
    padded[..., : batch.ik_cache.shape[2]] = batch.ik_cache
    ik_strided = padded[..., : batch.ik_cache.shape[2]]
    assert interpreted_api._descriptor_loads_fit(batch.ik_cache, batch.ik_cache)
    assert not interpreted_api._descriptor_loads_fit(ik_strided, ik_strided)
    by_descriptor = interpreted_api.prefill_select(plan, batch.iq, batch.ik_cache)
    by_pointer = interpreted_api.prefill_select(plan, batch.iq, ik_strided)
    assert torch.equal(by_pointer, by_descriptor)
    reference_out = torch.cat([reference_request(batch, b, params)[0] for b in range(len(seq_lens))])
    agreement = compare_with_reference(batch, params, reference_out, by_descriptor, rel_tol=0.0)
    assert agreement.ok, agreement.failures
    assert agreement.rows == sum(extend_lens) * 2


@pytest.mark.parametrize("q_len, ragged", [(1, False), (3, True)])
def test_decode_matches_reference(interpreted_api, q_len, ragged):
    """Split attention merged in each one-token tile's last split: decode tokens, and the tokens of a
    verify chain (q_len > 1), each its own tile (draft trees, whose tiles are taller, merge in a
    launch of their own: test_msa_tree_verify)."""
    params = MSAParams(block_size=BLOCK, topk=4, local_blocks=1, init_blocks=0)
    seq_lens = [40, 150, 17, 129]
    max_context = 160  # the page table covers more blocks than any live request uses
    batch = _batch(seq_lens, [q_len] * 4, 4, 2, seed=q_len, decode_q_len=q_len, max_context=max_context)
    q_lens = torch.tensor([q_len, 1, max(1, q_len - 1), q_len]) if ragged else None
    if q_lens is not None:
        batch.extend_lens = q_lens.tolist()
    plan = plan_decode(
        params, _page_table(batch, max_context), torch.tensor(seq_lens), q_len=q_len, q_lens=q_lens, num_kv_heads=2, num_sms=24
    )
    assert plan.attn_splits > 1  # the split + merge path is exercised
    out, selected = interpreted_api.run_decode(plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache)
    agreement = compare_with_reference(batch, params, out, selected, rel_tol=1e-4)
    assert agreement.ok, agreement.failures
    assert agreement.rows == sum(batch.extend_lens) * 2
    # The merge tickets are zero again, so a second launch (the next layer, a graph replay)
    # elects its last splits afresh and gives the same result.
    assert not plan.tickets.any()
    out2, selected2 = interpreted_api.run_decode(plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache)
    rows = torch.cat([batch.rows_of(b) for b in range(len(seq_lens))])
    assert torch.equal(selected2[rows], selected[rows])
    torch.testing.assert_close(out2[rows], out[rows], rtol=0, atol=0)


def test_decode_topk_widths_pick_what_the_full_width_picks(interpreted_api):
    """A graph's plan spans the model's whole context (256 blocks here), so the top-k ranks only
    the narrowest width holding a token's visible blocks (16, 64 or 256 of them): tokens in each
    width, and at each width's last block, choose what the reference chooses over every block."""
    from msa_kernels.plan import Tiles
    from msa_kernels.reference import select_blocks
    from msa_kernels.triton_select import decode_topk_kernel

    params = MSAParams(block_size=BLOCK, topk=4, local_blocks=1, init_blocks=1)
    nbp, heads = 256, 2
    widths = interpreted_api.topk_widths(nbp)
    assert (widths["SHORT"], widths["MEDIUM"]) == (16, 64)
    # own block 0 (fewer visible than topk), 3, 15 | 16, 40, 63 | 64, 200, 255
    positions = torch.tensor([5, 3 * BLOCK + 2, 16 * BLOCK - 1, 16 * BLOCK, 40 * BLOCK + 7, 64 * BLOCK - 1,
                              64 * BLOCK, 200 * BLOCK + 9, 256 * BLOCK - 1])
    batch = positions.numel()
    gen = torch.Generator().manual_seed(11)
    scores = torch.randn(batch, 16, nbp, generator=gen)  # rows >= heads, as decode_select pads them
    scores[:, :, 30] = scores[:, :, 31]  # a tie: the lower block id wins, as in torch's topk
    tiles = Tiles(req=torch.arange(batch, dtype=torch.int32), tok0=torch.arange(batch, dtype=torch.int32),
                  pos0=positions.int(), ntok=torch.ones(batch, dtype=torch.int32), max_tokens=1)
    selected = torch.full((batch, heads, params.topk), -7, dtype=torch.int32)
    decode_topk_kernel[(batch, heads, 1)](
        scores, selected, tiles.tok0, tiles.pos0, tiles.ntok,
        scores.stride(0), scores.stride(1), selected.stride(0), selected.stride(1),
        NUM_HEADS=heads, BLOCK=BLOCK, NBP=nbp, TOPK=params.topk, KP=params.topk,
        LOCAL=params.local_blocks, INIT=params.init_blocks, **widths,
    )
    expected = select_blocks(scores[:, :heads, :nbp], positions, params)
    assert torch.equal(selected.long(), expected)


@pytest.mark.parametrize("nbp, topk", [(256, 6), (2048, 6), (16, 20)])
def test_decode_topk_both_forms_rank_ties_to_the_lower_block(interpreted_api, nbp, topk):
    """Rows of up to ``BITONIC_MAX_WIDTH`` blocks are ranked by the bitonic top-k, wider ones by
    the serial picks (2,048 blocks: widths 128, 512 bitonic, 2,048 serial), and so are rows
    narrower than the top-k's power-of-two slots (16 blocks, top-20). Scores drawn from five values
    (so most blocks tie), -0.0 among them: both forms choose the forced blocks, then the largest
    scores, equal ones by the lower block id, as a stable sort does."""
    from msa_kernels.triton_select import decode_topk_kernel

    params = MSAParams(block_size=BLOCK, topk=topk, local_blocks=2, init_blocks=1)
    heads = 2
    widths = interpreted_api.topk_widths(nbp)
    edges = {0, 3, widths["SHORT"] - 1, widths["SHORT"], widths["MEDIUM"] - 1, widths["MEDIUM"] + 5, nbp - 1}
    own_blocks = sorted(b for b in edges if b < nbp)
    positions = torch.tensor([b * BLOCK + (b % BLOCK) for b in own_blocks])
    batch = positions.numel()
    gen = torch.Generator().manual_seed(nbp)
    values = torch.tensor([-1.5, -0.0, 0.0, 0.25, 2.0])
    scores = values[torch.randint(0, 5, (batch, 16, nbp), generator=gen)]
    ones = torch.ones(batch, dtype=torch.int32)
    selected = torch.full((batch, heads, params.topk), -7, dtype=torch.int32)
    decode_topk_kernel[(batch, heads, 1)](
        scores, selected, torch.arange(batch, dtype=torch.int32), positions.int(), ones,
        scores.stride(0), scores.stride(1), selected.stride(0), selected.stride(1),
        NUM_HEADS=heads, BLOCK=BLOCK, NBP=nbp, TOPK=params.topk, KP=triton.next_power_of_2(params.topk),
        LOCAL=params.local_blocks, INIT=params.init_blocks, **widths,
    )
    for b, own in enumerate(own_blocks):
        for h in range(heads):
            visible = list(range(own + 1))
            forced = [j for j in visible if j > own - params.local_blocks or j < params.init_blocks]
            rank = {j: (0 if j in forced else 1, -float(scores[b, h, j]), j) for j in visible}
            chosen = sorted(sorted(visible, key=rank.get)[: params.topk])
            expected = chosen + [-1] * (params.topk - len(chosen))
            assert selected[b, h].tolist() == expected, (own, h)


def test_decode_in_a_whole_context_plan_matches_reference(interpreted_api):
    """Decode through a page table as wide as a graph's (256 blocks), with requests whose own
    blocks fall in each of the top-k's widths."""
    params = MSAParams(block_size=BLOCK, topk=4, local_blocks=1, init_blocks=0)
    seq_lens = [40, 1025, 2000]  # own blocks 2, 64 (the first past the middle width), 124
    max_context = 256 * BLOCK
    batch = _batch(seq_lens, [1] * 3, 4, 2, seed=5, decode_q_len=1, max_context=max_context)
    plan = plan_decode(params, _page_table(batch, max_context), torch.tensor(seq_lens), q_len=1, num_kv_heads=2, num_sms=24)
    out, selected = interpreted_api.run_decode(plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache)
    agreement = compare_with_reference(batch, params, out, selected, rel_tol=1e-4)
    assert agreement.ok, agreement.failures
    assert agreement.rows == 3 * 2


def test_decode_and_prefill_agree_on_the_last_token(interpreted_api):
    """The two paths are different kernels; for the same context they must choose and compute alike."""
    params = MSAParams(block_size=BLOCK, topk=4, local_blocks=1, init_blocks=0)
    seq_lens = [70, 41]
    batch = _batch(seq_lens, seq_lens, 4, 2, seed=7)
    table = _page_table(batch, max(seq_lens))
    plan = plan_prefill(params, table, seq_lens, seq_lens, num_index_heads=2, index_rows=32)
    out_p, sel_p = interpreted_api.run_prefill(plan, batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache)
    last = torch.tensor([seq_lens[0] - 1, sum(seq_lens) - 1])
    dplan = plan_decode(params, table, torch.tensor(seq_lens), q_len=1, num_kv_heads=2)
    args = (batch.k_cache, batch.v_cache, batch.iq[last], batch.ik_cache)
    out_d, sel_d = interpreted_api.run_decode(dplan, batch.q[last], *args)
    assert torch.equal(sel_p[last], sel_d)
    torch.testing.assert_close(out_p[last], out_d, rtol=1e-5, atol=1e-5)


def test_bad_tensors_are_refused_before_any_launch(interpreted_api):
    params = MSAParams(block_size=BLOCK, topk=4)
    batch = _batch([40], [1], 4, 2, seed=3, decode_q_len=1, max_context=48)
    plan = plan_decode(params, _page_table(batch, 48), torch.tensor([40]), num_kv_heads=2)
    args = [batch.q, batch.k_cache, batch.v_cache, batch.iq, batch.ik_cache]
    with pytest.raises(ValueError, match="iq must be"):
        interpreted_api.run_decode(plan, *args[:3], batch.iq[:, :1], args[4])
    with pytest.raises(ValueError, match="q must be contiguous"):
        interpreted_api.run_decode(plan, batch.q.transpose(1, 2).contiguous().transpose(1, 2), *args[1:])
    with pytest.raises(ValueError, match="multiple of kv heads"):
        interpreted_api.run_decode(plan, batch.q[:, :3], *args[1:])
    with pytest.raises(ValueError, match="the plan was made for 2"):  # its merge tickets count 2 heads
        interpreted_api.run_decode(plan, batch.q, batch.k_cache[:, :1], batch.v_cache[:, :1], batch.iq[:, :1], args[4])


def test_decode_launches_are_chained_on_hopper_gpus_only(interpreted_api):
    """Programmatic dependent launch is a Hopper feature: off for CPU tensors (the interpreter runs
    the kernels one after the other), and a dense attention, which follows no top-k, refuses it."""
    assert not interpreted_api.chains_decode_launches(torch.device("cpu"))
    params = MSAParams(block_size=BLOCK, topk=4, local_blocks=1, init_blocks=0)
    batch = _batch([40, 70], [1, 1], 4, 2, seed=3, decode_q_len=1, max_context=128)
    plan = plan_decode(params, _page_table(batch, 128), torch.tensor([40, 70]), q_len=1, num_kv_heads=2, num_sms=8)
    with pytest.raises(ValueError, match="cannot be chained"):
        interpreted_api.decode_attention(plan, batch.q, batch.k_cache, batch.v_cache, None, dense=True, chained=True)
