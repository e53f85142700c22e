"""Start the operator: kopf settings, credentials, metrics, and the event loop.

Settings that matter for robustness: every watch asks the server to close it after
``watch_timeout_seconds`` and the client gives up a little later, so a watch that silently
died is re-established instead of waiting forever; API errors are retried
with backoff; kopf keeps its bookkeeping in annotations under the operator's own prefix, so
the status holds only what the CRD declares.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from typing import Any

import kopf

from m3_operator import handlers
from m3_operator.controller import Controller
from m3_operator.kube import Cluster, api_client_for
from m3_operator.metrics import OperatorMetrics
from m3_operator.names import KOPF_ANNOTATION_PREFIX
from m3_operator.options import OperatorConfig

logger = logging.getLogger(__name__)


def operator_settings(config: OperatorConfig) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    timeout = config.watch_timeout_seconds
    settings.watching.server_timeout = max(1, int(timeout))
    settings.watching.client_timeout = timeout + min(30.0, timeout / 10)
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = config.request_timeout_seconds
    settings.networking.connect_timeout = 10
    settings.networking.error_backoffs = (1, 2, 4, 8, 16, 30)
    # One operator replica (the chart's Deployment uses the Recreate strategy).
    settings.peering.standalone = True
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=KOPF_ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=KOPF_ANNOTATION_PREFIX, key="last-handled-configuration")
    settings.posting.reporting_component = "m3-operator"
    return settings


def build(config: OperatorConfig, *, api_host: str | None = None,
          metrics: OperatorMetrics | None = None,
          ) -> tuple[kopf.OperatorRegistry, Controller]:
    """A registry with the operator's handlers and the controller behind them."""
    cluster = Cluster(api_client_for(api_host), config.field_manager,
                      config.request_timeout_seconds)
    controller = Controller(cluster, config, metrics)
    registry = kopf.OperatorRegistry()
    handlers.register(registry, controller, config.resync_seconds)
    return registry, controller


async def run(
    config: OperatorConfig,
    *,
    namespaces: Collection[str] = (),
    api_host: str | None = None,
    login: Callable[..., Any] | None = None,
    metrics_port: int | None = None,
    liveness_endpoint: str | None = None,
    stop_flag: asyncio.Event | None = None,
    ready_flag: asyncio.Event | None = None,
    registry_hook: Callable[[kopf.OperatorRegistry, Controller], None] | None = None,
) -> None:
    """Run until ``stop_flag`` is set (or forever). No namespaces means cluster-wide."""
    metrics = OperatorMetrics()
    registry, controller = build(config, api_host=api_host, metrics=metrics)
    if login is not None:
        kopf.on.login(registry=registry)(login)
    else:
        kopf.on.login(registry=registry)(kopf.login_via_client)
    if registry_hook is not None:
        registry_hook(registry, controller)
    if metrics_port is not None:
        metrics.serve(metrics_port)
    await kopf.operator(
        registry=registry,
        settings=operator_settings(config),
        clusterwide=not namespaces,
        namespaces=list(namespaces),
        liveness_endpoint=liveness_endpoint,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )
