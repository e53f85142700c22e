"""The plugin's hook table against the installed SGLang, its entry points, and the prompt-id check."""

from __future__ import annotations

import pkgutil
from importlib.metadata import entry_points

import pytest
from hypothesis import given
from hypothesis import strategies as st

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


def _tokenizer_manager(architecture: str, vocab: int):
    from types import SimpleNamespace

    return SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=[architecture]), vocab_size=vocab))


@given(ids=st.lists(st.integers(min_value=-3, max_value=70), max_size=40))
def test_out_of_vocabulary_prompt_ids_are_refused_naming_the_first(ids):
    """Ids in 0..63 pass; otherwise the first id out of range is named, with its position."""
    from sglang_m3.integration.hooks import refuse_out_of_vocabulary_ids

    manager = _tokenizer_manager("MiniMaxM3SparseForCausalLM", 64)
    bad = [i for i, token in enumerate(ids) if not 0 <= token < 64]
    if not bad:
        assert refuse_out_of_vocabulary_ids(manager, None, ids) is None
        return
    with pytest.raises(ValueError, match=rf"^input_ids\[{bad[0]}\] = {ids[bad[0]]} is not a token id of this model: ids run from 0 to 63$"):
        refuse_out_of_vocabulary_ids(manager, None, ids)


def test_other_models_prompt_ids_are_left_to_sglang():
    from sglang_m3.integration.hooks import refuse_out_of_vocabulary_ids

    assert refuse_out_of_vocabulary_ids(_tokenizer_manager("LlamaForCausalLM", 64), None, [5, 99, -1]) is None
