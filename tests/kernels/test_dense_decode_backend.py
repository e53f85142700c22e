"""Dense-attention layers of verify and decode batches through the hybrid backend onto the MSA
kernels (``sglang_m3.msa.dense_decode``), on the CPU under the Triton interpreter.

The hybrid routes a dense layer's call of a verify batch to the MSA Triton backend unless
``SGLANG_M3_DENSE_VERIFY=sglang``, and of a decode batch unless ``SGLANG_M3_DENSE_DECODE=sglang``;
otherwise SGLang's dense backend takes it. What the MSA backend returns is the
layer's causal attention over every key before each draft (the torch reference with every block
chosen), and it writes the layer's K/V first as SGLang's pool expects.
"""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from msa_kernels.paged_batch import make_paged_batch, reference_request
from msa_triton_fakes import BLOCK, D, HKV, HQ, LAYER, PARAMS, forward_batch, make_backend

SPARSE_LAYER_IDS = (1, 2)
DENSE_LAYER = LAYER  # layer 0: not among SPARSE_LAYER_IDS


class RecordingDense:
    """SGLang's dense backend as the hybrid sees it: plans and calls are recorded, planning does nothing."""

    def __init__(self):
        self.calls = []
        self.plans = []
        self.kv_index_translator = None

    def init_forward_metadata(self, forward_batch):
        self.plans.append("eager")

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        self.plans.append("out_graph")

    def init_forward_metadata_in_graph(self, forward_batch):
        self.plans.append("in_graph")

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self.calls.append(("forward", layer.layer_id))
        return torch.zeros(q.shape[0], HQ * D)

    forward_extend = forward


def _hybrid(backend_module, batch, monkeypatch, verify=None, decode=None, dense_layers=()):
    """The hybrid over ``batch`` with the two switches set (None: unset, their defaults), told of
    the model's ``dense_layers`` (none: not known, so SGLang's backend plans every batch)."""
    from sglang_m3.msa.dense_decode import DECODE_ENV, VERIFY_ENV
    from sglang_m3.msa.hybrid import M3HybridAttnBackend

    for name, switch in ((VERIFY_ENV, verify), (DECODE_ENV, decode)):
        if switch is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, switch)
    dense = RecordingDense()
    return M3HybridAttnBackend(dense, make_backend(backend_module, batch), SPARSE_LAYER_IDS, dense_layers=dense_layers), dense


def _verify_batch(q_len, seed):
    return make_paged_batch(
        [41, 150, 18], [q_len] * 3, HQ, HKV, D, D, BLOCK, torch.float32, "cpu",
        decode_q_len=q_len, generator=torch.Generator().manual_seed(seed),
    )


@pytest.mark.parametrize("q_len, switch", [(2, None), (4, None), (4, "msa")])
def test_dense_layer_of_a_verify_batch_runs_on_the_msa_kernels(backend_module, monkeypatch, q_len, switch):
    """By default (and with ``msa``)."""
    batch = _verify_batch(q_len, seed=q_len)
    hybrid, dense = _hybrid(backend_module, batch, monkeypatch, verify=switch)
    fb = forward_batch("TARGET_VERIFY", batch)
    hybrid.init_forward_metadata(fb)
    q = batch.q.reshape(batch.q.shape[0], -1)
    out = hybrid.forward(q, None, None, DENSE_LAYER, fb, save_kv_cache=False).view(-1, HQ, D)
    assert dense.calls == []
    every_block = dataclasses.replace(PARAMS, topk=1 << 10)
    for b in range(3):
        want, _, _ = reference_request(batch, b, every_block)
        torch.testing.assert_close(out[batch.rows_of(b)], want, rtol=1e-4, atol=1e-4)


def test_the_dense_layer_writes_its_kv_before_attending(backend_module, monkeypatch):
    """With ``save_kv_cache`` the layer's K/V go to the batch's slots through ``set_kv_buffer``."""
    batch = _verify_batch(2, seed=9)
    hybrid, _ = _hybrid(backend_module, batch, monkeypatch, verify="msa")
    writes = []
    hybrid.sparse.token_to_kv_pool.set_kv_buffer = lambda layer, loc, k, v, *scales: writes.append((layer.layer_id, loc.loc, k, v))
    fb = forward_batch("TARGET_VERIFY", batch)
    hybrid.init_forward_metadata(fb)
    k, v = torch.randn(batch.q.shape[0], HKV, D), torch.randn(batch.q.shape[0], HKV, D)
    hybrid.forward(batch.q.reshape(batch.q.shape[0], -1), k, v, DENSE_LAYER, fb)
    (layer_id, loc, written_k, written_v), = writes
    assert layer_id == 0 and torch.equal(loc, fb.out_cache_loc)
    assert written_k is k and written_v is v


@pytest.mark.parametrize("verify, decode, mode", [
    ("sglang", None, "TARGET_VERIFY"), ("sglang", "msa", "TARGET_VERIFY"), ("msa", "sglang", "DECODE"), (None, "sglang", "DECODE"),
])
def test_dense_layers_stay_on_sglangs_backend_otherwise(backend_module, monkeypatch, verify, decode, mode):
    """Verify batches with ``SGLANG_M3_DENSE_VERIFY=sglang``, decode batches with
    ``SGLANG_M3_DENSE_DECODE=sglang`` (the other switch never moves them)."""
    batch = _verify_batch(2 if mode == "TARGET_VERIFY" else 1, seed=3)
    hybrid, dense = _hybrid(backend_module, batch, monkeypatch, verify, decode)
    fb = forward_batch(mode, batch)
    hybrid.init_forward_metadata(fb)
    hybrid.forward(batch.q.reshape(batch.q.shape[0], -1), None, None, DENSE_LAYER, fb, save_kv_cache=False)
    assert dense.calls == [("forward", 0)]


@pytest.mark.parametrize("entry, switch", [("forward", None), ("forward_decode", None), ("forward_decode", "msa")])
def test_dense_layer_of_a_decode_batch_runs_on_the_msa_kernels(backend_module, monkeypatch, entry, switch):
    """By default (and with ``SGLANG_M3_DENSE_DECODE=msa``): one query token per request over every
    key up to it, through either of the hybrid's entries SGLang calls for a decode batch."""
    batch = _verify_batch(1, seed=21)
    hybrid, dense = _hybrid(backend_module, batch, monkeypatch, decode=switch)
    fb = forward_batch("DECODE", batch)
    hybrid.init_forward_metadata(fb)
    out = getattr(hybrid, entry)(batch.q.reshape(batch.q.shape[0], -1), None, None, DENSE_LAYER, fb, save_kv_cache=False)
    assert dense.calls == []
    every_block = dataclasses.replace(PARAMS, topk=1 << 10)
    for b in range(3):
        want, _, _ = reference_request(batch, b, every_block)
        torch.testing.assert_close(out.view(-1, HQ, D)[batch.rows_of(b)], want, rtol=1e-4, atol=1e-4)


def test_a_dense_layer_of_other_kv_heads_stays_on_sglangs_backend(backend_module, monkeypatch):
    """The plan's merge tickets count its KV heads: a layer with another count is not taken."""
    batch = _verify_batch(2, seed=4)
    hybrid, dense = _hybrid(backend_module, batch, monkeypatch, verify="msa")
    fb = forward_batch("TARGET_VERIFY", batch)
    hybrid.init_forward_metadata(fb)
    other_heads = SimpleNamespace(**{**vars(DENSE_LAYER), "tp_k_head_num": HKV * 2})
    hybrid.forward(batch.q.reshape(batch.q.shape[0], -1), None, None, other_heads, fb, save_kv_cache=False)
    assert dense.calls == [("forward", 0)]


@pytest.mark.parametrize("switch", ["verify", "decode"])
def test_a_bad_switch_value_is_refused_with_the_variable_named(backend_module, monkeypatch, switch):
    batch = _verify_batch(2, seed=1)
    with pytest.raises(ValueError, match=f"SGLANG_M3_DENSE_{switch.upper()}='on'"):
        _hybrid(backend_module, batch, monkeypatch, **{switch: "on"})


#: the model's dense layer as the hybrid sees it, with its KV heads (the plan's)
PLAIN_DENSE = SimpleNamespace(**{**vars(DENSE_LAYER), "tp_k_head_num": HKV})


@pytest.mark.parametrize("mode, q_len, decode", [("TARGET_VERIFY", 4, None), ("DECODE", 1, None), ("DECODE", 1, "msa")])
def test_sglangs_backend_does_not_plan_a_batch_whose_dense_layers_all_run_on_the_msa_kernels(backend_module, monkeypatch, mode, q_len, decode):
    """Its plan would go unread: eager, out-of-graph and in-graph planning all skip it, and the dense
    layer's output is still the reference."""
    batch = _verify_batch(q_len, seed=11)
    hybrid, dense = _hybrid(backend_module, batch, monkeypatch, decode=decode, dense_layers=[PLAIN_DENSE])
    fb = forward_batch(mode, batch)
    hybrid.init_forward_metadata(fb)
    out = hybrid.forward(batch.q.reshape(batch.q.shape[0], -1), None, None, PLAIN_DENSE, fb, save_kv_cache=False)
    assert dense.plans == [] and dense.calls == []
    every_block = dataclasses.replace(PARAMS, topk=1 << 10)
    for b in range(3):
        want, _, _ = reference_request(batch, b, every_block)
        torch.testing.assert_close(out.view(-1, HQ, D)[batch.rows_of(b)], want, rtol=1e-4, atol=1e-4)
    hybrid.sparse.init_cuda_graph_state(4, 4 * 256)
    hybrid.init_forward_metadata_out_graph(fb, in_capture=True)
    hybrid.init_forward_metadata_in_graph(fb)
    assert dense.plans == []


@pytest.mark.parametrize("mode, q_len, verify, decode, layers", [
    ("DECODE", 1, None, "sglang", "plain"),
    ("TARGET_VERIFY", 2, "sglang", None, "plain"),
    ("TARGET_VERIFY", 2, None, None, "none"),  # the model's dense layers not known
    ("TARGET_VERIFY", 2, None, None, "other_heads"),  # one dense layer the kernels cannot attend
])
def test_sglangs_backend_plans_every_batch_whose_dense_layers_it_may_attend(backend_module, monkeypatch, mode, q_len, verify, decode, layers):
    batch = _verify_batch(q_len, seed=12)
    dense_layers = {
        "plain": [PLAIN_DENSE],
        "none": [],
        "other_heads": [PLAIN_DENSE, SimpleNamespace(**{**vars(PLAIN_DENSE), "layer_id": 3, "tp_k_head_num": HKV * 2})],
    }[layers]
    hybrid, dense = _hybrid(backend_module, batch, monkeypatch, verify, decode, dense_layers=dense_layers)
    hybrid.init_forward_metadata(forward_batch(mode, batch))
    assert dense.plans == ["eager"]


def test_a_dense_call_the_kernels_cannot_compute_in_an_unplanned_batch_is_refused(backend_module, monkeypatch):
    """Extra operands (which M3's dense layers never pass) would leave the call to a backend that
    did not plan the batch: refused, naming the switches that restore SGLang's planning."""
    batch = _verify_batch(2, seed=13)
    hybrid, dense = _hybrid(backend_module, batch, monkeypatch, dense_layers=[PLAIN_DENSE])
    fb = forward_batch("TARGET_VERIFY", batch)
    hybrid.init_forward_metadata(fb)
    with pytest.raises(RuntimeError, match="SGLANG_M3_DENSE_VERIFY=sglang"):
        hybrid.forward(batch.q.reshape(batch.q.shape[0], -1), None, None, PLAIN_DENSE, fb, save_kv_cache=False, sinks=None)
    assert dense.calls == []
