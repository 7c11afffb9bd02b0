"""An endpoint as a pool of replicas, through the real stack (registry, engine-proxy, gateway and the
official openai client) with stub servers whose speed and failures each test sets: least-load
routing, drain, failover, passive ejection and the /health probe that brings a replica back.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from examlops.engine_proxy.v1 import engine_proxy_pb2 as ep_pb
from examlops.engine_proxy.v1 import engine_proxy_pb2_grpc as ep_grpc
from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import DEFAULT_ADMIN_KEY, error_reason
from examlops_testsupport.fixtures import Stack, free_port, wait_until
from examlops_testsupport.replica_backend import ReplicaBackend

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=DEFAULT_ADMIN_KEY, max_retries=0,
                       timeout=30) as c:
        yield c


def register_pool(stack: Stack, name: str, urls: list[str], routing: str = "least-load") -> None:
    block = json.dumps({"engine": "vllm", "hf_model_id": "org/stub", "routing": routing})
    stack.register(name, engine="vllm-server", engine_block_json=block,
                   replicas=[reg.Replica(base_url=u) for u in urls])


def route(stack: Stack, name: str) -> ep_pb.Route:
    stub = ep_grpc.EngineProxyStub(stack.channel("engine-proxy"))
    routes = stub.ListRoutes(ep_pb.ListRoutesRequest(name=name), timeout=10).routes
    assert [r.name for r in routes] == [name]
    found: ep_pb.Route = routes[0]
    return found


def listed(stack: Stack, name: str) -> bool:
    stub = ep_grpc.EngineProxyStub(stack.channel("engine-proxy"))
    return bool(stub.ListRoutes(ep_pb.ListRoutesRequest(name=name), timeout=10).routes)


def replica(stack: Stack, name: str, rid: str) -> ep_pb.ReplicaStats | None:
    return next((r for r in route(stack, name).replicas if r.id == rid), None)


def ask(client: openai.OpenAI, model: str) -> str:
    return client.chat.completions.create(model=model, messages=HI).choices[0].message.content or ""  # type: ignore[arg-type]


def routed(client: openai.OpenAI, model: str) -> bool:
    try:
        ask(client, model)
    except openai.NotFoundError:
        return False
    return True


def test_a_slow_replica_gets_fewer_requests_under_least_load(stack: Stack, client: openai.OpenAI) -> None:
    slow, fast = ReplicaBackend(delay_s=0.4), ReplicaBackend(delay_s=0.02)
    try:
        register_pool(stack, "pool-ll", [slow.url, fast.url])
        wait_until(lambda: routed(client, "pool-ll"), 10, what="the pool routed")
        slow.served = fast.served = 0
        with ThreadPoolExecutor(6) as workers:
            answers = list(workers.map(lambda _: ask(client, "pool-ll"), range(90)))
        assert answers == ["pong"] * 90
        assert fast.served >= 4 * slow.served, (slow.served, fast.served)
        r = route(stack, "pool-ll")
        assert r.routing == "least-load" and [x.id for x in r.replicas] == ["r0", "r1"]
        assert sum(x.picks.get("least-load", 0) for x in r.replicas) >= 90
        assert all(x.healthy and x.errors == 0 and 0 <= x.metrics_age_ms < 2000 for x in r.replicas)
        fast.waiting = 7  # scraped within a scrape interval or two
        wait_until(lambda: (s := replica(stack, "pool-ll", "r1")) is not None and s.requests_waiting == 7, 3,
                   0.05, "the scraped waiting count")
    finally:
        slow.close()
        fast.close()


def test_a_draining_replica_finishes_its_requests_and_gets_no_new_ones(stack: Stack, client: openai.OpenAI) -> None:
    a, b = ReplicaBackend(delay_s=1.0), ReplicaBackend(delay_s=1.0)
    a.chunk_delay_s = b.chunk_delay_s = 0.3
    try:
        register_pool(stack, "pool-drain", [a.url, b.url])
        wait_until(lambda: routed(client, "pool-drain"), 10, what="the pool routed")

        def streamed(_: int) -> str:
            chunks = client.chat.completions.create(model="pool-drain", messages=HI, stream=True)  # type: ignore[arg-type]
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)  # type: ignore[union-attr]

        base = a.served + b.served
        with ThreadPoolExecutor(6) as workers:
            whole = [workers.submit(ask, client, "pool-drain") for _ in range(3)]
            streams = [workers.submit(streamed, i) for i in range(3)]
            wait_until(lambda: a.served + b.served == base + 6 and a.in_flight and b.in_flight, 5,
                       what="six requests in flight on the two replicas")
            before = a.served
            stack.registry().UpdateEndpoint(reg.UpdateEndpointRequest(
                name="pool-drain", replica="r0", draining=True, actor="tests"), timeout=10)
            wait_until(lambda: (s := replica(stack, "pool-drain", "r0")) is not None and s.draining, 5,
                       what="r0 draining in engine-proxy")
            assert replica(stack, "pool-drain", "r0").in_flight > 0  # type: ignore[union-attr]
            later = [workers.submit(ask, client, "pool-drain") for _ in range(4)]
            assert [f.result() for f in whole + later] == ["pong"] * 7
            assert [f.result() for f in streams] == ["pong0 pong1 pong2 pong3 "] * 3
        assert a.served == before, "a draining replica got a new request"
        # Its last request done, r0 leaves engine-proxy's pool (its connections closed).
        wait_until(lambda: replica(stack, "pool-drain", "r0") is None, 5, what="r0 retired")
        stack.registry().RemoveReplica(reg.RemoveReplicaRequest(name="pool-drain", replica="r0", actor="tests"),
                                       timeout=10)
        assert ask(client, "pool-drain") == "pong" and a.served == before
    finally:
        a.close()
        b.close()


def test_a_refused_replica_is_ejected_then_probed_back(stack: Stack, client: openai.OpenAI) -> None:
    port = free_port()
    live = ReplicaBackend()
    try:
        register_pool(stack, "pool-eject", [f"http://127.0.0.1:{port}", live.url], routing="round-robin")
        wait_until(lambda: routed(client, "pool-eject"), 10, what="the pool routed")
        assert [ask(client, "pool-eject") for _ in range(10)] == ["pong"] * 10  # no client error
        dead = replica(stack, "pool-eject", "r0")
        assert dead is not None and not dead.healthy and dead.ejections == 1
        assert dead.requests == dead.errors == dead.retries == 1, dead  # no pick after the ejection
        assert dead.ejected_until_ms > 0
        assert replica(stack, "pool-eject", "r1").picks["retry"] == 1  # type: ignore[union-attr]
        back = ReplicaBackend(port=port)  # the server restarts; nobody tells engine-proxy
        try:
            started = time.monotonic()

            def traffic_reaches_it() -> bool:
                ask(client, "pool-eject")
                return bool(back.served)
            wait_until(traffic_reaches_it, 10, 0.1, "traffic on the restarted replica")
            assert time.monotonic() - started < 10
            assert replica(stack, "pool-eject", "r0").healthy  # type: ignore[union-attr]
        finally:
            back.close()
    finally:
        live.close()


def test_every_replica_down_gives_502_naming_each_replica(stack: Stack, client: openai.OpenAI) -> None:
    ports = [free_port(), free_port()]
    register_pool(stack, "pool-down", [f"http://127.0.0.1:{p}" for p in ports])

    def outcome() -> openai.APIStatusError | None:
        try:
            ask(client, "pool-down")
        except openai.NotFoundError:
            return None
        except openai.APIStatusError as exc:
            return exc
        raise AssertionError("a pool with no server answered")
    wait_until(outcome, 10, what="the pool routed")
    started = time.monotonic()
    exc = outcome()
    took = time.monotonic() - started
    assert exc is not None and exc.status_code == 502 and exc.code == "all_backends_failed"
    assert "- endpoint:pool-down: all 2 replicas failed: r0 " in exc.message, exc.message
    for i, port in enumerate(ports):
        assert f"r{i} (http://127.0.0.1:{port}): connection refused" in exc.message, exc.message
    assert took < 2, took
    with pytest.raises(openai.APIStatusError) as streamed:
        list(client.chat.completions.create(model="pool-down", messages=HI, stream=True))  # type: ignore[arg-type]
    assert streamed.value.status_code == 502 and "endpoint:pool-down" in streamed.value.message


def test_hung_replicas_end_within_the_call_deadline_naming_them(stack: Stack) -> None:
    a, b = ReplicaBackend(delay_s=5), ReplicaBackend(delay_s=5)
    try:
        register_pool(stack, "pool-hung", [a.url, b.url])
        wait_until(lambda: listed(stack, "pool-hung"), 10, what="the pool routed")
        stub = ep_grpc.EngineProxyStub(stack.channel("engine-proxy"))
        request = ep_pb.GenerateRequest(endpoint="pool-hung", kind=ep_pb.REQUEST_KIND_CHAT,
                                        body_json=json.dumps({"model": "pool-hung", "messages": HI}).encode())
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, timeout=1.5))
        took = time.monotonic() - started
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
        assert error_reason(info.value)[0] == "AllBackendsFailed"
        details = info.value.details()
        assert details.startswith("endpoint:pool-hung: the call's deadline came after 1 of 2 replica(s) tried: r"), \
            details
        assert "no first byte before the call's deadline" in details and took < 1.5, (details, took)
        assert all(r.healthy and r.errors == 0 for r in route(stack, "pool-hung").replicas)  # not the server's fault
    finally:
        a.close()
        b.close()


def test_5xx_moves_to_another_replica_but_4xx_is_never_retried(stack: Stack, client: openai.OpenAI) -> None:
    bad, good = ReplicaBackend(), ReplicaBackend()
    bad.status = 503
    try:
        register_pool(stack, "pool-5xx", [bad.url, good.url], routing="round-robin")
        wait_until(lambda: routed(client, "pool-5xx"), 10, what="the pool routed")
        assert [ask(client, "pool-5xx") for _ in range(10)] == ["pong"] * 10
        r0 = replica(stack, "pool-5xx", "r0")
        assert r0 is not None and r0.errors == 2 and r0.ejections == 1 and not r0.healthy, r0  # two 503s eject
        assert bad.served == 2

        bad.status = good.status = 400
        register_pool(stack, "pool-4xx", [bad.url, good.url])
        wait_until(lambda: listed(stack, "pool-4xx"), 5, what="the pool routed")
        served = bad.served + good.served
        with pytest.raises(openai.BadRequestError) as info:
            ask(client, "pool-4xx")
        assert "stub says 400" in info.value.message
        assert bad.served + good.served == served + 1, "a refused request was sent again"
        assert all(x.healthy and x.errors == 0 for x in route(stack, "pool-4xx").replicas)
    finally:
        bad.close()
        good.close()


def test_a_stream_cut_midway_ends_with_an_sse_error_and_is_not_retried(stack: Stack, client: openai.OpenAI) -> None:
    a, b = ReplicaBackend(), ReplicaBackend()
    a.cut_after = b.cut_after = 2
    try:
        register_pool(stack, "pool-cut", [a.url, b.url])
        wait_until(lambda: routed(client, "pool-cut"), 10, what="the pool routed")
        served = a.served + b.served
        received: list[str] = []
        with pytest.raises(openai.APIError) as info:
            for chunk in client.chat.completions.create(model="pool-cut", messages=HI, stream=True):  # type: ignore[arg-type]
                received.append(chunk.choices[0].delta.content or "")  # type: ignore[union-attr]
        assert received == ["pong0 ", "pong1 "]
        assert "endpoint:pool-cut" in info.value.message and "mid-answer" in info.value.message, info.value.message
        assert a.served + b.served == served + 1, "a stream that had sent chunks was retried"
    finally:
        a.close()
        b.close()


def test_a_stopped_replica_answers_nothing_more_even_on_a_kept_connection(stack: Stack, client: openai.OpenAI) -> None:
    """A stopped server's kept-alive connections end with it: engine-proxy, which keeps one open to each
    replica (calls and /metrics scrapes), gets no answer from a replica that is gone."""
    server = ReplicaBackend()
    try:
        register_pool(stack, "pool-stopped", [server.url])
        wait_until(lambda: routed(client, "pool-stopped"), 10, what="the pool routed")
        assert ask(client, "pool-stopped") == "pong"
    finally:
        server.close()
    served = server.served
    with pytest.raises(openai.APIStatusError) as failed:
        ask(client, "pool-stopped")
    assert failed.value.status_code == 502 and server.served == served
    stack.registry().RemoveEndpoint(reg.RemoveEndpointRequest(name="pool-stopped", actor="tests"), timeout=10)
