"""The ``sglang-m3`` command: one argparse tree, one module per command group.

Each module in ``COMMAND_MODULES`` exposes ``register(subparsers)``, which adds its parser and
sets ``handler`` (a callable taking the parsed namespace and returning an exit code). Modules are
imported here, but must themselves import torch / SGLang only inside their handlers, so that
``sglang-m3 recipe ...`` works on a machine without either.
"""

from __future__ import annotations

import argparse
import importlib
import sys

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
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
