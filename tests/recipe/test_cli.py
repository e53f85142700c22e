"""``sglang-m3 recipe ...``: exit codes, outputs, and the shell command render prints."""

from __future__ import annotations

import json
import shlex

import yaml

from sglang_m3.recipe import crd_openapi_schema, load_recipe, recipe_json_schema, render_launch
from tests.recipe.cli_runner import run_cli
from tests.recipe.recipe_factory import BROKEN, LIBRARY, recipe_document


def test_validate_mixes_files_and_folders_and_fails_on_any_error(capsys, tmp_path):
    good = LIBRARY / "h200-bf16-tp8.yaml"
    code, out, _ = run_cli(capsys, "validate", str(good))
    assert code == 0 and out.startswith("ok   ")
    broken = BROKEN / "gpu-count-mismatch.yaml"
    code, out, _ = run_cli(capsys, "validate", str(good), str(broken))
    assert code == 1
    assert "FAIL " + str(broken) in out
    assert "error: spec.parallelism: tp x pp x dp" in out
    assert "2 recipe(s), 1 with errors" in out


def test_validate_warnings_do_not_fail(capsys, tmp_path):
    path = tmp_path / "warn.yaml"
    path.write_text(yaml.safe_dump(recipe_document(spec__kvCache={"dtype": "fp8_e5m2"})))
    code, out, _ = run_cli(capsys, "validate", str(path), "--output", "json")
    [result] = json.loads(out)
    assert code == 0 and result["ok"]
    assert [f["rule"] for f in result["findings"]] == ["kv.fp8-e5m2"]


def test_validate_empty_folder_is_an_error(capsys, tmp_path):
    code, _, err = run_cli(capsys, "validate", str(tmp_path))
    assert code == 1 and "no recipe files" in err


def test_fit_prints_the_table(capsys):
    code, out, _ = run_cli(capsys, "fit", str(LIBRARY / "b300-mxfp8-tp8-1m-context.yaml"))
    assert code == 0
    assert "largest concurrency at requested context              3" in out
    assert "KV + index bytes per token per GPU" in out and "45,312" in out
    code, out, _ = run_cli(capsys, "fit", str(BROKEN / "bf16-on-one-h100-node.yaml"),
                           "--output", "json")
    assert code == 1
    report = json.loads(out)
    assert report["findings"][0]["rule"] == "fit.weights"
    # one TP8 rank of the bf16 weights (108.93 GB, as inspect measures it) against 80 GB x 0.8 = 64 GB
    assert report["fit"]["weight_bytes_per_gpu"] == 108_930_863_104
    assert report["fit"]["static_budget_bytes"] == 64_000_000_000
    assert report["fit"]["pool_tokens"] == 0


def test_fit_of_the_cpu_recipe_explains_itself(capsys):
    code, out, _ = run_cli(capsys, "fit", str(LIBRARY / "cpu-tiny.yaml"))
    assert code == 0 and "serves the tiny model" in out


def test_render_prints_a_pasteable_command(capsys):
    path = LIBRARY / "cpu-tiny.yaml"
    code, out, _ = run_cli(capsys, "render", str(path))
    assert code == 0
    words = shlex.split(out)
    launch = render_launch(load_recipe(path))
    assert words[0] == "SGLANG_PLATFORM=sglang_m3_cpu"
    assert words[1:] == launch.command()
    code, out, _ = run_cli(capsys, "render", str(path), "--output", "json")
    assert json.loads(out) == {"argv": launch.argv, "env": launch.env}


def test_render_multi_node_uses_the_given_rank_and_leader(capsys):
    path = LIBRARY / "h100-bf16-tp8-pp2.yaml"
    code, out, _ = run_cli(capsys, "render", str(path), "--output", "json",
                           "--node-rank", "1", "--dist-init-addr", "10.1.2.3:5000")
    argv = json.loads(out)["argv"]
    assert code == 0
    assert argv[argv.index("--nnodes") + 1] == "2"
    assert argv[argv.index("--node-rank") + 1] == "1"
    assert argv[argv.index("--dist-init-addr") + 1] == "10.1.2.3:5000"
    code, out, _ = run_cli(capsys, "render", str(path), "--output", "json",
                           "--node-rank", "$(LWS_WORKER_INDEX)")
    argv = json.loads(out)["argv"]
    assert argv[argv.index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
    assert argv[argv.index("--dist-init-addr") + 1] == "$(LWS_LEADER_ADDRESS):20000"


def test_schema_outputs(capsys):
    code, out, _ = run_cli(capsys, "schema")
    assert code == 0 and json.loads(out)["title"] == "Recipe"
    code, out, _ = run_cli(capsys, "schema", "--crd")
    assert json.loads(out) == crd_openapi_schema()
    code, out, _ = run_cli(capsys, "schema", "--crd", "--format", "yaml")
    assert yaml.safe_load(out) == crd_openapi_schema()
    code, out, _ = run_cli(capsys, "schema", "--format", "yaml")
    assert yaml.safe_load(out) == recipe_json_schema()


def test_catalog_lists_every_profile(capsys):
    code, out, _ = run_cli(capsys, "catalog", "--output", "json")
    catalog = json.loads(out)
    assert code == 0
    assert catalog["mi300x"]["attention_backend"] == "triton"
    assert catalog["h100"]["variants"] == ["bf16", "mxfp8"]
    assert (catalog["h200"]["hbm_tbps"], catalog["cpu"]["hbm_tbps"]) == (4.8, None)
    code, out, _ = run_cli(capsys, "catalog")
    assert len(out.splitlines()) == 1 + len(catalog)


def test_render_refuses_a_node_rank_the_recipe_does_not_have(capsys):
    path = LIBRARY / "h100-bf16-tp8-pp2.yaml"  # 2 nodes
    for rank, message in [("2", "2 is outside 0 .. 1 (spec.hardware.nodes is 2)"),
                          ("-1", "-1 is outside 0 .. 1"),
                          ("leader", "takes a number or a variable reference")]:
        code, out, err = run_cli(capsys, "render", str(path), "--node-rank", rank)
        assert code == 1 and out == ""
        assert f"{path}: not rendered: --node-rank: {message}" in err
    code, out, err = run_cli(capsys, "render", str(LIBRARY / "cpu-tiny.yaml"), "--node-rank", "1")
    assert code == 1 and out == "" and "--node-rank: 1 is outside 0 .. 0" in err


def test_render_refuses_a_leader_address_it_cannot_use(capsys):
    path = LIBRARY / "h100-bf16-tp8-pp2.yaml"  # 2 nodes
    for address in ("leader", "leader:", ":5000", "leader:0", "leader:70000", ""):
        code, out, err = run_cli(capsys, "render", str(path), "--dist-init-addr", address)
        assert code == 1 and out == ""
        assert f"{path}: not rendered: --dist-init-addr: takes host:port (port 1 .. 65535)" in err, address
    code, out, err = run_cli(capsys, "render", str(LIBRARY / "cpu-tiny.yaml"), "--dist-init-addr", "10.1.2.3:5000")
    assert code == 1 and out == "" and "--dist-init-addr: applies to multi-node recipes only" in err
    code, out, _ = run_cli(capsys, "render", str(path), "--dist-init-addr", "[fd00::1]:5000")
    assert code == 0 and "--dist-init-addr '[fd00::1]:5000'" in out


def test_render_of_the_tiny_recipe_says_how_to_run_it(capsys):
    """The tiny model's path is a name only `serve` resolves: the pasted line alone cannot start."""
    code, out, err = run_cli(capsys, "render", str(LIBRARY / "cpu-tiny.yaml"))
    assert code == 0 and "--model-path sglang-m3:tiny" in out
    assert "sglang-m3 tiny-checkpoint DIR" in err and "sglang-m3 serve" in err
    code, out, err = run_cli(capsys, "render", str(LIBRARY / "h200-bf16-tp8.yaml"))
    assert code == 0 and err == ""


def test_every_recipe_option_has_help(capsys):
    """`--help` explains each option: none is listed bare."""
    import argparse

    from sglang_m3.commands import recipe as recipe_command

    parser = argparse.ArgumentParser(prog="sglang-m3")
    recipe_command.register(parser.add_subparsers(dest="command", required=True))
    recipe_parser = parser._subparsers._group_actions[0].choices["recipe"]
    commands = recipe_parser._subparsers._group_actions[0].choices
    bare = [f"{name} {action.option_strings or action.dest}"
            for name, sub in commands.items() for action in sub._actions
            if not action.help and not isinstance(action, argparse._HelpAction)]
    assert bare == []
