"""EXAMLOPS_WORKERS=2: the gateway and engine-proxy each run two worker processes on one port.

Real processes on a Redis of their own: the official openai client gets its answers, both workers
of each service serve (their own sample files in the metrics directory say how many calls each
took), /metrics counts the calls of all workers, a budget shared by both gateway workers is never
overspent, health answers SERVING from every engine-proxy worker, a SIGTERM to the parent stops
every worker and removes the metrics directory, a worker killed later is replaced, and a port
already taken stops the service at start with a message.
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from examlops.svc import DEFAULT_ADMIN_KEY, metrics_dir
from examlops_devstack import free_port, wait_grpc
from examlops_testsupport.fixtures import Stack, running_stack, start_redis, wait_until
from examlops_testsupport.governance import FAST, check_budget_never_overspent, routes_and_prices_synced
from examlops_testsupport.workers import children, start_engine_proxy

WORKERS = {"EXAMLOPS_WORKERS": "2"}
HEALTH_CHECK = "/grpc.health.v1.Health/Check"


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The stack on its own Redis, gateway and engine-proxy with two workers each, fast heartbeats;
    the echo model `conc-a` (and `slow`, which routes_and_prices_synced expects) priced."""
    redis_server = start_redis(tmp_path_factory.mktemp("workers-redis"))
    try:
        with running_stack(tmp_path_factory.mktemp("workers"), redis_server, {**FAST, **WORKERS}) as stack:
            for model in ("conc-a", "slow"):
                stack.register(model, engine="echo", project="conc")
                assert stack.cli("gateway", "price", "set", model, "--input-per-mtok", "1",
                                 "--output-per-mtok", "2").returncode == 0
            # each worker follows routes and prices on its own: wait until the port answers from both
            wait_until(lambda: all(routes_and_prices_synced(stack.gateway_url) for _ in range(20)), 20)
            yield stack
    finally:
        redis_server.proc.stop()


def per_worker(service: str, parent: int, sample: str, **labels: str) -> dict[int, float]:
    """`sample` summed over the series matching `labels`, per worker pid, from each worker's own file."""
    [folder] = metrics_dir(service, parent)
    out: dict[int, float] = {}
    for path in folder.glob("counter_*.db"):
        pid = int(path.stem.rsplit("_", 1)[1])
        out[pid] = sum(s.value for family in MultiProcessCollector.merge([str(path)], accumulate=True)
                       for s in family.samples
                       if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))
    return out


def scraped(url: str, sample: str, **labels: str) -> float:
    """`sample` summed over the matching series of one /metrics page."""
    page = httpx.get(url, timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(page) for s in family.samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def chat(url: str, i: int) -> None:
    """One call on a client of its own (a connection of its own, accepted by either worker)."""
    with openai.OpenAI(base_url=url + "/v1", api_key=DEFAULT_ADMIN_KEY, max_retries=0, timeout=30) as client:
        resp = client.chat.completions.create(model="conc-a", messages=[{"role": "user", "content": f"w{i} hello"}],
                                              max_tokens=8)
    assert resp.choices[0].message.content and resp.usage is not None


def test_gateway_workers_serve_one_port_and_metrics_sum_them(two_workers: Stack) -> None:
    stack = two_workers
    gateway = stack.procs["gateway"].pid
    workers = children(gateway)
    assert len(workers) == 2, workers
    requests = "examlops_gateway_requests_total"
    metrics_url = stack.gateway_url + "/metrics"
    before = scraped(metrics_url, requests, model="conc-a", status="200")
    sent = 0
    while sent < 400:  # new connections until each worker has taken some
        for _ in range(10):
            chat(stack.gateway_url, sent)
            sent += 1
        took = per_worker("gateway", gateway, requests, model="conc-a", status="200")
        if all(took.get(pid, 0) > 0 for pid in workers):
            break
    took = per_worker("gateway", gateway, requests, model="conc-a", status="200")
    assert set(took) == workers and all(took[pid] > 0 for pid in workers), took
    # whichever worker answers the scrape, it counts the calls of both
    for _ in range(6):
        assert scraped(metrics_url, requests, model="conc-a", status="200") - before == sent
    assert scraped(metrics_url, "examlops_gateway_governance_store_up") == 1
    # each worker is a replica of its own for the reaper
    with stack.redis_client() as r:
        assert r.zcard("{exa:gw}:replicas") == 2


def test_budget_shared_by_the_workers_is_never_overspent_and_nothing_is_reaped(two_workers: Stack) -> None:
    check_budget_never_overspent(two_workers, [two_workers.gateway_url])
    # a worker's reservations are its own: the other worker's reaper (every 0.5 s) returned none
    assert scraped(two_workers.gateway_url + "/metrics", "examlops_gateway_reservations_reaped_total") == 0


def fresh_health_check(addr: str) -> int:
    """Health/Check on a connection of its own (no subchannel shared with other channels)."""
    with grpc.insecure_channel(addr, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return int(reply.status)


def test_engine_proxy_workers_answer_health_and_sum_their_metrics(two_workers: Stack) -> None:
    stack = two_workers
    parent = stack.procs["engine-proxy"].pid
    workers = children(parent)
    assert len(workers) == 2, workers
    metrics_url = f"http://127.0.0.1:{stack.ports.metrics['engine-proxy']}/metrics"
    handled = "examlops_grpc_server_handled_total"
    before = scraped(metrics_url, handled, method=HEALTH_CHECK, code="OK")
    sent = 0
    while sent < 400:
        for _ in range(10):
            assert fresh_health_check(stack.ports.addr("engine-proxy")) == health_pb2.HealthCheckResponse.SERVING
            sent += 1
        took = per_worker("engine-proxy", parent, handled, method=HEALTH_CHECK, code="OK")
        if all(took.get(pid, 0) > 0 for pid in workers):
            break
    assert all(took.get(pid, 0) > 0 for pid in workers), took  # SERVING from each worker
    assert scraped(metrics_url, handled, method=HEALTH_CHECK, code="OK") - before == sent
    # generations through the gateway reach the engine-proxy workers and are counted once
    generations = scraped(metrics_url, "examlops_engine_generations_total")
    for i in range(5):
        chat(stack.gateway_url, i)
    assert scraped(metrics_url, "examlops_engine_generations_total") - generations == 5


def test_engine_proxy_replaces_a_dead_worker_and_sigterm_stops_them_all(two_workers: Stack) -> None:
    stack = two_workers
    port = free_port()
    proc = start_engine_proxy(stack, "ep-sigterm", port, free_port())
    try:
        wait_grpc(f"127.0.0.1:{port}", 30, proc)
        wait_until(lambda: len(children(proc.pid)) == 2, 10, what="two workers")
        # both serving: a worker that dies before it serves stops the service (by design)
        wait_until(lambda: "2 workers serving" in proc.log_tail(), 30, what="both workers serving")
        [folder] = metrics_dir("engine-proxy", proc.pid)
        first = children(proc.pid)
        os.kill(min(first), signal.SIGKILL)  # a worker dies once serving: another takes its place
        wait_until(lambda: len(children(proc.pid) - first) == 1 and len(children(proc.pid)) == 2, 30,
                   what="a new worker")
        assert fresh_health_check(f"127.0.0.1:{port}") == health_pb2.HealthCheckResponse.SERVING
        workers = children(proc.pid)
        os.kill(proc.pid, signal.SIGTERM)  # the parent alone: it passes the signal on
        assert proc.popen.wait(timeout=30) == 0
        wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers), 10, what="no orphan worker")
        assert not folder.exists()
    finally:
        proc.stop()


def test_engine_proxy_on_a_taken_port_exits_with_a_message(two_workers: Stack) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc = start_engine_proxy(two_workers, "ep-taken", taken.getsockname()[1], 0)
        try:
            assert proc.popen.wait(timeout=30) != 0
            assert "cannot listen on 127.0.0.1" in proc.log_tail()
        finally:
            proc.stop()


def test_gateway_sigterm_stops_every_worker_and_removes_the_metrics(two_workers: Stack) -> None:
    proc, url = two_workers.start_gateway_replica("gateway-sigterm", WORKERS)
    chat(url, 0)
    workers = children(proc.pid)
    assert len(workers) == 2
    [folder] = metrics_dir("gateway", proc.pid)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.popen.wait(timeout=30) == 0
    wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers), 10, what="no orphan worker")
    assert not folder.exists()


def test_gateway_workers_stop_when_their_parent_is_killed(two_workers: Stack) -> None:
    proc, url = two_workers.start_gateway_replica("gateway-orphans", WORKERS)
    chat(url, 0)
    wait_until(lambda: proc.log_tail().count("Application startup complete") == 2, 30, what="both workers up")
    workers = children(proc.pid)
    assert len(workers) == 2
    os.kill(proc.pid, signal.SIGKILL)  # no SIGTERM to pass on: each worker must notice on its own
    proc.popen.wait(timeout=10)
    try:
        wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers), 30, what="no orphan worker")
    finally:
        for pid in workers:
            if Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)
