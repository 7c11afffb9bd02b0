"""k8s/scaling.yaml: gateway and engine-proxy scale out on CPU and survive a node drain.

Rendered by the real `kubectl kustomize`, validated in strict mode against the schemas the pinned
kubernetes-validate ships, and checked against the Deployments they act on: an autoscaler aims at a
Deployment that exists and whose pods request CPU, a disruption budget selects exactly one
Deployment's pods, and at every replica count the autoscaler allows a drain can evict a pod while
another keeps serving.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import kubernetes_validate
import pytest

from examlops_testsupport.deploy import kustomized, objects, pod_labels, selects

#: the stateless request-path services, the only ones that scale out
SCALED = {"gateway", "engine-proxy"}


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    return copy.deepcopy(list(kustomized()))


def required_healthy(pdb: dict[str, Any], replicas: int) -> int:
    """The pods a PodDisruptionBudget keeps at `replicas` (the disruption controller's rounding:
    percentages round up, for minAvailable and maxUnavailable alike)."""
    spec = pdb["spec"]
    assert ("minAvailable" in spec) != ("maxUnavailable" in spec), "a budget sets exactly one bound"
    bound = spec.get("minAvailable", spec.get("maxUnavailable"))
    value = math.ceil(replicas * int(bound[:-1]) / 100) if isinstance(bound, str) else int(bound)
    return value if "minAvailable" in spec else replicas - value


def drain_blocked_or_dark(pdb: dict[str, Any], replicas: int) -> str:
    """Why a node drain would fail at `replicas` pods ('' when it goes through, one pod at a time,
    with a pod left serving)."""
    keep = required_healthy(pdb, replicas)
    if replicas - keep < 1:
        return f"{replicas} pods, {keep} required: the drain blocks"
    if keep < 1:
        return f"{replicas} pods, {keep} required: the drain may evict every pod"
    return ""


def test_scaling_objects_are_valid_kubernetes_in_strict_mode(rendered: list[dict[str, Any]]) -> None:
    version = kubernetes_validate.latest_version()
    hpas, pdbs = objects(rendered, "HorizontalPodAutoscaler"), objects(rendered, "PodDisruptionBudget")
    assert set(hpas) == set(pdbs) == SCALED
    for d in [*hpas.values(), *pdbs.values()]:
        kubernetes_validate.validate(d, version, strict=True)
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "examlops"
    assert {d["apiVersion"] for d in hpas.values()} == {"autoscaling/v2"}
    assert {d["apiVersion"] for d in pdbs.values()} == {"policy/v1"}


@pytest.mark.parametrize(("kind", "where", "bad"), [
    ("HorizontalPodAutoscaler", "spec", "minReplica"),
    ("PodDisruptionBudget", "spec", "maxUnavailabe"),
])
def test_strict_validation_catches_a_misspelt_scaling_field(rendered: list[dict[str, Any]], kind: str,
                                                            where: str, bad: str) -> None:
    # The control for the test above: the schemas do know these kinds and reject a misspelt field.
    d = copy.deepcopy(objects(rendered, kind)["gateway"])
    d[where][bad] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(d, kubernetes_validate.latest_version(), strict=True)


def test_each_autoscaler_scales_an_existing_deployment_on_its_cpu_request(rendered: list[dict[str, Any]]) -> None:
    deployments = objects(rendered, "Deployment")
    hpas = objects(rendered, "HorizontalPodAutoscaler")
    targets = [h["spec"]["scaleTargetRef"] for h in hpas.values()]
    assert sorted(t["name"] for t in targets) == sorted(SCALED), "one autoscaler per scaled Deployment"
    for name, hpa in hpas.items():
        spec = hpa["spec"]
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        assert name in deployments
        assert 2 <= spec["minReplicas"] < spec["maxReplicas"] <= 20, name
        [metric] = spec["metrics"]
        assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu", name
        assert metric["resource"]["target"]["type"] == "Utilization", name
        assert 50 <= metric["resource"]["target"]["averageUtilization"] <= 90, name
        # Down slowly (a bursty load must not flap the pool), up at once.
        behavior = spec["behavior"]
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 120, name
        assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0, name
        # Utilisation is a share of the request: every container of the pod must request CPU.
        pod = deployments[name]["spec"]["template"]["spec"]
        for c in pod["containers"]:
            assert c["resources"]["requests"]["cpu"], (name, c["name"])


def test_the_autoscaler_alone_owns_the_replica_count(rendered: list[dict[str, Any]]) -> None:
    # A Deployment that declared `replicas` would be reset to it by every `kubectl apply -k`,
    # undoing a scale-out under load; one without an autoscaler keeps its declared count.
    targets = {h["spec"]["scaleTargetRef"]["name"] for h in objects(rendered, "HorizontalPodAutoscaler").values()}
    for name, deployment in objects(rendered, "Deployment").items():
        if name in targets:
            assert "replicas" not in deployment["spec"], name
        else:
            assert deployment["spec"]["replicas"] == 1, name


def test_each_budget_selects_exactly_one_deployment_and_never_blocks_a_drain(rendered: list[dict[str, Any]]) -> None:
    workloads = {**objects(rendered, "Deployment"), **objects(rendered, "StatefulSet")}
    hpas = objects(rendered, "HorizontalPodAutoscaler")
    for name, pdb in objects(rendered, "PodDisruptionBudget").items():
        selector = pdb["spec"]["selector"]
        chosen = [w for w, d in workloads.items() if selects(selector, pod_labels(d))]
        assert chosen == [name], (name, chosen)
        # ... and the Deployment's own selector picks the same pods (no pod escapes either).
        assert selector == workloads[name]["spec"]["selector"], name
        # An unready pod (its Redis is down, say) may always go: it serves nothing anyway.
        assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow", name
        spec = hpas[name]["spec"]
        for replicas in range(spec["minReplicas"], spec["maxReplicas"] + 1):
            assert not drain_blocked_or_dark(pdb, replicas), (name, drain_blocked_or_dark(pdb, replicas))


@pytest.mark.parametrize(("bound", "replicas", "why"), [
    ({"minAvailable": 2}, 2, "the drain blocks"),      # minReplicas must be at least minAvailable + 1
    ({"minAvailable": "100%"}, 5, "the drain blocks"),
    ({"maxUnavailable": 0}, 3, "the drain blocks"),
    ({"maxUnavailable": "100%"}, 2, "may evict every pod"),
    ({"minAvailable": 0}, 2, "may evict every pod"),
    ({"minAvailable": 1}, 2, ""),
    ({"maxUnavailable": 1}, 2, ""),
    ({"maxUnavailable": "25%"}, 6, ""),               # rounds up to 2 of 6
])
def test_drain_arithmetic_flags_a_budget_that_blocks_or_empties_the_pool(bound: dict[str, Any], replicas: int,
                                                                         why: str) -> None:
    # The control for the test above: the check does fail on the budgets that would hurt.
    verdict = drain_blocked_or_dark({"spec": bound}, replicas)
    assert (why in verdict) if why else verdict == "", verdict


def test_a_scaled_pod_leaves_the_service_before_it_stops(rendered: list[dict[str, Any]]) -> None:
    # Scale-down and drains delete pods: each sleeps before SIGTERM while the Service stops
    # routing to it, and the sleep plus the process's own drain fit the termination grace period.
    deployments = objects(rendered, "Deployment")
    for name in SCALED:
        pod = deployments[name]["spec"]["template"]["spec"]
        [c] = pod["containers"]
        sleep_s = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert sleep_s >= 3 and sleep_s + 10 <= pod.get("terminationGracePeriodSeconds", 30), name
