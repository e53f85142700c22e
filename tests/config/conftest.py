"""Fixtures of the config tests: the shipped-layout tiny config and single-rank SGLang layers."""

from __future__ import annotations

import json
import os
import sys
import types

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from m3_config_layouts import shipped_text_config, vl_wrapper  # noqa: E402


@pytest.fixture(scope="session")
def tiny_spec(tiny_m3_checkpoint):
    """The spec of the project's tiny checkpoint, read from its own config.json."""
    from sglang_m3.config import M3TextSpec

    return M3TextSpec.from_config(None, tiny_m3_checkpoint)


@pytest.fixture
def shipped_top(tiny_spec) -> dict:
    """A valid VL top-level config whose text part is the tiny checkpoint in the shipped layout."""
    return vl_wrapper(shipped_text_config(tiny_spec))


@pytest.fixture
def single_rank():
    """SGLang's parallel layers (linear, MoE helpers) on one rank, without process groups.

    The layers read the tensor-parallel group, size and rank (and the MoE block its expert-parallel
    layout) from SGLang's runtime context; a scoped override states them for one CPU rank and is
    undone after the test.
    """
    from sglang.srt.runtime_context import get_parallel

    group = types.SimpleNamespace(world_size=1, rank_in_group=0)
    moe = {"moe_dp_size": 1, "moe_ep_size": 1, "moe_ep_rank": 0, "moe_tp_size": 1, "moe_tp_rank": 0}
    with get_parallel().override(tp_group=group, tp_size=1, tp_rank=0, **moe):
        yield


def write_checkpoint_copy(source_dir: str, target_dir: str, top: dict) -> str:
    """``source_dir``'s files (symlinked) under ``target_dir`` with ``top`` as its config.json."""
    os.makedirs(target_dir)
    for entry in os.listdir(source_dir):
        if entry != "config.json":
            os.symlink(os.path.join(source_dir, entry), os.path.join(target_dir, entry))
    with open(os.path.join(target_dir, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(top, handle, indent=2)
    return target_dir
