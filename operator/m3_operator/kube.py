"""The operator's writes to the API server, through the official Kubernetes client.

Three verbs are all it needs: server-side apply of a whole desired object (idempotent: applying
the same object twice changes nothing), delete of a child that is no longer desired, and a
merge patch of the recipe's status subresource. Every call has a timeout, and
``is_transient`` decides which failures are worth retrying.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import urllib3
from kubernetes import client as k8s

from m3_operator.desired import LWS_API_VERSION, ObjectRef
from m3_operator.recipe_api import API_VERSION, KIND, PLURAL

#: Plural resource name of every kind the operator writes.
PLURALS = {
    ("apps/v1", "Deployment"): "deployments",
    (LWS_API_VERSION, "LeaderWorkerSet"): "leaderworkersets",
    ("v1", "Service"): "services",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaims",
    ("batch/v1", "Job"): "jobs",
    (API_VERSION, KIND): PLURAL,
}

#: HTTP statuses that say "try again": conflicts, throttling, server-side trouble.
TRANSIENT_STATUSES = frozenset({409, 429, 500, 502, 503, 504})


def object_path(api_version: str, kind: str, namespace: str, name: str,
                subresource: str | None = None) -> str:
    try:
        plural = PLURALS[api_version, kind]
    except KeyError:
        raise ValueError(f"the operator does not write {kind} ({api_version})") from None
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{plural}/{name}"
    return f"{path}/{subresource}" if subresource else path


def is_transient(error: BaseException) -> bool:
    """True for failures a retry can cure: timeouts, dropped connections, 409/429/5xx."""
    if isinstance(error, k8s.ApiException):
        return error.status in TRANSIENT_STATUSES or not error.status
    return isinstance(error, (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError))


def describe(error: BaseException) -> str:
    """One line for a status message: the API server's own message where it gave one."""
    if isinstance(error, k8s.ApiException):
        try:
            message = json.loads(error.body or "{}").get("message")
        except (ValueError, AttributeError):
            message = None
        return f"HTTP {error.status} {error.reason}" + (f": {message}" if message else "")
    return f"{type(error).__name__}: {error}"


class Cluster:
    """Blocking API calls (the operator runs them in worker threads)."""

    def __init__(self, api_client: k8s.ApiClient, field_manager: str,
                 timeout_seconds: float = 30.0):
        self._api = api_client
        self._field_manager = field_manager
        self._timeout = (5.0, timeout_seconds)

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply ``obj`` (created if missing); the operator owns its fields."""
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        return self._call("PATCH", path, body=obj,
                          query=[("fieldManager", self._field_manager), ("force", "true")],
                          content_type="application/apply-patch+yaml")

    def delete(self, ref: ObjectRef, namespace: str) -> bool:
        """Delete a child; dependents go in the background. False if it was already gone."""
        path = object_path(ref.api_version, ref.kind, namespace, ref.name)
        try:
            self._call("DELETE", path, body={"propagationPolicy": "Background"})
        except k8s.ApiException as error:
            if error.status == 404:
                return False
            raise
        return True

    def patch_recipe_status(self, namespace: str, name: str,
                            status: Mapping[str, Any]) -> dict[str, Any]:
        path = object_path(API_VERSION, KIND, namespace, name, "status")
        return self._call("PATCH", path, body={"status": dict(status)},
                          content_type="application/merge-patch+json")

    def _call(self, method: str, path: str, *, body: Any = None,
              query: list[tuple[str, str]] | None = None,
              content_type: str = "application/json") -> dict[str, Any]:
        response = self._api.call_api(
            path, method, query_params=query or [],
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body, auth_settings=["BearerToken"], _preload_content=False,
            _request_timeout=self._timeout,
        )
        data = response.data if hasattr(response, "data") else response[0].data
        return json.loads(data) if data else {}


def api_client_for(host: str | None = None) -> k8s.ApiClient:
    """In-cluster credentials, else the local kubeconfig; ``host`` points at a given server
    (tests use an emulator)."""
    if host is not None:
        configuration = k8s.Configuration(host=host)
        return k8s.ApiClient(configuration)
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return k8s.ApiClient()
