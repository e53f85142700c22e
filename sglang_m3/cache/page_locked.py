"""Exact-size page-locked host tensors whose CUDA registration ends with their memory.

torch's pinned allocator rounds every buffer up to a power of two (a 40 GB host store would take
64 GB), so the sparse-offload host store is an anonymous mmap registered with ``cudaHostRegister``
instead, as SGLang's HiCache does for its host pools. HiCache never unregisters (its pools live as
long as the process); a store that is freed earlier, by a test or a rebuilt engine, would leave the
range registered, and the next mmap at the same address then fails with
``cudaErrorHostMemoryAlreadyRegistered`` while the device mapping still points at the old pages.
Here the registration is undone when the last view of the tensor is gone, before the mmap is
unmapped.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import weakref

import torch

#: ``cudaHostRegisterDefault``: portable to every context, mapped into the device's address space (UVA)
_REGISTER_DEFAULT = 0


class HostRegisterError(RuntimeError):
    """``cudaHostRegister`` refused the range (its CUDA error already cleared)."""


def discard_last_cuda_error() -> None:
    """Reset the thread's last CUDA error that a refused (non-sticky) runtime call left behind.

    Left set, the next launch check anywhere (torch reads ``cudaGetLastError`` after every kernel
    launch) would raise it against an unrelated operation. torch binds no ``cudaGetLastError``, but
    its launch check calls it, which resets it: one tiny launch takes the stale error and the
    exception it raises is dropped. A sticky error (a broken context) would raise again on the next
    launch, so nothing real is hidden.
    """
    try:
        torch.empty(1, device="cuda").zero_()
    except RuntimeError:  # torch.AcceleratorError, a RuntimeError: the error being discarded
        pass


def page_locked_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor of exactly ``shape``, registered with CUDA until its last view is freed."""
    nbytes = math.prod(shape) * dtype.itemsize
    region = mmap.mmap(-1, max(nbytes, 1))  # anonymous mappings are zero-filled
    # The ctypes window exports the mapping to torch and keeps it alive; its finalizer runs when the
    # tensor's storage lets go of it, before the mapping itself is released.
    window = (ctypes.c_char * max(nbytes, 1)).from_buffer(region)
    address = ctypes.addressof(window)
    cudart = torch.cuda.cudart()
    status = int(cudart.cudaHostRegister(address, max(nbytes, 1), _REGISTER_DEFAULT))
    if status != 0:
        discard_last_cuda_error()
        del window
        region.close()
        raise HostRegisterError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {status}")
    weakref.finalize(window, cudart.cudaHostUnregister, address)
    return torch.frombuffer(window, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)
