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


class CommandParser(argparse.ArgumentParser):
    """A parser that refuses the arguments it does not know itself, with its own usage, unless
    its command passes them on (``accepts_extra_args``: serve hands them to SGLang). argparse
    leaves a subcommand's unknown arguments to the top-level parser, whose message showed
    ``usage: sglang-m3 [-h] [--version] COMMAND ...`` for ``sglang-m3 tiny-checkpoint x --bogus``.
    Subparsers are made of their parent's class, so every command's tree is built of these."""

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        unknown = self._unknown_arguments(args)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        return super().parse_known_args(args, namespace)

    def _unknown_arguments(self, args: list[str]) -> list[str]:
        """What a parse with every argument optional leaves over, looked at before the real parse:
        that one reports a missing positional first, so ``sglang-m3 recipe validate --bogus``
        said only that PATH is required, and not that ``--bogus`` is no option of the command."""
        required = [action for action in self._actions if action.required]
        for action in required:
            action.required = False
        try:
            namespace, extra = super().parse_known_args(args, None)
        finally:
            for action in required:
                action.required = True
        return [] if getattr(namespace, "accepts_extra_args", False) else extra


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
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
    args.extra_args = extra
    args.argv = argv
    try:
        status = int(args.handler(args) or 0)
        sys.stdout.flush()  # here, not at exit, so that a closed pipe is met below
    except BrokenPipeError:
        return _closed_pipe_status()
    except KeyboardInterrupt:
        return _interrupted_status(args.command)
    return status


def _interrupted_status(command: str) -> int:
    """Ctrl+C ends a command with one line and the shell's status for an interrupted command
    (130, as ``serve`` exits), where Python printed a KeyboardInterrupt traceback. A build's
    staging directory has been removed on the way here (the builds remove it on any exception),
    so nothing half-written is left."""
    print(f"sglang-m3 {command}: interrupted", file=sys.stderr)
    return 128 + signal.SIGINT


def _closed_pipe_status() -> int:
    """A reader that stopped early (``sglang-m3 recipe schema | head``) ends the command quietly
    with the shell's status for a process SIGPIPE ended, as ``cat`` ends, where Python printed a
    BrokenPipeError traceback. stdout is pointed at /dev/null so that the interpreter's flush at
    exit does not meet the closed pipe again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
