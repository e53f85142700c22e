"""Shared fixtures: tiny M3 checkpoints and real SGLang servers on the CPU platform.

Servers are session-scoped and started on first use, because each start costs minutes on a
2-core machine (``server_harness`` forks them from a warm interpreter to spare SGLang's imports).
Tests that need their own server flags use ``launch_cpu_server`` from ``server_harness`` directly.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

# Triton reads TRITON_INTERPRET when ``triton.language`` is first imported, and test modules of
# any directory may import it (through SGLang) while being collected: without CUDA the whole
# session must be in interpreter mode before the first of them, or the interpreted MSA kernels
# call compiled ``tl`` helpers. Set here, in the conftest pytest loads first.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, os.path.dirname(__file__))

# Property tests explore new random examples on every local run; under CI they replay the same
# examples each time (derandomized), so a landing is not decided by which examples a run drew.
# A counterexample found locally is kept as a fixed case beside its property test.
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

from server_harness import (  # noqa: E402
    TINY_PREFILL_CHUNK,
    cpu_recipe_environment,
    launch_cpu_server,
    server_environment,
    start_zygote,
)
from terminate_as_interrupt import install as terminate_as_interrupt  # noqa: E402


def pytest_configure(config):
    """SIGTERM unwinds the tests instead of ending pytest before their cleanup
    (``terminate_as_interrupt``: servers in their own sessions would outlive the run)."""
    terminate_as_interrupt()


#: The ``xdist_group`` of every server test: one worker runs them all, one after another (a
#: server is several busy processes; two at once on 2 cores only slow each other down).
SERVER_GROUP = "servers"


def _under_xdist(config) -> bool:
    return hasattr(config, "workerinput")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into node ids
def pytest_collection_modifyitems(config, items):
    """Alone, tests that start no server run first (the order is otherwise kept): they fail fast,
    and their time overlaps the server zygotes' imports. Under ``pytest-xdist`` (``scripts/test.sh``
    runs ``--dist loadgroup``) the server tests form one group that goes first, so that one worker
    runs them while the other takes the remaining files, each file a unit (its module fixtures
    are built once)."""
    distributed = _under_xdist(config)
    items.sort(key=lambda item: (item.get_closest_marker("server") is None) == distributed)
    if distributed:
        for item in items:
            group = SERVER_GROUP if item.get_closest_marker("server") else item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_finish(session):
    """Alone, start the zygotes the collected server tests need now (their imports then run beside
    the tests that need no server). Under xdist every worker collects every test but only one runs
    the server group: that worker starts them at its first server test (``pytest_runtest_setup``)."""
    if not _under_xdist(session.config):
        _start_server_zygotes(session.items)


_zygotes_started = False


def pytest_runtest_setup(item):
    if item.get_closest_marker("server"):
        _start_server_zygotes(item.session.items)


def _start_server_zygotes(items) -> None:
    """Servers fork from a warm interpreter (``server_zygote``), one per import-time environment:
    start those that ``items`` need, once. Modules that start servers without ``TRITON_INTERPRET``
    import ``launch_without_interpreter``; those that serve recipes import ``serve_tiny_recipe``."""
    global _zygotes_started
    if _zygotes_started:
        return
    _zygotes_started = True
    server_modules = {getattr(item, "module", None) for item in items if item.get_closest_marker("server")} - {None}
    if server_modules:
        start_zygote(server_environment())
    if any(hasattr(module, "launch_without_interpreter") for module in server_modules):
        from tests.speculative.no_interpreter import environment_without_interpreter

        start_zygote(environment_without_interpreter())
    if any(hasattr(module, "serve_tiny_recipe") for module in server_modules):
        start_zygote(cpu_recipe_environment())


@pytest.fixture(scope="session")
def tiny_checkpoint_factory(tmp_path_factory):
    """Builds (once per variant) a tiny checkpoint:
    ``factory(vision=False, layout="shipped", seed=0, mtp_modules=0)`` (see ``sglang_m3.tiny.checkpoint``)."""
    from sglang_m3.tiny.checkpoint import build_tiny_checkpoint

    built: dict[tuple, str] = {}

    def factory(vision: bool = False, layout: str = "shipped", seed: int = 0, mtp_modules: int = 0) -> str:
        key = (vision, layout, seed, mtp_modules)
        if key not in built:
            name = f"tiny-{'vl' if vision else 'text'}-{layout}-{seed}-mtp{mtp_modules}"
            built[key] = build_tiny_checkpoint(
                str(tmp_path_factory.getbasetemp() / name), seed=seed, vision=vision, layout=layout, mtp_modules=mtp_modules
            )
        return built[key]

    return factory


@pytest.fixture(scope="session")
def tiny_m3_checkpoint(tiny_checkpoint_factory) -> str:
    """Text-only tiny M3, config.json in the shipped checkpoint's layout."""
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
    these flags a server parses neither reasoning nor tool calls). Prefill is chunked (see
    ``TINY_PREFILL_CHUNK``), so the end-to-end checks against transformers cover chunking here.
    """
    parsers = ("--reasoning-parser", "minimax_m3", "--tool-call-parser", "minimax_m3")
    chunking = ("--chunked-prefill-size", str(TINY_PREFILL_CHUNK))
    with launch_cpu_server(tiny_m3_checkpoint, server_log_dir, *parsers, *chunking) as server:
        yield server
