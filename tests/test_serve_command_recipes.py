"""``sglang-m3 serve RECIPE``: the line ``--dry-run`` prints pastes into a POSIX shell, the
recipe's local model folder is checked as ``--model`` is, a recipe is found wherever it
stands among the SGLang options, and what only the recipe's pod sets (``$(LWS_LEADER_ADDRESS)``
and other Kubernetes references) is taken from the environment of a real serve, or refused."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from serve_doubles import Started, no_server, option_values, started_argv  # noqa: F401 (no_server: an autouse fixture)
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
    """What serve's --dry-run line stands for with ARGS: the environment assignments, then the
    command, with the Kubernetes references expanded as the pod would."""
    argv, env = serve.build_launch(serve.split_command_line(["serve", *args, "--dry-run"]))
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


# --- values meant for the pod: a real (not --dry-run) serve resolves them here or refuses ---

@pytest.fixture
def no_leader(monkeypatch):
    for name in ("LWS_LEADER_ADDRESS", "LWS_WORKER_INDEX", "API_KEY", "TOKEN"):
        monkeypatch.delenv(name, raising=False)


def test_the_leader_placeholder_is_refused_where_no_pod_sets_it(no_leader):
    """SGLang got ``$(LWS_LEADER_ADDRESS):20000`` literally and could not rendezvous."""
    message = refusal(TWO_NODES, "--port", str(free_port()))
    assert f"{TWO_NODES}: spec.hardware.nodes is 2" in message
    assert "LWS_LEADER_ADDRESS" in message and "--dist-init-addr host:port" in message


def test_the_leader_address_is_taken_from_the_environment(no_leader, monkeypatch):
    monkeypatch.setenv("LWS_LEADER_ADDRESS", "10.0.0.7")
    argv = started_argv(TWO_NODES, "--port", str(free_port()))
    assert option_values(argv, "--dist-init-addr") == ["10.0.0.7:20000"]
    assert not any("$(" in word for word in argv)


@pytest.mark.parametrize("given", [["--dist-init-addr", "10.0.0.9:5000"], ["--dist-init-addr=10.0.0.9:5000"],
                                   ["--nccl-init-addr", "10.0.0.9:5000"]], ids=["flag", "inline", "alias"])
def test_a_given_leader_address_replaces_the_placeholder(no_leader, given):
    argv = started_argv(TWO_NODES, "--port", str(free_port()), *given)
    assert option_values(argv, "--dist-init-addr") == ["10.0.0.9:5000"]
    assert "--nccl-init-addr" not in argv and not any("$(" in word for word in argv)


def test_a_given_leader_address_is_in_the_dry_run_line_once(no_leader, capsys):
    words = shell_words(dry_run_line(capsys, TWO_NODES, "--dist-init-addr", "10.0.0.9:5000"))
    assert option_values(words, "--dist-init-addr") == ["10.0.0.9:5000"]


@pytest.mark.parametrize("args, expected", [
    ([TWO_NODES, "--dist-init-addr", "10.0.0.9"], f"sglang-m3 serve: {TWO_NODES}: --dist-init-addr: takes host:port"),
    ([TWO_NODES, "--dist-init-addr", "10.0.0.9:0"], f"sglang-m3 serve: {TWO_NODES}: --dist-init-addr: takes host:port"),
    ([SINGLE_NODE, "--dist-init-addr", "10.0.0.9:5000"],
     f"sglang-m3 serve: {SINGLE_NODE}: --dist-init-addr: applies to multi-node"),
    ([TWO_NODES, "--dist-init-addr", "10.0.0.9:5000", "--node-rank", "2"],
     f"sglang-m3 serve: {TWO_NODES}: --node-rank: 2 is outside 0 .. 1"),
], ids=["no-port", "port-0", "single-node", "rank-out-of-range"])
def test_a_bad_leader_address_or_rank_is_refused_as_recipe_render_refuses_it(no_leader, args, expected):
    assert refusal(*args, "--port", str(free_port())).startswith(expected)


def test_a_worker_node_gives_its_rank(no_leader):
    argv = started_argv(TWO_NODES, "--port", str(free_port()), "--node-rank", "1", "--dist-init-addr", "10.0.0.9:5000")
    assert option_values(argv, "--node-rank") == ["1"]


def test_a_rank_reference_is_resolved_here_or_refused(no_leader, monkeypatch):
    rank = ["--node-rank", "$(LWS_WORKER_INDEX)", "--dist-init-addr", "10.0.0.9:5000"]
    message = refusal(TWO_NODES, "--port", str(free_port()), *rank)
    assert message.startswith(f"sglang-m3 serve: {TWO_NODES}: --node-rank $(LWS_WORKER_INDEX): LWS_WORKER_INDEX is not set here")
    assert message.endswith("or give --node-rank N")
    monkeypatch.setenv("LWS_WORKER_INDEX", "1")
    assert option_values(started_argv(TWO_NODES, "--port", str(free_port()), *rank), "--node-rank") == ["1"]


def test_the_dry_run_keeps_the_placeholder_and_says_what_it_is(no_leader, capsys):
    assert main(["serve", TWO_NODES, "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert '--dist-init-addr "${LWS_LEADER_ADDRESS}":20000' in captured.out
    assert "LWS_LEADER_ADDRESS" in captured.err and "--dist-init-addr host:port" in captured.err


def recipe_with_references(tmp_path) -> str:
    with open(SINGLE_NODE, encoding="utf-8") as handle:
        text = handle.read()
    references = '  env:\n    HF_TOKEN: "$(TOKEN)"\n  serving:\n    extraArgs: ["--api-key", "key-$(API_KEY)"]\n'
    text = text.replace("  serving:\n", references, 1)
    recipe = tmp_path / "references.yaml"
    recipe.write_text(text)
    return str(recipe)


def test_other_kubernetes_references_of_a_recipe_are_resolved_or_named(no_leader, tmp_path, monkeypatch):
    recipe = recipe_with_references(tmp_path)
    assert refusal(recipe, "--port", str(free_port())).startswith(
        f"sglang-m3 serve: {recipe}: spec.env.HF_TOKEN $(TOKEN): TOKEN is not set here"
    )
    monkeypatch.setenv("TOKEN", "t0k")
    assert refusal(recipe, "--port", str(free_port())).startswith(
        f"sglang-m3 serve: {recipe}: spec.serving.extraArgs key-$(API_KEY): API_KEY is not set here"
    )
    monkeypatch.setenv("API_KEY", "s3cret")
    argv, env = serve.build_launch(serve.split_command_line(["serve", recipe]))
    assert env["HF_TOKEN"] == "t0k" and option_values(argv, "--api-key") == ["key-s3cret"]


def test_a_recipe_listening_on_every_interface_says_so(no_leader, capsys):
    """A recipe's spec.serving.host defaults to 0.0.0.0, which a pod needs; here it opens the
    server to the network."""
    with pytest.raises(Started):
        main(["serve", SINGLE_NODE, "--port", str(free_port())])
    err = capsys.readouterr().err
    assert "spec.serving.host 0.0.0.0" in err and "--host 127.0.0.1" in err
    with pytest.raises(Started):
        main(["serve", SINGLE_NODE, "--port", str(free_port()), "--host", "127.0.0.1"])
    assert "0.0.0.0" not in capsys.readouterr().err
