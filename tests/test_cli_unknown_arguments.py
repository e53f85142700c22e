"""An argument a command does not know is refused by that command's parser: its usage, the
argument named, exit 2. argparse hands a subcommand's leftovers to the top-level parser, which
printed ``usage: sglang-m3 [-h] [--version] COMMAND ...`` whatever the command."""

from __future__ import annotations

import pytest

from sglang_m3.cli import main


def _refusal(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    return err


@pytest.mark.parametrize("argv, prog", [
    (["tiny-checkpoint", "out", "--bogus"], "sglang-m3 tiny-checkpoint"),
    (["tiny-draft", "target", "out", "--bogus"], "sglang-m3 tiny-draft"),
    (["inspect", "config.json", "--bogus"], "sglang-m3 inspect"),
    (["recipe", "validate", "r.yaml", "--bogus"], "sglang-m3 recipe validate"),
    (["recipe", "--bogus", "validate", "r.yaml"], "sglang-m3 recipe"),
    (["operator", "render", "r.yaml", "--bogus"], "sglang-m3 operator render"),
    (["operator", "run", "--bogus"], "sglang-m3 operator run"),
    (["--bogus", "recipe", "schema"], "sglang-m3"),
])
def test_an_unknown_flag_is_refused_with_the_usage_of_the_command_given_it(argv, prog, capsys):
    err = _refusal(capsys, argv)
    assert err.startswith(f"usage: {prog} ")
    assert err.endswith(f"{prog}: error: unrecognized arguments: --bogus\n")


@pytest.mark.parametrize("argv, prog", [
    (["recipe", "validate", "--bogus"], "sglang-m3 recipe validate"),
    (["inspect", "--bogus"], "sglang-m3 inspect"),
    (["tiny-checkpoint", "--bogus"], "sglang-m3 tiny-checkpoint"),
])
def test_an_unknown_flag_is_named_before_a_missing_positional(argv, prog, capsys):
    """argparse reports the missing positional first, which hid the typo that caused it."""
    assert _refusal(capsys, argv).endswith(f"{prog}: error: unrecognized arguments: --bogus\n")


@pytest.mark.parametrize("argv, message", [
    (["recipe", "validate"], "sglang-m3 recipe validate: error: the following arguments are required: PATH\n"),
    (["recipe"], "sglang-m3 recipe: error: the following arguments are required: SUBCOMMAND\n"),
    ([], "sglang-m3: error: the following arguments are required: COMMAND\n"),
])
def test_missing_arguments_are_still_named(argv, message, capsys):
    assert _refusal(capsys, argv).endswith(message)


def test_serve_passes_unknown_flags_on_to_sglang():
    from sglang_m3.cli import build_parser

    parsed, extra = build_parser().parse_known_args(["serve", "--dry-run", "--enable-metrics", "--bogus"])
    assert parsed.dry_run and extra == ["--enable-metrics", "--bogus"]
