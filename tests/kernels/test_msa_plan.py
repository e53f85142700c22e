"""Plan metadata (torch only, no kernels): tiles cover every query row once at the right positions."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from msa_kernels import plan as plan_module
from msa_kernels.plan import page_table_from_req_to_token, plan_decode, plan_prefill
from msa_kernels.reference import MSAParams

PARAMS = MSAParams(block_size=16, topk=4)
M3_PARAMS = MSAParams(block_size=128, topk=16)
K = 1024


@st.composite
def extend_batches(draw):
    n = draw(st.integers(1, 5))
    extend = draw(st.lists(st.integers(1, 90), min_size=n, max_size=n))
    prefix = draw(st.lists(st.integers(0, 70), min_size=n, max_size=n))
    return [p + e for p, e in zip(prefix, extend)], extend


@settings(max_examples=60, deadline=None)
@given(extend_batches(), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]))
def test_prefill_tiles_cover_each_row_once(batch, attn_tile_tokens, heads):
    seq_lens, extend_lens = batch
    table = torch.zeros(len(seq_lens), 10, dtype=torch.int32)
    plan = plan_prefill(PARAMS, table, seq_lens, extend_lens, num_index_heads=heads, attn_tile_tokens=attn_tile_tokens)
    starts = [0]
    for e in extend_lens:
        starts.append(starts[-1] + e)
    for tiles in (plan.index_tiles, plan.attn_tiles):
        position_of_row = {}
        for req, tok0, pos0, ntok in zip(*(x.tolist() for x in (tiles.req, tiles.tok0, tiles.pos0, tiles.ntok))):
            assert 1 <= ntok <= tiles.max_tokens
            for i in range(ntok):
                assert tok0 + i not in position_of_row
                assert starts[req] <= tok0 + i < starts[req + 1]  # never crosses requests
                position_of_row[tok0 + i] = pos0 + i
        expected = {
            starts[b] + i: seq_lens[b] - extend_lens[b] + i for b in range(len(seq_lens)) for i in range(extend_lens[b])
        }
        assert position_of_row == expected
        ends = (tiles.pos0 + tiles.ntok).tolist()
        assert ends == sorted(ends, reverse=True)  # most work first
    assert plan.num_tokens == sum(extend_lens)


def _m3_prefill(seq_lens, extend_lens, heads, **kwargs):
    table = torch.zeros(len(seq_lens), max(seq_lens) // 128 + 1, dtype=torch.int32)
    return plan_prefill(M3_PARAMS, table, seq_lens, extend_lens, num_index_heads=heads, **kwargs)


@settings(max_examples=80, deadline=None)
@given(extend_batches(), st.sampled_from([1, 2, 3, 32]))
def test_tiles_are_cut_per_request_and_ordered_longest_context_first(batch, tile_tokens):
    """The tiles, in order, as the definition reads: each request's new tokens cut from its first,
    then all tiles sorted by the context their last token sees, largest first, ties in request order."""
    seq_lens, extend_lens = batch
    expected, tok0 = [], 0
    for req, (seq_len, ext) in enumerate(zip(seq_lens, extend_lens)):
        for start in range(0, ext, tile_tokens):
            expected.append((req, tok0 + start, seq_len - ext + start, min(tile_tokens, ext - start)))
        tok0 += ext
    expected.sort(key=lambda tile: -(tile[2] + tile[3]))
    tiles = plan_module._tiles_for(seq_lens, extend_lens, tile_tokens, torch.device("cpu"))
    got = list(zip(*(x.tolist() for x in (tiles.req, tiles.tok0, tiles.pos0, tiles.ntok))))
    assert got == expected
    assert all(x.dtype == torch.int32 and x.is_contiguous() for x in (tiles.req, tiles.tok0, tiles.pos0, tiles.ntok))
    assert tiles.max_tokens == tile_tokens


@pytest.mark.parametrize("n, heads", [(32 * K, 4), (64 * K, 1), (8 * K, 4), (4 * K, 4)])
def test_prefill_without_prefix_scans_in_one_pass(n, heads):
    """Many tiles fill the GPU (or each is too short to share): no split, no merge launch."""
    assert _m3_prefill([n], [n], heads).index_splits == 1


@pytest.mark.parametrize("prefix, heads", [(124 * K, 4), (24 * K, 4), (124 * K, 1)])
def test_short_chunk_after_long_prefix_splits_its_tiles(prefix, heads):
    num_sms = 132
    plan = _m3_prefill([prefix + 4 * K], [4 * K], heads, num_sms=num_sms)
    programs = plan.index_tiles.count * plan.index_splits
    assert plan.index_tiles.count < plan_module._INDEX_TILES_PER_SM_UNSPLIT * num_sms  # tiles alone leave SMs idle
    assert plan.index_splits > 1
    assert programs >= plan_module._INDEX_TILES_PER_SM_UNSPLIT * num_sms
    blocks = (prefix + 4 * K) // 128
    assert blocks // plan.index_splits >= plan_module._MIN_BLOCKS_PER_INDEX_SPLIT


def test_index_splits_keep_enough_blocks_each():
    """A chunk with few tiles but a short context splits only as far as the minimum blocks per split."""
    plan = _m3_prefill([200 * 128 + 5, 300], [64, 300], 4)
    assert plan.index_splits == 201 // plan_module._MIN_BLOCKS_PER_INDEX_SPLIT > 1
    assert _m3_prefill([300], [64], 4).index_splits == 1


def test_index_splits_can_be_forced():
    assert _m3_prefill([32 * K], [32 * K], 4, index_splits=3).index_splits == 3


def test_decode_tiles_are_requests():
    seq = torch.tensor([5, 40, 17])
    plan = plan_decode(PARAMS, torch.zeros(3, 4, dtype=torch.int32), seq, q_len=3, q_lens=torch.tensor([3, 1, 2]))
    assert plan.tiles.tok0.tolist() == [0, 3, 6]
    assert plan.tiles.pos0.tolist() == [2, 39, 15]
    assert plan.tiles.ntok.tolist() == [3, 1, 2]
    assert plan.num_tokens == 9 and plan.tiles.max_tokens == 3


@pytest.mark.parametrize("batch, blocks, splits, splits_fp8", [
    (8, 1024, 528, 66),  # B8 L128K: 32 and 4 programs per SM over 132 SMs
    (1, 256, 256, 256),  # B1 L32K: at most one program per block either way
    (64, 64, 64, 9),
])
def test_decode_index_scan_splits_follow_the_key_dtype(batch, blocks, splits, splits_fp8):
    plan = plan_decode(PARAMS, torch.zeros(batch, blocks, dtype=torch.int32), torch.full((batch,), blocks * 16), num_sms=132)
    assert (plan.index_splits, plan.index_splits_fp8) == (splits, splits_fp8)


def test_page_table_reads_the_first_slot_of_each_block():
    req_to_token = torch.zeros(3, 64, dtype=torch.int32)
    req_to_token[2, :40] = torch.cat([torch.arange(16) + 16 * p for p in (7, 2, 9)])[:40]
    table = page_table_from_req_to_token(req_to_token, torch.tensor([2]), 48, 16)
    assert table.tolist() == [[7, 2, 9]]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: plan_prefill(PARAMS, torch.zeros(1, 4, dtype=torch.int32), [10], [11], 2), "extend length"),
        (lambda: plan_prefill(PARAMS, torch.zeros(1, 2, dtype=torch.int32), [40], [8], 2), "needs more blocks"),
        (lambda: plan_prefill(PARAMS, torch.zeros(2, 4, dtype=torch.int32), [10], [5], 2), "page_table"),
        (lambda: plan_prefill(PARAMS, torch.zeros(1, 4, dtype=torch.int32), [10], [5], 3, index_rows=64), "index_rows"),
        (lambda: plan_prefill(PARAMS, torch.zeros(1, 4, dtype=torch.int32), [10], [5], 2, index_splits=0), "index_splits"),
        (lambda: plan_decode(PARAMS, torch.zeros(1, 4, dtype=torch.int32), torch.tensor([9]), q_len=0), "q_len"),
        (lambda: page_table_from_req_to_token(torch.zeros(2, 32, dtype=torch.int32), torch.tensor([0]), 64, 16), "max_context"),
    ],
)
def test_bad_inputs_name_the_field(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_attention_form_follows_the_batch_size_and_context():
    """Block-major for long extends, and shorter ones after long prefixes (where it measured
    faster), query-major otherwise; overridable."""
    for tokens, context in plan_module.BLOCK_MAJOR_FROM:
        seq = max(tokens, context)
        assert _m3_prefill([seq], [tokens], 4).block_major
    assert _m3_prefill([8 * K], [8 * K], 4).block_major  # a fresh 8K prompt
    assert not _m3_prefill([2 * K], [2 * K], 4).block_major  # a fresh 2K prompt: query-major
    assert _m3_prefill([18 * K], [2 * K], 4).block_major  # 2K after 16K
    assert not _m3_prefill([17 * K], [1 * K], 4).block_major  # 1K after 16K
    assert _m3_prefill([61 * K], [1 * K], 4).block_major  # 1K after 60K
    assert not _m3_prefill([128 * K], [512], 4).block_major  # 512 tokens after 127.5K
    assert _m3_prefill([2 * K], [2 * K], 4, block_major=True).block_major
    with pytest.raises(ValueError, match="block_major_chunk"):
        _m3_prefill([4 * K], [4 * K], 4, block_major_chunk=0)
