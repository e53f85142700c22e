"""SGLang's notes about serving on this machine, silenced while ``sglang-m3 inspect`` builds.

Inspect builds the model on the meta device to count and split its parameters; it serves
nothing, and its user should see only its report. SGLang 0.5.23 still writes to stderr:

- when its quantization package is imported without CUDA: ``warnings.warn`` at the top of
  ``layers/quantization/awq/awq.py`` and ``layers/quantization/gguf.py`` (no AWQ / GGUF kernels);
- when a rank's runtime context resolves the server arguments (``create_context``), log lines
  about serving choices: CUDA graphs off under torch-native attention, a quantized checkpoint's
  kernels "not fully optimized", a MoE runner that turns shared-expert fusion off, and, from the
  second resolution on, "SGLANG_USE_CUDA_IPC_TRANSPORT is deprecated" about the variable the
  first resolution set itself.

Each is matched by its exact text (log lines also by their logger) and silenced only while the
import or the resolution runs (:func:`sglang_noise_silenced`); anything else still shows.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings

#: the ``UserWarning`` texts SGLang's quantization package issues at import without CUDA
IMPORT_WARNINGS = (
    "Only CUDA, HIP and XPU support AWQ currently.",
    "Only CUDA, MUSA and NPU support GGUF quantization currently.",
)
#: logger -> the format strings (``record.msg``) of its lines that only concern serving
SERVER_ARGS_LOG_LINES = {
    "sglang.srt.arg_groups.attention_hook": ("Cuda graph is disabled because of using torch native attention backend",),
    "sglang.srt.configs.model_config": (
        "%s quantization is not fully optimized yet. The speed can be slower than non-quantized models.",
    ),
    "sglang.srt.arg_groups.overrides": (
        "FlashInfer TRTLLM MoE is enabled. --disable-shared-experts-fusion is automatically set.",
    ),
    "sglang.srt.arg_groups.serving_hook": (
        "SGLANG_USE_CUDA_IPC_TRANSPORT is deprecated; use --mm-feature-transport=%s instead.",
    ),
}


class _KnownLines(logging.Filter):
    """Drops a logger's records whose format string is one of ``templates``."""

    def __init__(self, templates: tuple[str, ...]):
        super().__init__()
        self.templates = frozenset(templates)

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in self.templates


@contextlib.contextmanager
def sglang_noise_silenced():
    """Silences :data:`IMPORT_WARNINGS` and :data:`SERVER_ARGS_LOG_LINES` while the block runs."""
    with _import_warnings_ignored(), _log_lines_dropped():
        yield


@contextlib.contextmanager
def _import_warnings_ignored():
    """Ignores :data:`IMPORT_WARNINGS` while the block runs. Not ``warnings.catch_warnings``: that
    restores the whole filter list afterwards, dropping the filters the libraries imported in the
    block install for themselves (numpy, urllib3, torch), so their own noise would show later."""
    ours = []
    for message in IMPORT_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message) + r"\Z", category=UserWarning)
        ours.append(warnings.filters[0])
    try:
        yield
    finally:
        warnings.filters[:] = [entry for entry in warnings.filters if not any(entry is mine for mine in ours)]


@contextlib.contextmanager
def _log_lines_dropped():
    """Drops :data:`SERVER_ARGS_LOG_LINES` from their loggers while the block runs."""
    installed = [(logging.getLogger(name), _KnownLines(lines)) for name, lines in SERVER_ARGS_LOG_LINES.items()]
    for logger, known in installed:
        logger.addFilter(known)
    try:
        yield
    finally:
        for logger, known in installed:
            logger.removeFilter(known)
