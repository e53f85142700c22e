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
    "mode, seq_lens, extend_lens, plan_type",
    [
        ("EXTEND", [40, 110, 33], [40, 30, 5], PrefillPlan),  # prefixes 0, 80, 28
        ("DECODE", [40, 150, 17], [1, 1, 1], DecodePlan),
        ("TARGET_VERIFY", [41, 150], [2, 2], DecodePlan),  # speculative verify: decode kernels, q_len 2
    ],
)
def test_triton_backend_matches_reference(backend_module, mode, seq_lens, extend_lens, plan_type):
    decode_rows = extend_lens[0] if plan_type is DecodePlan else 0
    batch = make_paged_batch(
        seq_lens, extend_lens, HQ, HKV, D, D, BLOCK, torch.float32, "cpu",
        decode_q_len=decode_rows, generator=torch.Generator().manual_seed(len(seq_lens)),
    )
    backend = make_backend(backend_module, batch)
    backend.init_forward_metadata(forward_batch(mode, seq_lens, extend_lens))
    assert isinstance(backend.kernel_plan, plan_type)
    out = attend(backend, batch)
    for b in range(len(seq_lens)):
        want, _, _ = reference_request(batch, b, PARAMS)
        torch.testing.assert_close(out[batch.rows_of(b)], want, rtol=1e-4, atol=1e-4)


def test_page_size_other_than_the_block_is_refused(backend_module):
    runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=None), token_to_kv_pool=None, device="cpu", page_size=1)
    with pytest.raises(ValueError, match="--page-size 16"):
        backend_module.MSATritonBackend(runner, SPEC)


def test_cpu_runner_keeps_the_torch_path(backend_module):
    from sglang_m3.msa.backend import MSATorchBackend

    runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=None), token_to_kv_pool=None, device="cpu")
    backend = backend_module.msa_backend_for(runner, SPEC)
    assert type(backend) is MSATorchBackend
