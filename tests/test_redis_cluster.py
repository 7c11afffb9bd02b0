"""The registry and two gateway replicas on a real three-master Redis Cluster
(EXAMLOPS_REDIS_URL=redis+cluster://...): registrations and their watch feed, virtual keys through
the official openai client, the 200-concurrent budget proof and RPM/TPM limits, every key in its hash
tag's slot, and the reaper's pipelined script running on the cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis

from examlops.registry.v1 import registry_pb2 as reg
from examlops_testsupport.fixtures import Stack, running_stack, wait_until
from examlops_testsupport.governance import (
    ADMIN,
    FAST,
    check_budget_never_overspent,
    check_rpm_holds,
    check_tpm_holds,
    issue,
    key_hash,
    routes_and_prices_synced,
)
from examlops_testsupport.redis_cluster import RedisClusterServer

MODELS = ("conc-a", "slow")


@pytest.fixture(scope="module")
def on_cluster(tmp_path_factory: pytest.TempPathFactory,
               redis_cluster: RedisClusterServer) -> Iterator[tuple[Stack, list[str]]]:
    """The five services on the cluster, and a second gateway replica; echo routes conc-a and slow, priced."""
    with running_stack(tmp_path_factory.mktemp("cluster"), redis_cluster, FAST) as stack:
        assert stack.env("gateway")["EXAMLOPS_REDIS_URL"].startswith("redis+cluster://")
        _proc, second = stack.start_gateway_replica("gateway-2")
        for model in MODELS:
            stack.register(model, engine="echo", project="conc")
            assert stack.cli("gateway", "price", "set", model, "--input-per-mtok", "1",
                             "--output-per-mtok", "2").returncode == 0
        urls = [stack.gateway_url, second]
        for url in urls:
            wait_until(lambda url=url: routes_and_prices_synced(url, MODELS), 10)
        yield stack, urls


def test_gateways_are_ready_on_every_primary(on_cluster: tuple[Stack, list[str]]) -> None:
    for url in on_cluster[1]:
        body = httpx.get(url + "/readyz").json()
        assert body["status"] == "ok" and body["redis"] is True


def test_registry_registers_lists_updates_and_watches_on_the_cluster(on_cluster: tuple[Stack, list[str]]) -> None:
    stack, _ = on_cluster
    registry = stack.registry()
    stack.register("cl-1", engine="echo", project="p1")
    names = {e.name for e in registry.ListEndpoints(reg.ListEndpointsRequest(), timeout=5).endpoints}
    assert {"cl-1", *MODELS} <= names
    stream = registry.WatchEndpoints(reg.WatchEndpointsRequest(), timeout=30)
    seen_synced, snapshot = False, set()
    for ev in stream:
        if ev.kind == reg.EndpointEvent.KIND_SNAPSHOT:
            snapshot.add(ev.endpoint.name)
        elif ev.kind == reg.EndpointEvent.KIND_SYNCED:
            seen_synced = True
            time.sleep(0.5)  # the feed is in its blocking XREAD on the cluster node now
            registry.UpdateEndpoint(reg.UpdateEndpointRequest(
                name="cl-1", state=reg.ENDPOINT_STATE_DISABLED, actor="tests"), timeout=5)
        elif seen_synced and ev.endpoint.name == "cl-1":
            assert ev.kind == reg.EndpointEvent.KIND_PUT and ev.endpoint.state == reg.ENDPOINT_STATE_DISABLED
            break
    stream.cancel()
    assert "cl-1" in snapshot
    ep = registry.GetEndpoint(reg.GetEndpointRequest(name="cl-1"), timeout=5)
    assert ep.state == reg.ENDPOINT_STATE_DISABLED and ep.revision == 2
    registry.RemoveEndpoint(reg.RemoveEndpointRequest(name="cl-1", actor="tests"), timeout=5)
    events = registry.ListAuditEvents(reg.ListAuditEventsRequest(target="endpoint:cl-1"), timeout=5).events
    assert [e.action for e in events] == ["remove", "update", "register"]


def test_virtual_key_is_issued_used_and_revoked_on_the_cluster(on_cluster: tuple[Stack, list[str]]) -> None:
    stack, urls = on_cluster
    row = issue(urls[0], budget_usd=1)
    for url in urls:
        c = openai.OpenAI(base_url=url + "/v1", api_key=row["virtual_key"], max_retries=0)
        resp = c.chat.completions.create(model="conc-a", messages=[{"role": "user", "content": "hello cluster"}])
        assert resp.choices[0].message.content == "echo: hello cluster"
        c.close()
    assert int(key_hash(stack, row["id"])["requests"]) == 2
    assert httpx.post(urls[1] + f"/admin/keys/{row['id']}/revoke", headers=ADMIN).status_code == 200
    c = openai.OpenAI(base_url=urls[0] + "/v1", api_key=row["virtual_key"], max_retries=0)
    with pytest.raises(openai.AuthenticationError) as revoked:
        c.chat.completions.create(model="conc-a", messages=[{"role": "user", "content": "after revoke"}])
    c.close()
    assert isinstance(revoked.value.body, dict) and revoked.value.body["code"] == "key_revoked"


def test_budget_is_never_overspent_by_200_concurrent_calls_on_the_cluster(on_cluster: tuple[Stack, list[str]]) -> None:
    check_budget_never_overspent(*on_cluster)


def test_rpm_holds_on_the_cluster(on_cluster: tuple[Stack, list[str]]) -> None:
    check_rpm_holds(*on_cluster)


def test_tpm_holds_on_the_cluster(on_cluster: tuple[Stack, list[str]]) -> None:
    check_tpm_holds(*on_cluster)


def test_every_key_lives_in_its_hash_tags_slot(on_cluster: tuple[Stack, list[str]],
                                               redis_cluster: RedisClusterServer) -> None:
    """Every key the services wrote carries a hash tag, and lies on the node serving that tag's slot;
    virtual keys spread over the masters while {exa:reg} and {exa:gw} each keep to one slot."""
    stack, _ = on_cluster
    issue(on_cluster[1][0])  # at least one more virtual key
    nodes_of_tag: dict[str, set[int]] = {}
    for port in redis_cluster.ports:
        with redis_cluster.node(port) as node:
            for key in node.scan_iter(count=1000):
                assert key.startswith("{") and "}" in key, f"{key!r} has no hash tag"
                tag = key[1:key.index("}")]
                slot = int(node.execute_command("CLUSTER KEYSLOT", key))
                assert slot == int(node.execute_command("CLUSTER KEYSLOT", "{" + tag + "}")), key
                nodes_of_tag.setdefault(tag.split(":")[0] if tag.startswith("vk:") else tag, set()).add(port)
                if not tag.startswith("vk:"):
                    nodes_of_tag.setdefault(f"slot {tag}", set()).add(slot)
    assert {"exa:reg", "exa:gw", "vk"} <= nodes_of_tag.keys()
    assert len(nodes_of_tag["slot exa:reg"]) == 1 and len(nodes_of_tag["slot exa:gw"]) == 1
    assert len(nodes_of_tag["vk"]) >= 2, "the virtual keys all landed on one master"
    with stack.redis_client() as r:
        assert r.hexists("{exa:reg}:endpoints", "conc-a")


def test_reaper_and_heartbeats_run_on_the_cluster(on_cluster: tuple[Stack, list[str]]) -> None:
    """reap.lua runs pipelined over every key (a cluster pipeline cannot run a Script object)."""
    stack, urls = on_cluster
    for _ in range(5):  # keys on several masters for the reaper to walk
        issue(urls[0])
    time.sleep(1.5)  # three reaper rounds at EXAMLOPS_REAPER_INTERVAL_S=0.5
    for name in ("gateway", "gateway-2"):
        log = (stack.workdir / f"{name}.log").read_text()
        assert "heartbeat/reaper: Redis error" not in log, log[-2000:]
    with stack.redis_client() as r:
        assert len(r.zrangebyscore("{exa:gw}:replicas", int(time.time() * 1000), "+inf")) >= 2


def test_a_malformed_cluster_url_is_refused_naming_the_variable_without_its_password(
        on_cluster: tuple[Stack, list[str]]) -> None:
    stack, _ = on_cluster
    env = {**os.environ, **stack.env("registry"), "EXAMLOPS_PORT": "0",
           "EXAMLOPS_REDIS_URL": "redis+cluster://:hunter2-secret@127.0.0.1:notaport"}
    out = subprocess.run([sys.executable, "-m", "examlops_registry"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0
    assert "EXAMLOPS_REDIS_URL" in out.stderr and "redis+cluster://" in out.stderr
    assert "hunter2-secret" not in out.stderr + out.stdout


def test_redis_url_pointing_at_one_cluster_node_is_refused(redis_cluster: RedisClusterServer,
                                                          on_cluster: tuple[Stack, list[str]]) -> None:
    """redis:// at a cluster node would answer most keys with MOVED: the registry says what to write."""
    stack, _ = on_cluster
    env = {**os.environ, **stack.env("registry"), "EXAMLOPS_PORT": "0",
           "EXAMLOPS_REDIS_URL": f"redis://127.0.0.1:{redis_cluster.port}/0"}
    out = subprocess.run([sys.executable, "-m", "examlops_registry"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "use redis+cluster://" in out.stderr, out.stderr[-1000:]
    with redis.Redis(port=redis_cluster.port) as node:
        assert node.ping()
