"""Reconciliation: make the cluster match each recipe's desired state, and report on it.

The kopf handlers (``handlers``) only feed events in. This class keeps what the operator has
seen of each recipe and its children, applies plans, and writes the status. Status writes for
one recipe are serialised by a lock and computed at write time from the latest observations,
so the last write always reflects the newest state, whichever event triggered it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes.client import ApiException

from m3_operator.desired import ObjectRef, Plan, desired_state
from m3_operator.kube import Cluster, describe, is_transient
from m3_operator.metrics import OperatorMetrics
from m3_operator.names import RECIPE_LABEL
from m3_operator.options import OperatorConfig
from m3_operator.status import ApplyError, Observation, compute_status

logger = logging.getLogger(__name__)

Key = tuple[str, str]
WORKLOAD_KINDS = ("Deployment", "LeaderWorkerSet")


class RetryLater(Exception):
    """Applying failed; try again after ``delay`` seconds (kopf turns this into a retry)."""

    def __init__(self, message: str, delay: float):
        super().__init__(message)
        self.delay = delay


def backoff(attempt: int, base: float = 1.0, cap: float = 60.0) -> float:
    """Exponential retry delay: 1, 2, 4, ... seconds, at most ``cap``."""
    return min(cap, base * 2 ** min(attempt, 16))


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def plain(value: Any) -> Any:
    """Deep copy of a mapping view (kopf's ``Body``) into plain dicts and lists."""
    if isinstance(value, Mapping):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value


@dataclasses.dataclass
class Record:
    """Everything seen of one recipe."""

    body: dict[str, Any] | None = None
    plan: Plan | None = None
    applied: Plan | None = None
    apply_error: ApplyError | None = None
    workload: dict[str, Any] | None = None
    pods: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def previous_refs(self) -> tuple[ObjectRef, ...]:
        """Children applied before: from memory, else from the status written last time."""
        if self.applied is not None:
            return self.applied.refs
        children = ((self.body or {}).get("status") or {}).get("children") or []
        return tuple(ObjectRef(c["apiVersion"], c["kind"], c["name"]) for c in children)

    def reconciled(self) -> bool:
        """Whether a reconcile of this controller has finished: applied the recipe, found it
        invalid, or failed to apply it. Until then the controller knows less than the status
        a previous operator wrote."""
        return (self.applied is not None or self.apply_error is not None
                or (self.plan is not None and not self.plan.valid))

    def observation(self) -> Observation:
        generation = ((self.body or {}).get("metadata") or {}).get("generation")
        workload = self.workload
        if workload is not None and self.applied is not None and self.applied.workload:
            wanted = self.applied.workload
            if (workload.get("kind"), workload["metadata"].get("name")) != (wanted.kind,
                                                                             wanted.name):
                workload = None  # a leftover of another kind, about to be pruned
        return Observation(generation=generation, plan=self.plan, applied=self.applied,
                           applied_refs=self.previous_refs(), apply_error=self.apply_error,
                           workload=workload,
                           pods=tuple(self.pods[name] for name in sorted(self.pods)))


class Controller:
    def __init__(self, cluster: Cluster, config: OperatorConfig,
                 metrics: OperatorMetrics | None = None,
                 clock: Callable[[], str] = utc_now):
        self.cluster = cluster
        self.config = config
        self.metrics = metrics or OperatorMetrics()
        self.records: dict[Key, Record] = {}
        self._published: dict[Key, dict[str, Any]] = {}
        self._locks: defaultdict[Key, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._clock = clock

    # ---- observations (called for every watch event) ----

    def observe_recipe(self, body: Mapping[str, Any], deleted: bool = False) -> Key:
        key = _key_of(body)
        if deleted:
            self.records.pop(key, None)
            self._published.pop(key, None)
        else:
            self.records.setdefault(key, Record()).body = plain(body)
        return key

    def observe_child(self, kind: str, body: Mapping[str, Any],
                      deleted: bool = False) -> Key | None:
        """Record a workload or pod of some recipe; returns that recipe's key."""
        meta = body.get("metadata") or {}
        recipe = (meta.get("labels") or {}).get(RECIPE_LABEL)
        if not recipe:
            return None
        key = (meta.get("namespace") or "default", recipe)
        if deleted and key not in self.records:
            return None  # a child of a deleted recipe, being garbage-collected
        record = self.records.setdefault(key, Record())
        if kind == "Pod":
            if deleted:
                record.pods.pop(meta.get("name"), None)
            else:
                record.pods[meta.get("name")] = plain(body)
        elif kind in WORKLOAD_KINDS:
            workload = {**plain(body), "kind": kind}
            if not deleted:
                record.workload = workload
            elif record.workload and record.workload["metadata"]["name"] == meta.get("name") \
                    and record.workload["kind"] == kind:
                record.workload = None
        return key

    # ---- actions ----

    async def reconcile(self, body: Mapping[str, Any], attempt: int = 0) -> Plan:
        """Apply the recipe's desired state; raise ``RetryLater`` when the API failed."""
        key = self.observe_recipe(body)
        record = self.records[key]
        plan = desired_state(record.body, self.config)
        record.plan = plan
        if not plan.valid:
            # Nothing is applied and nothing is retried: only a new spec can fix this.
            self.metrics.reconciles.labels("invalid").inc()
            await self.publish_status(key)
            return plan

        started = time.monotonic()
        try:
            for obj in plan.objects:
                live = await asyncio.to_thread(self.cluster.apply, obj)
                if obj["kind"] in WORKLOAD_KINDS:
                    self._observe_applied_workload(obj["kind"], live)
            for ref in set(record.previous_refs()) - set(plan.refs):
                await asyncio.to_thread(self.cluster.delete, ref, plan.namespace)
        except Exception as error:
            if not isinstance(error, ApiException) and not is_transient(error):
                raise
            transient = is_transient(error)
            record.apply_error = ApplyError(
                "ApplyRetrying" if transient else "ApplyFailed", describe(error))
            self.metrics.reconciles.labels("transient" if transient else "failed").inc()
            await self.publish_status(key)
            # Permanent failures (403 RBAC, 404 missing LeaderWorkerSet CRD, 422) are retried
            # slowly: a cluster change can cure them, and hammering the API cannot.
            delay = backoff(attempt, self.config.retry_base_seconds) if transient else 300.0
            raise RetryLater(f"{plan.namespace}/{plan.name}: {describe(error)}", delay) from error
        self.metrics.reconcile_seconds.observe(time.monotonic() - started)
        self.metrics.reconciles.labels("applied").inc()
        record.applied = plan
        record.apply_error = None
        await self.publish_status(key)
        return plan

    def _observe_applied_workload(self, kind: str, live: Any) -> None:
        """Take the workload as the apply answered it (the stored object, status included), so
        the status written right after the apply need not wait for the workload's watch event:
        after an operator restart that event may come later, and until then a serving recipe
        would read ``WorkloadMissing``, Ready=False."""
        if isinstance(live, Mapping) and isinstance(live.get("metadata"), Mapping):
            self.observe_child(kind, live)

    async def resync_forever(self, interval: float) -> None:
        """Re-apply every known recipe every ``interval`` seconds (``resync``), until cancelled."""
        while True:
            await asyncio.sleep(interval)
            await self.resync()

    async def resync(self) -> None:
        """Re-apply the desired state of every recipe seen, repairing children edited or deleted
        by hand. This runs here rather than as a kopf timer: kopf puts its finalizer on every
        object a timer serves, and that finalizer would hold each recipe in deletion for as long
        as the operator is not running (uninstalled, scaled down), although deletion needs
        nothing from it: the children go with the recipe through their owner references."""
        for key in list(self.records):
            record = self.records.get(key)
            body = record.body if record is not None else None
            if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
                continue
            try:
                await self.reconcile(body)
            except RetryLater as error:  # the next resync (or a watch event) tries again
                logger.warning("resync: %s", error)
            except Exception:  # one recipe's failure must not stop the others' resync
                logger.exception("resync of %s/%s failed", *key)

    async def publish_status(self, key: Key, attempt: int = 0) -> None:
        """Write the recipe's status if it differs from what the API server holds.

        Nothing is written until this controller's first reconcile of a recipe that already
        has a status has finished: a restarted operator sees each recipe, its workload and its
        pods before and while its resume reconcile applies, and knowing nothing applied yet it
        could only say Pending / NotApplied, flipping a serving recipe to Ready=False and
        erasing its renderedArgs, workload, appliedGeneration and warnings. The status a
        previous operator wrote stays until the reconcile's outcome replaces it. A new recipe,
        with no status yet, is still told at once that it is pending."""
        async with self._locks[key]:
            record = self.records.get(key)
            if record is None or record.body is None:
                return
            current = record.body.get("status") or {}
            if current and not record.reconciled():
                return
            previous = self._published.get(key, current)
            status = compute_status(record.observation(), previous, self._clock())
            if status == previous or status == current:
                self._published[key] = status
                return
            patch = {**{field: None for field in previous if field not in status}, **status}
            try:
                await asyncio.to_thread(self.cluster.patch_recipe_status, key[0], key[1], patch)
            except Exception as error:
                if isinstance(error, ApiException) and error.status == 404:
                    return  # the recipe is gone
                if not is_transient(error):
                    self.metrics.status_writes.labels("failed").inc()
                    logger.error("status of %s/%s not written: %s", *key, describe(error))
                    return
                self.metrics.status_writes.labels("retry").inc()
                self._retry_publish(key, attempt)
                return
            self.metrics.status_writes.labels("written").inc()
            self._published[key] = status
            self._count_ready()

    def _retry_publish(self, key: Key, attempt: int) -> None:
        loop = asyncio.get_running_loop()
        loop.call_later(backoff(attempt, self.config.retry_base_seconds, cap=30.0),
                        lambda: loop.create_task(self.publish_status(key, attempt + 1)))

    def _count_ready(self) -> None:
        counts = {"True": 0, "False": 0}
        for status in self._published.values():
            ready = next((c for c in status["conditions"] if c["type"] == "Ready"), None)
            counts["True" if ready and ready["status"] == "True" else "False"] += 1
        for value, count in counts.items():
            self.metrics.recipes.labels(value).set(count)


def _key_of(body: Mapping[str, Any]) -> Key:
    meta = body.get("metadata") or {}
    return meta.get("namespace") or "default", meta["name"]
