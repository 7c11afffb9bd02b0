"""The shipped Grafana dashboards and their provisioning (observability/grafana/).

Every panel expression (and every variable's selector) goes through `promtool check rules` as a
recording rule, with Grafana's variables replaced by valid values; every metric name a dashboard
reads must exist in a live scrape: the gateway's and the engine-proxy's /metrics after calls that
create their labelled series, or a real CPU vLLM with prefix caching and ngram speculative decoding.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
import yaml

from examlops.registry.v1 import registry_pb2 as reg
from examlops_devstack import service_argv, spawn, wait_grpc
from examlops_testsupport import REPO_ROOT
from examlops_testsupport.cache import cache_cli
from examlops_testsupport.fixtures import Stack, free_port, wait_until
from examlops_testsupport.governance import issue, routes_and_prices_synced
from examlops_testsupport.guardrails import applied, client, guardrail, set_policy
from examlops_testsupport.plugin import VllmServer
from examlops_testsupport.prometheus import metric_names, promtool, scraped_names
from examlops_testsupport.replica_backend import ReplicaBackend

GRAFANA = REPO_ROOT / "observability" / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
#: Where compose.yaml mounts the dashboards folder and how Grafana reaches Prometheus (observability/README.md).
DASHBOARDS_MOUNT = "/var/lib/grafana/dashboards/examlops"
PROMETHEUS_URL = "http://prometheus:9090"
DATASOURCE_UID = "prometheus"
#: Series Prometheus writes itself for every target: in no scrape.
SYNTHETIC = {"up"}
#: Grafana's built-in interval variables, as a query would see them.
GRAFANA_INTERVALS = {"__rate_interval": "5m", "__range": "1h", "__interval": "1m", "__range_s": "3600"}
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
#: The pool endpoint the live scrape of the services calls.
POOL = "dash-pool"
LABEL_VALUES = re.compile(r"^label_values\((?:(.*),\s*)?(\w+)\)$")


def load(path: Path) -> dict[str, Any]:
    board: dict[str, Any] = json.loads(path.read_text())
    return board


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows included (rows themselves excluded)."""
    for panel in board["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def variables(board: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in board["templating"]["list"]}


def expressions(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and of every query variable's series selector."""
    found = [(f"{board['uid']}: {p['title']} [{t['refId']}]", t["expr"]) for p in panels(board) for t in p["targets"]]
    for var in variables(board).values():
        if var["type"] == "query":
            m = LABEL_VALUES.match(var["query"]["query"])
            assert m, f"{board['uid']}: variable {var['name']} is not a label_values(...) query"
            if m.group(1):
                found.append((f"{board['uid']}: variable {var['name']}", m.group(1)))
    return found


def concrete(expr: str, names: set[str]) -> str:
    """`expr` with Grafana's variables replaced: intervals by durations, dashboard variables (used as
    label regexes) by `.*`. An unknown variable fails."""
    def value(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name in GRAFANA_INTERVALS:
            return GRAFANA_INTERVALS[name]
        assert name in names, f"unknown variable ${name} in {expr}"
        return ".*"
    return VARIABLE.sub(value, expr)



def dashboard_metrics() -> set[str]:
    return {n for path in DASHBOARDS for _, expr in expressions(load(path)) for n in metric_names(expr)}



def missing(wanted: set[str], scraped: set[str]) -> list[str]:
    return sorted(wanted - scraped)



def check_rules(exprs: list[tuple[str, str]], workdir: Path) -> subprocess.CompletedProcess[str]:
    """`promtool check rules` over a file holding each expression as a recording rule."""
    rules = [{"record": f"grafana:expr_{i}", "expr": expr} for i, (_, expr) in enumerate(exprs)]
    path = workdir / "dashboard-exprs.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "grafana-dashboards", "rules": rules}]}, sort_keys=False))
    return promtool("check", "rules", str(path), cwd=workdir)


# --- the files -------------------------------------------------------------------------------------------------


def test_the_dashboards_are_shipped() -> None:
    assert {p.name for p in DASHBOARDS} >= {"vllm-serving.json", "gateway.json"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_a_dashboard_is_well_formed(path: Path) -> None:
    board = load(path)
    assert board["uid"] and board["title"].startswith("ExaMLOps /") and board["schemaVersion"] >= 39
    found = variables(board)
    ds = found["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus" and ds["current"]["value"] == DATASOURCE_UID
    ids = [p["id"] for p in board["panels"]] + [p["id"] for row in board["panels"] for p in row.get("panels", [])]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {path.name}"
    for panel in [*board["panels"], *panels(board)]:
        pos = panel["gridPos"]
        assert set(pos) == {"h", "w", "x", "y"} and pos["x"] + pos["w"] <= 24, panel["title"]
    for panel in panels(board):
        assert panel["title"] and panel["description"], panel["id"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"] and target["expr"].strip(), panel["title"]
    for var in found.values():
        if var["type"] == "query":
            assert var["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, var["name"]
    for _, expr in expressions(board):  # every variable an expression uses is defined
        concrete(expr, set(found))


def test_no_two_dashboards_share_a_uid() -> None:
    uids = [load(p)["uid"] for p in DASHBOARDS]
    assert len(uids) == len(set(uids))


def test_the_provisioning_points_grafana_at_prometheus_and_the_dashboards_folder() -> None:
    sources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert sources["apiVersion"] == 1
    [source] = sources["datasources"]
    assert (source["uid"], source["type"], source["url"]) == (DATASOURCE_UID, "prometheus", PROMETHEUS_URL)
    boards = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "examlops.yml").read_text())
    [provider] = boards["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == DASHBOARDS_MOUNT
    readme = (REPO_ROOT / "observability" / "README.md").read_text()
    assert DASHBOARDS_MOUNT in readme and PROMETHEUS_URL in readme


# --- the expressions -------------------------------------------------------------------------------------------


def test_the_metric_name_reader() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, instance) (rate(vllm:time_to_first_token_seconds_bucket'
            '{job=~".*", model_name="a b"}[5m]))) / on (instance) group_left up or vector(1) * 3600 '
            '+ sum without (le) (x_total offset 5m) > bool 1e3')
    assert metric_names(expr) == {"vllm:time_to_first_token_seconds_bucket", "up", "x_total"}
    assert concrete('rate(a{b=~"$endpoint", c=~"${job}"}[$__rate_interval])', {"endpoint", "job"}) == \
        'rate(a{b=~".*", c=~".*"}[5m])'
    with pytest.raises(AssertionError, match=r"unknown variable \$nope"):
        concrete('a{b=~"$nope"}', set())


def test_every_dashboard_expression_passes_promtool(tmp_path: Path) -> None:
    exprs = [(where, concrete(expr, set(variables(load(path)))))
             for path in DASHBOARDS for where, expr in expressions(load(path))]
    assert len(exprs) > 40
    out = check_rules(exprs, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in out.stdout
    # the check can fail: an expression with an unbalanced parenthesis is refused
    bad = check_rules([*exprs, ("broken", "sum(rate(vllm:generation_tokens_total[5m])")], tmp_path)
    assert bad.returncode != 0 and "parse error" in bad.stdout + bad.stderr


def test_dashboard_metrics_come_from_vllm_or_the_services() -> None:
    names = dashboard_metrics()
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
            "vllm:prefix_cache_hits_total", "vllm:spec_decode_num_accepted_tokens_total",
            "examlops_gateway_cost_usd_total", "examlops_engine_replica_picks_total"} <= names
    strays = sorted(n for n in names if not n.startswith(("vllm:", "examlops_")) and n not in SYNTHETIC)
    assert not strays, f"metrics of no known scrape: {strays}"


# --- the live scrapes ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def services_scrape(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[set[str]]:
    """The sample names of a gateway's and an engine-proxy's /metrics after calls that make every labelled
    series the gateway dashboard reads: priced, cached and guarded calls (project `conc`) on a pool of
    two replicas (one answers 503: errors, retries, an ejection), a model the key may not use and a key
    over its requests-per-minute limit (a refusal). Both processes are this fixture's own, so their
    counters hold only these calls and the engine-proxy exports on a metrics port."""
    workdir = tmp_path_factory.mktemp("dash")
    ok, failing = ReplicaBackend(), ReplicaBackend()
    ok.running = 5.0        # the failing replica looks less loaded: least-load picks it first
    failing.status = 503
    grpc_port, metrics_port = free_port(), free_port()
    proxy = spawn("dash-engine-proxy", service_argv("engine-proxy"),
                  {**stack.env("engine-proxy"), "EXAMLOPS_PORT": str(grpc_port),
                   "EXAMLOPS_METRICS_PORT": str(metrics_port)}, workdir / "engine-proxy.log")
    try:
        wait_grpc(f"127.0.0.1:{grpc_port}", 30, proxy)
        _, url = stack.start_gateway_replica("dash-gateway", {
            "EXAMLOPS_ENGINE_PROXY_ADDR": f"127.0.0.1:{grpc_port}", "EXAMLOPS_PRICE_REFRESH_S": "0.2"})
        proxy_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        make_series(stack, url, proxy_metrics, [ok.url, failing.url])
        yield scraped_names(httpx.get(url + "/metrics", timeout=10).text) | \
            scraped_names(httpx.get(proxy_metrics, timeout=10).text)
    finally:
        with contextlib.suppress(grpc.RpcError):  # the session's stack stops routing to the closed stubs
            stack.registry().RemoveEndpoint(reg.RemoveEndpointRequest(name=POOL, actor="tests"), timeout=5)
        if "dash-gateway" in stack.procs:
            stack.stop("dash-gateway")
        proxy.stop()
        ok.close()
        failing.close()


def make_series(stack: Stack, url: str, proxy_metrics: str, replicas: list[str]) -> None:
    model = POOL
    block = json.dumps({"engine": "vllm", "hf_model_id": "org/stub", "routing": "least-load"})
    stack.register(model, engine="vllm-server", engine_block_json=block, project="dash",
                   replicas=[reg.Replica(base_url=u) for u in replicas])
    priced = stack.cli("gateway", "price", "set", model, "--input-per-mtok", "1", "--output-per-mtok", "2")
    assert priced.returncode == 0, priced.stderr
    cache_cli(stack, "set", "--model", model, "--mode", "exact", urls=(url,))
    set_policy(stack, "dash-email", "--detector", "pii", "--entities", "EMAIL_ADDRESS", "--direction", "input",
               "--action", "redact")
    guardrail(stack, "attach", "dash-email", "--model", model)
    wait_until(lambda: applied(url), 5, what="the gateway applies the guardrail policies")
    wait_until(lambda: routes_and_prices_synced(url, (model,)), 10, what="the gateway routes and prices the pool")
    c = client(stack, issue(url, (model,))["virtual_key"], url)
    calls = iter(range(1000))

    def ask_until_ejected() -> bool:  # each call is answered (moved to the healthy replica if need be)
        c.chat.completions.create(model=model, messages=[{"role": "user", "content": f"mail bob{next(calls)}@x.org"}])
        return "examlops_engine_replica_ejections_total" in scraped_names(httpx.get(proxy_metrics, timeout=10).text)

    wait_until(ask_until_ejected, 20, 0.1, "an ejection of the failing replica")
    c.chat.completions.create(model=model, messages=[{"role": "user", "content": "mail bob0@x.org"}])
    with pytest.raises(openai.PermissionDeniedError):  # a model the key may not use
        c.chat.completions.create(model="dash-other-model", messages=[{"role": "user", "content": "hi"}])
    limited = client(stack, issue(url, (model,), rpm=1)["virtual_key"], url)
    limited.chat.completions.create(model=model, messages=[{"role": "user", "content": "one"}])
    with pytest.raises(openai.RateLimitError):
        limited.chat.completions.create(model=model, messages=[{"role": "user", "content": "two"}])


def test_every_service_metric_of_the_dashboards_is_in_a_live_scrape(services_scrape: set[str]) -> None:
    wanted = {n for n in dashboard_metrics() if n.startswith("examlops_")}
    assert len(wanted) >= 15
    assert not missing(wanted, services_scrape), f"not in the gateway's or engine-proxy's scrape: " \
                                                 f"{missing(wanted, services_scrape)}"


@pytest.mark.vllm
def test_every_vllm_metric_of_the_dashboards_is_in_a_live_scrape(smol_spec_vllm: VllmServer) -> None:
    """The session's real vLLM with prefix caching and ngram speculative decoding, after two chat calls."""
    base = smol_spec_vllm.base_url
    for _ in range(2):
        resp = httpx.post(base + "/v1/chat/completions", timeout=120, json={
            "model": "smol", "max_tokens": 24,
            "messages": [{"role": "user", "content": "Repeat: one two three one two three"}]})
        assert resp.status_code == 200, resp.text
    scraped = scraped_names(httpx.get(base + "/metrics", timeout=10).text)
    wanted = {n for n in dashboard_metrics() if n.startswith("vllm:")}
    assert len(wanted) >= 15
    assert not missing(wanted, scraped), f"not in vLLM's scrape: {missing(wanted, scraped)}"
