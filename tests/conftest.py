"""Shared fixtures: tiny M3 checkpoints and real SGLang servers on the CPU platform.

Servers are session-scoped and started on first use, because each start costs about a minute
on a 2-core machine. Tests that need their own server flags use ``launch_cpu_server`` from
``server_harness`` directly.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from server_harness import launch_cpu_server  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint_factory(tmp_path_factory):
    """Builds (once per variant) a tiny checkpoint: ``factory(vision=False, sparse_form="flat", seed=0)``."""
    from sglang_m3.tiny.checkpoint import build_tiny_checkpoint

    built: dict[tuple, str] = {}

    def factory(vision: bool = False, sparse_form: str = "flat", seed: int = 0) -> str:
        key = (vision, sparse_form, seed)
        if key not in built:
            name = f"tiny-{'vl' if vision else 'text'}-{sparse_form}-{seed}"
            built[key] = build_tiny_checkpoint(str(tmp_path_factory.getbasetemp() / name), seed=seed, vision=vision, sparse_form=sparse_form)
        return built[key]

    return factory


@pytest.fixture(scope="session")
def tiny_m3_checkpoint(tiny_checkpoint_factory) -> str:
    """Text-only tiny M3, flat sparse config."""
    return tiny_checkpoint_factory()


@pytest.fixture(scope="session")
def tiny_m3_vl_checkpoint(tiny_checkpoint_factory) -> str:
    """Tiny M3 with its vision tower (MiniMaxM3SparseForConditionalGeneration)."""
    return tiny_checkpoint_factory(vision=True)


@pytest.fixture(scope="session")
def server_log_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("server-logs"))


@pytest.fixture(scope="session")
def tiny_m3_server(tiny_m3_checkpoint, server_log_dir):
    """The real SGLang server with the text-only tiny M3 and the project's parsers.

    The parsers are named by their ``minimax_m3`` alias: the plugin's hooks must map it onto
    SGLang's ``minimax-m3`` request logic (SGLang only suggests parsers it detects, so without
    these flags a server parses neither reasoning nor tool calls).
    """
    parsers = ("--reasoning-parser", "minimax_m3", "--tool-call-parser", "minimax_m3")
    with launch_cpu_server(tiny_m3_checkpoint, server_log_dir, *parsers) as server:
        yield server
