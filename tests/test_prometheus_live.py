"""The real Prometheus, on the shipped config and rules, scrapes the stack's five services and a real
CPU vLLM serving SmolLM2; what it sees when that vLLM is killed and when the gateway's Redis goes.

The config is the shipped one rendered for these processes (as `make up` does) with a 1 s scrape and
rule-evaluation interval; the alert expressions are read from the shipped rules files.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_devstack import SERVICES, Proc, free_port, local_targets
from examlops_testsupport.fixtures import RedisServer, Stack, running_stack, start_redis, wait_until
from examlops_testsupport.prometheus import alert_rules, metric_names, query, running_prometheus
from examlops_testsupport.vllm import smol_block, start_vllm

pytestmark = pytest.mark.vllm


@dataclass
class Observed:
    prometheus: str
    stack: Stack
    redis: RedisServer
    vllm: Proc
    vllm_url: str


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    """A stack on a Redis of its own (stopping it must not touch the session's), a SmolLM2 vLLM,
    and Prometheus scraping all of them every second."""
    root = tmp_path_factory.mktemp("prometheus-live")
    redis = start_redis(root / "redis")
    try:
        with running_stack(root / "stack", redis) as stack:
            port = free_port()
            vllm = start_vllm(root, port, smol_block())
            try:
                targets = {**local_targets(stack.ports, "echo"), "vllm": [f"127.0.0.1:{port}"]}
                with running_prometheus(root / "prometheus", targets, scrape_interval="1s") as url:
                    yield Observed(url, stack, redis, vllm, f"http://127.0.0.1:{port}")
            finally:
                vllm.stop()
    finally:
        redis.proc.stop()


def _jobs_up(url: str) -> set[str]:
    return {r["metric"]["job"] for r in query(url, "up == 1")}


def _alert_state(url: str, name: str) -> set[str]:
    alerts = httpx.get(f"{url}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
    return {a["state"] for a in alerts if a["labels"]["alertname"] == name}


def test_the_five_services_and_vllm_are_scraped(observed: Observed) -> None:
    wait_until(lambda: _jobs_up(observed.prometheus) >= {*SERVICES, "vllm"}, 60, 0.5, "every job up")
    assert {r["metric"]["instance"] for r in query(observed.prometheus, 'up{job="vllm"} == 1')} == \
        {observed.vllm_url.removeprefix("http://")}


def test_every_metric_the_alerts_read_is_in_a_real_scrape(observed: Observed) -> None:
    # One call through the gateway and one on vLLM: the labelled series appear with their first sample.
    observed.stack.register("echo-prom", engine="echo")
    headers = {"Authorization": f"Bearer {DEFAULT_ADMIN_KEY}"}
    body = {"model": "echo-prom", "messages": [{"role": "user", "content": "hi"}]}
    wait_until(lambda: httpx.post(observed.stack.gateway_url + "/v1/chat/completions", json=body, headers=headers,
                                  timeout=30).status_code == 200, 10, 0.2, "a call through the gateway")
    answer = httpx.post(observed.vllm_url + "/v1/completions", timeout=120,
                        json={"model": smol_block().served_model_name, "prompt": "Hello", "max_tokens": 4})
    assert answer.status_code == 200, answer.text
    names = set().union(*(metric_names(rule["expr"]) for rule in alert_rules().values()))
    assert {"up", "vllm:kv_cache_usage_perc", "examlops_gateway_requests_total"} <= names, names

    def stored() -> set[str]:
        return {name for name in names if query(observed.prometheus, f'count({{__name__="{name}"}})')}

    wait_until(lambda: stored() == names, 30, 0.5, "every metric name of the rules in Prometheus")


def test_a_killed_vllm_is_down_and_vllm_endpoint_down_holds(observed: Observed) -> None:
    wait_until(lambda: "vllm" in _jobs_up(observed.prometheus), 60, 0.5, "vllm scraped")
    instance = observed.vllm_url.removeprefix("http://")
    observed.vllm.stop(signal.SIGKILL)

    wait_until(lambda: query(observed.prometheus, 'up{job="vllm"} == 0'), 30, 0.5, 'up{job="vllm"} == 0')
    (down,) = query(observed.prometheus, 'up{job="vllm"} == 0')
    assert down["metric"]["instance"] == instance
    # The shipped alert's own expression is true for it, and Prometheus' rule engine agrees: the
    # alert is pending (it fires after its `for`, 2 minutes).
    (found,) = query(observed.prometheus, alert_rules()["VLLMEndpointDown"]["expr"])
    assert (found["metric"]["job"], found["metric"]["instance"]) == ("vllm", instance)
    wait_until(lambda: _alert_state(observed.prometheus, "VLLMEndpointDown") == {"pending"}, 30, 0.5,
               "VLLMEndpointDown pending")
    assert not query(observed.prometheus, alert_rules()["ExaMLOpsServiceDown"]["expr"])


def test_a_gateway_without_redis_makes_the_governance_store_alert_true(observed: Observed) -> None:
    expr = alert_rules()["GatewayGovernanceStoreUnreachable"]["expr"]
    wait_until(lambda: query(observed.prometheus, "examlops_gateway_governance_store_up == 1"), 30, 0.5,
               "the governance store seen up")
    assert not query(observed.prometheus, expr)
    observed.redis.proc.stop(signal.SIGKILL)

    wait_until(lambda: query(observed.prometheus, expr), 30, 0.5, "GatewayGovernanceStoreUnreachable's expression")
    (found,) = query(observed.prometheus, expr)
    assert found["metric"]["instance"] == observed.stack.gateway_url.removeprefix("http://")
    wait_until(lambda: _alert_state(observed.prometheus, "GatewayGovernanceStoreUnreachable") == {"pending"}, 30,
               0.5, "GatewayGovernanceStoreUnreachable pending")
    assert "gateway" in _jobs_up(observed.prometheus)  # the gateway itself still serves
