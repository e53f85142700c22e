"""Audit findings in the operator: what it renders and how it reads and keeps recipes.

- No handler makes kopf put its finalizer on a recipe (a kopf timer did): a finalizer holds
  every recipe in deletion while the operator is not running, and deletion needs nothing from
  it. The periodic re-apply is the controller's own loop, shown here to re-apply.
- A recipe whose ``spec.env`` names a variable the operator sets in the pod (HF_HOME, ...) is
  refused naming the field instead of rendering a container with the name twice.
- The tiny-model pod receives its recipe through an environment variable: values that turn a
  default off (``reasoning: none``, ``chunkedPrefillSize: -1``) reach it, so it serves the
  launch the operator rendered (explicit nulls, which did that before, were dropped, and the pod
  served the defaults).
- ``operator render`` reads a file as ``recipe validate`` does (a repeated key, an impossible
  date, a second document: refused, never the last key winning nor a traceback), and a recipe
  with a string, boolean or list where ``metadata`` belongs is refused, not a crash.
- Every object rendered for an unusual but valid recipe validates against Kubernetes' schemas.
"""

from __future__ import annotations

import asyncio
import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from k8s_schemas import validate

from m3_operator import handlers
from m3_operator.controller import Controller
from m3_operator.desired import desired_state
from m3_operator.options import OperatorConfig
from sglang_m3.recipe import load_recipe_text, render_launch

HERE = Path(__file__).parent
REPO = HERE.parents[1]
CONFIG = OperatorConfig()
UID = "7c6f1f2e-0000-4000-8000-000000000002"


def case(name: str) -> dict[str, Any]:
    body = yaml.safe_load((HERE / "cases" / f"{name}.yaml").read_text())
    body["metadata"].update(namespace="serving", uid=UID, generation=1)
    return body


def all_handlers(registry: kopf.OperatorRegistry) -> list:
    return [*registry._spawning.get_all_handlers(), *registry._changing.get_all_handlers(),
            *registry._watching.get_all_handlers()]


# --- finalizers and the periodic re-apply ------------------------------------------------------

def test_no_handler_puts_a_finalizer_on_recipes():
    registry = kopf.OperatorRegistry()
    handlers.register(registry, controller=None, resync_seconds=600)
    registered = all_handlers(registry)
    assert registered  # the reconcile and observe handlers are there
    assert [h.id for h in registered if getattr(h, "requires_finalizer", None)] == []
    assert [h for h in registry._spawning.get_all_handlers()] == []  # no timers or daemons
    ids = {h.id for h in registry._activities.get_all_handlers()}
    assert {"start-resync", "stop-resync"} <= ids


class RecordingCluster:
    """Stands in for ``kube.Cluster``: records what the controller applies."""

    def __init__(self):
        self.applied: list[tuple[str, str]] = []
        self.statuses: list[dict] = []

    def apply(self, obj):
        self.applied.append((obj["kind"], obj["metadata"]["name"]))
        return obj

    def delete(self, ref, namespace):
        return True

    def patch_recipe_status(self, namespace, name, status):
        self.statuses.append(dict(status))
        return {}


def test_resync_reapplies_every_known_recipe_and_skips_deleted_ones():
    cluster = RecordingCluster()
    controller = Controller(cluster, CONFIG, clock=lambda: "2025-01-01T00:00:00Z")
    live, deleting = case("h200-single-node"), case("h200-single-node")
    deleting["metadata"].update(name="going", deletionTimestamp="2025-01-01T00:00:00Z")
    controller.observe_recipe(live)
    controller.observe_recipe(deleting)
    asyncio.run(controller.resync())
    names = {name for _, name in cluster.applied}
    kinds = {kind for kind, _ in cluster.applied}
    assert names == {live["metadata"]["name"]}
    assert {"Deployment", "Service", "PodDisruptionBudget"} <= kinds


def test_resync_forever_runs_until_cancelled():
    cluster = RecordingCluster()
    controller = Controller(cluster, CONFIG, clock=lambda: "2025-01-01T00:00:00Z")
    controller.observe_recipe(case("h200-single-node"))

    async def run_briefly():
        task = asyncio.get_running_loop().create_task(controller.resync_forever(0.01))
        while len(cluster.applied) < 6:  # two rounds of three objects
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(asyncio.wait_for(run_briefly(), timeout=30))


# --- env the operator owns ----------------------------------------------------------------------

@pytest.mark.parametrize("name, env, annotations", [
    ("h200-single-node", {"HF_HOME": "/elsewhere"}, {}),
    ("h200-model-cache", {"HF_HUB_OFFLINE": "0"}, None),
    ("cpu-tiny", {"M3_RECIPE": "x"}, {}),
])
def test_env_the_operator_sets_is_refused_in_the_recipe(name, env, annotations):
    body = case(name)
    body["spec"]["env"] = env
    if annotations is not None:
        body["metadata"]["annotations"] = annotations
    plan = desired_state(body, CONFIG)
    [variable] = env
    assert not plan.valid and plan.objects == ()
    assert any(problem.startswith(f"spec.env.{variable}:") for problem in plan.problems), plan.problems


def test_env_names_stay_unique_in_every_container():
    body = case("h200-single-node")
    body["spec"]["env"] = {"NCCL_DEBUG": "INFO", "HF_HUB_OFFLINE": "1"}  # not set by the operator here
    plan = desired_state(body, CONFIG)
    assert plan.valid, plan.problems
    for obj in plan.objects:
        for container in obj["spec"].get("template", {}).get("spec", {}).get("containers", []):
            names = [entry["name"] for entry in container.get("env", [])]
            assert len(names) == len(set(names)), names


# --- the tiny-model pod serves what was rendered -----------------------------------------------

@pytest.mark.parametrize("spec_changes", [
    {"parsers": {"reasoning": "none", "toolCall": "none", "defaultThinkingMode": "disabled"}},
    {"serving": {"maxTotalTokens": 8192, "maxRunningRequests": 4, "chunkedPrefillSize": -1}},
    {},
])
def test_the_tiny_pod_gets_the_recipe_it_was_rendered_from(spec_changes):
    body = case("cpu-tiny")
    body["spec"].update(copy.deepcopy(spec_changes))
    plan = desired_state(body, CONFIG)
    assert plan.valid, plan.problems
    [deployment] = [obj for obj in plan.objects if obj["kind"] == "Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    document = next(entry["value"] for entry in container["env"] if entry["name"] == "M3_RECIPE")
    served = render_launch(load_recipe_text(document))
    assert served.argv == list(plan.rendered_args)


# --- operator render reads files as the recipe commands do --------------------------------------

def run_render(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "m3_operator", "render", str(path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


GOOD = (HERE / "cases" / "h200-single-node.yaml").read_text()


@pytest.mark.parametrize("text, expected", [
    (GOOD.replace("  serving:\n", "  serving:\n    maxRunningRequests: 64\n", 1), "duplicate key 'maxRunningRequests'"),
    (GOOD.replace("spec:\n", "spec:\n  provenance2: 2025-13-01\n", 1), "spec.provenance2"),
    (GOOD + "---\n" + GOOD, "2 YAML documents"),
    (GOOD.replace("metadata:\n  name: h200-single-node\n", "metadata: [a]\n"), "metadata: Input should be a valid dictionary"),
    (GOOD.replace("metadata:\n  name: h200-single-node\n", "metadata: null\n"), "metadata: Input should be a valid dictionary"),
])
def test_operator_render_refuses_what_recipe_validate_refuses(tmp_path, text, expected):
    assert "maxRunningRequests" in GOOD and "name: h200-single-node\n" in GOOD
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    result = run_render(path)
    assert result.returncode == 1 and result.stdout == ""
    assert expected in result.stderr and "Traceback" not in result.stderr, result.stderr


# --- unusual but valid recipes render valid objects ---------------------------------------------

def test_objects_of_a_longest_name_multi_node_recipe_validate():
    body = case("h200-two-node-lws")
    body["metadata"]["name"] = "a" * 43
    body["metadata"]["annotations"] = {"m3.sglang.io/model-cache-size": "2Ti", "m3.sglang.io/replicas": "2"}
    body["spec"]["model"]["servedModelName"] = "-m3"  # a value argparse would take for an option
    plan = desired_state(body, CONFIG)
    assert plan.valid, plan.problems
    for obj in plan.objects:
        validate(obj)
        assert len(obj["metadata"]["name"]) <= 63
    assert "--served-model-name=-m3" in plan.rendered_args


# --- local model paths keep their folder --------------------------------------------------------

@pytest.mark.parametrize("path, downloads", [
    ("MiniMaxAI/MiniMax-M3", True),
    ("/models/minimax-m3", False),      # baked into the image under the cache volume's folder
    ("./minimax-m3", False),
    ("s3://bucket/minimax-m3", False),
])
def test_only_hub_downloads_get_the_download_volume(path, downloads):
    """Without the shared cache the pod gets an emptyDir for SGLang's hub download; mounted for a
    local path it hid the weights the image holds under /models."""
    body = case("h200-single-node")
    body["spec"]["model"]["path"] = path
    plan = desired_state(body, CONFIG)
    assert plan.valid, plan.problems
    [deployment] = [obj for obj in plan.objects if obj["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    mounts = {mount["name"] for mount in container["volumeMounts"]}
    env = {entry["name"] for entry in container.get("env", [])}
    assert ("model-cache" in mounts) == downloads and ("HF_HOME" in env) == downloads
    assert any(v["name"] == "model-cache" for v in pod["volumes"]) == downloads
    validate(deployment)
