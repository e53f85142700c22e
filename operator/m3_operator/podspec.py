"""Pod templates for SGLang servers: container, probes, /dev/shm, scheduling, model cache.

The choices here are the deployment lessons collected in M3_FACTS s.6: probes with budgets
long enough for M3 weight loading, a memory-backed /dev/shm for NCCL, a preStop pause and a
grace period longer than SGLang's drain, and GPU resources, node selector and tolerations
taken from the hardware catalog rather than written into each recipe. A recipe that offloads KV
to host memory also requests that memory, so the pod lands on a node that has it.
"""

from __future__ import annotations

import math
import shlex
from typing import Any

import yaml

from m3_operator.names import LEADER, ROLE_LABEL, model_cache_claim, recipe_labels
from m3_operator.options import DeploymentOptions, OperatorConfig
from m3_operator.recipe_api import TINY_MODEL_PATH, HardwareProfile, LaunchSpec, Recipe, dump_recipe

CONTAINER_NAME = "sglang"
HTTP_PORT_NAME = "http"
DIST_PORT_NAME = "dist"
SHM_VOLUME = "dshm"
CACHE_VOLUME = "model-cache"
CACHE_MOUNT = "/models"
#: Hugging Face cache inside the model-cache volume. Servers find hub ids there, so the
#: rendered ``--model-path`` stays the hub id and needs no rewriting.
HF_HOME = f"{CACHE_MOUNT}/hf"
PROBE_PERIOD_SECONDS = 10
#: Variable through which a tiny-model pod receives its recipe (see ``server_command``).
RECIPE_ENV = "M3_RECIPE"


def shm_size(profile: HardwareProfile, options: DeploymentOptions) -> str:
    """NCCL's shared-memory transport needs GBs on GPU nodes; the CPU tiny model does not."""
    if options.shm_size:
        return options.shm_size
    return "32Gi" if profile.is_gpu else "1Gi"


def gpus_per_node(recipe: Recipe, profile: HardwareProfile) -> int:
    return recipe.spec.hardware.gpus_per_node or profile.gpus_per_node


def host_offload_memory(recipe: Recipe) -> str | None:
    """Host memory the ranks of one pod pin for KV offload (``hostOffload.sizeGbPerRank`` per
    rank), as a memory request: the scheduler then places the pod only on a node with that much
    unreserved, and under memory pressure the kubelet evicts pods that exceed their requests
    before this one. No limit: the server's own host memory (checkpoint reads, tokenizer,
    Python) comes on top, and a limit at the pinned size would get it OOM-killed. ``G`` is
    10**9 bytes, the unit of sizeGbPerRank."""
    offload = recipe.spec.host_offload
    if offload is None or offload.size_gb_per_rank is None:
        return None
    parallel = recipe.spec.parallelism
    ranks_per_pod = parallel.tp * parallel.pp * parallel.dp // recipe.spec.hardware.nodes
    return f"{ranks_per_pod * offload.size_gb_per_rank}G"


def is_hub_id(path: str) -> bool:
    """Whether SGLang downloads ``path`` from the Hugging Face hub (``owner/name``), rather than
    reading a directory in the image (``/models/m3``, ``./m3``), an object store (``s3://...``)
    or the embedded tiny model. Only a download needs the writable cache volume: mounted over a
    local path's folder (``/models``), it would hide the weights the image holds there."""
    return not path.startswith(("/", ".", "~")) and ":" not in path


def ready_marker(content_hash: str) -> str:
    """File the download Job writes last; servers start only once it exists."""
    return f"{CACHE_MOUNT}/.ready-{content_hash}"


def pod_template(
    *,
    name: str,
    role: str,
    recipe: Recipe,
    profile: HardwareProfile,
    launch: LaunchSpec,
    config: OperatorConfig,
    options: DeploymentOptions,
    cache_hash: str | None,
    multi_node: bool,
) -> dict[str, Any]:
    """PodTemplateSpec of one server role: ``leader`` serves HTTP, ``worker`` only joins."""
    image = options.image or config.server_image
    serves_http = role == LEADER
    port = recipe.spec.serving.port

    env = [{"name": key, "value": value} for key, value in sorted(launch.env.items())]
    downloads_in_pod = cache_hash is None and is_hub_id(recipe.spec.model.path)
    if cache_hash is not None:
        env += [{"name": "HF_HOME", "value": HF_HOME}, {"name": "HF_HUB_OFFLINE", "value": "1"}]
    elif downloads_in_pod:
        env.append({"name": "HF_HOME", "value": HF_HOME})
    command, args, command_env = server_command(recipe, launch)

    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": image,
        "imagePullPolicy": config.image_pull_policy,
        "command": command,
        "args": args,
        "env": env + command_env,
        "ports": [],
        "volumeMounts": [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}],
        "lifecycle": {"preStop": {"exec": {
            "command": ["/bin/sh", "-c", f"sleep {config.pre_stop_seconds}"]}}},
    }
    if serves_http:
        container["ports"].append(
            {"name": HTTP_PORT_NAME, "containerPort": port, "protocol": "TCP"})
        container.update(_probes(config))
    if multi_node and serves_http:
        container["ports"].append(
            {"name": DIST_PORT_NAME, "containerPort": config.dist_port, "protocol": "TCP"})
    for key in ("args", "env", "ports"):
        if not container[key]:
            del container[key]
    if profile.resource_name is not None:
        count = str(gpus_per_node(recipe, profile))
        container["resources"] = {"limits": {profile.resource_name: count},
                                  "requests": {profile.resource_name: count}}
    host_memory = host_offload_memory(recipe)
    if host_memory is not None:
        container.setdefault("resources", {}).setdefault("requests", {})["memory"] = host_memory
    if cache_hash is not None or downloads_in_pod:
        container["volumeMounts"].append({"name": CACHE_VOLUME, "mountPath": CACHE_MOUNT})

    spec: dict[str, Any] = {
        "containers": [container],
        "terminationGracePeriodSeconds": config.termination_grace_seconds,
        "nodeSelector": {profile.node_label[0]: profile.node_label[1]},
        "volumes": [{"name": SHM_VOLUME,
                     "emptyDir": {"medium": "Memory", "sizeLimit": shm_size(profile, options)}}],
        "enableServiceLinks": False,
    }
    if profile.resource_name is not None:
        # GPU node pools are commonly tainted with the device plugin's resource name.
        spec["tolerations"] = [{"key": profile.resource_name, "operator": "Exists",
                                "effect": "NoSchedule"}]
    if cache_hash is not None:
        spec["initContainers"] = [_wait_for_model(image, config, cache_hash)]
        spec["volumes"].append({"name": CACHE_VOLUME,
                                "persistentVolumeClaim": {"claimName": model_cache_claim(name)}})
    elif downloads_in_pod:
        # Without the shared cache each pod downloads the weights itself. Into the container's
        # writable layer, a restart (the startup probe's, when download and load outlast its
        # budget) would throw the download away and start over, for ever; an emptyDir lives
        # as long as the pod, so the restarted container resumes from what is there.
        spec["volumes"].append({"name": CACHE_VOLUME, "emptyDir": {}})

    labels = recipe_labels(name)
    labels[ROLE_LABEL] = role
    return {"metadata": {"labels": labels}, "spec": spec}


def server_command(recipe: Recipe,
                   launch: LaunchSpec) -> tuple[list[str], list[str], list[dict[str, str]]]:
    """(command, args, extra env) of the server container.

    SGLang's own launcher runs every real model with the rendered arguments. The embedded tiny
    model exists only once ``sglang-m3 serve`` has built it, so for it the pod hands the recipe
    to ``sglang-m3 serve``, which renders the same arguments with the built checkpoint's path.
    """
    if recipe.spec.model.path != TINY_MODEL_PATH:
        return ["python3", "-m", "sglang.launch_server"], list(launch.argv), []
    # Every field as the recipe holds it (``reasoning: none`` included): the pod must serve the
    # very launch the operator rendered.
    document = dump_recipe(recipe)
    document["metadata"] = {"name": recipe.metadata.name}
    script = f'printf "%s" "${RECIPE_ENV}" > /tmp/recipe.yaml && exec sglang-m3 serve /tmp/recipe.yaml'
    return (["/bin/sh", "-c", script], [],
            [{"name": RECIPE_ENV, "value": yaml.safe_dump(document, sort_keys=False)}])


def operator_env_names(recipe: Recipe, cached: bool) -> set[str]:
    """Environment variables the server container gets from the operator itself (besides the
    rendered launch's): a recipe's ``spec.env`` naming one would put the name in the pod twice."""
    names = {"HF_HOME", "HF_HUB_OFFLINE"} if cached else set()
    if recipe.spec.model.path == TINY_MODEL_PATH:
        names.add(RECIPE_ENV)
    elif not cached and is_hub_id(recipe.spec.model.path):
        names.add("HF_HOME")
    return names


def _probes(config: OperatorConfig) -> dict[str, Any]:
    """SGLang answers /health with 503 until the weights are loaded, then with a one-token
    generation; the startup probe holds the other two off for the whole loading budget."""
    def probe(period: int, timeout: int, failures: int) -> dict[str, Any]:
        return {"httpGet": {"path": "/health", "port": HTTP_PORT_NAME},
                "periodSeconds": period, "timeoutSeconds": timeout,
                "failureThreshold": failures}

    startup_failures = math.ceil(config.startup_budget_seconds / PROBE_PERIOD_SECONDS)
    return {
        "startupProbe": probe(PROBE_PERIOD_SECONDS, 5, startup_failures),
        "readinessProbe": probe(PROBE_PERIOD_SECONDS, 10, 3),
        "livenessProbe": probe(30, 30, 5),
    }


def _wait_for_model(image: str, config: OperatorConfig, cache_hash: str) -> dict[str, Any]:
    marker = shlex.quote(ready_marker(cache_hash))
    return {
        "name": "wait-for-model",
        "image": image,
        "imagePullPolicy": config.image_pull_policy,
        "command": ["/bin/sh", "-c",
                    f"until [ -f {marker} ]; do echo waiting for the model download; "
                    f"sleep 10; done"],
        "volumeMounts": [{"name": CACHE_VOLUME, "mountPath": CACHE_MOUNT, "readOnly": True}],
    }

