"""A sparse-offload host budget set while sparse offload is off is refused at start-up, by name.

``SGLANG_M3_SPARSE_OFFLOAD_HOST_GB`` caps the slot pool to what the host store holds; it means
something only with ``SGLANG_M3_SPARSE_OFFLOAD_BLOCKS``. Set alone (a hand-written environment, or
a blocks value dropped), the server used to start with every K/V on the device and a pool sized
from device memory alone, the budget silently ignored.
"""

from __future__ import annotations

import types

import pytest
from server_harness import expect_start_refused

from sglang_m3.cache.offload_budget import SPARSE_OFFLOAD_HOST_GB_ENV
from sglang_m3.cache.offload_settings import SPARSE_OFFLOAD_BLOCKS_ENV
from sglang_m3.integration.hooks import cap_tokens_by_host_budget

REFUSAL = (f"{SPARSE_OFFLOAD_HOST_GB_ENV}=64 sizes the sparse-offload host store, but sparse offload is off "
           f"({SPARSE_OFFLOAD_BLOCKS_ENV} is unset or 0): set {SPARSE_OFFLOAD_BLOCKS_ENV} as well, or unset "
           f"{SPARSE_OFFLOAD_HOST_GB_ENV}")

M3_KV_CONFIGURATOR = types.SimpleNamespace(
    model_config=types.SimpleNamespace(hf_config=types.SimpleNamespace(architectures=["MiniMaxM3SparseForCausalLM"])))


@pytest.mark.parametrize("blocks", [None, "0"])
def test_pool_sizing_refuses_a_host_budget_without_offload(monkeypatch, blocks):
    monkeypatch.setenv(SPARSE_OFFLOAD_HOST_GB_ENV, "64")
    if blocks is None:
        monkeypatch.delenv(SPARSE_OFFLOAD_BLOCKS_ENV, raising=False)
    else:
        monkeypatch.setenv(SPARSE_OFFLOAD_BLOCKS_ENV, blocks)
    with pytest.raises(ValueError) as refused:
        cap_tokens_by_host_budget(8192, M3_KV_CONFIGURATOR, 8192)
    assert str(refused.value) == REFUSAL


@pytest.mark.server
def test_a_server_with_the_budget_alone_does_not_start(tiny_m3_checkpoint, server_log_dir, monkeypatch):
    monkeypatch.delenv(SPARSE_OFFLOAD_BLOCKS_ENV, raising=False)
    monkeypatch.setenv(SPARSE_OFFLOAD_HOST_GB_ENV, "64")
    refused = expect_start_refused(tiny_m3_checkpoint, server_log_dir)
    assert refused.returncode != 0
    assert REFUSAL in refused.log
