"""kopf handlers: feed watch events into the ``Controller`` and map its outcomes onto kopf.

Recipes are reconciled on create, update and operator resume (kopf retries a handler that
raises ``TemporaryError`` after the given delay, which gives transient API errors their
backoff), and again on a slow timer that repairs drift. Workloads and pods carrying the
operator's labels are only observed: their changes rewrite the owning recipe's status.
"""

from __future__ import annotations

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
        kopf.timer(*RECIPES, registry=registry, id="resync", interval=resync_seconds,
                   initial_delay=resync_seconds)(reconcile)

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
