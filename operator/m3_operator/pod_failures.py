"""Lift pod failures into reasons a person can act on.

A recipe's pods fail in a handful of recurring ways: the server crashes at start-up
(CrashLoopBackOff), runs out of memory (OOMKilled), its image cannot be pulled, or no node
has the GPUs (Unschedulable). The kubelet reports each in a different corner of the pod
status; this module finds them and names them the same way every time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

#: Waiting reasons that mean the container will not start without a change.
_WAITING_FAILURES = {
    "CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
}

#: Most telling first: an OOM kill explains the crash loop it causes.
SEVERITY = ("OOMKilled", "CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull",
            "InvalidImageName", "CreateContainerConfigError", "CreateContainerError",
            "RunContainerError", "Unschedulable", "Evicted", "Failed")


@dataclasses.dataclass(frozen=True)
class PodFailure:
    pod: str
    container: str | None
    reason: str
    message: str

    def __str__(self) -> str:
        where = f"pod {self.pod}" + (f" container {self.container}" if self.container else "")
        return f"{where}: {self.reason}" + (f": {self.message}" if self.message else "")


def pod_failures(pod: Mapping[str, Any]) -> list[PodFailure]:
    """Every failure visible in one pod's status (empty for a healthy or starting pod).

    Reads defensively: a field of an unexpected type counts as absent, so one odd pod can
    never stop the operator from reporting on the others."""
    name = str(_map(pod.get("metadata")).get("name", "?"))
    status = _map(pod.get("status"))
    failures: list[PodFailure] = []
    statuses = [*_list(status.get("initContainerStatuses")),
                *_list(status.get("containerStatuses"))]
    for container in statuses:
        failure = _container_failure(name, _map(container))
        if failure is not None:
            failures.append(failure)
    for condition in map(_map, _list(status.get("conditions"))):
        if (condition.get("type") == "PodScheduled" and condition.get("status") == "False"
                and condition.get("reason") == "Unschedulable"):
            failures.append(PodFailure(name, None, "Unschedulable",
                                       _text(condition.get("message"))))
    if status.get("phase") == "Failed" and not failures:
        failures.append(PodFailure(name, None, _text(status.get("reason")) or "Failed",
                                   _text(status.get("message"))))
    return failures


#: Why an OOM kill happens to a server container: the operator sets no memory limit (only
#: requests), so it is the node running short, or a limit some namespace policy added.
_OOM_MESSAGE = ("killed by the kernel for lack of memory (no memory limit comes from the "
                "operator: the node ran short, or a namespace LimitRange set one)")


def _container_failure(pod: str, container: Mapping[str, Any]) -> PodFailure | None:
    name = _text(container.get("name")) or None
    state = _map(container.get("state"))
    last = _map(_map(container.get("lastState")).get("terminated"))
    terminated = _map(state.get("terminated"))
    past_oom = last.get("reason") == "OOMKilled" and not _recovered(container)
    if terminated.get("reason") == "OOMKilled" or past_oom:
        restarts = container.get("restartCount", 0)
        return PodFailure(pod, name, "OOMKilled", f"{_OOM_MESSAGE} (restarts: {restarts})")
    waiting = _map(state.get("waiting"))
    reason = waiting.get("reason")
    if isinstance(reason, str) and reason in _WAITING_FAILURES:
        message = _text(waiting.get("message"))
        if last.get("exitCode") is not None:
            message = f"last exit code {last['exitCode']}" + (f"; {message}" if message else "")
        return PodFailure(pod, name, reason, message)
    return None


def _recovered(container: Mapping[str, Any]) -> bool:
    """Whether the container is past its last termination: running and ready again (a server
    answering /health), or an init container that has since completed. ``lastState`` keeps a
    termination until the next one, however long ago; a Kubernetes user reads a past kill off
    ``restartCount`` and the pod's events, and expects Degraded, like the pod's own Ready, to
    describe the container now. Readiness, not a time bound: a server restarted after an OOM
    kill stays reported while it reloads (it may be killed again), and clears once it serves."""
    state = _map(container.get("state"))
    if "running" in state:
        return container.get("ready") is True
    terminated = _map(state.get("terminated"))
    return terminated.get("reason") == "Completed" or terminated.get("exitCode") == 0


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def most_severe(failures: Iterable[PodFailure]) -> list[PodFailure]:
    """Failures ordered by how much they explain, then by pod name (stable output)."""
    def rank(failure: PodFailure) -> tuple[int, str, str]:
        order = SEVERITY.index(failure.reason) if failure.reason in SEVERITY else len(SEVERITY)
        return order, failure.pod, failure.container or ""

    return sorted(failures, key=rank)
