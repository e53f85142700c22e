"""Findings of the recipe/operator audit (``/work/notes/audit_recipe.md``), one section each.

- (3) A speculative draft gets the treatment of the model: under the model cache only hub ids
  are downloaded (``hf download /models/x`` fails, and under ``set -e`` the ready marker never
  came), a local draft is read where it is, and no download volume is mounted over a local
  model or draft; one that a volume would hide is refused naming its field. A local model
  with a hub draft gets the download volume, so the draft survives a container restart.
- (4) A restarted operator keeps each recipe's status until it has reconciled it: before, it
  wrote Ready=False and erased renderedArgs, workload, appliedGeneration and warnings, then
  reported WorkloadMissing until the Deployment's watch event came.
- (7) An OOM kill in ``lastState`` stops being reported once the container serves again, and
  the message claims no memory limit (the operator sets none).
- (11) The webhook refuses an UPDATE only for problems the stored object did not have, so a
  recipe stored invalid still takes label, annotation and kopf's own patches.
- (6) Server pods are no longer BestEffort: the serving container requests the host memory the
  pod holds for sure, and an in-pod download requests the disk its checkpoint takes.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import shlex
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from k8s_schemas import validate
from m3_operator_harness import (
    NAMESPACE,
    RECIPE_PATH,
    RECIPES,
    condition,
    eventually,
    recipe_body,
    running_operator,
)

from m3_operator import webhook
from m3_operator.controller import Controller
from m3_operator.desired import desired_state
from m3_operator.options import OperatorConfig
from m3_operator.pod_failures import pod_failures
from sglang_m3.recipe.fit import DRAFT_WEIGHT_BYTES
from sglang_m3.recipe.model_geometry import WEIGHT_BYTES
from m3_operator.status import Observation, compute_status

HERE = Path(__file__).parent
CONFIG = OperatorConfig()
UID = "7c6f1f2e-0000-4000-8000-000000000003"
CACHE = {"m3.sglang.io/model-cache-size": "1Ti"}
DRAFT_FIELD = "spec.speculative.draftModel.path"


def case(name: str) -> dict[str, Any]:
    body = yaml.safe_load((HERE / "cases" / f"{name}.yaml").read_text())
    body["metadata"].update(namespace="serving", uid=UID, generation=1)
    return body


def with_weights(model: str, draft: str, annotations: dict[str, str]) -> dict[str, Any]:
    """The MXFP8 EAGLE3 case with the given model and draft paths and annotations."""
    body = case("b200-mxfp8-eagle3")
    body["spec"]["model"]["path"] = model
    body["spec"]["speculative"]["draftModel"]["path"] = draft
    body["metadata"]["annotations"] = annotations
    return body


def of_kind(plan, kind: str) -> dict[str, Any]:
    [obj] = [obj for obj in plan.objects if obj["kind"] == kind]
    return obj


def download_commands(plan) -> list[list[str]]:
    script = of_kind(plan, "Job")["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    return [shlex.split(part) for part in script.split(" && ")]


def hiding_mounts(container: dict[str, Any], path: str) -> list[str]:
    """Mount points of ``container`` at or above ``path``: each hides what the image holds there."""
    return [mount["mountPath"] for mount in container["volumeMounts"]
            if path == mount["mountPath"] or path.startswith(mount["mountPath"].rstrip("/") + "/")]


# --- (3) the draft model gets the model's treatment ---------------------------------------------

@pytest.mark.parametrize("model, draft, annotations", [
    ("MiniMaxAI/MiniMax-M3-MXFP8", "/models/eagle3-draft", CACHE),  # the cache's claim at /models
    ("MiniMaxAI/MiniMax-M3-MXFP8", "/models/hf/eagle3", {}),        # the download emptyDir
    ("/models/hf/m3", "Inferact/MiniMax-M3-EAGLE3", {}),
])
def test_local_weights_a_download_volume_would_hide_are_refused_by_field(model, draft, annotations):
    body = with_weights(model, draft, annotations)
    plan = desired_state(body, CONFIG)
    field = DRAFT_FIELD if draft.startswith("/") else "spec.model.path"
    assert not plan.valid and plan.objects == ()
    [problem] = [p for p in plan.problems if p.startswith(f"{field}:")]
    assert "hides it" in problem and repr(model if field == "spec.model.path" else draft) in problem


@pytest.mark.parametrize("draft", ["/opt/drafts/eagle3", "s3://bucket/eagle3"])
def test_under_the_cache_only_hub_ids_are_downloaded(draft):
    """The Job ran ``hf download /models/eagle3-draft`` (refused by hf), so under ``set -e`` its
    ready marker never came and every server waited for ever; a draft that is not a hub id is
    served from where it is."""
    plan = desired_state(with_weights("MiniMaxAI/MiniMax-M3-MXFP8", draft, CACHE), CONFIG)
    assert plan.valid, plan.problems
    downloads = [command for command in download_commands(plan) if command[:2] == ["hf", "download"]]
    assert downloads == [["hf", "download", "MiniMaxAI/MiniMax-M3-MXFP8"]]
    args = list(plan.rendered_args)
    assert args[args.index("--speculative-draft-model-path") + 1] == draft
    container = of_kind(plan, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert hiding_mounts(container, draft) == []


def test_under_the_cache_a_hub_draft_is_still_downloaded():
    plan = desired_state(with_weights("MiniMaxAI/MiniMax-M3-MXFP8", "Inferact/MiniMax-M3-EAGLE3",
                                      CACHE), CONFIG)
    assert plan.valid, plan.problems
    assert ["hf", "download", "Inferact/MiniMax-M3-EAGLE3"] in download_commands(plan)


@pytest.mark.parametrize("model, draft", [
    ("MiniMaxAI/MiniMax-M3-MXFP8", "/models/eagle3-draft"),   # draft baked into the image
    ("/models/minimax-m3", "Inferact/MiniMax-M3-EAGLE3"),     # model baked into the image
    ("/models/minimax-m3", "/models/eagle3-draft"),
])
def test_no_download_volume_hides_a_local_model_or_draft(model, draft):
    """Without the cache a hub model got an emptyDir over all of /models, hiding a draft the
    image holds there; and a local model with a hub draft got no volume, so the draft went to
    the container's layer and was downloaded again after every restart."""
    plan = desired_state(with_weights(model, draft, {}), CONFIG)
    assert plan.valid, plan.problems
    deployment = of_kind(plan, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    for path in (model, draft):
        if path.startswith("/"):
            assert hiding_mounts(container, path) == [], path
    env = {entry["name"]: entry["value"] for entry in container.get("env", [])}
    downloads = not (model.startswith("/") and draft.startswith("/"))
    assert ("HF_HOME" in env) == downloads
    if downloads:  # the hub download lands in the pod's emptyDir, which outlives the container
        assert {"name": "model-cache", "emptyDir": {}} in pod["volumes"]
        assert hiding_mounts(container, env["HF_HOME"] + "/hub") != []
    validate(deployment)


def test_a_draft_downloaded_in_the_pod_makes_its_hf_home_operator_owned():
    body = with_weights("/models/minimax-m3", "Inferact/MiniMax-M3-EAGLE3", {})
    body["spec"]["env"] = {"HF_HOME": "/elsewhere"}
    plan = desired_state(body, CONFIG)
    assert any(p.startswith("spec.env.HF_HOME:") for p in plan.problems), plan.problems


# --- (4) an operator restart keeps the status ---------------------------------------------------

class ApiStandIn:
    """Stands in for ``kube.Cluster``: answers an apply with the stored object, as the API server
    does (status included), and records status writes."""

    def __init__(self, stored_status: dict[str, dict[str, Any]] | None = None):
        self.stored_status = stored_status or {}
        self.statuses: list[dict[str, Any]] = []

    def apply(self, obj):
        live = copy.deepcopy(obj)
        if obj["kind"] in self.stored_status:
            live["status"] = copy.deepcopy(self.stored_status[obj["kind"]])
        return live

    def delete(self, ref, namespace):
        return True

    def patch_recipe_status(self, namespace, name, status):
        self.statuses.append(copy.deepcopy(dict(status)))
        return {}


READY_DEPLOYMENT = {"observedGeneration": 1, "readyReplicas": 1, "updatedReplicas": 1,
                    "replicas": 1}


def serving_status(body: dict[str, Any]) -> dict[str, Any]:
    """The status a first operator wrote for a recipe it applied and saw ready."""
    api = ApiStandIn({"Deployment": READY_DEPLOYMENT})
    first = Controller(api, CONFIG, clock=lambda: "2025-01-01T00:00:00Z")
    asyncio.run(first.reconcile(body))
    return api.statuses[-1]


def test_a_restarted_operator_keeps_the_status_until_it_has_reconciled():
    body = case("h200-single-node")
    body["status"] = before = serving_status(body)
    assert condition(body, "Ready")["status"] == "True" and before["renderedArgs"]

    api = ApiStandIn({"Deployment": READY_DEPLOYMENT})
    restarted = Controller(api, CONFIG, clock=lambda: "2025-02-01T00:00:00Z")
    key = restarted.observe_recipe(body)  # kopf delivers every recipe before the resume handler
    pod = {"metadata": {"name": "h200-single-node-0", "namespace": "serving",
                        "labels": {"m3.sglang.io/recipe": "h200-single-node"}},
           "status": {"phase": "Running"}}
    restarted.observe_child("Pod", pod)
    asyncio.run(restarted.publish_status(key))
    assert api.statuses == []  # nothing known yet that the stored status does not say

    asyncio.run(restarted.reconcile(body))
    # the reconcile finds everything as it was: no write at all, so no flip and nothing erased
    assert api.statuses == [], [condition({"status": s}, "Ready") for s in api.statuses]


def test_a_new_recipe_is_still_told_it_is_pending():
    api = ApiStandIn()
    controller = Controller(api, CONFIG, clock=lambda: "2025-01-01T00:00:00Z")
    asyncio.run(controller.publish_status(controller.observe_recipe(case("h200-single-node"))))
    [status] = api.statuses
    assert condition({"status": status}, "Validated")["reason"] == "Pending"


@pytest.mark.asyncio
@pytest.mark.timeout(600)
async def test_an_operator_restart_leaves_a_serving_recipe_ready(api, client):
    config = OperatorConfig(resync_seconds=0, request_timeout_seconds=2.0, retry_base_seconds=0.1)
    async with running_operator(api, config):
        await client.create(RECIPE_PATH, recipe_body("steady"))
        await eventually(lambda: client.get("apps/v1/deployments", "steady"), what="Deployment")
        await client.patch(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/steady/status",
                           {"status": READY_DEPLOYMENT})
        await eventually(lambda: (condition(client.get(RECIPES, "steady"), "Ready") or {})
                         .get("status") == "True", what="Ready=True")
    # An old transition time: any flip while restarting would replace it with the current time.
    status = copy.deepcopy(client.get(RECIPES, "steady")["status"])
    for cond in status["conditions"]:
        cond["lastTransitionTime"] = "2020-01-01T00:00:00Z"
    await client.patch(f"{RECIPE_PATH}/steady/status", {"status": status})
    applies_before = len(api.writes)

    async with running_operator(api, config):
        def reapplied() -> bool:  # the resume reconcile applied the last child and wrote status
            return any("poddisruptionbudgets/steady" in line
                       for line in api.writes[applies_before:])
        await eventually(reapplied, what="the resume reconcile")
        await asyncio.sleep(1.0)  # room for any status write the reconcile triggers
        after = client.get(RECIPES, "steady")["status"]
    assert condition({"status": after}, "Ready")["status"] == "True"
    assert condition({"status": after}, "Ready")["lastTransitionTime"] == "2020-01-01T00:00:00Z"
    for field in ("renderedArgs", "workload", "appliedGeneration", "warnings"):
        assert after.get(field) == status[field], field


# --- (7) a past OOM kill clears once the container serves again ---------------------------------

def container_pod(**container) -> dict[str, Any]:
    return {"metadata": {"name": "m3-0"},
            "status": {"containerStatuses": [{"name": "sglang", "restartCount": 1, **container}]}}


OOM = {"terminated": {"reason": "OOMKilled", "exitCode": 137}}


@pytest.mark.parametrize("state, ready, reported", [
    ({"running": {}}, True, False),                    # recovered: serving again
    ({"running": {}}, False, True),                    # restarted, reloading: may be killed again
    ({"waiting": {"reason": "CrashLoopBackOff"}}, False, True),
    (OOM, False, True),                                # killed just now
])
def test_a_past_oom_kill_is_reported_until_the_container_serves_again(state, ready, reported):
    pod = container_pod(state=state, ready=ready, lastState=OOM)
    reasons = [failure.reason for failure in pod_failures(pod)]
    assert ("OOMKilled" in reasons) == reported, reasons


def test_a_recovered_container_leaves_the_recipe_not_degraded():
    from m3_operator.desired import ObjectRef, Plan

    applied = Plan(name="m3", namespace="ns", generation=1, replicas=1,
                   workload=ObjectRef("apps/v1", "Deployment", "m3"))
    deployment = {"kind": "Deployment", "metadata": {"name": "m3", "generation": 1},
                  "status": {"readyReplicas": 1, "observedGeneration": 1}}
    killed = container_pod(state={"waiting": {"reason": "CrashLoopBackOff"}}, lastState=OOM)
    obs = Observation(generation=1, plan=applied, applied=applied, workload=deployment,
                      pods=(killed,))
    degraded = {c["type"]: c for c in compute_status(obs, None, "t0")["conditions"]}["Degraded"]
    assert degraded["status"] == "True" and degraded["reason"] == "OOMKilled"
    recovered = container_pod(state={"running": {}}, ready=True, lastState=OOM)
    later = compute_status(dataclasses.replace(obs, pods=(recovered,)), None, "t1")
    assert {c["type"]: c for c in later["conditions"]}["Degraded"]["status"] == "False"


def test_an_oom_message_claims_no_memory_limit_the_operator_never_set():
    [failure] = pod_failures(container_pod(state=OOM, lastState={}))
    assert "limit" not in failure.message.split("(")[0]
    assert "exceeding its memory limit" not in failure.message
    assert "restarts: 1" in failure.message


def test_an_init_container_that_completed_after_an_oom_kill_is_not_reported():
    pod = {"metadata": {"name": "m3-0"}, "status": {"initContainerStatuses": [
        {"name": "wait-for-model", "state": {"terminated": {"reason": "Completed", "exitCode": 0}},
         "lastState": OOM, "restartCount": 1}]}}
    assert pod_failures(pod) == []


# --- (11) the webhook ratchets against the stored object ----------------------------------------

def stored_invalid() -> dict[str, Any]:
    body = recipe_body("legacy")
    body["spec"]["parallelism"]["tp"] = 4  # 4 GPUs of 8: refused by rules added later
    return body


def validate_handler():
    registry = kopf.OperatorRegistry()
    webhook.installer(9443, Path("tls.crt"), Path("tls.key"), CONFIG)(registry, None)
    [handler] = registry._webhooks.get_all_handlers()
    return handler


@pytest.mark.parametrize("edit", [
    lambda b: b["metadata"].setdefault("labels", {}).update(team="inference"),
    lambda b: b["metadata"].setdefault("annotations", {}).update(
        {"kopf.zalando.org/last-handled-configuration": "{}"}),
    lambda b: b["spec"].update(contextLength=65536),  # a spec edit that adds no problem
])
def test_an_update_adding_no_problem_to_a_stored_invalid_recipe_is_admitted(edit):
    old = stored_invalid()
    assert webhook.admission_problems(old, CONFIG)  # it is invalid under today's rules
    new = copy.deepcopy(old)
    edit(new)
    assert webhook.admission_problems(new, CONFIG, old) == []
    assert validate_handler().fn(body=new, old=old, operation="UPDATE") is None


def test_an_update_adding_a_problem_is_refused_naming_only_the_new_one():
    old = stored_invalid()
    new = copy.deepcopy(old)
    new["spec"]["serving"]["host"] = "127.0.0.1"
    problems = webhook.admission_problems(new, CONFIG, old)
    assert [p.split(":")[0] for p in problems] == ["spec.serving.host"]
    with pytest.raises(kopf.AdmissionError) as refused:
        validate_handler().fn(body=new, old=old, operation="UPDATE")
    assert refused.value.code == 422 and "spec.serving.host" in str(refused.value)


def test_a_create_is_judged_alone():
    with pytest.raises(kopf.AdmissionError, match="spec.parallelism"):
        validate_handler().fn(body=stored_invalid(), old=None, operation="CREATE")


# --- (6) requests: no BestEffort pods, disk for in-pod downloads --------------------------------

def pod_templates(plan) -> list[dict[str, Any]]:
    templates = []
    for obj in plan.objects:
        if obj["kind"] == "Deployment":
            templates.append(obj["spec"]["template"])
        elif obj["kind"] == "LeaderWorkerSet":
            lws = obj["spec"]["leaderWorkerTemplate"]
            templates += [lws["leaderTemplate"], lws["workerTemplate"]]
    return templates


def qos_class(pod: dict[str, Any]) -> str:
    """Kubernetes' QoS class, as far as it matters here: BestEffort when no container requests
    or limits cpu or memory (extended resources such as GPUs do not count)."""
    containers = pod["spec"]["containers"] + pod["spec"].get("initContainers", [])
    for container in containers:
        resources = container.get("resources", {})
        if any(key in resources.get(part, {}) for part in ("requests", "limits")
               for key in ("cpu", "memory")):
            return "Burstable"
    return "BestEffort"


@pytest.mark.parametrize("name", sorted(path.stem for path in (HERE / "cases").glob("*.yaml")))
def test_no_server_pod_is_best_effort(name):
    """BestEffort pods are the kubelet's first eviction target under node memory pressure, while
    SGLang holds tens to hundreds of GB of host memory loading the weights."""
    plan = desired_state(case(name), CONFIG)
    assert plan.valid, plan.problems
    for template in pod_templates(plan):
        assert qos_class(template) == "Burstable"
        assert "memory" not in template["spec"]["containers"][0]["resources"].get("limits", {})


def test_the_memory_request_counts_dev_shm():
    body = case("h200-single-node")
    body["metadata"]["annotations"] = {"m3.sglang.io/shm-size": "100Gi"}
    plan = desired_state(body, CONFIG)
    container = of_kind(plan, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["requests"]["memory"] == "110Gi"  # + 8 ranks + 2 front-end


@pytest.mark.parametrize("model, draft, annotations, expected", [
    ("MiniMaxAI/MiniMax-M3", None, {}, WEIGHT_BYTES["bf16"]),
    ("MiniMaxAI/MiniMax-M3", "Inferact/MiniMax-M3-EAGLE3", {}, WEIGHT_BYTES["bf16"] + DRAFT_WEIGHT_BYTES),
    ("/opt/minimax-m3", "Inferact/MiniMax-M3-EAGLE3", {}, DRAFT_WEIGHT_BYTES),
    ("/opt/minimax-m3", None, {}, None),        # nothing downloaded in the pod
    ("MiniMaxAI/MiniMax-M3", None, CACHE, None),  # the shared cache's claim holds it
])
def test_an_in_pod_download_requests_the_disk_of_its_checkpoints(model, draft, annotations,
                                                                  expected):
    body = case("h200-single-node")
    body["spec"]["model"]["path"] = model
    if draft is not None:
        body["spec"]["speculative"] = {"algorithm": "EAGLE3", "draftModel": {"path": draft},
                                       "numSteps": 3, "eagleTopk": 1, "numDraftTokens": 4}
    body["metadata"]["annotations"] = annotations
    plan = desired_state(body, CONFIG)
    assert plan.valid, plan.problems
    pod = of_kind(plan, "Deployment")["spec"]["template"]["spec"]
    requests = pod["containers"][0]["resources"]["requests"]
    if expected is None:
        assert "ephemeral-storage" not in requests
    else:
        assert requests["ephemeral-storage"] == f"{-(-expected // 10**9)}G"
        # no sizeLimit: the repository may hold more than the weights, and going past a
        # sizeLimit evicts the pod, whose successor downloads everything again
        assert {"name": "model-cache", "emptyDir": {}} in pod["volumes"]
    validate(of_kind(plan, "Deployment"))
