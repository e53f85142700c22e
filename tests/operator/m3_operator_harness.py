"""Harness of the operator tests: a Kubernetes API emulator and a running operator.

No real API server can be installed on this machine, so the end-to-end tests run the real
operator (kopf + the official client, over HTTP) against ``kmock``'s Kubernetes emulator.
kmock stores objects, serves list/watch/get/patch/delete and streams watch events. It does
not implement three API-server behaviours the operator relies on, so ``ApiServer`` below adds
them, each in the simplest form that keeps the operator's contract observable:

- server-side apply creates a missing object (field ownership is not emulated: an apply is
  merged into the stored object);
- ``metadata.uid``, ``creationTimestamp``, ``generation`` (bumped when ``spec`` changes) and
  a ``resourceVersion`` that grows with every write (kopf relies on it to tell its own
  writes from stale watch events);
- the garbage collector: deleting an object deletes every object whose owner references
  point only at UIDs that no longer exist, as kube-controller-manager does.

kmock also keeps every request for assertions and matches each new request against that
history, which grows quadratically with hundreds of objects; ``ApiServer`` forgets finished
requests and logs every request line in ``log`` instead (``writes`` lists the writes).

``faults`` injects API failures (an HTTP status, or a delay past the client's timeout) for
matching requests, before the request touches any state.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import itertools
import re
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import kopf
import pytest
import pytest_asyncio
import yaml
from kmock._internal import enums

from m3_operator import runner
from m3_operator.controller import Controller
from m3_operator.options import OperatorConfig

NAMESPACE = "serving"
RECIPES = "m3.sglang.io/v1alpha1/m3recipes"
#: Collection URL of the test namespace's recipes (POST creates one, /<name> addresses it).
RECIPE_PATH = f"/apis/m3.sglang.io/v1alpha1/namespaces/{NAMESPACE}/m3recipes"
_BASE_RECIPE = Path(__file__).parent / "cases" / "h200-single-node.yaml"

#: (resource, kind, namespaced, subresources) the emulated cluster serves.
RESOURCES = [
    (RECIPES, "M3Recipe", True, {"status"}),
    ("apps/v1/deployments", "Deployment", True, {"status"}),
    ("leaderworkerset.x-k8s.io/v1/leaderworkersets", "LeaderWorkerSet", True, {"status"}),
    ("v1/services", "Service", True, set()),
    ("policy/v1/poddisruptionbudgets", "PodDisruptionBudget", True, set()),
    ("v1/persistentvolumeclaims", "PersistentVolumeClaim", True, set()),
    ("batch/v1/jobs", "Job", True, {"status"}),
    ("v1/pods", "Pod", True, {"status"}),
    ("v1/events", "Event", True, set()),
    ("v1/namespaces", "Namespace", False, set()),
    ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", False,
     set()),
]
VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}


@dataclasses.dataclass
class Fault:
    """Answer the next ``times`` requests matching ``method`` + ``path`` with a failure."""

    method: str
    path: str  # regular expression, matched against the whole URL path
    times: int
    status: int | None = None  # HTTP status to answer with
    delay: float | None = None  # or: stall this long before serving (past the client timeout)
    hits: int = 0

    def matches(self, request: kmock.Request) -> bool:
        return (self.hits < self.times and request.method.upper() == self.method
                and re.fullmatch(self.path, request.url.path) is not None)


class ApiServer(kmock.KubernetesEmulator):
    """kmock's emulator plus apply-creates, object identity, generation, GC and faults."""

    faults: list[Fault]
    log: list[str]

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.faults = []
        self.log = []
        self._versions = itertools.count(1)

    async def _handle(self, request: kmock.Request):
        self.log.append(f"{request.method.upper()} {request.url.path_qs}")
        try:
            return await self._serve(request)
        finally:
            for index in range(len(self._requests) - 1, -1, -1):
                if self._requests[index] is request:
                    del self._requests[index]
                    break

    @property
    def writes(self) -> list[str]:
        return [line for line in self.log if line.split()[0] in ("POST", "PUT", "PATCH", "DELETE")]

    async def _serve(self, request: kmock.Request):
        for fault in self.faults:
            if fault.matches(request):
                fault.hits += 1
                if fault.delay is not None:
                    await asyncio.sleep(fault.delay)
                    break
                raise kmock.KubernetesError(status=fault.status, reason="InjectedFault",
                                            message=f"injected HTTP {fault.status}")
        if request.resource is not None and isinstance(request.data, dict):
            if request.action in (enums.action.CREATE, enums.action.UPDATE):
                meta = request.data.setdefault("metadata", {})
                meta["resourceVersion"] = str(next(self._versions))
            if request.action == enums.action.CREATE:
                self._stamp_new(request.data, request.namespace)
            elif request.action == enums.action.UPDATE and request.name:
                await self._prepare_update(request)
        response = await super()._handle(request)
        if request.resource is not None and request.action == enums.action.DELETE:
            await self._collect_garbage()
        return response

    @staticmethod
    def _stamp_new(data: dict[str, Any], namespace: str | None) -> None:
        meta = data.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp",
                        datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        meta.setdefault("generation", 1)
        if namespace and not meta.get("namespace"):
            meta["namespace"] = namespace

    async def _prepare_update(self, request: kmock.Request) -> None:
        key = (request.resource, request.namespace, request.name)
        applying = request.headers.get("Content-Type", "").startswith("application/apply-patch")
        async with self._lock:
            exists = key in self._objects and not self._objects[key].deleted
            if not exists and applying:
                self._stamp_new(request.data, request.namespace)
                if key in self._objects:
                    self._objects[key].create(request.data)
                else:
                    self._objects[key] = request.data
                raw = self._objects[key].raw
                await self._buses[request.resource].put({"type": "ADDED", "object": raw})
                return
            if exists and request.subresource is None and "spec" in request.data:
                stored = self._objects[key].raw
                merged = _merge(stored.get("spec") or {}, request.data["spec"])
                if merged != stored.get("spec"):
                    generation = stored.get("metadata", {}).get("generation", 1) + 1
                    request.data.setdefault("metadata", {})["generation"] = generation

    async def _collect_garbage(self) -> None:
        async with self._lock:
            while True:
                live = {obj.raw.get("metadata", {}).get("uid")
                        for _, obj in self._objects.items() if not obj.deleted}
                orphans = [(key, obj) for key, obj in self._objects.items()
                           if not obj.deleted and _owners(obj.raw)
                           and not (_owners(obj.raw) & live)]
                if not orphans:
                    return
                for (resource, _, _), obj in orphans:
                    raw = obj.raw
                    obj.delete()
                    await self._buses[resource].put({"type": "DELETED", "object": raw})


def _owners(raw: dict[str, Any]) -> set[str]:
    return {ref.get("uid") for ref in raw.get("metadata", {}).get("ownerReferences") or []}


def _merge(base: Any, patch: Any) -> Any:
    if not isinstance(base, dict) or not isinstance(patch, dict):
        return patch
    merged = dict(base)
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = _merge(base.get(key), value)
    return merged


def recipe_body(name: str) -> dict[str, Any]:
    """The single-node H200 test recipe, named ``name``, in the test namespace."""
    body = yaml.safe_load(_BASE_RECIPE.read_text())
    body["metadata"] = {"name": name, "namespace": NAMESPACE}
    return body


@pytest.fixture
def kmock_options() -> dict[str, Any]:
    return {"cls": ApiServer}


@pytest.fixture
def api(kmock) -> ApiServer:
    """The emulated API server with the resources an M3 cluster serves."""
    for resource, kind, namespaced, subresources in RESOURCES:
        kmock.resources[resource] = kmock.ResourceInfo(
            kind=kind, namespaced=namespaced, verbs=VERBS, subresources=subresources)
    return kmock


class Client:
    """A plain HTTP client for the test's own requests (what kubectl or a kubelet would do)."""

    def __init__(self, session: aiohttp.ClientSession, server: ApiServer):
        self.session = session
        self.server = server

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self.session.post(path, json=body) as response:
            assert response.status < 300, await response.text()
            return await response.json()

    async def patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"Content-Type": "application/merge-patch+json"}
        async with self.session.patch(path, json=body, headers=headers) as response:
            assert response.status < 300, await response.text()
            return await response.json()

    async def delete(self, path: str) -> None:
        async with self.session.delete(path) as response:
            assert response.status < 300, await response.text()

    def stored(self, resource: str, namespace: str = NAMESPACE) -> dict[str, Any]:
        """Every live object of ``resource`` in ``namespace``, by name."""
        return {name: obj.raw for (res, ns, name), obj in self.server.objects.items()
                if _spelled(res) == resource and ns == namespace and not obj.deleted}

    def get(self, resource: str, name: str, namespace: str = NAMESPACE) -> dict[str, Any] | None:
        """The stored object (e.g. ``get("apps/v1/deployments", "x")``), None when absent."""
        return self.stored(resource, namespace).get(name)

    def names(self, resource: str, namespace: str = NAMESPACE) -> set[str]:
        return set(self.stored(resource, namespace))


def _spelled(resource: Any) -> str:
    return f"{resource.group}/{resource.version}/{resource.plural}".lstrip("/")


@pytest_asyncio.fixture
async def client(api: ApiServer) -> AsyncIterator[Client]:
    async with aiohttp.ClientSession(base_url=str(api.url)) as session:
        yield Client(session, api)


@contextlib.asynccontextmanager
async def running_operator(api: ApiServer, config: OperatorConfig) -> AsyncIterator[Controller]:
    """The real operator (kopf watch loop, handlers, official client) against ``api``.

    It runs on its own event loop in a thread, as it would in its own process: kopf treats
    every task of its loop as its own at shutdown, and would otherwise wait for the emulator's
    open watch streams.
    """
    url = str(api.url).rstrip("/")
    stop, ready = threading.Event(), threading.Event()
    controllers: list[Controller] = []
    failures: list[BaseException] = []

    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=url)

    def main() -> None:
        try:
            asyncio.run(runner.run(
                config, api_host=url, login=login, stop_flag=stop, ready_flag=ready,
                registry_hook=lambda registry, controller: controllers.append(controller)))
        except BaseException as error:  # surfaced by the test below
            failures.append(error)
            ready.set()

    thread = threading.Thread(target=main, name="m3-operator", daemon=True)
    thread.start()
    assert await asyncio.to_thread(ready.wait, WAIT_S), "the operator did not start"
    assert not failures, failures
    # Ready means started, not yet watching: wait for the watches the tests depend on.
    await eventually(lambda: _watching(api, "m3recipes") and _watching(api, "pods"),
                     what="the operator's watches")
    try:
        yield controllers[0]
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, WAIT_S)
        assert not thread.is_alive(), "the operator did not stop"
        assert not failures, failures


def _watching(api: ApiServer, plural: str) -> bool:
    """Whether a watch of ``plural`` is open (open streams stay in kmock's request list)."""
    return any(request.params.get("watch") == "true" and request.url.path.endswith(plural)
               for request in list(api))


#: How long a test waits for the operator to start, stop, or converge. Only a bound on waiting (a
#: check that holds returns at once): generous, because the 2-core CI machines can run ten times
#: slower than a workstation.
WAIT_S = 120.0


async def eventually(check: Callable[[], Any], timeout: float = WAIT_S, what: str = "",
                     interval: float = 0.05) -> Any:
    """Poll ``check`` until it returns something truthy; fail with ``what`` after ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = check()
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or check}")
        await asyncio.sleep(interval)


def condition(recipe: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    for cond in ((recipe or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            return cond
    return None
