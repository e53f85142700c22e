"""Deployment options: what the operator needs beyond the recipe's SGLang launch.

Two sources. ``OperatorConfig`` is process-wide (image, probe budgets, drain time), set by the
chart through environment variables. ``DeploymentOptions`` is per recipe, read from
``m3.sglang.io/*`` annotations on the recipe object, because the recipe schema describes the
SGLang launch and is shared with the CLI, while replicas, image overrides and the model cache
only mean something on Kubernetes.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

from m3_operator.names import ANNOTATION_PREFIX

_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_WHOLE_NUMBER = re.compile(r"^[0-9]{1,9}$")  # ASCII digits only: "²".isdigit() is True
_ACCESS_MODES = ("ReadWriteMany", "ReadOnlyMany", "ReadWriteOnce", "ReadWriteOncePod")


@dataclasses.dataclass(frozen=True)
class OperatorConfig:
    """Process-wide settings; ``from_env`` reads the ``M3_OPERATOR_*`` variables."""

    server_image: str = "ghcr.io/sglang-m3/server:0.1.0"
    """Image with SGLang 0.5.23 and sglang-m3 installed; runs every server pod."""
    image_pull_policy: str = "IfNotPresent"
    field_manager: str = "m3-operator"
    """Server-side apply field manager; owns every field the operator sets."""
    startup_budget_seconds: int = 3600
    """How long a server may take to load weights before the startup probe gives up
    (854 GB of BF16 weights from a network volume take tens of minutes)."""
    pre_stop_seconds: int = 15
    """preStop sleep, so endpoints and load balancers stop sending before SIGTERM."""
    drain_seconds: int = 300
    """Time SGLang gets after SIGTERM to finish in-flight requests."""
    dist_port: int = 20000
    """Port of SGLang's multi-node rendezvous on the group leader (``--dist-init-addr``)."""
    resync_seconds: float = 600.0
    """Period of the re-apply that repairs drift (children edited or deleted by hand)."""
    request_timeout_seconds: float = 30.0
    """Read timeout of every API request the operator makes."""
    watch_timeout_seconds: float = 300.0
    """The server is asked to end each watch after this long; the client abandons a watch
    that has not ended 10% (at most 30 s) later, so a silently dead watch is re-opened."""
    retry_base_seconds: float = 1.0
    """First delay of the exponential backoff after a transient API error (doubles, max 60)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> OperatorConfig:
        """Override defaults with ``M3_OPERATOR_<FIELD>`` variables (upper-case field names)."""
        values = {}
        for field in dataclasses.fields(cls):
            raw = environ.get(f"M3_OPERATOR_{field.name.upper()}")
            if raw is None:
                continue
            kind = type(field.default)
            try:
                values[field.name] = kind(raw)
            except ValueError:
                raise ValueError(
                    f"M3_OPERATOR_{field.name.upper()}={raw!r}: expected {kind.__name__}"
                ) from None
        return cls(**values)

    @property
    def termination_grace_seconds(self) -> int:
        """Longer than preStop + drain, so the kubelet never kills a draining server."""
        return self.pre_stop_seconds + self.drain_seconds + 30


@dataclasses.dataclass(frozen=True)
class ModelCache:
    """A PVC holding the Hugging Face cache, filled once by a download Job."""

    size: str
    storage_class: str | None = None
    access_mode: str = "ReadWriteMany"


@dataclasses.dataclass(frozen=True)
class DeploymentOptions:
    """Per-recipe options from ``m3.sglang.io/<key>`` annotations."""

    replicas: int = 1
    """Serving replicas (pods for one node, leader-worker groups for several)."""
    image: str | None = None
    """Server image for this recipe; defaults to the operator's."""
    shm_size: str | None = None
    """Size limit of the memory-backed /dev/shm; defaults by hardware (see ``podspec``)."""
    model_cache: ModelCache | None = None


ANNOTATION_KEYS = {
    "replicas": "replicas",
    "image": "image",
    "shm-size": "shm_size",
    "model-cache-size": "model_cache.size",
    "model-cache-storage-class": "model_cache.storage_class",
    "model-cache-access-mode": "model_cache.access_mode",
}


def parse_deployment_options(annotations: Mapping[str, str]) -> tuple[DeploymentOptions, list[str]]:
    """Options from a recipe's annotations, and one problem line per bad annotation.

    Unknown ``m3.sglang.io/`` keys are problems too: a misspelt cache size must not silently
    deploy without a cache.
    """
    ours = {key[len(ANNOTATION_PREFIX):]: value for key, value in annotations.items()
            if key.startswith(ANNOTATION_PREFIX)}
    problems: list[str] = []

    def problem(key: str, text: str) -> None:
        problems.append(f"metadata.annotations[{ANNOTATION_PREFIX}{key}]: {text}")

    for key in sorted(set(ours) - set(ANNOTATION_KEYS)):
        problem(key, f"unknown option; known: {', '.join(ANNOTATION_KEYS)}")

    replicas = 1
    if "replicas" in ours:
        raw = ours["replicas"]
        if _WHOLE_NUMBER.match(raw) and int(raw) >= 1:
            replicas = int(raw)
        else:
            problem("replicas", f"must be a whole number >= 1, got {raw!r}")

    for key in ("shm-size", "model-cache-size"):
        if key in ours and not _QUANTITY.match(ours[key]):
            problem(key, f"must be a Kubernetes quantity such as 64Gi, got {ours[key]!r}")

    access_mode = ours.get("model-cache-access-mode", "ReadWriteMany")
    if access_mode not in _ACCESS_MODES:
        problem("model-cache-access-mode", f"must be one of {', '.join(_ACCESS_MODES)}, "
                                           f"got {access_mode!r}")
    cache_keys = {"model-cache-storage-class", "model-cache-access-mode"} & set(ours)
    if cache_keys and "model-cache-size" not in ours:
        problem(sorted(cache_keys)[0], "needs model-cache-size, which turns the cache on")

    image = ours.get("image")
    if image is not None and not image.strip():
        problem("image", "must not be empty")

    cache = None
    if "model-cache-size" in ours:
        cache = ModelCache(size=ours["model-cache-size"],
                           storage_class=ours.get("model-cache-storage-class"),
                           access_mode=access_mode)
    options = DeploymentOptions(replicas=replicas, image=image, shm_size=ours.get("shm-size"),
                                model_cache=cache)
    return options, problems
