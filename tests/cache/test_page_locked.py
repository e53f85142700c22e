"""The page-locked host tensor's registration lifetime, against a recording stand-in for cudart.

The real ``cudaHostRegister`` needs a GPU (``tests/gpu/test_offload_gpu.py`` allocates, frees and
reallocates stores there); what can be checked anywhere is the bookkeeping: one registration of the
exact byte range, its undoing only once the last view is gone, and a refusal that clears CUDA's
last error and leaves nothing registered.
"""

from __future__ import annotations

import gc

import pytest
import torch

from sglang_m3.cache import page_locked
from sglang_m3.cache.page_locked import HostRegisterError, page_locked_tensor


class RecordingCudart:
    def __init__(self, status: int = 0):
        self.status = status
        self.registered: dict[int, int] = {}
        self.calls: list[str] = []

    def cudaHostRegister(self, address, size, flags):
        self.calls.append("register")
        if self.status == 0:
            self.registered[address] = size
        return self.status

    def cudaHostUnregister(self, address):
        self.calls.append("unregister")
        del self.registered[address]
        return 0



def record_with(monkeypatch, recorder: RecordingCudart) -> RecordingCudart:
    monkeypatch.setattr(page_locked.torch.cuda, "cudart", lambda: recorder)
    monkeypatch.setattr(page_locked, "discard_last_cuda_error", lambda: recorder.calls.append("discard-last-error"))
    return recorder


@pytest.fixture
def cudart(monkeypatch):
    return record_with(monkeypatch, RecordingCudart())


@pytest.mark.parametrize("shape, dtype", [((5, 16, 4, 128), torch.bfloat16), ((3, 7), torch.float32), ((1,), torch.uint8)])
def test_the_exact_range_is_registered_zeroed_and_writable(cudart, shape, dtype):
    tensor = page_locked_tensor(shape, dtype)
    assert tensor.shape == shape and tensor.dtype == dtype
    assert cudart.registered == {tensor.data_ptr(): tensor.numel() * tensor.element_size()}
    assert torch.count_nonzero(tensor) == 0
    tensor.fill_(3)
    assert bool((tensor == 3).all())


def test_the_registration_ends_with_the_last_view(cudart):
    tensor = page_locked_tensor((8, 32), torch.float32)
    pages = tensor.view(2, 4, 32)[1]
    del tensor
    gc.collect()
    assert len(cudart.registered) == 1, "unregistered while a view still addresses the range"
    pages.fill_(1.0)
    del pages
    gc.collect()
    assert cudart.registered == {} and cudart.calls == ["register", "unregister"]


def test_a_refused_registration_clears_the_error_and_registers_nothing(monkeypatch):
    recorder = record_with(monkeypatch, RecordingCudart(status=712))
    with pytest.raises(HostRegisterError, match="CUDA error 712"):
        page_locked_tensor((4, 4), torch.float32)
    gc.collect()
    assert recorder.calls == ["register", "discard-last-error"] and recorder.registered == {}
