"""Status conditions and pod-failure lifting: pure functions, checked case by case and with
generated inputs."""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from m3_operator.desired import ObjectRef, Plan
from m3_operator.pod_failures import SEVERITY, pod_failures
from m3_operator.status import ApplyError, Observation, compute_status

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"
WORKLOAD = ObjectRef("apps/v1", "Deployment", "m3")
APPLIED = Plan(name="m3", namespace="ns", generation=2, rendered_args=("--tp-size", "8"),
               workload=WORKLOAD, replicas=2)


def deployment(ready: int, generation: int = 1, observed: int = 1) -> dict:
    return {"kind": "Deployment", "metadata": {"name": "m3", "generation": generation},
            "status": {"readyReplicas": ready, "observedGeneration": observed}}


def conditions(status: dict) -> dict[str, dict]:
    return {c["type"]: c for c in status["conditions"]}


def pod(**container) -> dict:
    return {"metadata": {"name": "m3-0"},
            "status": {"containerStatuses": [{"name": "sglang", **container}]}}


def test_ready_needs_validation_current_generation_and_ready_replicas():
    obs = Observation(generation=2, plan=APPLIED, applied=APPLIED, workload=deployment(2))
    status = compute_status(obs, None, T0)
    cond = conditions(status)
    assert {k: c["status"] for k, c in cond.items()} == {
        "Validated": "True", "WorkloadReady": "True", "Ready": "True", "Degraded": "False"}
    assert all(c["observedGeneration"] == 2 for c in cond.values())
    assert status["appliedGeneration"] == 2 and status["readyReplicas"] == 2
    assert status["renderedArgs"] == ["--tp-size", "8"]

    partly = compute_status(dataclasses.replace(obs, workload=deployment(1)), None, T0)
    assert conditions(partly)["Ready"]["reason"] == "ReplicasNotReady"
    stale = compute_status(dataclasses.replace(obs, workload=deployment(2, 3, 2)), None, T0)
    assert conditions(stale)["WorkloadReady"]["reason"] == "RolloutPending"
    newer = compute_status(dataclasses.replace(obs, generation=3), None, T0)
    assert conditions(newer)["Ready"]["reason"] == "Applying"
    # mid-rollout readyReplicas still counts the old revision's pods: not ready until updated
    rolling = deployment(2)
    rolling["status"]["updatedReplicas"] = 1
    mid = conditions(compute_status(dataclasses.replace(obs, workload=rolling), None, T0))
    assert mid["WorkloadReady"]["reason"] == "RolloutInProgress" and mid["Ready"]["status"] == "False"
    rolling["status"]["updatedReplicas"] = 2
    done = conditions(compute_status(dataclasses.replace(obs, workload=rolling), None, T0))
    assert done["WorkloadReady"]["status"] == "True" and done["Ready"]["status"] == "True"


def test_invalid_spec_keeps_reporting_the_last_applied_generation():
    broken = Plan(name="m3", namespace="ns", generation=3, problems=("spec.x: bad",))
    obs = Observation(generation=3, plan=broken, applied=APPLIED, workload=deployment(2))
    cond = conditions(status := compute_status(obs, None, T0))
    assert cond["Validated"]["status"] == "False" and cond["Validated"]["message"] == "spec.x: bad"
    assert cond["Ready"]["status"] == "False" and cond["Ready"]["reason"] == "InvalidSpec"
    assert status["appliedGeneration"] == 2  # the running workload is still the old one


def test_transition_times_change_only_when_a_status_flips():
    obs = Observation(generation=2, plan=APPLIED, applied=APPLIED, workload=deployment(1))
    first = compute_status(obs, None, T0)
    assert compute_status(obs, first, T1) == first  # nothing changed: identical, no write
    ready = compute_status(dataclasses.replace(obs, workload=deployment(2)), first, T1)
    assert conditions(ready)["Ready"]["lastTransitionTime"] == T1
    assert conditions(ready)["Validated"]["lastTransitionTime"] == T0


def test_degraded_lifts_the_most_telling_pod_failure_and_apply_errors():
    crash = pod(state={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}},
                lastState={"terminated": {"reason": "OOMKilled", "exitCode": 137}},
                restartCount=3)
    obs = Observation(generation=2, plan=APPLIED, applied=APPLIED, workload=deployment(0),
                      pods=(crash,))
    degraded = conditions(compute_status(obs, None, T0))["Degraded"]
    assert degraded["status"] == "True" and degraded["reason"] == "OOMKilled"
    assert "m3-0" in degraded["message"]
    failed = dataclasses.replace(obs, apply_error=ApplyError("ApplyFailed", "HTTP 403"))
    assert conditions(compute_status(failed, None, T0))["Degraded"]["reason"] == "ApplyFailed"


def test_pod_failures_cover_the_common_cases():
    unschedulable = {"metadata": {"name": "p"}, "status": {"conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/4 nodes have 8 free nvidia.com/gpu"}]}}
    assert [f.reason for f in pod_failures(unschedulable)] == ["Unschedulable"]
    pull = pod(state={"waiting": {"reason": "ImagePullBackOff", "message": "not found"}})
    assert [f.reason for f in pod_failures(pull)] == ["ImagePullBackOff"]
    starting = pod(state={"waiting": {"reason": "ContainerCreating"}})
    assert pod_failures(starting) == []
    init = {"metadata": {"name": "p"}, "status": {"initContainerStatuses": [
        {"name": "wait-for-model", "state": {"waiting": {"reason": "CrashLoopBackOff"}}}]}}
    assert [(f.container, f.reason) for f in pod_failures(init)] == [
        ("wait-for-model", "CrashLoopBackOff")]
    evicted = {"metadata": {"name": "p"}, "status": {"phase": "Failed", "reason": "Evicted"}}
    assert [f.reason for f in pod_failures(evicted)] == ["Evicted"]


_text = st.text(max_size=12)
_leaf = st.one_of(st.none(), st.integers(), _text, st.sampled_from(SEVERITY + ("Running",)))
_json = st.recursive(_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(
        ["state", "lastState", "waiting", "terminated", "reason", "message", "name",
         "exitCode", "restartCount", "containerStatuses", "initContainerStatuses",
         "conditions", "phase", "type", "status"]), inner, max_size=4)), max_leaves=12)


@given(status=st.dictionaries(st.sampled_from(
    ["containerStatuses", "initContainerStatuses", "conditions", "phase", "reason"]),
    st.one_of(st.lists(st.dictionaries(st.sampled_from(
        ["name", "state", "lastState", "restartCount", "type", "status", "reason"]), _json,
        max_size=4), max_size=3), _leaf), max_size=4))
def test_pod_failures_never_crash_on_odd_statuses(status):
    failures = pod_failures({"metadata": {"name": "p"}, "status": status})
    assert all(f.pod == "p" and isinstance(f.reason, str) and f.reason for f in failures)
    assert all(isinstance(f.message, str) for f in failures)
