"""The sparse-offload host budget: bytes per token, the slot cap it sets, the start-up refusal."""

from __future__ import annotations

import pytest

from sglang_m3.cache.offload_budget import (
    SPARSE_OFFLOAD_HOST_GB_ENV,
    check_host_room,
    host_budget_bytes,
    offloaded_bytes_per_token,
)
from sglang_m3.recipe.fit import sparse_offload_host_tokens

#: M3 at TP1 in bf16: 57 sparse layers x 4 KV heads x (128 + 128) x 2 bytes = 2 KiB per layer
M3_HOST_BYTES_PER_TOKEN = 57 * 2048


def test_m3_offloads_two_kib_per_token_and_sparse_layer():
    assert offloaded_bytes_per_token(57, 4, 128, 128, 2) == M3_HOST_BYTES_PER_TOKEN
    assert offloaded_bytes_per_token(57, 1, 128, 128, 1) == M3_HOST_BYTES_PER_TOKEN // 8  # TP4+, fp8 KV


def test_budget_is_read_in_gb_and_bad_values_are_named(monkeypatch):
    monkeypatch.delenv(SPARSE_OFFLOAD_HOST_GB_ENV, raising=False)
    assert host_budget_bytes() is None
    monkeypatch.setenv(SPARSE_OFFLOAD_HOST_GB_ENV, "512")
    assert host_budget_bytes() == 512 * 10**9
    for bad in ("0", "-3", "lots"):
        monkeypatch.setenv(SPARSE_OFFLOAD_HOST_GB_ENV, bad)
        with pytest.raises(ValueError, match=f"{SPARSE_OFFLOAD_HOST_GB_ENV}='{bad}': expected a positive number of GB"):
            host_budget_bytes()


def test_cap_is_whole_pages_less_the_padding_page():
    # 1M tokens of M3 need 122.4 GB of host store; 128 GB hold 1,096,320 slots
    assert sparse_offload_host_tokens(128 * 10**9, M3_HOST_BYTES_PER_TOKEN, 128) == 1_096_320
    assert (1_096_320 + 128) * M3_HOST_BYTES_PER_TOKEN <= 128 * 10**9
    check_host_room(1_096_320, 1_048_576, 128 * 10**9, M3_HOST_BYTES_PER_TOKEN, 128)


def test_a_budget_below_one_full_length_request_is_refused_with_the_size_needed():
    cap = sparse_offload_host_tokens(100 * 10**9, M3_HOST_BYTES_PER_TOKEN, 128)
    with pytest.raises(ValueError, match=f"{SPARSE_OFFLOAD_HOST_GB_ENV}=100: the host store holds 856,448 tokens "
                                         "\\(116,736 bytes each\\), fewer than one request of --context-length "
                                         "1,048,576; raise it to at least 122.44 or lower --context-length"):
        check_host_room(cap, 1_048_576, 100 * 10**9, M3_HOST_BYTES_PER_TOKEN, 128)
