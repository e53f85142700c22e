"""``benchmarks/draft_extend_attention.py``'s two timed paths, on the CPU under the Triton interpreter:
the MSA path as the draft-extend graph runner drives it and SGLang's extend kernel as its Triton
backend calls it must both give the torch reference's attention, so the GPU run times two
kernels computing the same thing. Small heads stand in for the draft's (a GQA group of 6, as its 48
over 8)."""

import os
import sys
from types import SimpleNamespace

import pytest
import torch

from msa_kernels.paged_batch import make_paged_batch
from msa_kernels.reference import MSAParams

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))

HQ, HKV, D, BLOCK = 12, 2, 32, 16


@pytest.fixture
def bench(interpreted_api, monkeypatch):
    import draft_extend_attention

    for name, value in {
        "DEVICE": "cpu", "HQ": HQ, "HKV": HKV, "D": D, "BLOCK": BLOCK,
        "PARAMS": MSAParams(block_size=BLOCK, topk=4, local_blocks=1, init_blocks=0),
        "LAYER": SimpleNamespace(layer_id=0, tp_q_head_num=HQ, tp_k_head_num=HKV, qk_head_dim=D, v_head_dim=D,
                                 scaling=D**-0.5, k_scale=None, v_scale=None),
    }.items():
        monkeypatch.setattr(draft_extend_attention, name, value)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: SimpleNamespace(multi_processor_count=24))
    return draft_extend_attention


@pytest.mark.parametrize("batch_size, context, window", [(1, 100, 4), (3, 70, 8)])
def test_both_timed_paths_give_the_reference_attention(bench, batch_size, context, window):
    seq_lens = [context] * batch_size
    batch = make_paged_batch(seq_lens, [window] * batch_size, HQ, HKV, D, D, BLOCK, torch.float32, "cpu",
                             decode_q_len=window, max_context=context + BLOCK, generator=torch.Generator().manual_seed(context))
    msa, splits = bench.msa_step(batch, seq_lens, window)
    assert splits >= 1
    assert bench.max_rel_err(batch, msa()) < 1e-5
    assert bench.max_rel_err(batch, bench.sglang_step(batch, seq_lens, window)()) < 1e-5
