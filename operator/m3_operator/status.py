"""The recipe's status as a pure function of what the operator has observed.

Conditions (all carry ``observedGeneration``):

- ``Validated``: the spec passed the recipe rules (False names every error; nothing applied).
- ``WorkloadReady``: the Deployment / LeaderWorkerSet has all its replicas ready.
- ``Ready``: validated, the current generation applied, and the workload ready.
- ``Degraded``: pods are failing (reason lifted from the pod status) or applying failed.

``lastTransitionTime`` changes only when a condition's status flips, so recomputing the
status from unchanged observations yields an identical object and no write.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from m3_operator.desired import ObjectRef, Plan
from m3_operator.pod_failures import PodFailure, most_severe, pod_failures

MAX_LISTED_FAILURES = 5


@dataclasses.dataclass(frozen=True)
class ApplyError:
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class Observation:
    """What the operator knows about one recipe at one moment."""

    generation: int | None
    plan: Plan | None = None
    """Plan of the current generation (None before the first reconcile)."""
    applied: Plan | None = None
    """Plan most recently applied in full."""
    applied_refs: tuple[ObjectRef, ...] = ()
    apply_error: ApplyError | None = None
    workload: Mapping[str, Any] | None = None
    pods: tuple[Mapping[str, Any], ...] = ()


def condition(kind: str, ok: bool, reason: str, message: str = "") -> dict[str, Any]:
    return {"type": kind, "status": "True" if ok else "False", "reason": reason,
            "message": message}


def workload_readiness(workload: Mapping[str, Any] | None,
                       desired: int) -> tuple[int, dict[str, Any]]:
    """(ready replicas, WorkloadReady condition) from a Deployment or LeaderWorkerSet."""
    if workload is None:
        return 0, condition("WorkloadReady", False, "WorkloadMissing",
                            "the Deployment or LeaderWorkerSet does not exist yet")
    kind = workload.get("kind", "workload")
    status = workload.get("status") or {}
    ready = int(status.get("readyReplicas") or 0)
    generation = (workload.get("metadata") or {}).get("generation")
    observed = status.get("observedGeneration")
    if generation is not None and observed is not None and observed < generation:
        return ready, condition("WorkloadReady", False, "RolloutPending",
                                f"{kind} controller has not yet seen generation {generation}")
    updated = status.get("updatedReplicas")
    if updated is not None and int(updated) < desired:
        # readyReplicas also counts pods of the previous revision while a rollout replaces them
        return ready, condition("WorkloadReady", False, "RolloutInProgress",
                                f"{updated}/{desired} replicas updated, {ready} ready")
    if ready >= desired:
        return ready, condition("WorkloadReady", True, "ReplicasReady",
                                f"{ready}/{desired} replicas ready")
    return ready, condition("WorkloadReady", False, "ReplicasNotReady",
                            f"{ready}/{desired} replicas ready")


def degraded_condition(failures: list[PodFailure],
                       apply_error: ApplyError | None) -> dict[str, Any]:
    if apply_error is not None:
        return condition("Degraded", True, apply_error.reason, apply_error.message)
    if failures:
        ordered = most_severe(failures)
        listed = "; ".join(str(f) for f in ordered[:MAX_LISTED_FAILURES])
        more = len(ordered) - MAX_LISTED_FAILURES
        if more > 0:
            listed += f"; and {more} more"
        return condition("Degraded", True, ordered[0].reason, listed)
    return condition("Degraded", False, "AsExpected")


def compute_status(obs: Observation, previous: Mapping[str, Any] | None,
                   now: str) -> dict[str, Any]:
    """The full ``status`` object; ``previous`` supplies unchanged transition times."""
    plan = obs.plan
    if plan is None:
        validated = {"type": "Validated", "status": "Unknown", "reason": "Pending",
                     "message": "not reconciled yet"}
    elif plan.valid:
        validated = condition("Validated", True, "Valid", "; ".join(plan.warnings))
    else:
        validated = condition("Validated", False, "InvalidSpec", "; ".join(plan.problems))

    applied = obs.applied
    desired = applied.replicas if applied is not None else 0
    ready_replicas, workload_ready = workload_readiness(obs.workload, desired)
    if applied is None:
        workload_ready = condition("WorkloadReady", False, "NotApplied",
                                   "no valid generation has been applied yet")

    failures = [failure for pod in obs.pods for failure in pod_failures(pod)]
    degraded = degraded_condition(failures, obs.apply_error)

    up_to_date = (applied is not None and plan is not None and plan.valid
                  and applied.generation == obs.generation)
    if validated["status"] != "True":
        ready = condition("Ready", False, validated["reason"], validated["message"])
    elif not up_to_date:
        ready = condition("Ready", False, "Applying",
                          f"generation {obs.generation} is not applied yet")
    elif workload_ready["status"] != "True":
        ready = condition("Ready", False, workload_ready["reason"], workload_ready["message"])
    else:
        ready = condition("Ready", True, "Serving", workload_ready["message"])

    conditions = [validated, workload_ready, ready, degraded]
    before = {c.get("type"): c for c in (previous or {}).get("conditions") or []}
    for cond in conditions:
        cond["observedGeneration"] = obs.generation
        old = before.get(cond["type"])
        same = old is not None and old.get("status") == cond["status"]
        cond["lastTransitionTime"] = old.get("lastTransitionTime", now) if same else now
        if cond["observedGeneration"] is None:
            del cond["observedGeneration"]

    status: dict[str, Any] = {"conditions": conditions, "readyReplicas": ready_replicas,
                              "replicas": desired}
    if obs.generation is not None:
        status["observedGeneration"] = obs.generation
    if applied is not None:
        if applied.generation is not None:
            status["appliedGeneration"] = applied.generation
        status["renderedArgs"] = list(applied.rendered_args)
        status["warnings"] = list(applied.warnings)
        if applied.workload is not None:
            status["workload"] = applied.workload.as_dict()
    refs = applied.refs if applied is not None else obs.applied_refs
    status["children"] = [ref.as_dict() for ref in refs]
    return status
