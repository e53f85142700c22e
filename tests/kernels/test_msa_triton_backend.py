"""The CUDA code path of the SGLang MSA backend, end to end on the CPU under the Triton interpreter.

``MSATritonBackend`` plans from a ForwardBatch-shaped object (SGLang's own ``ForwardMode``,
``req_to_token`` rows reached through ``req_pool_indices``, CPU and device lengths) and runs
every kernel of the CUDA path; outputs are compared with the torch reference per request.
"""

import importlib
from types import SimpleNamespace

import pytest
import torch

from msa_kernels.paged_batch import make_paged_batch, reference_request
from msa_kernels.plan import DecodePlan, PrefillPlan
from msa_kernels.reference import MSAParams

BLOCK, HQ, HKV, D = 16, 4, 2, 32
PARAMS = MSAParams(block_size=BLOCK, topk=4, local_blocks=1, init_blocks=0)


@pytest.fixture(scope="module")
def backend_module(interpreted_api):
    from sglang_m3.msa import triton_backend

    return importlib.reload(triton_backend)  # bind the interpreted kernels


def _backend(module, batch):
    reversed_pool = batch.req_to_token.flip(0)  # request b lives in pool row B-1-b
    pool = SimpleNamespace(
        head_num=HKV,
        get_key_buffer=lambda layer_id: batch.k_cache,
        get_value_buffer=lambda layer_id: batch.v_cache,
        get_index_k_buffer=lambda layer_id: batch.ik_cache,
    )
    runner = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(req_to_token=reversed_pool), token_to_kv_pool=pool, device="cpu", page_size=BLOCK
    )
    spec = SimpleNamespace(index_block_size=BLOCK, index_topk_blocks=4, index_local_blocks=1, index_init_blocks=0)
    return module.MSATritonBackend(runner, spec)


def _forward_batch(mode, seq_lens, extend_lens):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    n = len(seq_lens)
    return SimpleNamespace(
        forward_mode=getattr(ForwardMode, mode),
        seq_lens=torch.tensor(seq_lens),
        seq_lens_cpu=torch.tensor(seq_lens),
        req_pool_indices=torch.arange(n - 1, -1, -1),
        extend_seq_lens=torch.tensor(extend_lens),
        extend_seq_lens_cpu=list(extend_lens),
    )


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
    backend = _backend(backend_module, batch)
    backend.init_forward_metadata(_forward_batch(mode, seq_lens, extend_lens))
    assert isinstance(backend.kernel_plan, plan_type)
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=HQ, qk_head_dim=D, v_head_dim=D, scaling=D**-0.5)
    out = backend._attend(batch.q.reshape(batch.q.shape[0], -1), layer, batch.iq).view(-1, HQ, D)
    for b in range(len(seq_lens)):
        want, _, _ = reference_request(batch, b, PARAMS)
        torch.testing.assert_close(out[batch.rows_of(b)], want, rtol=1e-4, atol=1e-4)


def test_page_size_other_than_the_block_is_refused(backend_module):
    runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=None), token_to_kv_pool=None, device="cpu", page_size=1)
    spec = SimpleNamespace(index_block_size=BLOCK, index_topk_blocks=4, index_local_blocks=1, index_init_blocks=0)
    with pytest.raises(ValueError, match="--page-size 16"):
        backend_module.MSATritonBackend(runner, spec)


def test_cpu_runner_keeps_the_torch_path(backend_module):
    from sglang_m3.msa.backend import MSATorchBackend

    runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=None), token_to_kv_pool=None, device="cpu")
    spec = SimpleNamespace(index_block_size=BLOCK, index_topk_blocks=4, index_local_blocks=1, index_init_blocks=0)
    backend = backend_module.msa_backend_for(runner, spec)
    assert type(backend) is MSATorchBackend
