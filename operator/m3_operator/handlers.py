"""kopf handlers: feed watch events into the ``Controller`` and map its outcomes onto kopf.

Recipes are reconciled on create, update and operator resume (kopf retries a handler that
raises ``TemporaryError`` after the given delay, which gives transient API errors their
backoff), and again by the controller's slow resync loop, which repairs drift. No handler needs
a finalizer, so recipes delete whether or not the operator runs. Workloads and pods carrying the
operator's labels are only observed: their changes rewrite the owning recipe's status.
"""

from __future__ import annotations

import asyncio
from typing import Any

import kopf

from m3_operator.controller import Controller, RetryLater
from m3_operator.desired import LWS_API_VERSION
from m3_operator.names import MANAGED_BY, MANAGED_BY_LABEL
from m3_operator.recipe_api import GROUP, PLURAL, VERSION

RECIPES = (GROUP, VERSION, PLURAL)
OWNED = {MANAGED_BY_LABEL: MANAGED_BY}
#: (group, version, plural, kind) of the children whose state feeds the recipe status.
OBSERVED_CHILDREN = (
    ("apps", "v1", "deployments", "Deployment"),
    (*LWS_API_VERSION.split("/"), "leaderworkersets", "LeaderWorkerSet"),
    ("", "v1", "pods", "Pod"),
)


def register(registry: kopf.OperatorRegistry, controller: Controller,
             resync_seconds: float) -> None:
    """Attach the operator's handlers for ``controller`` to ``registry``."""

    async def reconcile(body: kopf.Body, retry: int, **_: Any) -> None:
        try:
            await controller.reconcile(body, attempt=retry)
        except RetryLater as error:
            raise kopf.TemporaryError(str(error), delay=error.delay) from error

    for decorator in (kopf.on.resume, kopf.on.create, kopf.on.update):
        decorator(*RECIPES, registry=registry, id="reconcile")(reconcile)
    if resync_seconds > 0:
        # The controller's own loop, not kopf.timer: a timer makes kopf put a finalizer on every
        # recipe, which blocks deleting recipes while the operator is down (Controller.resync).
        resync_task: list[asyncio.Task] = []

        @kopf.on.startup(registry=registry, id="start-resync")
        async def start_resync(**_: Any) -> None:
            resync_task.append(asyncio.get_running_loop().create_task(
                controller.resync_forever(resync_seconds)))

        @kopf.on.cleanup(registry=registry, id="stop-resync")
        async def stop_resync(**_: Any) -> None:
            for task in resync_task:
                task.cancel()

    @kopf.on.event(*RECIPES, registry=registry, id="observe-recipe")
    async def recipe_event(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
        key = controller.observe_recipe(body, deleted=event.get("type") == "DELETED")
        if event.get("type") != "DELETED":
            await controller.publish_status(key)

    for group, version, plural, kind in OBSERVED_CHILDREN:
        _observe(registry, controller, group, version, plural, kind)


def _observe(registry: kopf.OperatorRegistry, controller: Controller, group: str,
             version: str, plural: str, kind: str) -> None:
    @kopf.on.event(group=group, version=version, plural=plural, labels=OWNED,
                   registry=registry, id=f"observe-{plural}")
    async def child_event(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
        key = controller.observe_child(kind, body, deleted=event.get("type") == "DELETED")
        if key is not None:
            await controller.publish_status(key)
