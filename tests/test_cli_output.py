"""The ``sglang-m3`` command as a pipeline stage and its version."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from sglang_m3 import __version__
from sglang_m3.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("args", [["recipe", "schema"], ["recipe", "catalog"]])
def test_a_reader_that_stops_early_ends_the_command_quietly(args):
    """``sglang-m3 recipe schema | head`` printed a BrokenPipeError traceback: the pipe is closed
    here before the command writes, so every write meets it."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    done = subprocess.run(
        [sys.executable, "-m", "sglang_m3.cli", *args], stdout=write_end, stderr=subprocess.PIPE, text=True, cwd=REPO, timeout=120
    )
    os.close(write_end)
    assert done.stderr == ""
    assert done.returncode == 128 + signal.SIGPIPE


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"sglang-m3 {__version__}\n"
