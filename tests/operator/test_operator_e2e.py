"""The operator end to end: kopf + the official client against kmock's Kubernetes emulator.

No real API server can be installed on this machine; ``m3_operator_harness.ApiServer``
documents what the emulator adds to kmock (apply-creates, uid/generation, garbage collection,
fault injection). Pods and workload status are written by the test, standing in for the
kubelet and the Deployment / LeaderWorkerSet controllers.
"""

from __future__ import annotations

import asyncio

import pytest
from m3_operator_harness import (
    NAMESPACE,
    RECIPE_PATH,
    RECIPES,
    Fault,
    condition,
    eventually,
    recipe_body,
    running_operator,
)

from m3_operator.options import OperatorConfig

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(600)]

CONFIG = OperatorConfig(resync_seconds=0, request_timeout_seconds=2.0, retry_base_seconds=0.1)


def recipe(name: str, **spec_changes) -> dict:
    body = recipe_body(name)
    for dotted, value in spec_changes.items():
        node = body["spec"]
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return body


def workload_status_path(resource: str, name: str) -> str:
    group_version, plural = resource.rsplit("/", 1)
    return f"/apis/{group_version}/namespaces/{NAMESPACE}/{plural}/{name}/status"


async def test_create_update_switch_and_delete(api, client):
    async with running_operator(api, CONFIG) as controller:
        created = await client.create(RECIPE_PATH, recipe("alpha"))
        uid = created["metadata"]["uid"]

        deployment = await eventually(lambda: client.get("apps/v1/deployments", "alpha"),
                                      what="the Deployment")
        service = await eventually(lambda: client.get("v1/services", "alpha"), what="Service")
        await eventually(lambda: client.get("policy/v1/poddisruptionbudgets", "alpha"),
                         what="the PodDisruptionBudget")
        assert deployment["metadata"]["ownerReferences"][0]["uid"] == uid
        assert service["spec"]["selector"]["m3.sglang.io/role"] == "leader"

        stored = await eventually(
            lambda: client.get(RECIPES, "alpha")["status"].get("appliedGeneration") == 1
            and client.get(RECIPES, "alpha"), what="a status of the applied generation")
        assert condition(stored, "Validated")["status"] == "True"
        assert condition(stored, "Ready")["status"] == "False"
        assert stored["status"]["renderedArgs"][:2] == ["--model-path", "MiniMaxAI/MiniMax-M3"]

        # The Deployment controller reports the pod ready -> the recipe becomes Ready.
        await client.patch(workload_status_path("apps/v1/deployments", "alpha"),
                           {"status": {"readyReplicas": 1, "observedGeneration": 1}})
        await eventually(lambda: (condition(client.get(RECIPES, "alpha"), "Ready") or {})
                         .get("status") == "True", what="Ready=True")
        assert client.get(RECIPES, "alpha")["status"]["readyReplicas"] == 1
        metrics = controller.metrics.registry
        assert metrics.get_sample_value("m3_operator_reconciles_total", {"outcome": "applied"}) >= 1
        assert metrics.get_sample_value("m3_operator_recipes", {"ready": "True"}) == 1

        # A spec change re-renders the server arguments into the Deployment.
        await client.patch(f"{RECIPE_PATH}/alpha", {"spec": {"contextLength": 65536}})

        def updated():
            args = client.get("apps/v1/deployments", "alpha")["spec"]["template"]["spec"][
                "containers"][0]["args"]
            return args[args.index("--context-length") + 1] == "65536"

        await eventually(updated, what="the Deployment to carry the new context length")
        await eventually(lambda: client.get(RECIPES, "alpha")["status"].get(
            "appliedGeneration") == 2, what="appliedGeneration 2")
        assert condition(client.get(RECIPES, "alpha"), "Ready")["observedGeneration"] == 2

        # Two nodes: the Deployment is replaced by a LeaderWorkerSet.
        await client.patch(f"{RECIPE_PATH}/alpha", {"spec": {
            "hardware": {"nodes": 2}, "parallelism": {"tp": 16}}})
        lws = await eventually(
            lambda: client.get("leaderworkerset.x-k8s.io/v1/leaderworkersets", "alpha-lws"),
            what="the LeaderWorkerSet")
        await eventually(lambda: client.get("apps/v1/deployments", "alpha") is None,
                         what="the Deployment to be pruned")
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2

        await client.delete(f"{RECIPE_PATH}/alpha")
        await eventually(lambda: not (client.names("apps/v1/deployments")
                                      | client.names("leaderworkerset.x-k8s.io/v1/leaderworkersets")
                                      | client.names("v1/services")
                                      | client.names("policy/v1/poddisruptionbudgets")),
                         what="children removed")


async def test_invalid_recipe_creates_nothing_and_does_not_hot_loop(api, client):
    async with running_operator(api, CONFIG):
        await client.create(RECIPE_PATH, recipe("broken", parallelism__tp=3))
        stored = await eventually(
            lambda: (condition(client.get(RECIPES, "broken"), "Validated") or {}).get(
                "status") == "False" and client.get(RECIPES, "broken"), what="Validated=False")
        validated = condition(stored, "Validated")
        assert validated["status"] == "False" and validated["reason"] == "InvalidSpec"
        assert "spec.parallelism.tp" in validated["message"]
        assert condition(stored, "Ready")["status"] == "False"

        # kopf records the handled spec in an annotation once the handler has finished.
        await eventually(lambda: any(key.endswith("/last-handled-configuration") for key in
                                     client.get(RECIPES, "broken")["metadata"].get(
                                         "annotations", {})), what="kopf's bookkeeping")
        writes_before = len(api.writes)
        await asyncio.sleep(1.5)
        assert api.writes[writes_before:] == [], "the operator kept writing"
        assert not client.names("apps/v1/deployments")
        assert not client.names("v1/services")
        assert not client.names("policy/v1/poddisruptionbudgets")


@pytest.mark.parametrize("state, reason", [
    ({"state": {"waiting": {"reason": "CrashLoopBackOff",
                            "message": "back-off 5m0s restarting failed container"}},
      "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}}}, "CrashLoopBackOff"),
    ({"state": {"waiting": {"reason": "CrashLoopBackOff"}},
      "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}, "OOMKilled"),
])
async def test_failing_pod_marks_recipe_degraded(api, client, state, reason):
    async with running_operator(api, CONFIG):
        await client.create(RECIPE_PATH, recipe("gamma"))
        deployment = await eventually(lambda: client.get("apps/v1/deployments", "gamma"))
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        await client.create(f"/api/v1/namespaces/{NAMESPACE}/pods", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "gamma-7d9f-abcde", "namespace": NAMESPACE, "labels": labels},
            "status": {"phase": "Running", "containerStatuses": [
                {"name": "sglang", "ready": False, "restartCount": 4, **state}]},
        })
        degraded = await eventually(
            lambda: (condition(client.get(RECIPES, "gamma"), "Degraded") or {}).get(
                "status") == "True" and condition(client.get(RECIPES, "gamma"), "Degraded"),
            what="Degraded=True")
        assert degraded["reason"] == reason
        assert "gamma-7d9f-abcde" in degraded["message"]

        # The pod is replaced by a healthy one: Degraded clears.
        await client.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/gamma-7d9f-abcde")
        await eventually(lambda: condition(client.get(RECIPES, "gamma"), "Degraded")[
            "status"] == "False", what="Degraded=False")


async def test_transient_api_errors_converge(api, client):
    base = f"/apis/apps/v1/namespaces/{NAMESPACE}"
    api.faults += [
        Fault("PATCH", f"{base}/deployments/delta", times=2, status=409),
        Fault("PATCH", f"/api/v1/namespaces/{NAMESPACE}/services/delta", times=2, status=500),
        # Stalls past the operator's 2 s read timeout once.
        Fault("PATCH", f"/apis/policy/v1/namespaces/{NAMESPACE}/poddisruptionbudgets/delta",
              times=1, delay=3.0),
        Fault("PATCH", f"{RECIPE_PATH}/delta/status", times=2, status=503),
    ]
    async with running_operator(api, CONFIG):
        await client.create(RECIPE_PATH, recipe("delta"))

        def converged():
            stored = client.get(RECIPES, "delta")
            return (client.get("apps/v1/deployments", "delta")
                    and client.get("v1/services", "delta")
                    and client.get("policy/v1/poddisruptionbudgets", "delta")
                    and (condition(stored, "Validated") or {}).get("status") == "True"
                    and (condition(stored, "Degraded") or {}).get("status") == "False"
                    and stored["status"].get("appliedGeneration") == 1)

        await eventually(converged, what="convergence despite API faults")
    assert all(fault.hits == fault.times for fault in api.faults), api.faults
