"""Where the shared expert runs beside the routed experts: never on the CPU platform, never with
the switch off, and in order (shared first, same values) wherever it does not overlap."""

from __future__ import annotations

import types

import pytest
import torch

from sglang_m3.models.moe_overlap import MOE_OVERLAP_ENV, overlap_stream, shared_beside_routed


def test_no_second_stream_on_a_cpu_platform(monkeypatch):
    import sglang.srt.platforms as platforms

    monkeypatch.delenv(MOE_OVERLAP_ENV, raising=False)
    monkeypatch.setattr(platforms, "_current_platform", types.SimpleNamespace(device_type="cpu"))
    assert overlap_stream() is None


def test_the_switch_keeps_one_stream_even_on_cuda(monkeypatch):
    import sglang.srt.platforms as platforms

    monkeypatch.setenv(MOE_OVERLAP_ENV, "0")
    monkeypatch.setattr(platforms, "_current_platform", types.SimpleNamespace(device_type="cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert overlap_stream() is None


@pytest.mark.parametrize("rows", [1, 7])
def test_without_a_stream_both_run_in_order_on_the_same_input(rows):
    calls = []
    x = torch.randn(rows, 16)

    def shared(t):
        calls.append(("shared", t))
        return t * 2

    def routed(t):
        calls.append(("routed", t))
        return t + 1

    got_shared, got_routed = shared_beside_routed(None, x, shared, routed)
    assert [name for name, _ in calls] == ["shared", "routed"]
    assert all(t is x for _, t in calls)
    torch.testing.assert_close(got_shared, x * 2, rtol=0, atol=0)
    torch.testing.assert_close(got_routed, x + 1, rtol=0, atol=0)
