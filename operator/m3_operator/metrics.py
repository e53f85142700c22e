"""Prometheus metrics of the operator, served on ``/metrics`` (the chart scrapes it).

Kept on a registry of its own so tests can create and read it without global state.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.reconciles = Counter(
            "m3_operator_reconciles", "Reconciliations of M3Recipe objects by outcome.",
            ["outcome"], registry=self.registry)
        self.reconcile_seconds = Histogram(
            "m3_operator_reconcile_seconds", "Time to apply one recipe's desired objects.",
            registry=self.registry)
        self.status_writes = Counter(
            "m3_operator_status_writes", "Status subresource patches by outcome.",
            ["outcome"], registry=self.registry)
        self.recipes = Gauge(
            "m3_operator_recipes", "Known M3Recipe objects by their Ready condition.",
            ["ready"], registry=self.registry)

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)
