"""The ``sglang-m3`` command: one argparse tree, one module per command group.

Each module in ``COMMAND_MODULES`` exposes ``register(subparsers)``, which adds its parser and
sets ``handler`` (a callable taking the parsed namespace and returning an exit code). Modules are
imported here, but must themselves import torch / SGLang only inside their handlers, so that
``sglang-m3 recipe ...`` works on a machine without either.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from sglang_m3 import __version__

COMMAND_MODULES = (
    "sglang_m3.commands.tiny_checkpoint",
    "sglang_m3.commands.tiny_draft",
    "sglang_m3.commands.serve",
    "sglang_m3.commands.recipe",
    "sglang_m3.commands.operator",
    "sglang_m3.commands.inspect",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang-m3",
        description="Serve MiniMax M3 with SGLang and manage its deployment recipes.",
    )
    parser.add_argument("--version", action="version", version=f"sglang-m3 {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extra = build_parser().parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra_args", False):
        build_parser().error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra_args = extra
    args.argv = argv
    try:
        status = int(args.handler(args) or 0)
        sys.stdout.flush()  # here, not at exit, so that a closed pipe is met below
    except BrokenPipeError:
        return _closed_pipe_status()
    return status


def _closed_pipe_status() -> int:
    """A reader that stopped early (``sglang-m3 recipe schema | head``) ends the command quietly
    with the shell's status for a process SIGPIPE ended, as ``cat`` ends, where Python printed a
    BrokenPipeError traceback. stdout is pointed at /dev/null so that the interpreter's flush at
    exit does not meet the closed pipe again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
