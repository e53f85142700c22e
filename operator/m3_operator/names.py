"""Names and labels of the objects the operator owns.

Labels are the operator's only link from a child back to its recipe that survives restarts
(owner references carry the UID, labels carry the name), so every child and every pod carries
``RECIPE_LABEL``. The Service selects ``ROLE_LABEL=leader`` only: in a multi-node group just
the leader runs SGLang's HTTP server.
"""

from __future__ import annotations

from m3_operator import recipe_api
from m3_operator.recipe_api import GROUP

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "m3-operator"
NAME_LABEL = "app.kubernetes.io/name"
APP_NAME = "sglang-m3"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
RECIPE_LABEL = f"{GROUP}/recipe"
ROLE_LABEL = f"{GROUP}/role"

LEADER = "leader"
WORKER = "worker"

#: Annotations through which a recipe object asks for deployment options (see ``options``).
ANNOTATION_PREFIX = f"{GROUP}/"

#: kopf bookkeeping annotations live under the operator's own prefix, not kopf's default.
KOPF_ANNOTATION_PREFIX = f"operator.{GROUP}"

#: Longest recipe name the operator is given: the recipe layer refuses longer ones (and so does
#: the CRD), sized so that the suffixes of ``model_download_job`` and ``leader_worker_set`` keep
#: every child's name and pod labels within 63 characters. Change a suffix and the limit together.
MAX_RECIPE_NAME = recipe_api.MAX_RECIPE_NAME


def recipe_labels(name: str, component: str = "server") -> dict[str, str]:
    """Labels on every child of recipe ``name``."""
    return {
        NAME_LABEL: APP_NAME,
        INSTANCE_LABEL: name,
        COMPONENT_LABEL: component,
        MANAGED_BY_LABEL: MANAGED_BY,
        RECIPE_LABEL: name,
    }


def pod_selector(name: str, role: str | None = None) -> dict[str, str]:
    """Label selector for the pods of recipe ``name`` (optionally of one role)."""
    selector = {INSTANCE_LABEL: name, RECIPE_LABEL: name}
    if role is not None:
        selector[ROLE_LABEL] = role
    return selector


def leader_worker_set(name: str) -> str:
    """The LeaderWorkerSet of recipe ``name``. Not ``name`` itself: LeaderWorkerSet creates a
    headless Service named after itself, through which ``LWS_LEADER_ADDRESS``
    (``<lws>-<group>.<lws>.<namespace>``) resolves, and ``name`` is the recipe's own Service."""
    return f"{name}-lws"


def model_cache_claim(name: str) -> str:
    return f"{name}-model-cache"


def model_download_job(name: str, content_hash: str) -> str:
    # The hash is part of the name because a Job's pod template is immutable: new weights
    # need a new Job, and the old one is pruned.
    return f"{name}-download-{content_hash}"
