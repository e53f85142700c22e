"""Kernel tests: on a machine without CUDA the Triton kernels run under the interpreter.

``TRITON_INTERPRET`` is set by the root ``tests/conftest.py`` before any test module imports
Triton; the ``interpreted_api`` fixture re-imports the kernels in interpreter mode if something
imported them earlier in the session in compiled mode.
"""

import importlib
import os

import pytest
import torch


@pytest.fixture(scope="session")
def interpreted_api():
    """``msa_kernels.api`` with every kernel running under the Triton interpreter (CPU only)."""
    if torch.cuda.is_available():
        pytest.skip("interpreter tests run on CPU machines; the GPU tests cover CUDA")
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime.interpreter import InterpretedFunction

    from msa_kernels import (
        api, triton_attention, triton_block_major, triton_index, triton_index_quant, triton_pair_plan, triton_prefill_attention,
        triton_select, triton_tree,
    )

    if not isinstance(triton_index.decode_index_scores_kernel, InterpretedFunction):
        for module in (triton_select, triton_tree, triton_index_quant, triton_index, triton_attention, triton_prefill_attention,
                       triton_pair_plan, triton_block_major, api):
            importlib.reload(module)
    return api


@pytest.fixture
def poisoned_buffers(monkeypatch):
    """``torch.empty`` returns NaN floats / huge ints, so a buffer element a kernel forgets to
    write cannot pass as zero."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        tensor = real_empty(*args, **kwargs)
        return tensor.fill_(float("nan") if tensor.is_floating_point() else 0x3FFFFFF0)

    monkeypatch.setattr(torch, "empty", empty)


@pytest.fixture(scope="module")
def backend_module(interpreted_api):
    """``sglang_m3.msa.triton_backend`` bound to the interpreted kernels."""
    from sglang_m3.msa import triton_backend

    return importlib.reload(triton_backend)
