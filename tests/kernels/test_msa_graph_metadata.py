"""CUDA-graph metadata of the MSA Triton backend: capture, then replays, on the CPU under the interpreter.

No graph can be captured without a GPU, so :class:`GraphRunnerDouble` plays SGLang's decode
graph runner around the backend: static input buffers (``req_pool_indices``, ``seq_lens``) that
every step refills in place, padding the batch to the captured size with the dense backend's fill
value and pool row 0; ``init_forward_metadata_out_graph`` (``in_capture=True`` once, then
``False``) and the in-graph work at every step. What a real graph relies on is asserted: the
plan's tensors keep their addresses from capture on, and real rows equal the torch reference.
"""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from msa_kernels.paged_batch import make_paged_batch, reference_request
from msa_triton_fakes import BLOCK, D, HKV, HQ, LAYER, PARAMS, SPEC, attend, fake_runner

MAX_BS = 4
CONTEXT = 160  # model context_len; req_to_token is wider, as SGLang's (+4 + draft tokens)
POOL_ROWS, POOL_WIDTH = 8, CONTEXT + 8


def _forward_mode(name):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return getattr(ForwardMode, name)


class GraphRunnerDouble:
    """The runner's side of graph capture / replay for one ``mode`` with ``q_len`` tokens per request."""

    def __init__(self, module, mode: str, q_len: int, fill: int):
        self.mode, self.q_len, self.fill = mode, q_len, fill
        self.req_to_token = torch.zeros(POOL_ROWS, POOL_WIDTH, dtype=torch.int32)
        self.batch = None
        self.backend = module.MSATritonBackend(fake_runner(self.req_to_token, lambda: self.batch, CONTEXT), SPEC)
        self.backend.init_cuda_graph_state(MAX_BS, MAX_BS * q_len)
        self.req_pool_indices = torch.zeros(MAX_BS, dtype=torch.int64)
        self.seq_lens = torch.full((MAX_BS,), fill, dtype=torch.int64)
        self.seq_lens_cpu = self.seq_lens.clone()
        self.spec_info = SimpleNamespace(draft_token_num=q_len, num_tokens_per_req=-1, topk=1) if mode == "TARGET_VERIFY" else None

    def load(self, kv_lens, pool_rows, seed, poison_padding=False):
        """A random batch whose request ``b`` holds ``kv_lens[b]`` tokens (queries included) in pool row ``pool_rows[b]``."""
        raw = len(kv_lens)
        self.batch = make_paged_batch(
            kv_lens, [self.q_len] * raw, HQ, HKV, D, D, BLOCK, torch.float32, "cpu",
            decode_q_len=self.q_len, max_context=POOL_WIDTH, generator=torch.Generator().manual_seed(seed),
        )
        self.req_to_token.zero_()  # rows of finished requests: slot 0, as a fresh pool
        self.req_to_token[torch.tensor(pool_rows)] = self.batch.req_to_token
        if poison_padding:  # padded rows read row 0: point it at a spare page, all NaN
            slots = torch.arange(0, self.batch.k_cache.shape[0], BLOCK)
            spare = int(slots[self.batch.k_cache[slots, 0, 0].isnan()][0])
            self.req_to_token[0] = spare + torch.arange(POOL_WIDTH) % BLOCK
        # seq_lens as SGLang hands them: decode counts the new token, verify keeps the drafts out
        counted = torch.tensor(kv_lens) - (self.q_len if self.mode == "TARGET_VERIFY" else 0)
        self.req_pool_indices[:raw] = torch.tensor(pool_rows)
        self.req_pool_indices[raw:] = 0
        for buffer in (self.seq_lens, self.seq_lens_cpu):
            buffer[:raw] = counted
            buffer[raw:] = self.fill

    def view(self, bs):
        return SimpleNamespace(
            forward_mode=_forward_mode(self.mode),
            batch_size=bs,
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=self.seq_lens_cpu[:bs],
            spec_info=self.spec_info,
        )

    def step(self, bs, in_capture):
        """Metadata prep as at capture / replay, then one sparse layer over the padded batch."""
        fb = self.view(bs)
        self.backend.init_forward_metadata_out_graph(fb, in_capture=in_capture)
        self.backend.init_forward_metadata_in_graph(fb)
        padded_rows = bs * self.q_len - self.batch.q.shape[0]
        generator = torch.Generator().manual_seed(bs)
        q = torch.cat([self.batch.q, torch.randn(padded_rows, HQ, D, generator=generator)])
        iq = torch.cat([self.batch.iq, torch.randn(padded_rows, HKV, D, generator=generator)])
        return attend(self.backend, SimpleNamespace(q=q, iq=iq))


def _addresses(plan):
    tiles = plan.tiles
    return [t.data_ptr() for t in (plan.page_table, tiles.req, tiles.tok0, tiles.pos0, tiles.ntok, plan.tickets)]


def _assert_real_rows_match(runner, out):
    batch = runner.batch
    for b in range(len(batch.seq_lens)):
        want, _, _ = reference_request(batch, b, PARAMS)
        torch.testing.assert_close(out[batch.rows_of(b)], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "mode, q_len, fill, steps",
    [
        # (kv lengths, pool rows) per step: capture with 3 of 4 rows real, then replays with
        # 4 real rows (one at the full context, one of a single token) and with 2 real rows
        ("DECODE", 1, 1, [([40, 150, 17], [5, 0, 3]), ([CONTEXT, 33, 1, 95], [1, 2, 6, 7]), ([64, 129], [2, 6])]),
        # a fill value of 0 (a dense backend may pad with it) must not make positions negative
        ("DECODE", 1, 0, [([40, 150, 17], [5, 0, 3]), ([CONTEXT, 33, 1, 95], [1, 2, 6, 7]), ([64, 129], [2, 6])]),
        # verify drafts may run past context_len into req_to_token's spare columns
        ("TARGET_VERIFY", 2, 1, [([41, 150, 18], [5, 0, 3]), ([CONTEXT + 2, 33, 2, 96], [1, 2, 6, 7]), ([64, 129], [2, 6])]),
    ],
)
def test_capture_then_replays_keep_addresses_and_match_reference(backend_module, mode, q_len, fill, steps):
    runner = GraphRunnerDouble(backend_module, mode, q_len, fill)
    captured = None
    for i, (kv_lens, pool_rows) in enumerate(steps):
        last = i == len(steps) - 1
        runner.load(kv_lens, pool_rows, seed=i, poison_padding=last)
        out = runner.step(MAX_BS, in_capture=i == 0)
        plan = runner.backend.kernel_plan
        if captured is None:
            captured = _addresses(plan)
        assert _addresses(plan) == captured, f"step {i}: the plan moved"
        assert plan.num_tokens == MAX_BS * q_len and plan.max_blocks == -(-(CONTEXT + (q_len if q_len > 1 else 0)) // BLOCK)
        _assert_real_rows_match(runner, out)
        if last:  # the padded rows did read the poisoned page, and it stayed in their own rows
            assert out[len(kv_lens) * q_len :].isnan().any()


@pytest.mark.parametrize("mode, q_len, switch, longest", [
    ("TARGET_VERIFY", 2, "SGLANG_M3_DENSE_VERIFY", CONTEXT + 2),  # a full context plus its drafts
    ("DECODE", 1, "SGLANG_M3_DENSE_DECODE", CONTEXT),
])
def test_dense_layers_of_graphed_batches_read_the_same_static_plan(backend_module, monkeypatch, mode, q_len, switch, longest):
    """``SGLANG_M3_DENSE_VERIFY=msa`` / ``SGLANG_M3_DENSE_DECODE=msa`` (the defaults): a dense layer
    of a graphed verify or decode batch runs on the static plan the sparse layers refreshed
    (captured once, then replayed), every block up to each query token."""
    monkeypatch.setenv(switch, "msa")
    runner = GraphRunnerDouble(backend_module, mode, q_len, 1)
    every_block = dataclasses.replace(PARAMS, topk=1 << 10)
    for i, (kv_lens, pool_rows) in enumerate([([41, 150, 18], [5, 0, 3]), ([longest, 33, 2, 96], [1, 2, 6, 7])]):
        runner.load(kv_lens, pool_rows, seed=10 + i)
        runner.step(MAX_BS, in_capture=i == 0)
        fb = runner.view(MAX_BS)
        assert runner.backend.takes_dense_layer(LAYER, fb, {})
        padded_rows = MAX_BS * q_len - runner.batch.q.shape[0]
        q = torch.cat([runner.batch.q, torch.randn(padded_rows, HQ, D, generator=torch.Generator().manual_seed(i))])
        out = runner.backend.forward_dense_layer(q.reshape(MAX_BS * q_len, -1), None, None, LAYER, fb, save_kv_cache=False)
        out = out.view(-1, HQ, D)
        for b in range(len(kv_lens)):
            want, _, _ = reference_request(runner.batch, b, every_block)
            torch.testing.assert_close(out[runner.batch.rows_of(b)], want, rtol=1e-4, atol=1e-4)


def test_eager_plans_are_unchanged_between_replays(backend_module):
    runner = GraphRunnerDouble(backend_module, "DECODE", 1, 1)
    runner.load([40, 150, 17], [5, 0, 3], seed=0)
    runner.step(MAX_BS, in_capture=True)
    captured = _addresses(runner.backend.kernel_plan)

    runner.load([70, 20], [4, 1], seed=1)  # a batch SGLang runs eagerly: the eager plan, fresh tensors
    runner.backend.init_forward_metadata(
        SimpleNamespace(
            forward_mode=_forward_mode("DECODE"),
            seq_lens=torch.tensor([70, 20]),
            seq_lens_cpu=torch.tensor([70, 20]),
            req_pool_indices=torch.tensor([4, 1]),
        )
    )
    eager = runner.backend.kernel_plan
    assert eager.max_blocks == 8  # next power of two of the 5 blocks needed, as before graphs
    assert not set(_addresses(eager)) & set(captured)
    _assert_real_rows_match(runner, attend(runner.backend, runner.batch))

    runner.load([90, 3, 160], [7, 2, 0], seed=2)  # and the next replay is undisturbed
    out = runner.step(MAX_BS, in_capture=False)
    assert _addresses(runner.backend.kernel_plan) == captured
    _assert_real_rows_match(runner, out)


def test_batches_beyond_the_captured_state_are_refused(backend_module):
    runner = GraphRunnerDouble(backend_module, "DECODE", 1, 1)
    too_many = SimpleNamespace(
        forward_mode=_forward_mode("DECODE"), seq_lens=torch.ones(MAX_BS + 1, dtype=torch.int64),
        seq_lens_cpu=torch.ones(MAX_BS + 1, dtype=torch.int64), req_pool_indices=torch.zeros(MAX_BS + 1, dtype=torch.int64),
    )
    with pytest.raises(ValueError, match=f"batch of {MAX_BS + 1} requests exceeds the CUDA-graph max_bs {MAX_BS}"):
        runner.backend.init_forward_metadata_out_graph(too_many)

    runner.seq_lens_cpu[0] = CONTEXT + 1  # decode: the new token is one of context_len
    with pytest.raises(ValueError, match=f"{CONTEXT + 1} tokens .* exceeds the CUDA-graph context of {CONTEXT}"):
        runner.backend.init_forward_metadata_out_graph(runner.view(MAX_BS))

    verify = GraphRunnerDouble(backend_module, "TARGET_VERIFY", 2, 1)
    verify.seq_lens_cpu[0] = CONTEXT + 1  # + 2 drafts: one past the captured context
    with pytest.raises(ValueError, match="exceeds the CUDA-graph context"):
        verify.backend.init_forward_metadata_out_graph(verify.view(MAX_BS))
    verify.seq_lens_cpu[0] = 1
    verify.spec_info.topk = 2  # a draft tree: read from its tree mask, which must be there
    with pytest.raises(ValueError, match="draft trees without spec_info.custom_mask"):
        verify.backend.init_forward_metadata_out_graph(verify.view(MAX_BS))

    extend = runner.view(MAX_BS)
    extend.forward_mode = _forward_mode("EXTEND")
    with pytest.raises(ValueError, match="DECODE and TARGET_VERIFY batches only"):
        runner.backend.init_forward_metadata_out_graph(extend)

    runner.backend.graph_plans = None
    with pytest.raises(RuntimeError, match="before init_cuda_graph_state"):
        runner.backend.init_forward_metadata_out_graph(runner.view(MAX_BS))


def test_hybrid_graph_hooks_reach_both_backends():
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend, SharedReadEnds

    from sglang_m3.msa.hybrid import M3HybridAttnBackend

    class Recording(AttentionBackend):
        def __init__(self, read_end, fill, capped):
            self.calls, self.read_end, self.fill = [], read_end, fill
            self.extend_dummy_seqs_capped_by_req_pool = capped
            self._verify_mask = object()

        def __getattribute__(self, name):
            if name.startswith(("init_", "on_after", "validate_", "update_verify")):
                object.__getattribute__(self, "calls").append(name)
                return lambda *args, **kwargs: None
            return object.__getattribute__(self, name)

        def shared_read_ends(self, fm):
            return self.read_end

        def get_cuda_graph_seq_len_fill_value(self):
            return self.fill

        @property
        def verify_mask(self):
            return self._verify_mask

    dense = Recording(SharedReadEnds.PRE_REPLAY, fill=1, capped=False)
    sparse = Recording(SharedReadEnds.IN_REPLAY, fill=0, capped=True)
    hybrid = M3HybridAttnBackend(dense, sparse, [0])
    fb = SimpleNamespace()
    hybrid.init_cuda_graph_state(4, 4)
    hybrid.init_forward_metadata_out_graph(fb, in_capture=True)
    hybrid.init_forward_metadata_in_graph(fb)
    hybrid.on_after_cuda_graph_warmup()
    hybrid.validate_elastic_cuda_graph_recapture()
    hybrid.update_verify_buffers_to_fill_after_draft(None, 4)
    both = [
        "init_cuda_graph_state", "init_forward_metadata_out_graph", "init_forward_metadata_in_graph",
        "on_after_cuda_graph_warmup", "validate_elastic_cuda_graph_recapture",
    ]
    assert sparse.calls == both
    assert dense.calls == both + ["update_verify_buffers_to_fill_after_draft"]  # the tree mask is dense-only
    assert hybrid.get_cuda_graph_seq_len_fill_value() == 1  # the dense backend's; the MSA plans cope with it
    assert hybrid.verify_mask is dense.verify_mask
    assert hybrid.shared_read_ends(_forward_mode("DECODE")) is SharedReadEnds.IN_REPLAY  # the later of the two
    assert hybrid.extend_dummy_seqs_capped_by_req_pool
