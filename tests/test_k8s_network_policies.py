"""k8s/: who may connect to whom (NetworkPolicies) and where internal tokens come from (an operator's Secret)."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest

from examlops.svc import DEFAULT_PORTS
from examlops_testsupport.deploy import GRPC_SERVICES, SERVICES, kustomized, objects, pod_labels, selects

#: part -> the app names allowed to connect to its main port (besides operator pods); None: anyone.
CALLERS: dict[str, set[str] | None] = {
    "gateway": None,
    "engine-proxy": {"gateway"},
    "mediaguard": {"engine-proxy"},
    "registry": {"gateway", "launcher", "engine-proxy"},
    "launcher": set(),
    "redis": {"registry"},
    "gateway-redis": {"gateway"},
}
REDIS = ("redis", "gateway-redis")
OPERATOR = {"examlops.io/operator": "true"}
TOKENS_SECRET = "examlops-internal-tokens"


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    return [json.loads(json.dumps(d)) for d in kustomized()]  # a copy each module may change



def container_port(workload: dict[str, Any], name: str) -> int:
    [c] = workload["spec"]["template"]["spec"]["containers"]
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)  # type: ignore[no-any-return]


def allowed_sources(policy: dict[str, Any], workload: dict[str, Any], pods: dict[str, dict[str, str]],
                    port: int) -> set[str] | None:
    """The parts (and "operator") that may reach `port`; None when any source may."""
    found: set[str] = set()
    for rule in policy["spec"].get("ingress", []):
        ports = {container_port(workload, p["port"]) if isinstance(p["port"], str) else p["port"]
                 for p in rule.get("ports", [])}
        if ports and port not in ports:
            continue
        if not rule.get("from"):
            return None
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"}, peer  # no namespace or IP-block peers
            found |= {name for name, labels in pods.items() if selects(peer["podSelector"], labels)}
            if selects(peer["podSelector"], {**OPERATOR, "app.kubernetes.io/part-of": "examlops"}):
                found.add("operator")
    return found


def test_every_part_has_exactly_one_ingress_policy_letting_in_only_its_callers(
        rendered: list[dict[str, Any]]) -> None:
    workloads = {**objects(rendered, "Deployment"), **objects(rendered, "StatefulSet")}
    pods = {name: pod_labels(w) for name, w in workloads.items()}
    policies = list(objects(rendered, "NetworkPolicy").values())
    assert set(workloads) == set(CALLERS)
    for name, workload in workloads.items():
        mine = [p for p in policies if selects(p["spec"]["podSelector"], pods[name])]
        assert len(mine) == 1, (name, [p["metadata"]["name"] for p in mine])
        [policy] = mine
        assert policy["spec"]["policyTypes"] == ["Ingress"], name
        main_port = 6379 if name in REDIS else DEFAULT_PORTS[name]
        expected = CALLERS[name]
        sources = allowed_sources(policy, workload, pods, main_port)
        if expected is None:
            assert sources is None, name
            continue
        operators = set() if name in REDIS else {"operator"}
        assert sources == expected | operators, name
        # Any other port a pod listens on: only metrics, and only the metrics port is open to all.
        [c] = workload["spec"]["template"]["spec"]["containers"]
        for p in c["ports"]:
            if p["containerPort"] != main_port:
                assert p["name"] == "metrics", (name, p)
                assert allowed_sources(policy, workload, pods, p["containerPort"]) is None, name


def test_network_policies_are_valid_kubernetes_in_strict_mode(rendered: list[dict[str, Any]]) -> None:
    version = kubernetes_validate.latest_version()
    for policy in objects(rendered, "NetworkPolicy").values():
        kubernetes_validate.validate(policy, version, strict=True)


def test_internal_tokens_come_from_an_operator_secret_that_is_not_committed(rendered: list[dict[str, Any]]) -> None:
    deployments = objects(rendered, "Deployment")
    assert TOKENS_SECRET not in objects(rendered, "Secret")
    for name in SERVICES:
        [c] = deployments[name]["spec"]["template"]["spec"]["containers"]
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c.get("env", []) if "valueFrom" in e
                and e["valueFrom"]["secretKeyRef"]["name"] == TOKENS_SECRET}
        if name in GRPC_SERVICES:  # every server knows its callers
            assert refs["EXAMLOPS_INTERNAL_TOKENS"]["key"] == "internal-tokens", name
        if name in ("gateway", "launcher", "engine-proxy"):  # every caller sends its own token, and only its own
            assert refs["EXAMLOPS_SERVICE_TOKEN"]["key"] == name, name
        else:
            assert "EXAMLOPS_SERVICE_TOKEN" not in refs, name
