"""200 recipes reconcile to a steady state (the time taken is printed, not asserted)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from m3_operator_harness import (
    NAMESPACE,
    RECIPE_PATH,
    RECIPES,
    condition,
    eventually,
    recipe_body,
    running_operator,
)

from m3_operator.options import OperatorConfig

COUNT = int(os.environ.get("M3_OPERATOR_SCALE_COUNT", "200"))


@pytest.mark.asyncio
@pytest.mark.timeout(1800)
async def test_200_recipes_reach_steady_state(api, client):
    names = [f"r{index:03d}" for index in range(COUNT)]
    config = OperatorConfig(resync_seconds=0, retry_base_seconds=0.1)
    async with running_operator(api, config):
        started = time.monotonic()
        for name in names:
            await client.create(RECIPE_PATH, recipe_body(name))

        def all_applied():
            recipes = client.stored(RECIPES)
            return (all(recipes[name].get("status", {}).get("appliedGeneration") == 1
                        for name in names)
                    and client.names("apps/v1/deployments") >= set(names)
                    and client.names("v1/services") >= set(names)
                    and client.names("policy/v1/poddisruptionbudgets") >= set(names))

        def all_ready():
            recipes = client.stored(RECIPES)
            return all((condition(recipes[name], "Ready") or {}).get("status") == "True"
                       for name in names)

        await eventually(all_applied, timeout=600, interval=0.5, what=f"{COUNT} recipes applied")
        applied = time.monotonic() - started

        for name in names:  # the Deployment controller reports every pod ready
            await client.patch(
                f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{name}/status",
                {"status": {"readyReplicas": 1, "observedGeneration": 1}})
        await eventually(all_ready, timeout=600, interval=0.5, what=f"{COUNT} recipes Ready")
        ready = time.monotonic() - started

        # Steady: with nothing changing, the operator writes nothing.
        writes = len(api.writes)
        await asyncio.sleep(1.0)
        assert api.writes[writes:] == []
    print(f"\n{COUNT} recipes: all applied after {applied:.1f} s, all Ready after {ready:.1f} s "
          f"(kmock emulator and operator sharing this machine's 2 cores)")
