"""Names and labels of the objects the operator owns.

Labels are the operator's only link from a child back to its recipe that survives restarts
(owner references carry the UID, labels carry the name), so every child and every pod carries
``RECIPE_LABEL``. The Service selects ``ROLE_LABEL=leader`` only: in a multi-node group just
the leader runs SGLang's HTTP server.
"""

from __future__ import annotations

import re

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

#: The longest recipe name whose children all get valid names: the model-download Job
#: ``<name>-download-<10-hex hash>`` must fit 63 characters (it becomes a pod label), and a
#: LeaderWorkerSet ``<name>-lws`` names StatefulSets ``<name>-lws-<group>`` whose pods carry
#: ``controller-revision-hash: <statefulset>-<10 characters>``, also a 63-character label.
MAX_RECIPE_NAME = 43

_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


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


def name_problems(name: str) -> list[str]:
    """Why ``name`` cannot name the children (Service names must start with a letter)."""
    problems = []
    if not _DNS_1035.match(name):
        problems.append(
            "must start with a letter and hold only lower-case letters, digits and '-' "
            "(it names the Service, which Kubernetes requires to be a DNS-1035 label)")
    if len(name) > MAX_RECIPE_NAME:
        problems.append(
            f"at most {MAX_RECIPE_NAME} characters (the model-download Job and a multi-node "
            f"group's StatefulSets append suffixes, and their pod labels must fit 63), got {len(name)}")
    return problems


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
