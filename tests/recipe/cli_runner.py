"""Run ``sglang-m3 recipe ...`` in-process through the command module's own parser."""

from __future__ import annotations

import argparse

from sglang_m3.commands import recipe as recipe_command


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``sglang-m3 recipe *argv``."""
    parser = argparse.ArgumentParser(prog="sglang-m3")
    recipe_command.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["recipe", *argv])
    code = args.handler(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err
