"""The plugin's hook table against the installed SGLang, and its entry points."""

from __future__ import annotations

import pkgutil
from importlib.metadata import entry_points

import pytest

from sglang_m3.plugin import HOOKS


@pytest.mark.parametrize("hook", HOOKS, ids=lambda h: h.target)
def test_hook_target_exists_in_installed_sglang(hook):
    module_path, _, attribute = hook.target.rpartition(".")
    owner = pkgutil.resolve_name(module_path)
    assert hasattr(owner, attribute), f"{hook.target} no longer exists in the installed SGLang"
    assert hook.kind in ("BEFORE", "AFTER", "AROUND", "REPLACE")
    assert len(hook.reason) > 40, "every hook says why it exists"


def test_hook_targets_are_unique():
    targets = [h.target for h in HOOKS]
    assert len(targets) == len(set(targets))


def test_entry_points_are_declared():
    plugins = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    platforms = {ep.name: ep.value for ep in entry_points(group="sglang.srt.platforms")}
    assert plugins.get("sglang_m3") == "sglang_m3.plugin:register"
    assert platforms.get("sglang_m3_cpu") == "sglang_m3.platform:activate"


def test_model_classes_carry_the_checkpoint_architecture_names():
    from sglang.srt.models.registry import import_model_classes

    classes = import_model_classes("sglang_m3.models", strict=True)
    assert "MiniMaxM3SparseForCausalLM" in classes
    assert "MiniMaxM3SparseForConditionalGeneration" in classes
    assert all(cls.__module__.startswith("sglang_m3.") for cls in classes.values())
