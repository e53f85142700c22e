"""Pod templates for SGLang servers: container, probes, /dev/shm, scheduling, model cache.

The choices here are the deployment lessons collected in M3_FACTS s.6: probes with budgets
long enough for M3 weight loading, a memory-backed /dev/shm for NCCL, a preStop pause and a
grace period longer than SGLang's drain, and GPU resources, node selector and tolerations
taken from the hardware catalog rather than written into each recipe. The pod requests the host
memory it holds for sure (KV offload, /dev/shm, a floor per process) and, when it downloads the
weights itself, the disk they take, so it lands on a node that has them.
"""

from __future__ import annotations

import math
import shlex
from typing import Any

import yaml

from m3_operator.names import LEADER, ROLE_LABEL, model_cache_claim, recipe_labels
from m3_operator.options import DeploymentOptions, OperatorConfig
from m3_operator.recipe_api import (
    DRAFT_WEIGHT_BYTES,
    TINY_MODEL_PATH,
    WEIGHT_BYTES,
    HardwareProfile,
    LaunchSpec,
    Recipe,
    dump_recipe,
)

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
#: Host memory requested for each SGLang process of a pod, a floor rather than its peak:
#: importing torch and SGLang's scheduler alone holds 0.9 GB (RSS, measured on the CPU);
#: the CUDA context and load buffers come on top, from the node's headroom (no limit is set).
PROCESS_MEMORY_FLOOR = 2**30
#: SGLang processes of a pod besides one scheduler per rank: tokenizer manager and detokenizer.
FRONTEND_PROCESSES = 2
_QUANTITY_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
                   "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
                   "Pi": 2**50, "Ei": 2**60}


def shm_size(profile: HardwareProfile, options: DeploymentOptions) -> str:
    """NCCL's shared-memory transport needs GBs on GPU nodes; the CPU tiny model does not."""
    if options.shm_size:
        return options.shm_size
    return "32Gi" if profile.is_gpu else "1Gi"


def gpus_per_node(recipe: Recipe, profile: HardwareProfile) -> int:
    return recipe.spec.hardware.gpus_per_node or profile.gpus_per_node


def ranks_per_pod(recipe: Recipe) -> int:
    """SGLang ranks (one process each) in one pod: a multi-node group spreads them evenly."""
    parallel = recipe.spec.parallelism
    return parallel.tp * parallel.pp * parallel.dp // recipe.spec.hardware.nodes


def host_offload_memory(recipe: Recipe) -> int:
    """Bytes of host memory the ranks of one pod pin for KV offload (``hostOffload.sizeGbPerRank``
    per rank; ``G`` is 10**9 bytes, its unit), 0 without offload."""
    offload = recipe.spec.host_offload
    if offload is None or offload.size_gb_per_rank is None:
        return 0
    return ranks_per_pod(recipe) * offload.size_gb_per_rank * 10**9


def memory_request(recipe: Recipe, profile: HardwareProfile, options: DeploymentOptions) -> str:
    """Host memory the pod holds for sure, as the serving container's memory request: the KV
    offload its ranks pin, the memory-backed /dev/shm (charged to the pod as it fills), and
    ``PROCESS_MEMORY_FLOOR`` per SGLang process. Any memory request lifts the pod out of the
    BestEffort class, the kubelet's first eviction target under node memory pressure, while
    SGLang holds tens to hundreds of GB of host RAM loading; the scheduler then places the pod
    only where that much is unreserved. No limit: what loading needs on top varies, and a limit
    would turn it into an OOM kill."""
    processes = ranks_per_pod(recipe) + FRONTEND_PROCESSES
    total = (host_offload_memory(recipe) + quantity_bytes(shm_size(profile, options))
             + processes * PROCESS_MEMORY_FLOOR)
    return f"{math.ceil(total / 2**30)}Gi"


def download_storage(recipe: Recipe) -> str:
    """Disk an in-pod download fills, as an ephemeral-storage request: the checkpoint bytes
    ``sglang-m3 inspect`` measured for the model's variant, and the EAGLE3 draft's, for each hub
    id. The emptyDir's usage counts against the pod's ephemeral storage, so the scheduler places
    the pod only on a node with that much disk free. No sizeLimit: ``hf download`` fetches a
    repository's every file, which may be more than the weights, and exceeding a sizeLimit
    evicts the pod, whose next pod would download again."""
    total = sum(DRAFT_WEIGHT_BYTES if field.startswith("spec.speculative")
                else WEIGHT_BYTES[recipe.spec.model.variant]
                for field, path, _ in weight_sources(recipe) if is_hub_id(path))
    return f"{math.ceil(total / 10**9)}G"


def quantity_bytes(quantity: str) -> float:
    """Bytes of a Kubernetes quantity in the forms the annotations accept (``64Gi``, ``1.5G``)."""
    number = quantity.rstrip("kMGTPEi")
    return float(number) * _QUANTITY_UNITS[quantity[len(number):]]


def is_hub_id(path: str) -> bool:
    """Whether SGLang downloads ``path`` from the Hugging Face hub (``owner/name``), rather than
    reading a directory in the image (``/models/m3``, ``./m3``), an object store (``s3://...``)
    or the embedded tiny model. Only a download needs the writable volume (``download_mount``):
    mounted over a local path's folder, it would hide the weights the image holds there."""
    return not path.startswith(("/", ".", "~")) and ":" not in path


def weight_sources(recipe: Recipe) -> list[tuple[str, str, str | None]]:
    """(field, path, revision) of every checkpoint the server loads: the model and, with
    speculative decoding, its draft. Both get the same treatment: downloaded when a hub id,
    read where they are otherwise."""
    spec = recipe.spec
    sources = [("spec.model.path", spec.model.path, spec.model.revision)]
    draft = spec.speculative.draft_model if spec.speculative else None
    if draft is not None:
        sources.append(("spec.speculative.draftModel.path", draft.path, draft.revision))
    return sources


def downloads_in_pod(recipe: Recipe, cached: bool) -> bool:
    """Whether SGLang in the server pod downloads weights itself: without the shared cache,
    when the model or the draft is a hub id."""
    return not cached and any(is_hub_id(path) for _, path, _ in weight_sources(recipe))


def download_mount(recipe: Recipe, cached: bool) -> str | None:
    """Folder where the server container mounts the volume its downloaded weights live in, None
    when it downloads nothing. The shared cache's claim goes at ``CACHE_MOUNT``, where the
    download Job also leaves its ready marker; an in-pod download's emptyDir only at
    ``HF_HOME``, so a local model or draft that the image keeps under ``/models`` (the usual
    place) stays visible beside a hub id downloaded into it."""
    if cached:
        return CACHE_MOUNT
    return HF_HOME if downloads_in_pod(recipe, cached) else None


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
    cached = cache_hash is not None
    in_pod = downloads_in_pod(recipe, cached)
    if cached:
        env += [{"name": "HF_HOME", "value": HF_HOME}, {"name": "HF_HUB_OFFLINE", "value": "1"}]
    elif in_pod:
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
    requests = {"memory": memory_request(recipe, profile, options)}
    if in_pod:
        requests["ephemeral-storage"] = download_storage(recipe)
    container["resources"] = {"requests": requests}
    if profile.resource_name is not None:
        count = str(gpus_per_node(recipe, profile))
        container["resources"] = {"limits": {profile.resource_name: count},
                                  "requests": {profile.resource_name: count, **requests}}
    mount = download_mount(recipe, cached)
    if mount is not None:
        container["volumeMounts"].append({"name": CACHE_VOLUME, "mountPath": mount})

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
    if cached:
        spec["initContainers"] = [_wait_for_model(image, config, cache_hash)]
        spec["volumes"].append({"name": CACHE_VOLUME,
                                "persistentVolumeClaim": {"claimName": model_cache_claim(name)}})
    elif in_pod:
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
    if downloads_in_pod(recipe, cached):
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

