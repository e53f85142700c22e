"""The CUDA code path of the SGLang MSA backend, end to end on the CPU under the Triton interpreter.

``MSATritonBackend`` plans from a ForwardBatch-shaped object (SGLang's own ``ForwardMode``,
``req_to_token`` rows reached through ``req_pool_indices``, CPU and device lengths) and runs
every kernel of the CUDA path; outputs are compared with the torch reference per request.
"""

from types import SimpleNamespace

import pytest
import torch

from msa_kernels.paged_batch import make_paged_batch, reference_request
from msa_kernels.plan import DecodePlan, PrefillPlan
from msa_triton_fakes import BLOCK, D, HKV, HQ, PARAMS, SPEC, attend, forward_batch, make_backend


@pytest.mark.parametrize(
    "mode, kv_lens, query_lens, plan_type",
    [
        ("EXTEND", [40, 110, 33], [40, 30, 5], PrefillPlan),  # prefixes 0, 80, 28
        ("DECODE", [40, 150, 17], [1, 1, 1], DecodePlan),
        # speculative verify, drafts outside seq_lens: decode kernels, q_len 2 (seq_lens 39, 148)
        ("TARGET_VERIFY", [41, 150], [2, 2], DecodePlan),
        # drafts crossing a block boundary (seq_lens 14, 61: drafts 14..17, 61..64), some in a
        # block that seq_lens alone would not reach
        ("TARGET_VERIFY", [18, 65, 100], [4, 4, 4], DecodePlan),
    ],
)
def test_triton_backend_matches_reference(backend_module, mode, kv_lens, query_lens, plan_type):
    decode_rows = query_lens[0] if plan_type is DecodePlan else 0
    batch = make_paged_batch(
        kv_lens, query_lens, HQ, HKV, D, D, BLOCK, torch.float32, "cpu",
        decode_q_len=decode_rows, generator=torch.Generator().manual_seed(len(kv_lens)),
    )
    backend = make_backend(backend_module, batch)
    backend.init_forward_metadata(forward_batch(mode, batch))
    assert isinstance(backend.kernel_plan, plan_type)
    out = attend(backend, batch)
    for b in range(len(kv_lens)):
        want, _, _ = reference_request(batch, b, PARAMS)
        torch.testing.assert_close(out[batch.rows_of(b)], want, rtol=1e-4, atol=1e-4)


def _verify_batch_missing(**changes):
    batch = make_paged_batch([40, 70], [3, 3], HQ, HKV, D, D, BLOCK, torch.float32, "cpu", decode_q_len=3)
    fb = forward_batch("TARGET_VERIFY", batch)
    for name, value in changes.items():
        target = fb.spec_info if name != "spec_info" else fb
        setattr(target, name, value)
    return batch, fb


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"spec_info": None}, "forward_batch.spec_info"),
        ({"topk": 2}, "draft trees without spec_info.custom_mask"),
        ({"ragged_verify_layout": object()}, "spec_info.ragged_verify_layout"),
        ({"num_tokens_per_req": -1, "draft_token_num": None}, "num_tokens_per_req > 0 nor draft_token_num"),
    ],
)
def test_verify_batch_without_a_usable_draft_count_is_refused(backend_module, changes, message):
    batch, fb = _verify_batch_missing(**changes)
    with pytest.raises(ValueError, match=message):
        make_backend(backend_module, batch).init_forward_metadata(fb)


def test_ngram_draft_trees_are_refused(backend_module):
    """NGRAM verify inputs carry irregular trees (SGLang reports tree_topk -1): never attend them as a chain."""
    batch, fb = _verify_batch_missing()
    fb.spec_info = SimpleNamespace(tree_topk=-1, draft_token_num=3, num_tokens_per_req=3)
    with pytest.raises(ValueError, match="tree_topk = -1.*NGRAM"):
        make_backend(backend_module, batch).init_forward_metadata(fb)


def test_extend_batch_without_host_lengths_is_refused(backend_module):
    batch = make_paged_batch([40, 70], [8, 3], HQ, HKV, D, D, BLOCK, torch.float32, "cpu")
    fb = forward_batch("EXTEND", batch)
    fb.extend_seq_lens_cpu = None
    with pytest.raises(ValueError, match="extend_seq_lens_cpu is None"):
        make_backend(backend_module, batch).init_forward_metadata(fb)


def test_page_size_other_than_the_block_is_refused(backend_module):
    runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=None), token_to_kv_pool=None, device="cpu", page_size=1)
    with pytest.raises(ValueError, match="--page-size 16"):
        backend_module.MSATritonBackend(runner, SPEC)


def test_cpu_runner_keeps_the_torch_path(backend_module):
    from sglang_m3.msa.backend import MSATorchBackend

    runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=None), token_to_kv_pool=None, device="cpu")
    backend = backend_module.msa_backend_for(runner, SPEC)
    assert type(backend) is MSATorchBackend
