"""Replica pools in the registry, on a real Redis: normalisation, derived fields, per-replica updates,
AddReplica/RemoveReplica with their audit and watch events, and old single-server callers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import openai
import pytest

from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import DEFAULT_ADMIN_KEY, error_reason, routable_replicas, unroutable_reason
from examlops_testsupport.fixtures import RedisServer, Stack, wait_until

S = reg.EndpointState
READY, STARTING, PENDING, FAILED = (S.ENDPOINT_STATE_READY, S.ENDPOINT_STATE_STARTING, S.ENDPOINT_STATE_PENDING,
                                    S.ENDPOINT_STATE_FAILED)
STOPPED, DISABLED = S.ENDPOINT_STATE_STOPPED, S.ENDPOINT_STATE_DISABLED


def refused(call: Callable[[], Any]) -> tuple[grpc.StatusCode, tuple[str, str], str]:
    """The status code, (reason, field) and message a call is refused with."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    err: Any = info.value
    return err.code(), error_reason(err), err.details() or ""


def pool(ep: reg.Endpoint) -> list[tuple[str, str, int]]:
    return [(r.id, r.base_url, r.state) for r in ep.replicas]


def update(stack: Stack, name: str, **fields: Any) -> reg.Endpoint:
    out: reg.Endpoint = stack.registry().UpdateEndpoint(
        reg.UpdateEndpointRequest(name=name, actor="tests", **fields), timeout=5)
    return out


def test_single_server_registration_becomes_replica_r0(stack: Stack) -> None:
    ep = stack.register("rep-legacy", base_url="http://gpu01:8000/", state=STARTING, state_reason="booting")
    assert pool(ep) == [("r0", "http://gpu01:8000", STARTING)]
    assert ep.replicas[0].source == "external" and ep.replicas[0].state_reason == "booting"
    assert ep.base_url == "http://gpu01:8000" and ep.state == STARTING
    queued = stack.register("rep-queued", launcher="slurm", job_id="4711", state=PENDING)
    assert pool(queued) == [("r0", "", PENDING)]
    assert queued.replicas[0].source == "slurm:4711" and queued.replicas[0].job_id == "4711"
    # No address and no job (an echo route): nothing to make a replica of.
    assert list(stack.register("rep-echo", engine="echo").replicas) == []


def test_pool_registration_checks_each_replica(stack: Stack) -> None:
    ep = stack.register("rep-pool", launcher="compose", replicas=[
        reg.Replica(base_url="http://a:8000/", job_id="c1", state=FAILED),
        reg.Replica(id="r0", base_url="http://b:8000", source="compose:vllm#2"),
        reg.Replica(id="gpu.3", base_url="https://c:8000")])
    assert [(r.id, r.base_url, r.source) for r in ep.replicas] == [
        ("r1", "http://a:8000", "compose:c1"), ("r0", "http://b:8000", "compose:vllm#2"),
        ("gpu.3", "https://c:8000", "compose")]
    # Replicas without a state take the registration's; the endpoint is as good as its best one.
    assert [r.state for r in ep.replicas] == [FAILED, READY, READY] and ep.state == READY
    assert ep.base_url == "http://a:8000"  # the first routable replica's (FAILED with an address is routed)
    for bad, field in [([reg.Replica(base_url="http://a:1"), reg.Replica(base_url="a:2")], "replicas[1].base_url"),
                       ([reg.Replica(base_url="http://a:1"), reg.Replica(id="R1", base_url="http://a:2")],
                        "replicas[1].id"),
                       ([reg.Replica(id="x", base_url="http://a:1"), reg.Replica(id="x", base_url="http://a:2")],
                        "replicas[1].id"),
                       ([reg.Replica(base_url="http://a:1/"), reg.Replica(base_url="http://a:1")],
                        "replicas[1].base_url")]:
        code, reason, message = refused(lambda bad=bad: stack.registry().RegisterEndpoint(
            reg.RegisterEndpointRequest(endpoint=reg.Endpoint(name="rep-bad", replicas=bad)), timeout=5))
        assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, ("invalid_endpoint", field)), message
        assert field.split(".")[-1] in message
    assert refused(lambda: stack.registry().GetEndpoint(reg.GetEndpointRequest(name="rep-bad"), timeout=5))[0] \
        == grpc.StatusCode.NOT_FOUND


def test_derived_fields_follow_the_replicas(stack: Stack) -> None:
    stack.register("rep-derive", replicas=[reg.Replica(base_url="http://a:8000", state=STARTING),
                                           reg.Replica(base_url="http://b:8000", state=PENDING)])
    ep = update(stack, "rep-derive", replica="r1", state=READY)
    assert ep.state == READY and ep.base_url == "http://a:8000"
    ep = update(stack, "rep-derive", replica="r0", draining=True, state_reason="scale-in")
    assert ep.base_url == "http://b:8000" and ep.replicas[0].draining and ep.replicas[0].state_reason == "scale-in"
    assert [r.id for r in routable_replicas(ep)] == ["r1"]
    ep = update(stack, "rep-derive", replica="r1", state=FAILED, last_health_ms=1234, state_reason="refused")
    assert ep.state == STARTING  # r0 is still STARTING, even while draining
    assert ep.replicas[1].last_health_ms == 1234 and ep.replicas[1].state_reason == "refused"
    # An operator's DISABLED is kept whatever the replicas report; a live state leaves it.
    ep = update(stack, "rep-derive", state=DISABLED, state_reason="maintenance")
    ep = update(stack, "rep-derive", replica="r1", state=READY)
    assert ep.state == DISABLED and ep.state_reason == "maintenance" and routable_replicas(ep) == []
    ep = update(stack, "rep-derive", state=STARTING)
    assert ep.state == READY and pool(ep)[1][2] == READY
    # STOPPED stops every replica; a live state brings them all back.
    ep = update(stack, "rep-derive", state=STOPPED, action="stop")
    assert ep.state == STOPPED and {r.state for r in ep.replicas} == {STOPPED}
    ep = update(stack, "rep-derive", replica="r1", state=READY)
    assert ep.state == STOPPED
    ep = update(stack, "rep-derive", state=STARTING)
    assert ep.state == READY and [r.state for r in ep.replicas] == [STARTING, READY]


def test_updates_name_their_replica(stack: Stack) -> None:
    stack.register("rep-upd", replicas=[reg.Replica(base_url="http://a:8000"), reg.Replica(base_url="http://b:8000")])
    code, reason, message = refused(lambda: update(stack, "rep-upd", replica="r9", state=READY))
    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, ("replica_not_found", "replica"))
    assert "r0, r1" in message
    for fields in [dict(base_url="http://c:8000"), dict(job_id="7"), dict(draining=True)]:
        code, reason, message = refused(lambda fields=fields: update(stack, "rep-upd", **fields))
        assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, ("invalid_endpoint", "replica")), fields
        assert "name the replica" in message
    code, reason, _ = refused(lambda: update(stack, "rep-upd", replica="r1", base_url="http://a:8000/"))
    assert (code, reason) == (grpc.StatusCode.ALREADY_EXISTS, ("replica_exists", "replica.base_url"))
    code, reason, _ = refused(lambda: update(stack, "rep-upd", replica="r1", base_url="b:9"))
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, ("invalid_endpoint", "base_url"))
    ep = update(stack, "rep-upd", replica="r1", base_url="http://c:8000/", job_id="9")
    assert pool(ep)[1][:2] == ("r1", "http://c:8000") and ep.replicas[1].job_id == "9"
    ep = update(stack, "rep-upd", state_reason="pool note")  # without a replica: the endpoint's own
    assert ep.state_reason == "pool note" and {r.state_reason for r in ep.replicas} == {""}


def test_single_server_callers_keep_working(stack: Stack) -> None:
    stack.register("rep-old", launcher="slurm", job_id="100", state=PENDING)
    ep = update(stack, "rep-old", base_url="http://node7:8000/", state=STARTING, state_reason="address published")
    assert (ep.base_url, ep.state, ep.state_reason) == ("http://node7:8000", STARTING, "address published")
    assert pool(ep) == [("r0", "http://node7:8000", STARTING)] and ep.replicas[0].state_reason == "address published"
    ep = update(stack, "rep-old", job_id="101", state=FAILED)
    assert ep.job_id == "101" and ep.state == FAILED and ep.replicas[0].source == "slurm:101"
    ep = update(stack, "rep-old", state=DISABLED)
    assert ep.state == DISABLED and ep.replicas[0].state == FAILED
    ep = update(stack, "rep-old", state=READY)
    assert ep.state == READY and ep.replicas[0].state == READY
    ep = update(stack, "rep-old", state=STOPPED, state_reason="stopped by alice")
    assert ep.state == STOPPED and ep.replicas[0].state == STOPPED
    assert unroutable_reason(ep) == "endpoint 'rep-old' is STOPPED"


def test_add_and_remove_replicas_are_audited_and_watched(stack: Stack) -> None:
    registry = stack.registry()
    stack.register("rep-live", base_url="http://a:8000")
    stream = registry.WatchEndpoints(reg.WatchEndpointsRequest(), timeout=30)
    seen: list[list[str]] = []
    for ev in stream:
        if ev.kind == reg.EndpointEvent.KIND_SYNCED:
            for url in ("http://b:8000", "http://c:8000"):
                registry.AddReplica(reg.AddReplicaRequest(name="rep-live", replica=reg.Replica(base_url=url),
                                                          actor="alice"), timeout=5)
            registry.RemoveReplica(reg.RemoveReplicaRequest(name="rep-live", replica="r1", actor="alice"), timeout=5)
        elif ev.kind == reg.EndpointEvent.KIND_PUT and ev.endpoint.name == "rep-live":
            seen.append([r.id for r in ev.endpoint.replicas])
            if len(seen) == 3:
                break
    stream.cancel()
    assert seen == [["r0", "r1"], ["r0", "r1", "r2"], ["r0", "r2"]]
    added = registry.AddReplica(reg.AddReplicaRequest(name="rep-live", replica=reg.Replica(base_url="http://d:8000")),
                                timeout=5)
    assert pool(added) == [("r0", "http://a:8000", READY), ("r2", "http://c:8000", STARTING),
                           ("r1", "http://d:8000", STARTING)]  # the next unused id
    events = registry.ListAuditEvents(reg.ListAuditEventsRequest(target="endpoint:rep-live"), timeout=5).events
    assert [(e.action, e.actor, e.on_behalf_of) for e in events] == [
        ("replica.add", "cli:tests", ""), ("replica.remove", "cli:tests", ""), ("replica.add", "cli:tests", ""),
        ("replica.add", "cli:tests", ""), ("register", "cli:tests", "")]
    assert '"r1"' in events[1].before_json and '"r1"' not in events[1].after_json


def test_add_and_remove_replica_refusals(stack: Stack) -> None:
    registry = stack.registry()
    stack.register("rep-ref", replicas=[reg.Replica(id="a", base_url="http://a:8000")])

    def add(**replica: Any) -> Callable[[], Any]:
        return lambda: registry.AddReplica(reg.AddReplicaRequest(name="rep-ref", replica=reg.Replica(**replica)),
                                           timeout=5)
    assert refused(add(id="a", base_url="http://x:1"))[:2] == (
        grpc.StatusCode.ALREADY_EXISTS, ("replica_exists", "replica.id"))
    assert refused(add(base_url="http://a:8000/"))[:2] == (
        grpc.StatusCode.ALREADY_EXISTS, ("replica_exists", "replica.base_url"))
    assert refused(add(base_url="a:8000"))[:2] == (
        grpc.StatusCode.INVALID_ARGUMENT, ("invalid_endpoint", "replica.base_url"))
    assert refused(add())[:2] == (grpc.StatusCode.INVALID_ARGUMENT, ("invalid_endpoint", "replica.base_url"))
    assert refused(lambda: registry.AddReplica(reg.AddReplicaRequest(
        name="rep-nope", replica=reg.Replica(base_url="http://x:1")), timeout=5))[:2] == (
        grpc.StatusCode.NOT_FOUND, ("endpoint_not_found", "name"))

    def remove(rid: str) -> Callable[[], Any]:
        return lambda: registry.RemoveReplica(reg.RemoveReplicaRequest(name="rep-ref", replica=rid), timeout=5)
    assert refused(remove("zz"))[:2] == (grpc.StatusCode.NOT_FOUND, ("replica_not_found", "replica"))
    code, reason, message = refused(remove("a"))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, ("last_replica", "replica"))
    assert "stop the endpoint instead" in message
    assert pool(registry.GetEndpoint(reg.GetEndpointRequest(name="rep-ref"), timeout=5)) == [
        ("a", "http://a:8000", READY)]


def test_an_address_with_a_password_is_refused_on_every_way_in_without_echoing_it(stack: Stack) -> None:
    """The registry holds addresses by the engine block's rule: a server's key is a secret ref, never
    part of a URL that every `list` would print. Registering, adding a replica and changing an address
    are refused alike, the message masks the password, and nothing is stored."""
    registry = stack.registry()
    stack.register("rep-creds", replicas=[reg.Replica(id="a", base_url="http://a:8000")])
    secret = "http://ops:s3cret@gpu01:8000"

    def add(url: str) -> Callable[[], Any]:
        return lambda: registry.AddReplica(reg.AddReplicaRequest(name="rep-creds", replica=reg.Replica(base_url=url)),
                                           timeout=5)
    calls = [
        ("base_url", lambda: registry.RegisterEndpoint(reg.RegisterEndpointRequest(
            endpoint=reg.Endpoint(name="rep-creds-new", base_url=secret)), timeout=5)),
        ("replicas[0].base_url", lambda: registry.RegisterEndpoint(reg.RegisterEndpointRequest(
            endpoint=reg.Endpoint(name="rep-creds-new", replicas=[reg.Replica(base_url=secret)])), timeout=5)),
        ("replica.base_url", add(secret)),
        ("base_url", lambda: update(stack, "rep-creds", replica="a", base_url=secret)),
    ]
    for field, call in calls:
        code, reason, message = refused(call)
        assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, ("invalid_endpoint", field)), message
        assert "'http://ops:***@gpu01:8000' carries credentials; use api_key_secret_ref" in message
        assert "s3cret" not in message
    assert refused(lambda: registry.GetEndpoint(reg.GetEndpointRequest(name="rep-creds-new"), timeout=5))[0] \
        == grpc.StatusCode.NOT_FOUND
    assert pool(registry.GetEndpoint(reg.GetEndpointRequest(name="rep-creds"), timeout=5)) == [
        ("a", "http://a:8000", READY)]
    assert refused(add("http://ops@gpu01:8000"))[0] == grpc.StatusCode.INVALID_ARGUMENT  # a user alone: no address


def test_record_stored_before_pools_routes_and_migrates(stack: Stack, redis_server: RedisServer) -> None:
    old = '{"name": "rep-pre", "base_url": "http://old:8000", "state": "ENDPOINT_STATE_READY", ' \
          '"launcher": "external", "engine": "vllm-server", "served_model_name": "rep-pre", "revision": 3}'
    redis_server.client().hset("{exa:reg}:endpoints", "rep-pre", old)
    ep = stack.registry().GetEndpoint(reg.GetEndpointRequest(name="rep-pre"), timeout=5)
    assert [(r.id, r.base_url) for r in routable_replicas(ep)] == [("r0", "http://old:8000")]
    assert unroutable_reason(ep) is None
    ep = update(stack, "rep-pre", replica="r0", draining=True)
    assert pool(ep) == [("r0", "http://old:8000", READY)] and ep.replicas[0].draining and ep.revision == 4


def test_gateway_refuses_a_pool_with_no_routable_replica(stack: Stack) -> None:
    stack.register("rep-drained", replicas=[reg.Replica(base_url="http://127.0.0.1:9"),
                                            reg.Replica(base_url="http://127.0.0.1:10")])
    update(stack, "rep-drained", replica="r0", draining=True)
    update(stack, "rep-drained", replica="r1", state=STOPPED)
    client = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=DEFAULT_ADMIN_KEY, max_retries=0)
    messages: list[str] = []

    def refused_as_unroutable() -> bool:
        try:
            client.chat.completions.create(model="rep-drained", messages=[{"role": "user", "content": "hi"}])
        except openai.NotFoundError as exc:
            messages.append(str(exc))
            return "no routable replica" in str(exc)
        except openai.APIError:
            return False
        return False
    try:
        wait_until(refused_as_unroutable, timeout_s=5, what="the gateway to see the drained pool")
    finally:
        client.close()
    assert "r0 draining, r1 STOPPED" in messages[-1]
