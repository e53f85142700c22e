"""The mark for test modules that run Triton kernels on CPU tensors under the interpreter.

On a machine with CUDA the kernels compile for the GPU and refuse CPU tensors, so these modules
skip there; their compiled counterparts under ``tests/gpu`` cover CUDA.
"""

import pytest
import torch

INTERPRETER_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter tests run on CPU machines; tests/gpu covers CUDA"
)
