"""``sglang-m3 operator`` on a user's mistakes: one line naming the flag or path, a non-zero exit,
no traceback, and nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from m3_operator.crd import MANIFEST_PATH, crd_yaml
from sglang_m3.cli import main

CASE = str(Path(__file__).parent / "cases" / "cpu-tiny.yaml")


def test_crd_write_into_a_plain_file_is_refused(tmp_path, capsys):
    root = tmp_path / "afile"
    root.write_text("")
    assert main(["operator", "crd", "--write", str(root)]) == 1
    assert capsys.readouterr().err == f"--write {root}: not a directory\n"


@pytest.mark.parametrize("root, message", [
    ("absent", "no such directory"),
    ("elsewhere", "no charts/m3-crds there (REPO_ROOT is the top folder of the sglang-m3 repository)"),
])
def test_crd_write_outside_a_checkout_creates_nothing(root, message, tmp_path, capsys):
    """Any path got a charts/m3-crds/templates tree created under it."""
    (tmp_path / "elsewhere").mkdir()
    assert main(["operator", "crd", "--write", str(tmp_path / root)]) == 1
    assert capsys.readouterr().err == f"--write {tmp_path / root}: {message}\n"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["elsewhere"]


def test_crd_write_where_the_manifest_cannot_be_written_names_it(tmp_path, capsys):
    """A directory in the manifest's place fails whoever runs the test (root too)."""
    (tmp_path / MANIFEST_PATH).mkdir(parents=True)
    assert main(["operator", "crd", "--write", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err == f"--write {tmp_path}: cannot write {tmp_path / MANIFEST_PATH}: Is a directory\n"


def test_crd_write_into_a_checkout_writes_the_manifest(tmp_path, capsys):
    (tmp_path / MANIFEST_PATH.parents[1]).mkdir(parents=True)
    assert main(["operator", "crd", "--write", str(tmp_path)]) == 0
    assert (tmp_path / MANIFEST_PATH).read_text(encoding="utf-8") == crd_yaml()
    assert capsys.readouterr().out == f"{tmp_path / MANIFEST_PATH}\n"


def test_run_without_cluster_credentials_says_so_in_one_line(tmp_path):
    """The most common first run; a fresh process, since the client reads KUBECONFIG on import."""
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    env["KUBECONFIG"] = str(tmp_path / "absent")
    done = subprocess.run([sys.executable, "-m", "sglang_m3.cli", "operator", "run"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == (f"no cluster credentials: not running inside a cluster, and the kubeconfig "
                           f"{tmp_path / 'absent'} (KUBECONFIG, else ~/.kube/config) gives none: "
                           "Invalid kube-config file. No configuration found.\n")


@pytest.mark.parametrize("name", ["Bad_NS!", "UPPER", "-lead", "trail-", "", "a" * 64])
@pytest.mark.parametrize("command, flag", [(["render", CASE], "--namespace"), (["run"], "-n/--namespace")])
def test_a_namespace_that_is_no_rfc1123_label_is_refused(command, flag, name, capsys):
    """``render`` printed it into every object, which the API server would refuse."""
    with pytest.raises(SystemExit) as exit_info:
        main(["operator", *command, f"--namespace={name}"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"error: argument {flag}: {name!r} is not a namespace name" in captured.err


@pytest.mark.parametrize("name", ["serving", "a", "m3-prod-2", "a" * 63])
def test_a_namespace_label_is_rendered(name, capsys):
    assert main(["operator", "render", CASE, "--namespace", name]) == 0
    assert f"namespace: {name}\n" in capsys.readouterr().out
