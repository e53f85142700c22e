"""The real server refuses a broken checkpoint config at start-up, naming the field, and never serves.

A copy of the tiny checkpoint (tensors symlinked) gets a config.json in the shipped layout with one
corpus field wrong; a second copy keeps the valid shipped layout and is broken only through
``--json-model-override-args``, which proves the overrides reach the config reader. Three
server starts, each refused while the model is built, before any weight is loaded.
"""

from __future__ import annotations

import json

import pytest
from conftest import write_checkpoint_copy
from m3_config_layouts import CORPUS, broken_config
from server_harness import expect_start_refused

pytestmark = pytest.mark.server

#: SGLang's line once a model's weights are in: a refused config never gets there
WEIGHTS_LOADED = "Load weight end"


def _by_name(name: str):
    return next(entry for entry in CORPUS if entry.name == name)


def _assert_refused(refused, expected: tuple[str, ...]) -> None:
    assert refused.returncode != 0, refused.log[-4000:]
    assert WEIGHTS_LOADED not in refused.log, "refused only after loading the weights"
    assert "M3ConfigError" in refused.log, refused.log[-4000:]
    for text in expected:
        assert text in refused.log, f"{text!r} not in the server log:\n{refused.log[-4000:]}"


def _server_top(shipped_top: dict, tiny_m3_checkpoint: str) -> dict:
    """The checkpoint's own top level (architecture, token ids, text-only switch), shipped text part."""
    with open(f"{tiny_m3_checkpoint}/config.json", encoding="utf-8") as handle:
        top = json.load(handle)
    top["text_config"] = shipped_top["text_config"]
    return top


def _refused_from_file(entry_name, shipped_top, tiny_m3_checkpoint, server_log_dir, tmp_path):
    entry = _by_name(entry_name)
    top = broken_config(_server_top(shipped_top, tiny_m3_checkpoint), entry)
    model = write_checkpoint_copy(tiny_m3_checkpoint, str(tmp_path / "broken"), top)
    return entry, expect_start_refused(model, server_log_dir)


def test_broken_config_json_refused_at_start(shipped_top, tiny_m3_checkpoint, server_log_dir, tmp_path):
    """transformers' config class reads a moe_layer_freq entry 2 as MoE without complaint; the
    project's reader refuses it before any weight is read."""
    entry, refused = _refused_from_file("moe_layer_freq entry 2", shipped_top, tiny_m3_checkpoint, server_log_dir, tmp_path)
    _assert_refused(refused, entry.expected)


def test_short_moe_layer_freq_refused_naming_it(shipped_top, tiny_m3_checkpoint, server_log_dir, tmp_path):
    entry, refused = _refused_from_file("moe_layer_freq too short", shipped_top, tiny_m3_checkpoint, server_log_dir, tmp_path)
    _assert_refused(refused, entry.expected)


def test_broken_override_refused_at_start(shipped_top, tiny_m3_checkpoint, server_log_dir, tmp_path):
    entry = _by_name("scoring_func softmax")
    model = write_checkpoint_copy(tiny_m3_checkpoint, str(tmp_path / "valid"), _server_top(shipped_top, tiny_m3_checkpoint))
    # SGLang 0.5.23 keeps M3's text_config as a plain dict (its own MiniMaxM3VLConfig) and so
    # replaces it whole with a mapping override: a partial one like {"text_config":
    # {"scoring_func": "softmax"}} fails inside SGLang (get_hf_text_config) before any M3 code
    # runs. The whole text_config with one field changed is the override that SGLang accepts.
    text = {**shipped_top["text_config"], "scoring_func": "softmax"}
    override = json.dumps({"text_config": text})
    refused = expect_start_refused(model, server_log_dir, "--json-model-override-args", override)
    _assert_refused(refused, entry.expected)
