"""Registry on a real Redis: validation, watch propagation, durability across SIGKILL, audit."""

from __future__ import annotations

import signal
from pathlib import Path

import grpc
import openai
import pytest

from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import DEFAULT_ADMIN_KEY, error_reason
from examlops_testsupport.fixtures import RedisServer, Stack, running_stack, start_redis, wait_until


def test_register_validates_and_fills_defaults(stack: Stack) -> None:
    ep = stack.register("valid-1", engine="vllm", base_url="http://gpu01:8000/", project="acme")
    assert ep.engine == "vllm-server" and ep.base_url == "http://gpu01:8000"
    assert ep.launcher == "external" and ep.served_model_name == "valid-1" and ep.revision >= 1
    assert ep.created_at_ms > 0 and ep.updated_at_ms >= ep.created_at_ms
    for bad, field in [(dict(name="Bad Name"), "name"), (dict(name="x1", engine="tgi"), "engine"),
                       (dict(name="x2", base_url="gpu01:8000"), "base_url"),
                       (dict(name="x3", launcher="nomad"), "launcher")]:
        with pytest.raises(grpc.RpcError) as info:
            stack.registry().RegisterEndpoint(reg.RegisterEndpointRequest(endpoint=reg.Endpoint(**bad)), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert error_reason(info.value) == ("invalid_endpoint", field)  # type: ignore[arg-type]
    with pytest.raises(grpc.RpcError):
        stack.registry().GetEndpoint(reg.GetEndpointRequest(name="x1"), timeout=5)


def test_live_endpoint_is_not_silently_replaced(stack: Stack) -> None:
    stack.register("live-1", engine="echo")
    with pytest.raises(grpc.RpcError) as info:
        stack.registry().RegisterEndpoint(reg.RegisterEndpointRequest(
            endpoint=reg.Endpoint(name="live-1", engine="echo")), timeout=5)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS  # type: ignore[attr-defined]
    assert "READY" in (info.value.details() or "")  # type: ignore[attr-defined]


def test_list_filters_by_project_and_state(stack: Stack) -> None:
    stack.register("proj-a", engine="echo", project="p-one")
    stack.register("proj-b", engine="echo", project="p-one", state=reg.ENDPOINT_STATE_STOPPED)
    stack.register("proj-c", engine="echo", project="p-two")
    r = stack.registry()
    names = {e.name for e in r.ListEndpoints(reg.ListEndpointsRequest(project="p-one"), timeout=5).endpoints}
    assert names == {"proj-a", "proj-b"}
    stopped = r.ListEndpoints(reg.ListEndpointsRequest(project="p-one", states=[reg.ENDPOINT_STATE_STOPPED]),
                              timeout=5).endpoints
    assert [e.name for e in stopped] == ["proj-b"]


def test_watch_streams_snapshot_then_changes(stack: Stack) -> None:
    stack.register("watch-1", engine="echo")
    stream = stack.registry().WatchEndpoints(reg.WatchEndpointsRequest(), timeout=20)
    seen_synced = False
    for ev in stream:
        if ev.kind == reg.EndpointEvent.KIND_SYNCED:
            seen_synced = True
            stack.registry().UpdateEndpoint(reg.UpdateEndpointRequest(
                name="watch-1", state=reg.ENDPOINT_STATE_DISABLED, actor="tests"), timeout=5)
        elif seen_synced and ev.endpoint.name == "watch-1":
            assert ev.kind == reg.EndpointEvent.KIND_PUT
            assert ev.endpoint.state == reg.ENDPOINT_STATE_DISABLED
            break
    stream.cancel()
    assert seen_synced


def test_every_mutation_is_audited(stack: Stack) -> None:
    stack.register("audit-1", engine="echo")
    stack.registry().UpdateEndpoint(reg.UpdateEndpointRequest(
        name="audit-1", state=reg.ENDPOINT_STATE_STOPPED, actor="alice", action="stop"), timeout=5)
    stack.registry().RemoveEndpoint(reg.RemoveEndpointRequest(name="audit-1", actor="bob"), timeout=5)
    events = stack.registry().ListAuditEvents(reg.ListAuditEventsRequest(target="endpoint:audit-1"), timeout=5).events
    # The actor is the credential's name; what an operator's request claims is not evidence.
    assert [(e.action, e.actor, e.on_behalf_of) for e in events] == [
        ("remove", "cli:tests", ""), ("stop", "cli:tests", ""), ("register", "cli:tests", "")]
    assert events[0].after_json == "" and '"STOPPED"' in events[0].before_json.replace("ENDPOINT_STATE_", "")
    assert events[2].before_json == "" and "audit-1" in events[2].after_json


def test_new_endpoint_routes_within_a_second_and_survives_registry_outage(
        tmp_path: Path, redis_server: RedisServer) -> None:
    with running_stack(tmp_path, redis_server) as stack:
        client = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=DEFAULT_ADMIN_KEY, max_retries=0)
        t_close = client.close

        def answers() -> bool:
            try:
                client.chat.completions.create(model="fresh-1", messages=[{"role": "user", "content": "hi"}])
            except openai.NotFoundError:
                return False
            return True
        assert not answers()  # the gateway holds a route table, and it has no fresh-1 yet
        stack.register("fresh-1", engine="echo")
        # Routes come only from the watch (there is no polling), so this can only pass by its push;
        # the deadline is generous so that a loaded machine does not flake.
        wait_until(answers, timeout_s=5.0)
        stack.stop("registry", signal.SIGKILL)
        for _ in range(5):  # no registry on the request path
            resp = client.chat.completions.create(model="fresh-1", messages=[{"role": "user", "content": "still"}])
            assert resp.choices[0].message.content == "echo: still"
        stack.start("registry")  # the watch comes back by itself
        stack.register("fresh-2", engine="echo")
        wait_until(lambda: any(m.id == "fresh-2" for m in client.models.list()), timeout_s=5)
        t_close()


def test_acknowledged_writes_survive_redis_sigkill(tmp_path: Path) -> None:
    server = start_redis(tmp_path / "redis")
    try:
        with running_stack(tmp_path / "stack", server) as stack:
            stack.register("durable-1", engine="echo", project="keep")
            stack.registry().RecordAuditEvent(reg.RecordAuditEventRequest(event=reg.AuditEvent(
                actor="tests", action="key.issue", target="key:k1")), timeout=5)
            server.proc.stop(signal.SIGKILL)
            server = start_redis(tmp_path / "redis", port=server.port)
            ep = stack.registry().GetEndpoint(reg.GetEndpointRequest(name="durable-1"), timeout=5)
            assert ep.project == "keep"
            events = stack.registry().ListAuditEvents(reg.ListAuditEventsRequest(target="key:k1"), timeout=5).events
            assert [e.action for e in events] == ["key.issue"]
    finally:
        server.proc.stop()


def test_registry_refuses_redis_without_aof(tmp_path: Path) -> None:
    import subprocess
    import sys

    from examlops_devstack import free_port, spawn

    port = free_port()
    proc = spawn("redis", ["redis-server", "--port", str(port), "--appendonly", "no", "--save", "",
                           "--dir", str(tmp_path)], {}, tmp_path / "redis.log")
    try:
        wait_until(lambda: proc.log_tail().find("Ready to accept") >= 0)
        out = subprocess.run([sys.executable, "-m", "examlops_registry"], capture_output=True, text=True, timeout=30,
                             env={"EXAMLOPS_REDIS_URL": f"redis://127.0.0.1:{port}/0", "EXAMLOPS_PORT": "0",
                                  "EXAMLOPS_INTERNAL_TOKENS": "cli:tests=" + "t" * 32, "PATH": "/usr/bin:/bin"})
        assert out.returncode != 0
        assert "appendonly" in out.stderr and "EXAMLOPS_REQUIRE_AOF" in out.stderr
    finally:
        proc.stop()
