"""The shipped Prometheus configuration (observability/prometheus/), checked by the real promtool,
and the Prometheus `make up` runs on it.

`promtool check config` on the Compose config and on the one `make up` renders from it, `promtool
check rules`, and `promtool test rules` on unit tests that make every alert fire and stay silent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from examlops.yamlio import dump_yaml
from examlops_devstack import SERVICES, StackPorts, free_port, http_ok, local_targets, render_local_config
from examlops_devstack._prometheus import start_prometheus
from examlops_devstack._up import RunDir, _prometheus_line, down
from examlops_testsupport.prometheus import OBSERVABILITY_DIR, alert_rules, promtool

SPEC_ALERTS = {"VLLMEndpointDown", "VLLMKVCacheNearFull", "VLLMQueueBacklog", "VLLMHighTTFT"}
GATEWAY_ALERTS = {"GatewayHighErrorRatio", "GatewayGovernanceStoreUnreachable", "GatewayBudgetReservationsReaped"}


def shipped() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((OBSERVABILITY_DIR / "prometheus.yml").read_text())
    return config


def jobs(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {job["job_name"]: job for job in config["scrape_configs"]}


def test_promtool_checks_the_shipped_config_and_its_rules() -> None:
    out = promtool("check", "config", "prometheus.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 2 rule files found" in out.stdout, out.stdout


def test_promtool_checks_every_rules_file() -> None:
    files = sorted(str(p.relative_to(OBSERVABILITY_DIR)) for p in (OBSERVABILITY_DIR / "rules").glob("*.yml"))
    assert files == ["rules/gateway.yml", "rules/vllm.yml"]
    out = promtool("check", "rules", *files)
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    tests = sorted(str(p.relative_to(OBSERVABILITY_DIR)) for p in (OBSERVABILITY_DIR / "tests").glob("*.yml"))
    out = promtool("test", "rules", *tests)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SUCCESS") == len(tests) >= 2, out.stdout


def test_a_broken_expectation_fails_promtool(tmp_path: Path) -> None:
    # The unit tests can fail: the same test with the alert expected silent where it fires.
    test = yaml.safe_load((OBSERVABILITY_DIR / "tests" / "vllm_test.yml").read_text())
    test["rule_files"] = [str(OBSERVABILITY_DIR / "rules" / "vllm.yml")]
    case = test["tests"][0]["alert_rule_test"][-1]
    assert case["alertname"] == "VLLMEndpointDown" and case["exp_alerts"]
    case["exp_alerts"] = []
    (tmp_path / "broken_test.yml").write_text(dump_yaml(test))
    out = promtool("test", "rules", "broken_test.yml", cwd=tmp_path)
    assert out.returncode != 0 and "VLLMEndpointDown" in out.stdout + out.stderr


def test_every_alert_has_a_unit_test_that_fires_it_and_one_that_keeps_it_silent() -> None:
    rules = alert_rules()
    assert set(rules) == SPEC_ALERTS | GATEWAY_ALERTS | {"ExaMLOpsServiceDown"}
    fired: set[str] = set()
    silent: set[str] = set()
    for path in (OBSERVABILITY_DIR / "tests").glob("*.yml"):
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (fired if check["exp_alerts"] else silent).add(check["alertname"])
    assert fired == set(rules) and silent == set(rules), (set(rules) - fired, set(rules) - silent)


def test_every_alert_says_how_bad_and_what_happened() -> None:
    for name, rule in alert_rules().items():
        assert rule["labels"]["severity"] in {"critical", "warning"}, name
        assert rule["annotations"]["summary"] and len(rule["annotations"]["description"]) > 40, name


def test_the_four_vllm_alerts_mean_what_the_spec_says() -> None:
    rules = alert_rules()
    assert rules["VLLMEndpointDown"]["expr"].strip() == 'up{job=~"vllm|fleet"} == 0'
    assert "vllm:kv_cache_usage_perc" in rules["VLLMKVCacheNearFull"]["expr"]
    assert "vllm:num_requests_waiting" in rules["VLLMQueueBacklog"]["expr"]
    ttft = rules["VLLMHighTTFT"]["expr"]
    assert "histogram_quantile(0.95" in ttft and "vllm:time_to_first_token_seconds_bucket[5m]" in ttft
    # A spike is no backlog, a slow request no TTFT problem: each must hold for a while.
    assert all(rules[name].get("for") for name in SPEC_ALERTS)


def test_jobs_scrape_the_five_services_vllm_and_the_hpc_fleet() -> None:
    config = shipped()
    by_name = jobs(config)
    assert set(by_name) == {*SERVICES, "vllm", "fleet"}
    assert by_name["gateway"]["static_configs"] == [{"targets": ["gateway:8080"]}]
    for name in SERVICES:
        if name != "gateway":  # the gRPC services' EXAMLOPS_METRICS_PORT in compose.yaml and k8s/
            assert by_name[name]["static_configs"] == [{"targets": [f"{name}:9090"]}], name
    # Every container of the Compose vLLM services, scaled or not.
    names = {(n, sd["port"]) for sd in by_name["vllm"]["dns_sd_configs"] for n in sd["names"]}
    assert names == {("vllm", 8000), ("vllm-cpu", 8000), ("minilm-cpu", 8001)}
    # The folder `exa hpc prometheus-sd --out observability/prometheus/targets/fleet.json` writes, re-read every 30 s.
    (sd,) = by_name["fleet"]["file_sd_configs"]
    assert sd == {"files": ["targets/*.json"], "refresh_interval": "30s"}
    assert (OBSERVABILITY_DIR / "targets" / ".gitignore").read_text().splitlines()[-1] == "*.json"
    assert config["rule_files"] == ["rules/*.yml"]


@pytest.mark.parametrize("engine", ["vllm", "echo"])
def test_make_ups_config_is_the_shipped_one_on_local_addresses(tmp_path: Path, engine: str) -> None:
    ports = StackPorts.with_offset(0)
    rendered = render_local_config(local_targets(ports, engine))
    (tmp_path / "prometheus.yml").write_text(dump_yaml(rendered))
    out = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    by_name = jobs(rendered)
    assert by_name["gateway"]["static_configs"] == [{"targets": ["127.0.0.1:8080"]}]
    assert by_name["engine-proxy"]["static_configs"] == [{"targets": ["127.0.0.1:50064"]}]
    assert all("dns_sd_configs" not in job for job in by_name.values())
    # No vLLM under ENGINE=echo: no job, so no VLLMEndpointDown for servers that were never meant to run.
    vllm = by_name.get("vllm", {}).get("static_configs")
    assert vllm == ([{"targets": ["127.0.0.1:8000", "127.0.0.1:8001"]}] if engine == "vllm" else None)
    assert by_name["fleet"]["file_sd_configs"][0]["files"] == [str(OBSERVABILITY_DIR / "targets" / "*.json")]
    assert rendered["rule_files"] == [str(OBSERVABILITY_DIR / "rules" / "*.yml")]


def test_make_up_starts_prometheus_on_the_rendered_config_and_make_down_stops_it(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    ports = StackPorts(services={"gateway": free_port()}, prometheus=free_port())
    try:
        url = start_prometheus(run, ports, "echo")
        assert url == ports.prometheus_url and http_ok(f"{url}/-/ready")
        rules = httpx.get(f"{url}/api/v1/rules", timeout=10).json()["data"]["groups"]
        assert {r["name"] for g in rules for r in g["rules"]} == set(alert_rules())
        assert jobs(yaml.safe_load((run.root / "prometheus" / "prometheus.yml").read_text())).keys() == \
            {"gateway", "fleet"}
    finally:
        down(run)
    assert not http_ok(f"{ports.prometheus_url}/-/ready") and run.recorded("prometheus") is None


def test_make_up_without_prometheus_says_how_to_install_it_and_carries_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no prometheus binary on it
    assert start_prometheus(RunDir(tmp_path / "run"), StackPorts(prometheus=free_port()), "echo") is None
    assert "apt-get install prometheus" in capsys.readouterr().err
    assert _prometheus_line(None).startswith("Prometheus: not installed (apt-get install prometheus)")
