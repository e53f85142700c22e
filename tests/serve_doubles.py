"""``sglang-m3 serve`` run up to the point where it would start SGLang, for tests of its checks.

Import ``no_server`` (an autouse fixture) into a test module to make the command raise
``Started`` with the command line in place of starting a server, its tiny-model cache in the
test's own directory.
"""

from __future__ import annotations

import subprocess
import types

import pytest

import sglang_m3.commands.serve as serve


class Started(Exception):
    """Raised in place of starting SGLang: the command got past every check."""


@pytest.fixture(autouse=True)
def no_server(monkeypatch, tmp_path):
    def start(command, **kwargs):
        raise Started(command)

    # the command's own subprocess module only: a test may still run the command end to end
    monkeypatch.setattr(serve, "subprocess", types.SimpleNamespace(Popen=start, TimeoutExpired=subprocess.TimeoutExpired))
    monkeypatch.setenv("SGLANG_M3_CACHE", str(tmp_path / "cache"))
