"""Recovery paths: a watch that never ends is abandoned and re-opened, drift is repaired by
the periodic re-apply, and the admission webhook refuses what the reconciler would refuse."""

from __future__ import annotations

from pathlib import Path

import kopf
import pytest
from m3_operator_harness import NAMESPACE, RECIPE_PATH, eventually, recipe_body, running_operator

from m3_operator import runner, webhook
from m3_operator.options import OperatorConfig

recipe = recipe_body


def recipe_watches(api) -> int:
    return sum(1 for line in api.log
               if line.startswith("GET /apis/m3.sglang.io/v1alpha1/m3recipes?")
               and "watch=true" in line)


@pytest.mark.asyncio
@pytest.mark.timeout(600)
async def test_a_watch_that_never_ends_is_reopened(api, client):
    # kmock ignores timeoutSeconds, so its watches stay open and silent: a dead watch as far
    # as the operator can tell. The client-side timeout must close and re-open it.
    config = OperatorConfig(resync_seconds=0, watch_timeout_seconds=1, retry_base_seconds=0.1)
    async with running_operator(api, config):
        await eventually(lambda: recipe_watches(api) >= 3, what="re-opened watches")
        await client.create(RECIPE_PATH, recipe("late"))
        await eventually(lambda: client.get("apps/v1/deployments", "late"),
                         what="a recipe created after the reconnects to be reconciled")


@pytest.mark.asyncio
@pytest.mark.timeout(600)
async def test_drift_is_repaired_by_the_periodic_reapply(api, client):
    config = OperatorConfig(resync_seconds=1, retry_base_seconds=0.1)
    async with running_operator(api, config):
        await client.create(RECIPE_PATH, recipe("drift"))
        await eventually(lambda: client.get("v1/services", "drift"), what="the Service")
        await client.delete(f"/api/v1/namespaces/{NAMESPACE}/services/drift")
        assert client.get("v1/services", "drift") is None
        await eventually(lambda: client.get("v1/services", "drift"), what="the deleted Service to come back")

        await client.patch(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/drift",
                           {"spec": {"replicas": 5}})
        await eventually(lambda: client.get("apps/v1/deployments", "drift")["spec"][
            "replicas"] == 1, what="hand-edited replicas to be restored")


def test_operator_settings_bound_every_watch_and_request():
    settings = runner.operator_settings(OperatorConfig())
    assert settings.watching.server_timeout == 300
    assert 300 < settings.watching.client_timeout <= 330
    assert settings.networking.request_timeout == 30
    assert settings.peering.standalone is True


def test_webhook_refuses_what_the_reconciler_refuses():
    config = OperatorConfig()
    registry = kopf.OperatorRegistry()
    webhook.installer(9443, Path("tls.crt"), Path("tls.key"), config)(registry, None)
    [handler] = registry._webhooks.get_all_handlers()
    bad = recipe("bad")
    bad["spec"]["parallelism"]["tp"] = 3
    with pytest.raises(kopf.AdmissionError) as refused:
        handler.fn(body=bad)
    assert refused.value.code == 422 and "spec.parallelism" in str(refused.value)
    assert handler.fn(body=recipe("good")) is None
    assert webhook.admission_problems(recipe("good"), config) == []


def test_webhook_needs_its_certificate():
    with pytest.raises(SystemExit, match="--webhook-cert"):
        webhook.installer(9443, None, None, OperatorConfig())
