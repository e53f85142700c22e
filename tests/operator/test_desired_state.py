"""Golden tests of the desired state, and schema validation of every emitted object.

Each case in ``cases/`` renders to ``golden/<case>.yaml``; set ``M3_UPDATE_GOLDEN=1`` to
rewrite them after an intended change (and review the diff). Every object must validate
against Kubernetes 1.33's schemas (strict), LeaderWorkerSets against the LWS schema subset.
"""

from __future__ import annotations

import copy
import os
import shlex
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from k8s_schemas import validate

from m3_operator.desired import desired_state
from m3_operator.options import OperatorConfig

HERE = Path(__file__).parent
CASES = sorted((HERE / "cases").glob("*.yaml"))
UID = "7c6f1f2e-0000-4000-8000-000000000001"
CONFIG = OperatorConfig()


def load_case(path: Path) -> dict:
    body = yaml.safe_load(path.read_text())
    body["metadata"].update(namespace="serving", uid=UID, generation=3)
    return body


def render(path: Path):
    plan = desired_state(load_case(path), CONFIG)
    assert plan.valid, plan.problems
    return plan


def by_kind(plan) -> dict:
    return {obj["kind"]: obj for obj in plan.objects}


def server_container(template: dict) -> dict:
    return template["spec"]["containers"][0]


@pytest.mark.parametrize("case", CASES, ids=lambda path: path.stem)
def test_rendered_objects_match_golden(case: Path):
    rendered = yaml.safe_dump_all(render(case).objects, sort_keys=False, width=100)
    golden = HERE / "golden" / f"{case.stem}.yaml"
    if os.environ.get("M3_UPDATE_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(rendered)
    assert rendered == golden.read_text()


@pytest.mark.parametrize("case", CASES, ids=lambda path: path.stem)
def test_every_object_validates_against_pinned_schemas(case: Path):
    for obj in render(case).objects:
        validate(obj)


def test_validators_reject_broken_objects():
    """The schema checks above would catch a mistake (they are not vacuous)."""
    plan = render(HERE / "cases" / "h200-two-node-lws.yaml")
    objects = by_kind(plan)
    lws = copy.deepcopy(objects["LeaderWorkerSet"])
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0][
        "livenessprobe"] = {}
    with pytest.raises(jsonschema.ValidationError):
        validate(lws)
    lws = copy.deepcopy(objects["LeaderWorkerSet"])
    lws["spec"]["leaderWorkerTemplate"]["size"] = "2"
    with pytest.raises(jsonschema.ValidationError):
        validate(lws)
    service = copy.deepcopy(objects["Service"])
    service["spec"]["ports"][0]["port"] = "http"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(service)


def test_single_node_is_a_deployment_with_gpus_probes_shm_and_drain():
    objects = by_kind(render(HERE / "cases" / "h200-single-node.yaml"))
    assert set(objects) == {"Deployment", "Service", "PodDisruptionBudget"}
    deployment = objects["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    container = server_container(deployment["spec"]["template"])

    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
        pod["tolerations"]
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]

    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= CONFIG.startup_budget_seconds
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"][-1]
    assert pre_stop == f"sleep {CONFIG.pre_stop_seconds}"
    assert pod["terminationGracePeriodSeconds"] > CONFIG.pre_stop_seconds + CONFIG.drain_seconds

    args = container["args"]
    assert args[args.index("--tp-size") + 1] == "8"
    assert "--nnodes" not in args
    owner = deployment["metadata"]["ownerReferences"][0]
    assert owner["uid"] == UID and owner["controller"] is True
    # The Service and PDB select the recipe's pods; the Service only the serving ones.
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for selector in (objects["Service"]["spec"]["selector"],
                     objects["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
                     deployment["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= labels.items()


def test_multi_node_is_a_leader_worker_set_wired_into_sglang_flags():
    objects = by_kind(render(HERE / "cases" / "h200-two-node-lws.yaml"))
    lws = objects["LeaderWorkerSet"]
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2
    leader, worker = template["leaderTemplate"], template["workerTemplate"]
    for pod in (leader, worker):
        args = server_container(pod)["args"]
        assert args[args.index("--nnodes") + 1] == "2"
        assert args[args.index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
        assert args[args.index("--dist-init-addr") + 1] == "$(LWS_LEADER_ADDRESS):20000"
    # Only the leader runs SGLang's HTTP server: probes, port and Service selection.
    assert "readinessProbe" in server_container(leader)
    assert "readinessProbe" not in server_container(worker)
    service_selector = objects["Service"]["spec"]["selector"]
    assert service_selector.items() <= leader["metadata"]["labels"].items()
    assert not service_selector.items() <= worker["metadata"]["labels"].items()


def test_eagle3_renders_the_draft_model():
    objects = by_kind(render(HERE / "cases" / "b200-mxfp8-eagle3.yaml"))
    deployment = objects["Deployment"]
    assert deployment["spec"]["replicas"] == 2
    args = server_container(deployment["spec"]["template"])["args"]
    assert args[args.index("--speculative-algorithm") + 1] == "EAGLE3"
    assert args[args.index("--speculative-draft-model-path") + 1] == "Inferact/MiniMax-M3-EAGLE3"
    assert args[args.index("--speculative-num-steps") + 1] == "3"
    limits = server_container(deployment["spec"]["template"])["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": "4"}


def gib(nbytes: int) -> str:
    return f"{-(-nbytes // 2**30)}Gi"


#: /dev/shm of a GPU pod and the memory floor of one SGLang process (8 ranks + 2 front-end).
SHM, PROCESS = 32 * 2**30, 2**30


def test_host_offload_requests_the_host_memory_its_ranks_pin():
    """8 ranks x 64 GB of page-locked host store, on top of /dev/shm and the processes' floor:
    requested (scheduling, eviction order), not limited; the sparse-offload environment
    reaches the server; recipes without offload request /dev/shm and the floor only."""
    objects = by_kind(render(HERE / "cases" / "h100-sparse-offload.yaml"))
    container = server_container(objects["Deployment"]["spec"]["template"])
    assert container["resources"]["requests"]["memory"] == gib(512 * 10**9 + SHM + 10 * PROCESS)
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env["SGLANG_M3_SPARSE_OFFLOAD_HOST_GB"] == "64"
    assert env["SGLANG_M3_SPARSE_OFFLOAD_BLOCKS"] == "512"

    two_nodes = load_case(HERE / "cases" / "h200-two-node-lws.yaml")
    two_nodes["spec"]["hostOffload"] = {"mode": "hierarchical-cache", "sizeGbPerRank": 100}
    plan = desired_state(two_nodes, CONFIG)
    assert plan.valid, plan.problems
    template = by_kind(plan)["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):  # tp 16 over 2 nodes: 8 ranks per pod
        assert server_container(template[role])["resources"]["requests"]["memory"] == gib(
            800 * 10**9 + SHM + 10 * PROCESS)

    plain = server_container(by_kind(render(HERE / "cases" / "h200-single-node.yaml"))["Deployment"]["spec"]["template"])
    assert plain["resources"]["requests"]["memory"] == gib(SHM + 10 * PROCESS)


def test_model_cache_is_filled_once_and_mounted_by_every_server():
    plan = render(HERE / "cases" / "h200-model-cache.yaml")
    objects = by_kind(plan)
    claim, job, deployment = (objects["PersistentVolumeClaim"], objects["Job"],
                              objects["Deployment"])
    assert [obj["kind"] for obj in plan.objects][:2] == ["PersistentVolumeClaim", "Job"]
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"],
                             "resources": {"requests": {"storage": "1Ti"}},
                             "storageClassName": "shared-nfs"}
    script = job["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    commands = [shlex.split(part) for part in script.split(" && ")]
    assert ["hf", "download", "MiniMaxAI/MiniMax-M3", "--revision", "main"] in commands
    marker = commands[-1][-1]
    pod = deployment["spec"]["template"]["spec"]
    wait = pod["initContainers"][0]
    assert marker in wait["command"][-1]
    claim_volume = {"name": "model-cache",
                    "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}}
    assert claim_volume in pod["volumes"]
    env = {e["name"]: e["value"] for e in server_container(deployment["spec"]["template"])["env"]}
    assert env["HF_HOME"].startswith("/models/") and env["HF_HUB_OFFLINE"] == "1"
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["sizeLimit"] == "64Gi"


def test_tiny_model_pods_hand_the_recipe_to_sglang_m3_serve():
    """The tiny model exists only once `sglang-m3 serve` built it: the pod carries the recipe."""
    from m3_operator.recipe_api import parse_recipe

    body = load_case(HERE / "cases" / "cpu-tiny.yaml")
    container = server_container(by_kind(desired_state(body, CONFIG))["Deployment"]["spec"][
        "template"])
    assert container["command"][-1].endswith("exec sglang-m3 serve /tmp/recipe.yaml")
    env = {e["name"]: e["value"] for e in container["env"]}
    assert parse_recipe(yaml.safe_load(env["M3_RECIPE"])).spec == parse_recipe(body).spec
    # no GPU on the CPU profile; host memory: 1Gi /dev/shm + 1 rank and 2 front-end processes
    assert container["resources"] == {"requests": {"memory": "4Gi"}}


def test_new_weights_get_a_new_download_job():
    body = load_case(HERE / "cases" / "h200-model-cache.yaml")
    first = by_kind(desired_state(body, CONFIG))["Job"]["metadata"]["name"]
    body["spec"]["model"]["revision"] = "v2"
    second = by_kind(desired_state(body, CONFIG))["Job"]["metadata"]["name"]
    assert first != second and first.startswith("h200-cached-download-")


def test_leader_worker_set_leaves_its_headless_service_name_free():
    """LeaderWorkerSet creates a headless Service named after itself, through which
    LWS_LEADER_ADDRESS (``<lws>-<group>.<lws>.<namespace>``) resolves; the recipe's own Service
    keeps the recipe's name, so the two must differ."""
    objects = by_kind(render(HERE / "cases" / "h200-two-node-lws.yaml"))
    assert objects["Service"]["metadata"]["name"] == "h200-two-node"
    assert objects["LeaderWorkerSet"]["metadata"]["name"] == "h200-two-node-lws"


def test_disruption_budget_covers_the_serving_pods_not_the_download_job():
    """A maxUnavailable budget over a pod with no scalable controller (a Job's) allows no
    disruption at all, which would block every node drain."""
    objects = by_kind(render(HERE / "cases" / "h200-model-cache.yaml"))
    selector = objects["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"]
    served = objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
    downloading = objects["Job"]["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= served.items()
    assert not selector.items() <= downloading.items()


def test_the_longest_accepted_name_gives_every_child_a_valid_name():
    from m3_operator.names import MAX_RECIPE_NAME

    for case in ("h200-model-cache.yaml", "h200-two-node-lws.yaml"):
        body = load_case(HERE / "cases" / case)
        body["metadata"]["name"] = "m" * MAX_RECIPE_NAME
        plan = desired_state(body, CONFIG)
        assert plan.valid, plan.problems
        for obj in plan.objects:
            # a Job's name and a StatefulSet's <name>-<group>-<10-char revision hash> are pod labels
            assert len(obj["metadata"]["name"]) <= 63
            if obj["kind"] == "LeaderWorkerSet":
                assert len(f"{obj['metadata']['name']}-999-0123456789") <= 63
        body["metadata"]["name"] = "m" * (MAX_RECIPE_NAME + 1)
        assert any("metadata.name" in p for p in desired_state(body, CONFIG).problems)


@pytest.mark.parametrize("change, field", [
    (lambda b: b["spec"]["serving"].update(host="127.0.0.1"), "spec.serving.host"),
    (lambda b: (b["spec"]["hardware"].update(nodes=2), b["spec"]["parallelism"].update(tp=16),
                b["spec"]["serving"].update(port=CONFIG.dist_port)), "spec.serving.port"),
    (lambda b: b["spec"]["parallelism"].update(tp=3), "spec.parallelism"),
    (lambda b: b["spec"].update(contextLenght=4096), "spec.contextLenght"),
    (lambda b: b["metadata"].update(name="9lives"), "metadata.name"),
    (lambda b: b["metadata"].setdefault("annotations", {}).update(
        {"m3.sglang.io/replicas": "zero"}), "m3.sglang.io/replicas"),
    (lambda b: b["metadata"].setdefault("annotations", {}).update(
        {"m3.sglang.io/model-cache-sise": "1Ti"}), "m3.sglang.io/model-cache-sise"),
])
def test_invalid_recipes_yield_problems_and_no_objects(change, field):
    body = load_case(HERE / "cases" / "h200-single-node.yaml")
    change(body)
    plan = desired_state(body, CONFIG)
    assert not plan.valid and plan.objects == ()
    assert any(field in problem for problem in plan.problems), plan.problems


def test_desired_state_is_deterministic_and_does_not_mutate_its_input():
    body = load_case(HERE / "cases" / "h200-two-node-lws.yaml")
    snapshot = copy.deepcopy(body)
    assert desired_state(body, CONFIG).objects == desired_state(body, CONFIG).objects
    assert body == snapshot


def test_without_the_shared_cache_a_pods_download_outlives_a_container_restart():
    """The startup probe restarts the container, not the pod: weights downloaded into an
    emptyDir are still there for the restarted container (in its writable layer they were not)."""
    template = by_kind(render(HERE / "cases" / "h200-single-node.yaml"))["Deployment"]["spec"]["template"]
    container = server_container(template)
    env = {e["name"]: e["value"] for e in container["env"]}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "model-cache")
    volume = next(v for v in template["spec"]["volumes"] if v["name"] == "model-cache")
    assert f"{env['HF_HOME']}/".startswith(mount["mountPath"] + "/") and "HF_HUB_OFFLINE" not in env
    assert volume == {"name": "model-cache", "emptyDir": {}}
