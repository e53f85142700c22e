"""The sparse-offload switch: its environment variables and every start-up refusal, by name."""

from __future__ import annotations

import json

from types import SimpleNamespace

import pytest
import torch

from sglang_m3.cache.offload_settings import (
    SPARSE_OFFLOAD_BLOCKS_ENV,
    SPARSE_OFFLOAD_LOG_STEPS_ENV,
    OffloadShape,
    check_sparse_offload,
    max_query_tokens,
    offload_log_steps,
    sparse_offload_blocks,
)

M3_SHAPE = OffloadShape(cache_blocks=256, block_size=128, topk=16, kv_heads=4, max_query_tokens=1)


def args(**overrides):
    return SimpleNamespace(**{"enable_hierarchical_cache": False, "enable_hisparse": False, "speculative_algorithm": None,
                              "speculative_eagle_topk": None, "speculative_num_draft_tokens": None, **overrides})


def test_off_unless_set_and_bad_values_named(monkeypatch):
    monkeypatch.delenv(SPARSE_OFFLOAD_BLOCKS_ENV, raising=False)
    monkeypatch.delenv(SPARSE_OFFLOAD_LOG_STEPS_ENV, raising=False)
    assert sparse_offload_blocks() == 0 and offload_log_steps() == 100
    monkeypatch.setenv(SPARSE_OFFLOAD_BLOCKS_ENV, "512")
    assert sparse_offload_blocks() == 512
    for bad in ("-1", "many"):
        monkeypatch.setenv(SPARSE_OFFLOAD_BLOCKS_ENV, bad)
        with pytest.raises(ValueError, match=f"{SPARSE_OFFLOAD_BLOCKS_ENV}='{bad}': expected a whole number"):
            sparse_offload_blocks()


def test_rounds_follow_one_requests_worst_case_selection():
    assert M3_SHAPE.pages_per_request == 64 and M3_SHAPE.requests_per_round == 4
    verify = OffloadShape(cache_blocks=256, block_size=128, topk=16, kv_heads=4, max_query_tokens=4)
    assert verify.pages_per_request == 256 and verify.requests_per_round == 1
    assert max_query_tokens(args()) == 1
    assert max_query_tokens(args(speculative_algorithm="EAGLE3", speculative_num_draft_tokens=4)) == 4


def test_an_adaptive_chain_sizes_the_rounds_for_its_longest_candidate(tmp_path):
    """The adaptive worker switches between chains of 1, 3, 5 and 7 drafts (SGLang's defaults) or
    the candidates of ``--speculative-adaptive-config``, whatever the starting length: the rounds
    are sized for the longest one's verify tokens, and a cache too small for it is refused saying so."""
    chain = dict(speculative_algorithm="EAGLE3", speculative_num_draft_tokens=4, speculative_eagle_topk=1)
    assert max_query_tokens(args(**chain, speculative_adaptive=True)) == 8
    assert max_query_tokens(args(**chain, speculative_adaptive=False)) == 4
    config = tmp_path / "adaptive.json"
    config.write_text(json.dumps({"1": {"candidate_steps": [1, 3]}, "16": {"candidate_steps": [0, 2]}}))
    assert max_query_tokens(args(**chain, speculative_adaptive=True, speculative_adaptive_config=str(config))) == 4
    config.write_text(json.dumps({"1": {"candidate_steps": [3, 11]}}))
    assert max_query_tokens(args(**chain, speculative_adaptive=True, speculative_adaptive_config=str(config))) == 12
    adaptive = args(**chain, speculative_adaptive=True)
    longest = OffloadShape(cache_blocks=256, block_size=128, topk=16, kv_heads=4, max_query_tokens=max_query_tokens(adaptive))
    with pytest.raises(ValueError, match=f"^{SPARSE_OFFLOAD_BLOCKS_ENV}=256 is smaller than one request's selection: "
                                         r"8 query token\(s\) \(the longest adaptive chain verifies that many\) x 4 KV "
                                         "heads x top-16 = 512 blocks per step; .* at least 512"):
        check_sparse_offload(longest, adaptive, "cpu", 128)
    check_sparse_offload(OffloadShape(512, 128, 16, 4, 8), adaptive, "cpu", 128)


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0"])
def test_m3_geometry_on_the_cpu_platform_and_cuda_is_accepted(device, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    check_sparse_offload(M3_SHAPE, args(), device, 128)


def test_rocm_and_other_devices_are_refused_by_name(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.3")
    for device in ("cuda", "xpu", "npu"):
        with pytest.raises(ValueError, match=f"^{SPARSE_OFFLOAD_BLOCKS_ENV}=256: sparse offload runs on the CPU platform "
                                             f".* and on NVIDIA CUDA .*unset {SPARSE_OFFLOAD_BLOCKS_ENV} on {device}"):
            check_sparse_offload(M3_SHAPE, args(), device, 128)


@pytest.mark.parametrize("device, page, server, message", [
    ("cuda:0", 128, {"speculative_eagle_topk": 2}, "a draft tree's attention reads each draft"),
    ("cpu", 1, {}, "needs --page-size 128 \\(the MSA block size\\)"),
    ("cpu", 128, {"enable_hierarchical_cache": True}, "cannot be combined with --enable-hierarchical-cache"),
    ("cpu", 128, {"enable_hisparse": True}, "replaces --enable-hisparse"),
    ("cpu", 128, {"speculative_eagle_topk": 4}, "run with --speculative-eagle-topk 1"),
    ("cpu", 128, {"pp_size": 2}, "cannot run with --pp-size > 1 yet"),
])
def test_incompatible_settings_are_refused_by_name(device, page, server, message):
    with pytest.raises(ValueError, match=f"^{SPARSE_OFFLOAD_BLOCKS_ENV}=256.*{message}"):
        check_sparse_offload(M3_SHAPE, args(**server), device, page)


def test_a_cache_smaller_than_one_requests_selection_is_refused():
    small = OffloadShape(cache_blocks=63, block_size=128, topk=16, kv_heads=4, max_query_tokens=1)
    with pytest.raises(ValueError, match="=63 is smaller than one request's selection: 1 query token\\(s\\) x 4 KV heads "
                                         "x top-16 = 64 blocks per step; set SGLANG_M3_SPARSE_OFFLOAD_BLOCKS to at least 64"):
        check_sparse_offload(small, args(), "cpu", 128)
