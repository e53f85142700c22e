"""``sglang-m3 serve RECIPE``: the line ``--dry-run`` prints pastes into a POSIX shell, the
recipe's local model folder is checked as ``--model`` is, and a recipe is found wherever it
stands among the SGLang options."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from serve_doubles import Started, no_server  # noqa: F401 (no_server: an autouse fixture)
from server_harness import free_port

import sglang_m3.commands.serve as serve
from sglang_m3.cli import main
from sglang_m3.serve_support import launch_command

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SINGLE_NODE = os.path.join(REPO, "recipes", "h200-bf16-tp8.yaml")  # JSON chat-template kwargs
TWO_NODES = os.path.join(REPO, "recipes", "gb200-bf16-tp8-ep8-2node.yaml")  # $(LWS_LEADER_ADDRESS)


def dry_run_line(capsys, *args: str) -> str:
    assert main(["serve", *args, "--dry-run"]) == 0
    return capsys.readouterr().out.rstrip("\n")


def shell_words(line: str, **env: str) -> list[str]:
    """The words a POSIX shell makes of ``line`` (an assignment prefix stays one word)."""
    script = f"set -- {line}; printf '%s\\0' \"$@\""
    done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True, env={"PATH": os.environ["PATH"], **env})
    return done.stdout.split("\0")[:-1]


def launch_words(*args: str, **expansions: str) -> list[str]:
    """What serve would run for ARGS: the environment assignments, then the command, with the
    Kubernetes references expanded as the pod would."""
    argv, env = serve.build_launch(serve.split_command_line(["serve", *args]))
    words = [f"{name}={value}" for name, value in env.items()] + launch_command(argv)
    for name, value in expansions.items():
        words = [word.replace(f"$({name})", value) for word in words]
    return words


@pytest.mark.parametrize("recipe", [SINGLE_NODE, TWO_NODES], ids=["json-arguments", "two-nodes"])
def test_the_dry_run_line_pastes_into_a_shell(recipe, capsys):
    """The JSON of ``--default-chat-template-kwargs`` reached SGLang split at its spaces, and
    ``$(LWS_LEADER_ADDRESS)`` ran as a command; in the pod the reference expands."""
    line = dry_run_line(capsys, recipe)
    assert not line.startswith(" ")
    leader = {"LWS_LEADER_ADDRESS": "10.0.0.7"}
    assert shell_words(line, **leader) == launch_words(recipe, **leader)
    assert '{"thinking_mode": "adaptive"}' in shell_words(line, **leader)


def test_environment_values_are_quoted_too():
    line = serve.shell_line({"A": "two words", "B": ""}, ["prog", "it's", "$(X):1"])
    assert shell_words(line, X="host") == ["A=two words", "B=", "prog", "it's", "host:1"]


def refusal(*args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *args])
    message = exit_info.value.code
    assert isinstance(message, str) and message.startswith("sglang-m3 serve: ") and "\n" not in message
    return message


def recipe_serving(tmp_path, model_path) -> str:
    with open(SINGLE_NODE, encoding="utf-8") as handle:
        text = handle.read().replace("path: MiniMaxAI/MiniMax-M3", f"path: {model_path}")
    recipe = tmp_path / "local-model.yaml"
    recipe.write_text(text)
    return str(recipe)


def test_a_recipes_missing_model_folder_is_named_with_the_field(tmp_path):
    """SGLang took it for a hub id and failed with a traceback after its imports."""
    missing = tmp_path / "no-such-model"
    recipe = recipe_serving(tmp_path, missing)
    assert refusal(recipe, "--port", str(free_port())) == f"sglang-m3 serve: {recipe}: spec.model.path {missing}: no such directory"


def test_a_recipes_model_folder_without_config_json_is_named(tmp_path):
    folder = tmp_path / "empty-model"
    folder.mkdir()
    recipe = recipe_serving(tmp_path, folder)
    assert refusal(recipe, "--port", str(free_port())) == (
        f"sglang-m3 serve: {recipe}: spec.model.path {folder}: no config.json there (not a model directory)"
    )


def test_a_recipes_bad_m3_config_is_named_with_the_file(tmp_path, tiny_m3_checkpoint):
    folder = tmp_path / "m3"
    folder.mkdir()
    shutil.copy(os.path.join(tiny_m3_checkpoint, "config.json"), folder)
    recipe = recipe_serving(tmp_path, folder)
    with pytest.raises(Started):
        main(["serve", recipe, "--port", str(free_port())])
    (folder / "config.json").write_text("{not json")
    assert refusal(recipe, "--port", str(free_port())).startswith(f"sglang-m3 serve: {folder / 'config.json'}: not valid JSON")


def test_the_dry_run_does_not_check_the_recipes_model(tmp_path, capsys):
    recipe = recipe_serving(tmp_path, tmp_path / "on-another-machine")
    assert "--model-path" in dry_run_line(capsys, recipe)


def test_a_recipe_after_sglang_options_is_the_recipe(capsys):
    """It went to SGLang as a stray argument while the tiny model was served."""
    words = shell_words(dry_run_line(capsys, "--enable-metrics", SINGLE_NODE))
    assert words == launch_words(SINGLE_NODE, "--enable-metrics")
    assert "MiniMaxAI/MiniMax-M3" in words and words[-1] == "--enable-metrics" and SINGLE_NODE not in words


def test_sglangs_own_yaml_config_still_goes_to_sglang(tmp_path, capsys):
    config = tmp_path / "sglang.yaml"
    config.write_text("tp-size: 8\n")
    words = shell_words(dry_run_line(capsys, "--model", "/models/m3", "--config", str(config)))
    assert words[-2:] == ["--config", str(config)]


def test_two_recipes_are_refused():
    assert refusal(SINGLE_NODE, "--enable-metrics", TWO_NODES, "--dry-run") == (
        f"sglang-m3 serve: two recipes ({SINGLE_NODE}, {TWO_NODES}): give one"
    )
