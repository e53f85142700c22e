"""The CPU platform activates only when asked for or when no accelerator exists."""

from __future__ import annotations

import torch

from sglang_m3 import platform

CLASS_PATH = "sglang_m3.platform.cpu_platform.TorchNativeCpuPlatform"


def test_selected_by_name_even_with_a_gpu(monkeypatch):
    monkeypatch.setenv("SGLANG_PLATFORM", "sglang_m3_cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert platform.activate() == CLASS_PATH


def test_never_claims_a_gpu_machine_by_surprise(monkeypatch):
    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert platform.activate() is None


def test_activates_without_any_accelerator(monkeypatch):
    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    monkeypatch.setattr(platform, "_has_accelerator", lambda: False)
    assert platform.activate() == CLASS_PATH


def test_leaves_sglangs_own_cpu_engine_alone(monkeypatch):
    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    monkeypatch.setattr(platform, "_has_accelerator", lambda: False)
    assert platform.activate() is None


def test_platform_replaces_the_sgl_kernel_cpu_backend():
    from types import SimpleNamespace

    # SGLang resolves its platform while it is first imported, which here loads this very module:
    # import SGLang first, as every SGLang process does, or the import is circular.
    import sglang  # noqa: F401

    from sglang_m3.platform.cpu_platform import TorchNativeCpuPlatform

    args = SimpleNamespace(device=None, sampling_backend=None, attention_backend="intel_amx",
                           prefill_attention_backend=None, decode_attention_backend="triton",
                           dp_size=1, tp_size=1, pp_size=1)
    TorchNativeCpuPlatform().apply_server_args_defaults(args)
    assert (args.device, args.sampling_backend) == ("cpu", "pytorch")
    assert args.attention_backend == args.prefill_attention_backend == "torch_native"
    assert args.decode_attention_backend == "triton"  # an explicit user choice stays
