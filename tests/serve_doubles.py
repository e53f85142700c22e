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
from sglang_m3.cli import main


class Started(Exception):
    """Raised in place of starting SGLang: the command got past every check."""


@pytest.fixture(autouse=True)
def no_server(monkeypatch, tmp_path):
    def start(command, **kwargs):
        raise Started(command)

    # the command's own subprocess module only: a test may still run the command end to end
    monkeypatch.setattr(serve, "subprocess", types.SimpleNamespace(Popen=start, TimeoutExpired=subprocess.TimeoutExpired))
    monkeypatch.setenv("SGLANG_M3_CACHE", str(tmp_path / "cache"))


def started_argv(*args: str) -> list[str]:
    """The SGLang arguments ``sglang-m3 serve ARGS`` would start (after ``python -m sglang.launch_server``)."""
    with pytest.raises(Started) as started:
        main(["serve", *args])
    return started.value.args[0][3:]


def option_values(argv: list[str], flag: str) -> list[str]:
    """Every value ``argv`` gives ``flag`` (as ``flag value``), in order."""
    return [argv[i + 1] for i, word in enumerate(argv) if word == flag]
