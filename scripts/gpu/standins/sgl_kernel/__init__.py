"""GPU-harness stand-in for SGLang's compiled ``sgl_kernel`` wheel (test infrastructure only).

The real wheel (about 1.2 GB, built against another torch) cannot travel to the lent GPU. SGLang
imports many names from it at import time on CUDA and calls only a few on the harness platform.
This package answers:

* the ops in ``ops.py`` (Triton/torch, each recorded when it runs, see ``_standin.note_ran``);
* every other top-level name, and every name of every ``sgl_kernel.<sub>`` module, with a
  callable that raises ``StandInMissing`` naming itself when called, so an unexpected path fails
  loudly instead of computing something wrong.

Never imported by the product: ``scripts/gpu/build_site.sh`` puts it in the device archive only.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

from . import _standin
from ._standin import StandInMissing, missing, ran
from .ops import (
    fused_add_rmsnorm,
    gemma_fused_add_rmsnorm,
    gemma_rmsnorm,
    moe_align_block_size,
    moe_sum_reduce,
    rmsnorm,
    silu_and_mul,
    topk_sigmoid,
    transfer_kv_direct,
    weak_ref_tensor,
)

__version__ = "0.5.23.standin"
__sgl_kernel_standin__ = True

class _Missing:
    """Placeholder for a name the stand-in does not implement: refuses when called.

    Attribute access gives further placeholders (``scalar_types.uint4b8`` at import time), so
    module-level references succeed and only a real call fails.
    """

    __sgl_kernel_standin__ = "missing"

    def __init__(self, qualname: str):
        self._qualname = qualname

    def __call__(self, *args, **kwargs):
        return missing(self._qualname)(*args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self._qualname}.{name}")

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in: {self._qualname} (not implemented)>"


# Submodules SGLang reaches as attributes (``sgl_kernel.utils.is_arch_support_pdl``).
_SUBMODULES = frozenset({
    "allreduce", "attention", "elementwise", "flash_attn", "gemm", "kvcacheio", "mamba", "moe",
    "quantization", "sampling", "scalar_type", "speculative", "top_k", "utils",
})


def __getattr__(name: str):  # PEP 562: any other top-level name
    if name.startswith("__"):
        raise AttributeError(name)
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    return _Missing(f"sgl_kernel.{name}")


class _SubmoduleModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self.__name__}.{name}")


def _is_arch_support_pdl(*args, **kwargs) -> bool:
    # Programmatic dependent launch is a compiled-kernel feature; the stand-in has none.
    return False


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Creates ``sgl_kernel.<anything>`` on import (``sgl_kernel.kvcacheio``, ``.flash_attn``, ...)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("sgl_kernel.") and fullname.split(".")[1] not in ("ops", "_standin"):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _SubmoduleModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        if module.__name__ == "sgl_kernel.utils":
            module.is_arch_support_pdl = _is_arch_support_pdl
        if module.__name__ == "sgl_kernel.elementwise":
            module.silu_and_mul = silu_and_mul
            module.rmsnorm, module.fused_add_rmsnorm = rmsnorm, fused_add_rmsnorm
            module.gemma_rmsnorm, module.gemma_fused_add_rmsnorm = gemma_rmsnorm, gemma_fused_add_rmsnorm
        if module.__name__ == "sgl_kernel.kvcacheio":
            module.transfer_kv_direct = transfer_kv_direct


if not any(isinstance(f, _SubmoduleFinder) for f in sys.meta_path):
    sys.meta_path.append(_SubmoduleFinder())
