"""The desired state of one recipe: a pure function from the recipe object to Kubernetes objects.

``desired_state`` reads nothing but its arguments and writes nothing, so the same recipe always
yields the same objects: golden tests pin them, the operator server-side-applies them, and
``sglang-m3 operator render`` prints them. An invalid recipe yields no objects at all, only
the problems, so nothing half-configured is ever applied.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import posixpath
import shlex
from collections.abc import Mapping
from typing import Any

from m3_operator import names
from m3_operator.options import DeploymentOptions, OperatorConfig, parse_deployment_options
from m3_operator.podspec import (
    CACHE_MOUNT,
    CACHE_VOLUME,
    HF_HOME,
    HTTP_PORT_NAME,
    download_mount,
    is_hub_id,
    operator_env_names,
    pod_template,
    ready_marker,
    weight_sources,
)
from m3_operator.recipe_api import (
    API_VERSION,
    KIND,
    LaunchSpec,
    Recipe,
    RecipeLoadError,
    get_profile,
    parse_recipe,
    render_launch,
    validate_recipe,
)

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
#: Kubernetes expands ``$(VAR)`` from the container's environment; LeaderWorkerSet injects
#: these variables into every pod of a group.
LWS_WORKER_INDEX = "$(LWS_WORKER_INDEX)"
LWS_LEADER_ADDRESS = "$(LWS_LEADER_ADDRESS)"


@dataclasses.dataclass(frozen=True)
class ObjectRef:
    """Identity of one child: enough to prune it when it is no longer desired."""

    api_version: str
    kind: str
    name: str

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> ObjectRef:
        return cls(obj["apiVersion"], obj["kind"], obj["metadata"]["name"])

    def as_dict(self) -> dict[str, str]:
        return {"apiVersion": self.api_version, "kind": self.kind, "name": self.name}


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything the operator derives from one version of a recipe."""

    name: str
    namespace: str
    generation: int | None
    problems: tuple[str, ...] = ()
    """Errors that stop the deployment, each naming its field."""
    warnings: tuple[str, ...] = ()
    objects: tuple[dict[str, Any], ...] = ()
    """Children to apply, in dependency order; empty when there are problems."""
    rendered_args: tuple[str, ...] = ()
    """SGLang arguments of the serving (leader) container."""
    workload: ObjectRef | None = None
    replicas: int = 0

    @property
    def valid(self) -> bool:
        return not self.problems

    @property
    def refs(self) -> tuple[ObjectRef, ...]:
        return tuple(ObjectRef.of(obj) for obj in self.objects)


def desired_state(body: Mapping[str, Any], config: OperatorConfig) -> Plan:
    """The objects recipe object ``body`` asks for, or the problems that prevent them."""
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        metadata = {}  # parse_recipe refuses it below, naming metadata
    name = metadata.get("name", "")
    namespace = metadata.get("namespace") or "default"
    generation = metadata.get("generation")
    base = Plan(name=name, namespace=namespace, generation=generation)

    try:
        recipe = parse_recipe(dict(body), source=f"{KIND} {namespace}/{name}")
    except RecipeLoadError as error:
        return dataclasses.replace(base, problems=tuple(str(p) for p in error.problems))

    findings = validate_recipe(recipe)
    problems = [str(f) for f in findings if f.severity == "error"]
    warnings = tuple(str(f) for f in findings if f.severity != "error")
    problems += _network_problems(recipe, config)
    options, option_problems = parse_deployment_options(metadata.get("annotations") or {})
    problems += option_problems
    cached = options.model_cache is not None
    if cached:
        problems += _cache_problems(recipe)
    problems += _hidden_weight_problems(recipe, cached)
    problems += _env_problems(recipe, options)
    if problems:
        return dataclasses.replace(base, problems=tuple(problems), warnings=warnings)

    objects, launch = _children(recipe, name, namespace, config, options)
    owner = _owner_reference(name, metadata.get("uid"))
    for obj in objects:
        obj["metadata"]["namespace"] = namespace
        if owner is not None:
            obj["metadata"]["ownerReferences"] = [owner]
    workload = ObjectRef.of(next(o for o in objects if o["kind"] in ("Deployment",
                                                                   "LeaderWorkerSet")))
    return dataclasses.replace(base, warnings=warnings, objects=tuple(objects),
                               rendered_args=tuple(launch.argv), workload=workload,
                               replicas=options.replicas)


#: Listen addresses that only the pod itself can reach.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def _network_problems(recipe: Recipe, config: OperatorConfig) -> list[str]:
    """What a laptop recipe may say but a pod cannot serve: the kubelet's probes and the Service
    connect to the pod IP, and a multi-node group's rendezvous binds the distributed port."""
    serving, problems = recipe.spec.serving, []
    if serving.host in LOOPBACK_HOSTS:
        problems.append(f"spec.serving.host: {serving.host} is reachable from inside the pod only (probes and "
                        f"the Service connect to the pod IP); set host: 0.0.0.0")
    if recipe.spec.hardware.nodes > 1 and serving.port == config.dist_port:
        problems.append(f"spec.serving.port: {serving.port} is the multi-node rendezvous port (--dist-init-addr, "
                        f"the operator's distPort), which SGLang binds on the leader; choose another port")
    return problems


def _env_problems(recipe: Recipe, options: DeploymentOptions) -> list[str]:
    """Kubernetes keys a container's env by name: one set both by the recipe and by the operator
    appears twice, which server-side apply refuses (and a plain write lets one silently win)."""
    owned = operator_env_names(recipe, cached=options.model_cache is not None)
    return [f"spec.env.{name}: the operator sets {name} in the server pod itself (model cache and "
            f"download location); remove it from env" for name in sorted(owned & set(recipe.spec.env))]


def _children(recipe: Recipe, name: str, namespace: str, config: OperatorConfig,
              options: DeploymentOptions) -> tuple[list[dict[str, Any]], LaunchSpec]:
    profile = get_profile(recipe.spec.hardware.profile)
    multi_node = recipe.spec.hardware.nodes > 1
    if multi_node:
        launch = render_launch(recipe, node_rank=LWS_WORKER_INDEX,
                               dist_init_addr=f"{LWS_LEADER_ADDRESS}:{config.dist_port}")
    else:
        launch = render_launch(recipe)
    cache_hash = _cache_hash(recipe) if options.model_cache is not None else None

    def template(role: str) -> dict[str, Any]:
        return pod_template(name=name, role=role, recipe=recipe, profile=profile, launch=launch,
                            config=config, options=options, cache_hash=cache_hash,
                            multi_node=multi_node)

    objects: list[dict[str, Any]] = []
    if cache_hash is not None:
        objects += _model_cache(recipe, name, config, options, cache_hash)
    if multi_node:
        objects.append(_leader_worker_set(name, recipe, options, template))
    else:
        objects.append(_deployment(name, options, template(names.LEADER)))
    objects.append(_service(name, recipe))
    objects.append(_disruption_budget(name))
    return objects, launch


def _meta(name: str, recipe_name: str, component: str = "server") -> dict[str, Any]:
    return {"name": name, "labels": names.recipe_labels(recipe_name, component)}


def _deployment(name: str, options: DeploymentOptions, template: dict) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, name),
        "spec": {
            "replicas": options.replicas,
            "selector": {"matchLabels": names.pod_selector(name, names.LEADER)},
            # GPU nodes rarely have room for a surge pod: replace in place instead.
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "template": template,
        },
    }


def _leader_worker_set(name: str, recipe: Recipe, options: DeploymentOptions,
                       template) -> dict[str, Any]:
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": _meta(names.leader_worker_set(name), name),
        "spec": {
            "replicas": options.replicas,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": {"maxUnavailable": 1,
                                                               "maxSurge": 0}},
            "leaderWorkerTemplate": {
                "size": recipe.spec.hardware.nodes,
                # One rank failing breaks the NCCL group: restart the whole group together.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": template(names.LEADER),
                "workerTemplate": template(names.WORKER),
            },
        },
    }


def _service(name: str, recipe: Recipe) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(name, name),
        "spec": {
            "type": "ClusterIP",
            "selector": names.pod_selector(name, names.LEADER),
            "ports": [{"name": HTTP_PORT_NAME, "port": recipe.spec.serving.port,
                       "targetPort": HTTP_PORT_NAME, "protocol": "TCP"}],
        },
    }


def _disruption_budget(name: str) -> dict[str, Any]:
    # One pod at a time: in a multi-node group any eviction restarts the whole group, so
    # this also bounds voluntary disruption to one group. Only the serving pods: the model
    # download Job's pod has no scalable controller, and a maxUnavailable budget over it
    # allows no disruption at all (it blocks every node drain).
    selector = {**names.pod_selector(name), names.COMPONENT_LABEL: "server"}
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(name, name),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}},
    }


def _model_cache(recipe: Recipe, name: str, config: OperatorConfig,
                 options: DeploymentOptions, cache_hash: str) -> list[dict[str, Any]]:
    cache = options.model_cache
    assert cache is not None
    claim_spec: dict[str, Any] = {"accessModes": [cache.access_mode],
                                  "resources": {"requests": {"storage": cache.size}}}
    if cache.storage_class:
        claim_spec["storageClassName"] = cache.storage_class
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
             "metadata": _meta(names.model_cache_claim(name), name, "model-cache"),
             "spec": claim_spec}

    # Only hub ids: a local or object-store draft is read where it is (``hf download`` refuses
    # it, and under ``set -e`` the ready marker would never be written).
    downloads = [_download_command(path, revision)
                 for _, path, revision in weight_sources(recipe) if is_hub_id(path)]
    script = " && ".join(["set -e", *downloads, f"touch {shlex.quote(ready_marker(cache_hash))}"])
    job_name = names.model_download_job(name, cache_hash)
    job_labels = names.recipe_labels(name, "model-cache")
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _meta(job_name, name, "model-cache"),
        "spec": {
            "backoffLimit": 6,
            "template": {
                "metadata": {"labels": job_labels},
                "spec": {
                    "restartPolicy": "OnFailure",
                    "containers": [{
                        "name": "download",
                        "image": options.image or config.server_image,
                        "imagePullPolicy": config.image_pull_policy,
                        "command": ["/bin/sh", "-c", script],
                        "env": [{"name": "HF_HOME", "value": HF_HOME}],
                        "volumeMounts": [{"name": CACHE_VOLUME, "mountPath": CACHE_MOUNT}],
                    }],
                    "volumes": [{"name": CACHE_VOLUME, "persistentVolumeClaim": {
                        "claimName": names.model_cache_claim(name)}}],
                },
            },
        },
    }
    return [claim, job]


def _download_command(repo: str, revision: str | None) -> str:
    command = ["hf", "download", repo]
    if revision:
        command += ["--revision", revision]
    return shlex.join(command)


def _cache_hash(recipe: Recipe) -> str:
    """Short digest of what the cache must hold; a change means a new download."""
    spec = recipe.spec
    draft = spec.speculative.draft_model if spec.speculative else None
    content = {"model": [spec.model.path, spec.model.revision],
               "draft": [draft.path, draft.revision] if draft else None}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:10]


def _cache_problems(recipe: Recipe) -> list[str]:
    path = recipe.spec.model.path
    if not is_hub_id(path):
        return [f"spec.model.path: the model cache downloads a Hugging Face hub id "
                f"(owner/name), got {path!r}; drop the {names.ANNOTATION_PREFIX}"
                f"model-cache-size annotation for local or built-in models"]
    return []


def _hidden_weight_problems(recipe: Recipe, cached: bool) -> list[str]:
    """A local model or draft inside the folder where the pod mounts its download volume cannot
    be served: the volume hides what the image holds there, and SGLang finds no weights."""
    mount = download_mount(recipe, cached)
    if mount is None:
        return []
    volume = (f"the model cache ({names.ANNOTATION_PREFIX}model-cache-size)" if cached
              else "the volume its hub downloads go to")
    return [f"{field}: {path!r} is inside {mount}, where the server pod mounts {volume}, which "
            f"hides it; keep local weights outside {mount}, or name them by hub id"
            for field, path, _ in weight_sources(recipe)
            if not is_hub_id(path) and _is_within(path, mount)
            and not (cached and field == "spec.model.path")]  # refused by _cache_problems


def _is_within(path: str, folder: str) -> bool:
    """Whether absolute ``path`` is ``folder`` or lies below it (``/models/../x`` does not)."""
    normal = posixpath.normpath(path)
    return normal == folder or normal.startswith(folder + "/")


def _owner_reference(name: str, uid: str | None) -> dict[str, Any] | None:
    if not uid:
        return None
    return {"apiVersion": API_VERSION, "kind": KIND, "name": name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}
