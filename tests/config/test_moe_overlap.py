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


class _FakeStream:
    """Records the stream protocol calls the overlap makes (no CUDA on the CPU runner)."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits {other.name}")


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's stream calls replaced by recorders; returns (log, alt, set_capture(plain, breakable))."""
    import contextlib

    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import context as breakable

    log, current = [], []
    main, alt = _FakeStream("main", log), _FakeStream("alt", log)
    state = {"capturing": False}

    @contextlib.contextmanager
    def on_stream(stream):
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current[-1] if current else main)
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])

    def set_capture(plain: bool, breakable_graph: bool = False):
        state["capturing"] = plain or breakable_graph
        monkeypatch.setattr(breakable, "_in_breakable_cuda_graph", breakable_graph)

    def recorder(name):
        def call(t):
            log.append(f"{name} on {torch.cuda.current_stream().name}")
            return t + (1 if name == "routed" else 2)
        return call

    return log, alt, set_capture, recorder


def test_plain_capture_forks_the_routed_experts_onto_the_second_stream_and_joins(fake_cuda):
    log, alt, set_capture, recorder = fake_cuda
    set_capture(plain=True)
    x = torch.zeros(3, 4)
    shared, routed = shared_beside_routed(alt, x, recorder("shared"), recorder("routed"))
    assert log == ["alt waits main", "shared on main", "routed on alt", "main waits alt"]
    torch.testing.assert_close(shared, x + 2, rtol=0, atol=0)
    torch.testing.assert_close(routed, x + 1, rtol=0, atol=0)


@pytest.mark.parametrize("plain, breakable_graph", [(False, False), (False, True)])
def test_eager_and_breakable_graphs_keep_one_stream(fake_cuda, plain, breakable_graph):
    log, alt, set_capture, recorder = fake_cuda
    set_capture(plain, breakable_graph)
    shared_beside_routed(alt, torch.zeros(2, 4), recorder("shared"), recorder("routed"))
    assert log == ["shared on main", "routed on main"]


@pytest.mark.parametrize("value", ["false", "off", "no", ""])
def test_a_value_other_than_1_or_0_is_refused_with_the_variable_named(monkeypatch, value):
    monkeypatch.setenv(MOE_OVERLAP_ENV, value)
    with pytest.raises(ValueError, match=f"{MOE_OVERLAP_ENV}={value!r}: expected '1' or '0'"):
        overlap_stream()
