"""Deployment options from annotations, OperatorConfig from the environment, and the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from m3_operator.crd import crd_yaml
from m3_operator.options import (
    ANNOTATION_KEYS,
    DeploymentOptions,
    OperatorConfig,
    parse_deployment_options,
)

HERE = Path(__file__).parent
PREFIX = "m3.sglang.io/"


def test_defaults_without_annotations():
    assert parse_deployment_options({}) == (DeploymentOptions(), [])


def test_cache_and_replicas_annotations():
    options, problems = parse_deployment_options({
        f"{PREFIX}replicas": "3", f"{PREFIX}model-cache-size": "900Gi",
        f"{PREFIX}model-cache-access-mode": "ReadOnlyMany", "unrelated/key": "x"})
    assert problems == []
    assert options.replicas == 3
    assert options.model_cache.size == "900Gi"
    assert options.model_cache.access_mode == "ReadOnlyMany"


def test_cache_settings_without_a_size_are_refused():
    _, problems = parse_deployment_options({f"{PREFIX}model-cache-storage-class": "nfs"})
    assert problems and "model-cache-size" in problems[0]


@given(st.dictionaries(st.sampled_from([*(PREFIX + k for k in ANNOTATION_KEYS), PREFIX + "x",
                                        "other/replicas"]), st.text(max_size=8), max_size=6))
def test_any_annotations_parse_or_name_the_culprit(annotations):
    options, problems = parse_deployment_options(annotations)
    assert options.replicas >= 1
    for problem in problems:
        assert problem.startswith(f"metadata.annotations[{PREFIX}")
        key = problem.split("[", 1)[1].split("]", 1)[0]
        assert key in annotations or key == f"{PREFIX}model-cache-size"


@given(st.integers(min_value=1, max_value=10**6))
def test_replicas_round_trip(count):
    options, problems = parse_deployment_options({f"{PREFIX}replicas": str(count)})
    assert (options.replicas, problems) == (count, [])


def test_config_from_environment():
    config = OperatorConfig.from_env({"M3_OPERATOR_SERVER_IMAGE": "reg/server:1",
                                      "M3_OPERATOR_DRAIN_SECONDS": "900",
                                      "UNRELATED": "1"})
    assert config.server_image == "reg/server:1" and config.drain_seconds == 900
    assert config.termination_grace_seconds > config.drain_seconds + config.pre_stop_seconds
    with pytest.raises(ValueError, match="M3_OPERATOR_DRAIN_SECONDS"):
        OperatorConfig.from_env({"M3_OPERATOR_DRAIN_SECONDS": "soon"})


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "m3_operator", *args], capture_output=True,
                          text=True, timeout=600)


def test_cli_render_prints_the_golden_objects():
    case = HERE / "cases" / "h200-two-node-lws.yaml"
    result = run_cli("render", str(case), "--namespace", "serving")
    assert result.returncode == 0, result.stderr
    objects = list(yaml.safe_load_all(result.stdout))
    golden = list(yaml.safe_load_all((HERE / "golden" / f"{case.stem}.yaml").read_text()))
    for obj in golden:  # the CLI renders a file: no UID, so no owner reference
        del obj["metadata"]["ownerReferences"]
    assert objects == golden


def test_cli_render_lists_problems_of_an_invalid_recipe(tmp_path):
    body = yaml.safe_load((HERE / "cases" / "h200-single-node.yaml").read_text())
    body["spec"]["parallelism"]["tp"] = 3
    body["spec"]["kvCache"] = {"pageSize": 0}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(body))
    result = run_cli("render", str(path))
    assert result.returncode == 1 and result.stdout == ""
    assert "spec.kvCache.pageSize" in result.stderr


@pytest.mark.parametrize("make, expected", [
    (lambda tmp: tmp / "absent.yaml", "<file>: no such file"),
    (lambda tmp: tmp, "<file>: cannot read:"),
    (lambda tmp: (tmp / "binary.yaml").write_bytes(b"\xef\xff\x00") and tmp / "binary.yaml", "<file>: cannot read:"),
])
def test_cli_render_names_a_file_it_cannot_read_as_the_recipe_commands_do(tmp_path, make, expected):
    path = make(tmp_path)
    result = run_cli("render", str(path))
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith(f"{path}: {expected}") and "Traceback" not in result.stderr


def test_cli_crd_prints_the_generated_crd():
    result = run_cli("crd")
    assert result.returncode == 0 and result.stdout == crd_yaml()


def test_operator_subcommand_mounts_under_sglang_m3():
    import argparse

    from sglang_m3.commands import operator

    parser = argparse.ArgumentParser(prog="sglang-m3")
    operator.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["operator", "run", "-n", "a", "-n", "b", "--metrics-port", "8080"])
    assert args.namespaces == ["a", "b"] and args.metrics_port == 8080 and callable(args.handler)
