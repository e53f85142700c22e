"""``sglang-m3 serve`` refusing what SGLang could not start, before SGLang starts.

SGLang itself meets a bad model directory 30 s into its start with a traceback, and a port in use
only after loading the model, then hangs in its warm-up. Each case here must be refused by the
command with one line naming the argument or file at fault: starting a server fails the test.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
from serve_doubles import Started, no_server, option_values, started_argv  # noqa: F401 (no_server: an autouse fixture)
from server_harness import free_port

import sglang_m3.commands.serve as serve
import sglang_m3.serve_support as serve_support
from sglang_m3.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def refusal(*args: str) -> str:
    """The one-line message ``sglang-m3 serve ARGS`` exits with (status 1, no traceback)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *args])
    message = exit_info.value.code
    assert isinstance(message, str), f"exit status {message!r} instead of a message"
    assert message.startswith("sglang-m3 serve: ") and "\n" not in message
    return message


@pytest.fixture
def m3_dir(tiny_m3_checkpoint, tmp_path):
    """A directory with the tiny M3's config.json alone (the checks read no weights)."""
    directory = tmp_path / "m3"
    directory.mkdir()
    shutil.copy(os.path.join(tiny_m3_checkpoint, "config.json"), directory)
    return directory


def edit_config(directory, edit) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def test_a_missing_model_directory_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    assert refusal("--model", str(missing), "--port", str(free_port())) == f"sglang-m3 serve: --model {missing}: no such directory"


def test_a_directory_without_config_json_is_named(tmp_path):
    assert refusal("--model", str(tmp_path), "--port", str(free_port())) == (
        f"sglang-m3 serve: --model {tmp_path}: no config.json there (not a model directory)"
    )


def test_a_file_given_as_the_model_is_named(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("kind: M3Recipe\n")
    message = refusal("--model", str(recipe), "--port", str(free_port()))
    assert message.startswith(f"sglang-m3 serve: --model {recipe}: not a directory")
    assert "without --model" in message  # a recipe is the positional argument


def test_a_config_that_is_not_json_is_named(m3_dir):
    (m3_dir / "config.json").write_text('{"architectures": ["MiniMaxM3SparseForCausalLM"],')
    message = refusal("--model", str(m3_dir), "--port", str(free_port()))
    assert message.startswith(f"sglang-m3 serve: {m3_dir / 'config.json'}: not valid JSON")


def test_a_bad_m3_config_field_is_named_with_the_file(m3_dir):
    edit_config(m3_dir, lambda config: config["text_config"].update(hidden_size="big"))
    assert refusal("--model", str(m3_dir), "--port", str(free_port())) == (
        f"sglang-m3 serve: {m3_dir / 'config.json'}: config field 'hidden_size' must be a positive integer, got 'big'"
    )


def test_an_unknown_m3_architecture_is_named(m3_dir):
    edit_config(m3_dir, lambda config: config.update(architectures=["MiniMaxM3ForEverything"]))
    message = refusal("--model", str(m3_dir), "--port", str(free_port()))
    assert message.startswith(f"sglang-m3 serve: {m3_dir / 'config.json'}: architecture 'MiniMaxM3ForEverything'")
    assert "MiniMaxM3SparseForCausalLM" in message


def test_another_model_passes_through_with_a_note(tmp_path, capsys):
    """README: ``--model`` serves any checkpoint SGLang serves; the note says M3's support is unused."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(Started):
        main(["serve", "--model", str(tmp_path), "--port", str(free_port())])
    assert f"{tmp_path / 'config.json'} names LlamaForCausalLM, not MiniMax M3" in capsys.readouterr().err


def test_a_hub_id_is_passed_through_unchecked():
    with pytest.raises(Started) as started:
        main(["serve", "--model", "MiniMaxAI/MiniMax-M3", "--port", str(free_port())])
    assert started.value.args[0][3:5] == ["--model-path", "MiniMaxAI/MiniMax-M3"]


def test_sglangs_model_path_is_the_model(capsys):
    """SGLang spells ``--model`` also ``--model-path``: given so, it names the model to serve, not
    a path the tiny model's CPU settings and platform are then applied to."""
    assert main(["serve", "--model-path", "/models/m3", "--tp-size", "8", "--dry-run"]) == 0
    line = capsys.readouterr().out
    assert "sglang.launch_server --model-path /models/m3 --tp-size 8" in line
    assert "SGLANG_PLATFORM" not in line and "--dtype float32" not in line


@pytest.mark.parametrize("args", [
    ["--model", "/models/a", "--model-path", "/models/b"],
    ["--model-path=/models/b", "--model", "/models/a"],
    ["--model", "/models/a", "--model", "/models/b"],
])
def test_the_model_given_twice_is_refused(args):
    message = refusal(*args, "--dry-run")
    assert "the model is given twice" in message and "/models/a" in message and "/models/b" in message


def test_a_recipe_and_sglangs_model_path_are_refused_together():
    recipe = os.path.join(REPO, "recipes", "cpu-tiny.yaml")
    assert refusal(recipe, "--model-path", "/models/b", "--dry-run") == "sglang-m3 serve: give a recipe or --model-path, not both"


def test_a_port_in_use_is_named_before_the_server_starts(m3_dir):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        message = refusal("--model", str(m3_dir), "--port", str(port))
    assert message == f"sglang-m3 serve: port {port} on 127.0.0.1 is in use (another server?): choose another with --port"


def test_the_tiny_models_port_in_use_is_named_too():
    """The default tiny model too: a second ``sglang-m3 serve`` on a first one's port would
    otherwise wait on the first server's answers and print them as its own."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        message = refusal("--host", "127.0.0.1", "--port", str(port))
    assert f"port {port} on 127.0.0.1 is in use" in message


def test_a_host_that_cannot_be_listened_on_is_named(m3_dir):
    message = refusal("--model", str(m3_dir), "--host", "192.0.2.1", "--port", str(free_port()))
    assert message.startswith("sglang-m3 serve: cannot listen on 192.0.2.1:")


def test_a_recipe_that_is_a_directory_points_to_model(tmp_path):
    assert refusal(str(tmp_path), "--dry-run") == (
        f"sglang-m3 serve: {tmp_path} is a directory, not a recipe file: to serve the model in it, give --model {tmp_path}"
    )


def test_an_unwritable_tiny_model_cache_is_named(tmp_path, monkeypatch):
    (tmp_path / "plain-file").write_text("")
    cache = tmp_path / "plain-file" / "cache"
    monkeypatch.setenv("SGLANG_M3_CACHE", str(cache))
    message = refusal("--dry-run")
    assert message.startswith(f"sglang-m3 serve: cannot build the tiny M3 checkpoint: cannot write {cache}")
    assert "SGLANG_M3_CACHE" in message


def test_a_foreign_directory_in_the_tiny_model_cache_is_named(tmp_path, monkeypatch):
    from sglang_m3.tiny.checkpoint import BUILD_FORMAT

    cache = tmp_path / "cache"
    foreign = cache / f"tiny-m3-v{BUILD_FORMAT}-seed0"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine")
    monkeypatch.setenv("SGLANG_M3_CACHE", str(cache))
    message = refusal("--dry-run")
    assert f"{foreign} exists and is not empty" in message
    assert (foreign / "notes.txt").read_text() == "mine"


def test_a_tiny_build_finished_first_by_another_command_is_used(tmp_path, monkeypatch):
    """Two first ``serve`` runs build the same cached checkpoint; the one that renames its build
    into place second finds the directory taken, and serves the other's build."""
    import sglang_m3.tiny.checkpoint as checkpoint

    def other_finishes_first(directory, seed):
        os.makedirs(directory)
        with open(os.path.join(directory, "config.json"), "w") as handle:
            handle.write("{}")
        raise OSError(errno.ENOTEMPTY, "Directory not empty", directory)

    monkeypatch.setattr(checkpoint, "build_tiny_checkpoint", other_finishes_first)
    path = serve_support.ensure_tiny_checkpoint(log=lambda line: None)
    assert os.path.isfile(os.path.join(path, "config.json"))


def test_help_says_what_goes_to_sglang(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "[SGLang option ...]" in text
    assert "python -m sglang.launch_server --help" in text
    assert "--model-path" in text
    assert "--dry-run checks neither" in text


def test_a_refusal_has_no_traceback_end_to_end(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "sglang_m3.cli", "serve", "--model", str(tmp_path / "missing"), "--port", str(free_port())],
        capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, "SGLANG_M3_CACHE": str(tmp_path)},
    )
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == f"sglang-m3 serve: --model {tmp_path / 'missing'}: no such directory\n"


def test_abbreviated_options_are_read_one_way():
    """``--dry`` or ``--mod`` are not serve's options: argparse must not take them for
    ``--dry-run`` / ``--model`` while the command line's own reader passes them to SGLang (a
    ``--dry`` would then start a server that the parsed namespace says is a dry run)."""
    from sglang_m3.cli import build_parser

    argv = ["serve", "--dry", "--mod", "some/model"]
    parsed, extra = build_parser().parse_known_args(argv)
    own = serve.split_command_line(argv)
    assert (parsed.dry_run, parsed.model) == (own.dry_run, own.model) == (False, None)
    assert own.extra_args == ["--dry", "--mod", "some/model"]
    assert extra[:2] == ["--dry", "--mod"]  # (argparse takes the value for the recipe; the command reads argv itself)


def test_a_local_m3_checkpoint_is_served_with_m3s_parsers(m3_dir):
    """Without them SGLang only logged a suggestion: reasoning came back in `content`, and a
    required tool call as plain text from SGLang's JSON grammar."""
    with pytest.raises(Started) as started:
        main(["serve", "--model", str(m3_dir), "--port", str(free_port()), "--tp-size", "1"])
    argv = started.value.args[0][3:]
    assert argv[:6] == ["--model-path", str(m3_dir), "--reasoning-parser", "minimax-m3", "--tool-call-parser", "minimax-m3"]
    assert argv[-2:] == ["--tp-size", "1"]


def test_the_users_parser_flags_come_after_and_win(m3_dir, capsys):
    assert main(["serve", "--model", str(m3_dir), "--tool-call-parser", "qwen", "--dry-run"]) == 0
    assert capsys.readouterr().out.split()[-4:] == ["--tool-call-parser", "minimax-m3", "--tool-call-parser", "qwen"]


def test_another_model_gets_no_m3_parsers(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    assert main(["serve", "--model", str(tmp_path), "--dry-run"]) == 0
    assert "--tool-call-parser" not in capsys.readouterr().out


@pytest.fixture
def platform_here(monkeypatch):
    """Choose what SGLang's platform discovery finds on this machine: ``cpu`` (torch sees no
    accelerator, so sglang-m3's CPU platform activates) or ``gpu``."""
    import sglang_m3.platform as platform

    for name in ("SGLANG_PLATFORM", "SGLANG_USE_CPU_ENGINE"):
        monkeypatch.delenv(name, raising=False)

    def choose(kind: str) -> None:
        monkeypatch.setattr(platform, "_has_accelerator", lambda: kind == "gpu")

    return choose


def test_a_local_model_on_the_cpu_platform_gets_a_bounded_kv_cache(m3_dir, platform_here, capsys):
    """SGLang sized the KV pool from the machine's whole memory: ~15 GB for a tiny model on a
    23 GB machine. The bound is the tiny model's, before the user's flags, and said."""
    platform_here("cpu")
    argv = started_argv("--model", str(m3_dir), "--port", str(free_port()), "--tp-size", "1")
    assert option_values(argv, "--max-total-tokens") == [str(serve_support.CPU_MAX_TOTAL_TOKENS)] == ["8192"]
    assert argv[-2:] == ["--tp-size", "1"]
    err = capsys.readouterr().err
    assert "CPU platform" in err and "--max-total-tokens 8192" in err and "--mem-fraction-static" in err


def declare_context(directory, tokens: int) -> None:
    edit_config(directory, lambda config: config["text_config"].update(max_position_embeddings=tokens))


def test_a_million_token_context_is_capped_with_the_kv_cache_on_the_cpu_platform(m3_dir, platform_here, capsys):
    """M3 declares 1M positions: SGLang's request-slot table then held 2,049 x 1M int32 slots
    (8.6 GB written at start-up, the scheduler at 9.2 GB RSS) for a pool of 8,192 tokens that no
    longer request fits."""
    platform_here("cpu")
    declare_context(m3_dir, 1_048_576)
    argv = started_argv("--model", str(m3_dir), "--port", str(free_port()), "--tp-size", "1")
    assert option_values(argv, "--context-length") == ["8192"]
    assert option_values(argv, "--max-total-tokens") == ["8192"]
    assert argv[-2:] == ["--tp-size", "1"]
    assert "--context-length 8192 (the model declares 1,048,576 tokens)" in capsys.readouterr().err


def test_a_context_overridden_by_json_model_override_args_is_the_one_read(m3_dir, platform_here):
    platform_here("cpu")
    override = '{"text_config": {"max_position_embeddings": 65536}}'
    argv = started_argv("--model", str(m3_dir), "--port", str(free_port()), "--json-model-override-args", override)
    assert option_values(argv, "--context-length") == ["8192"]


@pytest.mark.parametrize("own", [["--context-length", "32768"], ["--context-len=32768"]], ids=["spelled-out", "abbreviated"])
def test_the_users_own_context_length_is_left_alone(m3_dir, platform_here, own):
    platform_here("cpu")
    declare_context(m3_dir, 1_048_576)
    argv = started_argv("--model", str(m3_dir), "--port", str(free_port()), *own)
    assert argv[-len(own):] == own and option_values(argv, "--context-length") == own[1:]
    assert option_values(argv, "--max-total-tokens") == ["8192"]


def test_a_context_within_the_bound_is_not_touched(m3_dir, platform_here):
    platform_here("cpu")
    declare_context(m3_dir, 4096)
    assert "--context-length" not in started_argv("--model", str(m3_dir), "--port", str(free_port()))


def test_a_user_sized_kv_cache_keeps_the_declared_context(m3_dir, platform_here):
    platform_here("cpu")
    declare_context(m3_dir, 1_048_576)
    argv = started_argv("--model", str(m3_dir), "--port", str(free_port()), "--max-total-tokens", "65536")
    assert "--context-length" not in argv


def test_the_tiny_model_and_a_local_model_share_the_cpu_bound():
    tiny = serve_support.TINY_CPU_ARGS
    assert tiny[tiny.index("--max-total-tokens") + 1] == str(serve_support.CPU_MAX_TOTAL_TOKENS)


@pytest.mark.parametrize("own", [
    ["--max-total-tokens", "2048"],
    ["--max-total-tokens=2048"],
    ["--max-total-tok", "2048"],  # SGLang's argparse expands an unambiguous prefix
    ["--mem-fraction-static", "0.3"],
    ["--mem-fraction=0.3"],
], ids=["max-total-tokens", "inline", "abbreviated", "mem-fraction", "mem-fraction-abbreviated"])
def test_the_users_own_kv_sizing_is_left_alone(m3_dir, platform_here, capsys, own):
    platform_here("cpu")
    argv = started_argv("--model", str(m3_dir), "--port", str(free_port()), *own)
    assert argv[-len(own):] == own and "8192" not in argv
    assert "--max-total-tokens 8192" not in capsys.readouterr().err


def test_kv_sizing_in_sglangs_config_file_is_left_alone(m3_dir, platform_here, tmp_path):
    """SGLang's command line wins over its --config file: the bound would have replaced it."""
    platform_here("cpu")
    config = tmp_path / "sglang.yaml"
    config.write_text("max_total_tokens: 2048\n")
    argv = started_argv("--model", str(m3_dir), "--port", str(free_port()), "--config", str(config))
    assert "--max-total-tokens" not in argv


def test_a_hub_model_on_the_cpu_platform_is_bounded_too(platform_here):
    platform_here("cpu")
    argv = started_argv("--model", "some-org/some-model", "--port", str(free_port()))
    assert option_values(argv, "--max-total-tokens") == ["8192"]


def test_gpu_serving_keeps_sglangs_memory_defaults(m3_dir, platform_here, capsys):
    platform_here("gpu")
    argv = started_argv("--model", str(m3_dir), "--port", str(free_port()))
    assert "--max-total-tokens" not in argv and "--mem-fraction-static" not in argv
    assert "CPU platform" not in capsys.readouterr().err


def test_another_platform_named_by_sglang_platform_keeps_sglangs_defaults(m3_dir, platform_here, monkeypatch):
    platform_here("cpu")
    monkeypatch.setenv("SGLANG_PLATFORM", "some_other_platform")
    assert "--max-total-tokens" not in started_argv("--model", str(m3_dir), "--port", str(free_port()))


def test_the_cpu_platform_named_by_sglang_platform_is_bounded(m3_dir, platform_here, monkeypatch):
    platform_here("gpu")
    monkeypatch.setenv("SGLANG_PLATFORM", "sglang_m3_cpu")
    assert option_values(started_argv("--model", str(m3_dir), "--port", str(free_port())), "--max-total-tokens") == ["8192"]


def test_the_dry_run_line_has_no_machine_dependent_bound(m3_dir, platform_here, capsys):
    """--dry-run's line may be meant for another machine (a GPU one): the bound of this one
    would cap its KV cache at 8192 tokens there."""
    platform_here("cpu")
    assert main(["serve", "--model", str(m3_dir), "--dry-run"]) == 0
    assert "--max-total-tokens" not in capsys.readouterr().out
