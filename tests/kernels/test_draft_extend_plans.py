"""An EAGLE draft's extend over the verify window on the MSA decode kernels
(``sglang_m3.speculative.draft_extend``), on the CPU under the Triton interpreter.

Each request's window tokens (the last ``q_len`` of its ``seq_lens``, as SGLang's
DRAFT_EXTEND_V2 batch counts them) must attend causally to every key up to their position: the
torch reference with every block chosen. Eager plans, and the static graph plans through a
capture and replays with padded rows, as the draft-extend graph runner drives them.
"""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from forward_batch_doubles import draft_extend_input, forward_batch_for
from msa_kernels.paged_batch import make_paged_batch, reference_request
from msa_triton_fakes import BLOCK, D, HKV, HQ, LAYER, PARAMS

EVERY_BLOCK = dataclasses.replace(PARAMS, topk=1 << 10)
CONTEXT = 160
MAX_BS = 4


@pytest.fixture
def draft_extend(interpreted_api, monkeypatch):
    monkeypatch.delenv("SGLANG_M3_DRAFT_EXTEND", raising=False)
    from sglang_m3.speculative import draft_extend

    return draft_extend


def _pool(caches):
    return SimpleNamespace(
        head_num=HKV,
        get_key_buffer=lambda layer_id: caches().k_cache,
        get_value_buffer=lambda layer_id: caches().v_cache,
    )


def _window_batch(kv_lens, q_len, seed, max_context=None):
    return make_paged_batch(
        kv_lens, [q_len] * len(kv_lens), HQ, HKV, D, D, BLOCK, torch.float32, "cpu",
        decode_q_len=q_len, max_context=max_context, generator=torch.Generator().manual_seed(seed),
    )


def _eager(draft_extend, batch, q_len):
    """Plans over ``batch`` (request ``b`` in pool row ``B-1-b``) and its DRAFT_EXTEND_V2 batch."""
    n = len(batch.seq_lens)
    req_to_token = batch.req_to_token.flip(0)
    plans = draft_extend.DraftExtendPlans(req_to_token, _pool(lambda: batch), PARAMS, CONTEXT, 24, "cpu")
    fb = forward_batch_for("DRAFT_EXTEND_V2", req_to_token, torch.arange(n - 1, -1, -1), batch.seq_lens, [q_len] * n)
    return plans, fb


def _assert_matches_reference(batch, out):
    for b in range(len(batch.seq_lens)):
        want, _, _ = reference_request(batch, b, EVERY_BLOCK)
        torch.testing.assert_close(out[batch.rows_of(b)], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("q_len, kv_lens", [(4, [41, 150, 18]), (8, [8, 129, 64]), (1, [5, 33])])
def test_an_eager_window_attends_every_key_up_to_each_token(draft_extend, q_len, kv_lens):
    batch = _window_batch(kv_lens, q_len, seed=q_len)
    plans, fb = _eager(draft_extend, batch, q_len)
    plans.plan_eager(fb)
    assert plans.takes(LAYER, fb, {})
    out = plans.attend(batch.q.reshape(batch.q.shape[0], -1), None, None, LAYER, fb, save_kv_cache=False)
    _assert_matches_reference(batch, out.view(-1, HQ, D))


def test_the_window_is_planned_without_host_lengths(draft_extend):
    """``prepare_for_draft_extend`` leaves ``seq_lens_cpu`` None on its GPU-only path: the plan then
    spans ``req_to_token``'s width instead of reading the device lengths back."""
    batch = _window_batch([41, 150, 18], 4, seed=2)
    plans, fb = _eager(draft_extend, batch, 4)
    fb.seq_lens_cpu = None
    plans.plan_eager(fb)
    out = plans.attend(batch.q.reshape(batch.q.shape[0], -1), None, None, LAYER, fb, save_kv_cache=False)
    _assert_matches_reference(batch, out.view(-1, HQ, D))


def test_the_window_writes_its_kv_before_attending(draft_extend):
    batch = _window_batch([41, 150], 4, seed=5)
    plans, fb = _eager(draft_extend, batch, 4)
    writes = []
    plans.kv_pool.set_kv_buffer = lambda layer, loc, k, v, *scales: writes.append((loc.loc, k, v))
    plans.plan_eager(fb)
    k, v = torch.randn(batch.q.shape[0], HKV, D), torch.randn(batch.q.shape[0], HKV, D)
    plans.attend(batch.q.reshape(batch.q.shape[0], -1), k, v, LAYER, fb)
    (loc, written_k, written_v), = writes
    assert torch.equal(loc, fb.out_cache_loc) and written_k is k and written_v is v


def _other(layer, **fields):
    return SimpleNamespace(**{**vars(layer), **fields})


@pytest.mark.parametrize("layer, extra", [
    (_other(LAYER, tp_k_head_num=HKV * 2), {}),  # the plan's merge tickets count its KV heads
    (_other(LAYER, qk_head_dim=24, v_head_dim=24), {}),  # the kernels' head dim is a power of two
    (_other(LAYER, v_head_dim=D // 2), {}),
    (_other(LAYER, logit_cap=30.0), {}),
    (LAYER, {"sinks": torch.zeros(HQ)}),
])
def test_calls_the_kernels_do_not_compute_are_left_to_sglang(draft_extend, layer, extra):
    batch = _window_batch([41, 150], 4, seed=7)
    plans, fb = _eager(draft_extend, batch, 4)
    plans.plan_eager(fb)
    assert plans.takes(LAYER, fb, {})
    assert not plans.takes(layer, fb, extra)


@pytest.mark.parametrize("mode", ["EXTEND", "TARGET_VERIFY", "DECODE"])
def test_other_batches_of_the_draft_are_not_planned(draft_extend, mode):
    q_len = 1 if mode == "DECODE" else 4
    batch = _window_batch([41, 150], q_len, seed=8)
    plans, _ = _eager(draft_extend, batch, q_len)
    fb = forward_batch_for(mode, batch.req_to_token.flip(0), torch.tensor([1, 0]), batch.seq_lens, [q_len] * 2)
    plans.plan_eager(fb)
    assert plans.plan is None and not plans.takes(LAYER, fb, {})


def test_a_widened_window_is_left_to_sglang(draft_extend):
    """Front tokens re-run before the window are not in the plan's shape."""
    batch = _window_batch([41, 150], 4, seed=9)
    plans, fb = _eager(draft_extend, batch, 4)
    fb.spec_info = draft_extend_input(2, 4, num_front_tokens=2)
    plans.plan_eager(fb)
    assert plans.plan is None and not plans.takes(LAYER, fb, {})


class DraftExtendGraphDouble:
    """The draft-extend graph runner's side: static ``req_pool_indices`` / ``seq_lens`` buffers
    (device and host) refilled in place, the batch padded to the replayed size with SGLang's fill
    value and pool row 0, rows past it left stale. As SGLang does, the host side of a replay sees
    the whole buffers with ``batch_size``, the work recorded in the graph the batch's slices."""

    STALE = CONTEXT * 10  # a length no request has: reading it would refuse the batch

    def __init__(self, draft_extend, q_len, fill=1):
        self.q_len, self.fill = q_len, fill
        self.req_to_token = torch.zeros(8, CONTEXT + 8, dtype=torch.int32)
        self.batch = None
        self.plans = draft_extend.DraftExtendPlans(self.req_to_token, _pool(lambda: self.batch), PARAMS, CONTEXT, 24, "cpu")
        self.plans.init_graph_state(MAX_BS, MAX_BS * q_len)
        self.req_pool_indices = torch.zeros(MAX_BS, dtype=torch.int64)
        self.seq_lens = torch.full((MAX_BS,), fill, dtype=torch.int64)
        self.seq_lens_cpu = self.seq_lens.clone()
        self.spec_info = draft_extend_input(MAX_BS, q_len)

    def load(self, kv_lens, pool_rows, seed, bs):
        raw = len(kv_lens)
        self.batch = _window_batch(kv_lens, self.q_len, seed, max_context=self.req_to_token.shape[1])
        self.req_to_token.zero_()
        self.req_to_token[torch.tensor(pool_rows)] = self.batch.req_to_token
        self.req_pool_indices[:raw] = torch.tensor(pool_rows)
        self.req_pool_indices[raw:] = 0
        for buffer in (self.seq_lens, self.seq_lens_cpu):
            buffer[:raw] = torch.tensor(kv_lens)
            buffer[raw:bs] = self.fill
            buffer[bs:] = self.STALE

    def step(self, bs):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        def view(rows):
            return SimpleNamespace(
                forward_mode=ForwardMode.DRAFT_EXTEND_V2, batch_size=bs, req_pool_indices=self.req_pool_indices[:rows],
                seq_lens=self.seq_lens[:rows], seq_lens_cpu=self.seq_lens_cpu[:rows], spec_info=self.spec_info,
            )

        replay, recorded = view(MAX_BS), view(bs)
        self.plans.plan_graphed(replay)
        self.plans.refresh_graphed(recorded)
        padding = torch.randn(bs * self.q_len - self.batch.q.shape[0], HQ, D, generator=torch.Generator().manual_seed(bs))
        q = torch.cat([self.batch.q, padding])
        assert self.plans.takes(LAYER, replay, {})
        return self.plans.attend(q.reshape(q.shape[0], -1), None, None, LAYER, recorded, save_kv_cache=False).view(-1, HQ, D)


@pytest.mark.parametrize("q_len", [4, 8])
def test_graphed_windows_keep_their_plan_and_match_the_reference(draft_extend, q_len):
    """Three replays: 3 requests padded to 4, 4 requests (one at the full context, one of a bare
    window), 2 requests replayed at 2 with the buffers' last rows stale."""
    runner = DraftExtendGraphDouble(draft_extend, q_len)
    steps = [([41, 150, 17], [5, 0, 3], MAX_BS), ([CONTEXT, 33, q_len, 95], [1, 2, 6, 7], MAX_BS), ([64, 129], [2, 6], 2)]
    addresses = None
    for seed, (kv_lens, rows, bs) in enumerate(steps):
        runner.load(kv_lens, rows, seed, bs)
        out = runner.step(bs)
        plan = runner.plans.plan
        assert plan.tiles.count == bs
        now = [t.data_ptr() for t in (plan.page_table, plan.tiles.pos0, plan.tickets)]
        assert addresses in (None, now)
        addresses = now
        _assert_matches_reference(runner.batch, out)


@pytest.mark.parametrize("value, taken", [(None, True), ("msa", True), ("sglang", False)])
def test_the_switch(draft_extend, monkeypatch, value, taken):
    if value is not None:
        monkeypatch.setenv(draft_extend.ENV, value)
    assert draft_extend.enabled() is taken


def test_a_bad_switch_value_is_refused_with_the_variable_named(draft_extend, monkeypatch):
    monkeypatch.setenv(draft_extend.ENV, "on")
    with pytest.raises(ValueError, match="SGLANG_M3_DRAFT_EXTEND='on'"):
        draft_extend.enabled()
