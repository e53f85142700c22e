"""Both Helm charts render and lint with the real Helm engine (helm-python-sdk embeds Helm 4's
Go SDK), with default and non-default values; values outside values.schema.json are refused;
every rendered object validates against the pinned Kubernetes schemas; and the CRD chart holds
exactly the CRD generated from the recipe models."""

from __future__ import annotations

from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from m3_operator.crd import MANIFEST_PATH, crd_yaml

REPO = Path(__file__).resolve().parents[2]
OPERATOR_CHART = REPO / "charts" / "m3-operator"
CRD_CHART = REPO / "charts" / "m3-crds"
PINNED_KUBERNETES = "1.33.0"
WARNING = 2  # helm lint severities: 1 info, 2 warning, 3 error

NON_DEFAULT = {
    "image": {"repository": "registry.example/m3/operator", "tag": "1.2.3"},
    "serverImage": {"repository": "registry.example/m3/server", "tag": "9.9.9",
                    "pullPolicy": "Always"},
    "watchNamespaces": ["llm-a", "llm-b"],
    "servers": {"startupBudgetSeconds": 7200, "drainSeconds": 600, "preStopSeconds": 30},
    "resyncSeconds": 0,
    "metrics": {"enabled": True, "port": 9090,
                "serviceMonitor": {"enabled": True, "interval": "15s"}},
    "webhook": {"enabled": True, "certSecretName": "m3-webhook-tls",
                "certManagerInjectFrom": "m3-system/m3-webhook"},
    "nodeSelector": {"node-role": "control"},
    "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
}


def render(chart: Path, values: dict | None = None) -> list[dict]:
    with helm.Chart.load(chart) as loaded:
        manifests = loaded.render(values or {}, name="m3", namespace="m3-system")
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith(".yaml"):
            objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def lint_findings(chart: Path, values: dict | None = None) -> list[dict]:
    report = helm.lint(chart, values or {}, strict=True, namespace="m3-system",
                       kube_version=f"v{PINNED_KUBERNETES}")
    assert not report.get("errors"), report
    return [message for message in report["messages"] if message["severity"] >= WARNING]


def kinds(objects: list[dict]) -> dict[str, list[dict]]:
    result: dict[str, list[dict]] = {}
    for obj in objects:
        result.setdefault(obj["kind"], []).append(obj)
    return result


@pytest.mark.parametrize("values", [None, NON_DEFAULT], ids=["defaults", "non-default"])
def test_operator_chart_lints_renders_and_validates(values):
    assert lint_findings(OPERATOR_CHART, values) == []
    objects = render(OPERATOR_CHART, values)
    for obj in objects:
        if obj["kind"] != "ServiceMonitor":  # a Prometheus Operator CRD, not a core kind
            kubernetes_validate.validate(obj, PINNED_KUBERNETES, strict=True)
    by_kind = kinds(objects)
    assert len(by_kind["Deployment"]) == 1 and len(by_kind["ServiceAccount"]) == 1
    container = by_kind["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] == "/healthz"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_default_values_grant_cluster_wide_least_privilege():
    by_kind = kinds(render(OPERATOR_CHART))
    assert "Role" not in by_kind
    rules = [rule for role in by_kind["ClusterRole"] for rule in role["rules"]]
    granted = {(group, resource, verb) for rule in rules for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    # Pods are read, never written; recipes are never created or deleted by the operator.
    assert {("", "pods", verb) for verb in ("get", "list", "watch")} <= granted
    assert not {("", "pods", verb) for verb in ("create", "patch", "delete")} & granted
    assert not {("m3.sglang.io", "m3recipes", verb) for verb in ("create", "delete")} & granted
    assert ("apps", "deployments", "patch") in granted
    assert not any("*" in rule["verbs"] or "*" in rule["resources"] for rule in rules)
    assert not any(resource == "secrets" for _, resource, _ in granted)


def test_watch_namespaces_use_roles_per_namespace():
    by_kind = kinds(render(OPERATOR_CHART, NON_DEFAULT))
    assert {role["metadata"]["namespace"] for role in by_kind["Role"]} == {"llm-a", "llm-b"}
    cluster_roles = by_kind["ClusterRole"]
    assert len(cluster_roles) == 1  # only CRD / namespace discovery stays cluster-wide
    assert {r for rule in cluster_roles[0]["rules"] for r in rule["resources"]} == {
        "customresourcedefinitions", "namespaces"}
    args = by_kind["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=llm-a" in args and "--webhook-port=9443" in args
    webhook = by_kind["ValidatingWebhookConfiguration"][0]["webhooks"][0]
    assert webhook["clientConfig"]["service"]["path"] == "/validate-recipe"


def test_webhook_is_off_by_default():
    assert "ValidatingWebhookConfiguration" not in kinds(render(OPERATOR_CHART))


@pytest.mark.parametrize("values, key", [
    ({"replicaCount": 2}, "replicaCount"),
    ({"image": {"repository": "x", "tga": "1"}}, "tga"),
    ({"metrics": {"port": 70000}}, "port"),
    ({"watchNamespaces": ["Not_A_Namespace"]}, "watchNamespaces"),
    ({"webhook": {"failurePolicy": "Sometimes"}}, "failurePolicy"),
    ({"servers": {"startupBudgetSeconds": "long"}}, "startupBudgetSeconds"),
])
def test_values_outside_the_schema_are_refused(values, key):
    with helm.Chart.load(OPERATOR_CHART) as chart:
        with pytest.raises(helm.HelmValuesError) as refused:
            chart.render(values, name="m3", namespace="m3-system")
    assert key in str(refused.value)


def test_crd_chart_lints_renders_and_matches_the_generated_crd():
    assert lint_findings(CRD_CHART) == []
    objects = render(CRD_CHART)
    assert [obj["kind"] for obj in objects] == ["CustomResourceDefinition"]
    kubernetes_validate.validate(objects[0], PINNED_KUBERNETES, strict=True)
    assert (REPO / MANIFEST_PATH).read_text() == crd_yaml(), \
        "stale CRD: run `sglang-m3 operator crd --write .`"
    with helm.Chart.load(CRD_CHART) as chart:
        with pytest.raises(helm.HelmError):
            chart.render({"anything": 1}, name="m3", namespace="m3-system")
