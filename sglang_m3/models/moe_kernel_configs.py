"""Tuned tile configurations for SGLang's Triton fused MoE at M3's expert shapes.

SGLang 0.5.23 ships no tuned fused-MoE table for M3's experts (128 experts of intermediate size
3072 at hidden 6144: ``E=128,N=3072``), so its kernel falls back to one heuristic tile (64x64x32 for
every prefill size), about half the speed of the best tile on 8K-token chunks on an H100 or an
H200 (1.8-2.2x in the tuner). The tables here were measured
with ``benchmarks/tune_fused_moe.py`` on the lent GPU through SGLang's own ``fused_experts`` and
are applied per call with SGLang's ``override_config`` (the M3 MoE block knows its token count on
the host, so the choice is fixed per captured graph shape and needs no device read).

A table is keyed like SGLang's own files (local experts, local intermediate size, GPU name) plus the
hidden size and the Triton version it was measured with; a shape, GPU or Triton version without a
table leaves SGLang's own choice in place. Each table maps a token count to a config; the nearest
measured count serves (SGLang's rule for its own tables).
"""

from __future__ import annotations

import functools
import json
import logging
import os

logger = logging.getLogger(__name__)

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "moe_kernel_configs")


def table_name(experts: int, intermediate: int, hidden: int, device_name: str, triton_version: str) -> str:
    """File name of the table for one expert shape on one GPU and Triton version."""
    return f"E={experts},N={intermediate},K={hidden},device_name={device_name.replace(' ', '_')},triton={triton_version}.json"


@functools.lru_cache(maxsize=None)
def load_table(name: str) -> dict[int, dict] | None:
    path = os.path.join(CONFIG_DIR, name)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return {int(tokens): config for tokens, config in json.load(handle).items()}


def tile_table(experts: int, intermediate: int, hidden: int) -> dict[int, dict] | None:
    """The measured table for this expert shape on the current GPU and Triton, or None.
    Resolved once per MoE block at build time; :func:`nearest` picks per call."""
    import torch
    import triton

    name = table_name(experts, intermediate, hidden, torch.cuda.get_device_name(), triton.__version__)
    table = load_table(name)
    if table is None:
        _report_missing(name)
    return table


@functools.lru_cache(maxsize=None)
def _report_missing(name: str) -> None:
    """Once per shape and GPU: prefill chunks then run SGLang's one default tile, about half the
    tuned speed in the tuner on H100 and H200, which a server log should explain."""
    logger.info(
        "M3 MoE: no measured fused-MoE tile table %s in %s: SGLang's default tiles serve this shape "
        "(benchmarks/tune_fused_moe.py --install with this server's --tp-size / --ep-size measures one)",
        name, CONFIG_DIR,
    )


def nearest(table: dict[int, dict], tokens: int) -> dict:
    """The entry measured at the token count closest to ``tokens`` (ties: the smaller count)."""
    return table[min(sorted(table), key=lambda measured: abs(measured - tokens))]
