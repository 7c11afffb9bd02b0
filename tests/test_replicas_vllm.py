"""One endpoint, two real CPU vLLM servers (SmolLM2, prefix caching on): failover and prefix affinity.

Both servers start once for the module, in parallel. The first test compares the prefix policy
with round-robin on vLLM's own prefix-cache counters and on TTFT; the second SIGKILLs one server
under 50 concurrent requests, then restarts it. Numbers are printed (run with -s to see them).
"""

from __future__ import annotations

import json
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from examlops.engine_proxy.v1 import engine_proxy_pb2 as ep_pb
from examlops.engine_proxy.v1 import engine_proxy_pb2_grpc as ep_grpc
from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_devstack import Proc
from examlops_testsupport.fixtures import Stack, free_port, wait_until
from examlops_testsupport.vllm import smol_block, start_vllm

# The first test's time includes starting both vLLM servers (140-160 s on a busy 2-core machine), and the
# prefix test then streams 160 requests with ~1,000-token prompts (~145 s): 281 s of the default 300 here.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

TOPICS_A = ["astronomy", "baking", "chess", "dentistry", "economics", "forestry", "geology", "hydraulics"]
TOPICS_B = ["irrigation", "journalism", "knitting", "linguistics", "metallurgy", "navigation", "optics",
            "pottery"]


@dataclass
class Replica:
    workdir: Path
    port: int
    proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        block = smol_block().model_copy(update={"prefix_cache": True})
        self.proc = start_vllm(self.workdir, self.port, block, f"vllm-{self.port}.log")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    replicas = [Replica(tmp_path_factory.mktemp(f"replica{i}"), free_port()) for i in range(2)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(r.start) for r in replicas]:
            future.result()
    print(f"\ntwo SmolLM2 servers healthy in {time.monotonic() - t0:.1f} s")
    for r in replicas:  # the first request of a fresh server pays its warm-up: not part of any measure
        httpx.post(r.url + "/v1/completions", json={"model": "smol", "prompt": "hi", "max_tokens": 2}, timeout=120)
    yield replicas
    for r in replicas:
        if r.proc is not None:
            r.proc.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=DEFAULT_ADMIN_KEY, max_retries=0,
                       timeout=300) as c:
        yield c


def register_pool(stack: Stack, client: openai.OpenAI, name: str, replicas: list[Replica], routing: str) -> None:
    block = smol_block().model_dump(mode="json", exclude_none=True)
    block.pop("base_url", None)
    block.update(prefix_cache=True, routing=routing)
    stack.register(name, engine="vllm-server", served_model_name="smol", engine_block_json=json.dumps(block),
                   replicas=[reg.Replica(id=f"r{i}", base_url=r.url, state=reg.ENDPOINT_STATE_READY)
                             for i, r in enumerate(replicas)])
    proxy = ep_grpc.EngineProxyStub(stack.channel("engine-proxy"))

    def ready() -> bool:
        routes = proxy.ListRoutes(ep_pb.ListRoutesRequest(name=name), timeout=5).routes
        return bool(routes) and routes[0].routing == routing and len(routes[0].replicas) == len(replicas)

    wait_until(ready, 10, 0.05, f"engine-proxy routes {name} with {routing}")


def replica_stats(stack: Stack, name: str) -> dict[str, ep_pb.ReplicaStats]:
    proxy = ep_grpc.EngineProxyStub(stack.channel("engine-proxy"))
    route = proxy.ListRoutes(ep_pb.ListRoutesRequest(name=name), timeout=5).routes[0]
    return {r.id: r for r in route.replicas}


def prefix_counters(replicas: list[Replica]) -> tuple[float, float]:
    """(hits, queries) of vLLM's prefix cache, summed over the servers."""
    hits = queries = 0.0
    for r in replicas:
        for line in httpx.get(r.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def system_prompt(topic: str) -> str:
    """About 1,000 SmolLM2 tokens, distinct from its first word on."""
    rules = " ".join(f"Rule {n} of {topic}: keep every answer about {topic} short, exact and polite."
                     for n in range(52))
    return f"{topic.capitalize()} desk. You are the {topic} assistant. {rules}"


def run_interleaved(client: openai.OpenAI, model: str, topics: list[str], rounds: int = 10) -> list[float]:
    """Eight system prompts, `rounds` requests each, interleaved (each round starts one prompt later, so
    a prompt's turns do not fall on the same parity); streamed one at a time. TTFT of each, in ms."""
    prompts = [system_prompt(t) for t in topics]
    ttfts = []
    for r in range(rounds):
        for i in range(len(prompts)):
            j = (i + r) % len(prompts)
            t0 = time.perf_counter()
            first = None
            stream = client.chat.completions.create(
                model=model, stream=True, max_tokens=4, temperature=0,
                messages=[{"role": "system", "content": prompts[j]},
                          {"role": "user", "content": f"Question {r}: name one word about {topics[j]}."}])
            for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter()
            ttfts.append(((first or time.perf_counter()) - t0) * 1000)
    return ttfts


def test_prefix_affinity_beats_round_robin_on_vllms_prefix_cache(
        stack: Stack, client: openai.OpenAI, pair: list[Replica]) -> None:
    results: dict[str, dict[str, float]] = {}
    for routing, topics in (("round-robin", TOPICS_A), ("prefix", TOPICS_B)):
        name = f"pool-{routing}"
        register_pool(stack, client, name, pair, routing)
        hits0, queries0 = prefix_counters(pair)
        ttfts = run_interleaved(client, name, topics)
        hits1, queries1 = prefix_counters(pair)
        stats = replica_stats(stack, name)
        results[routing] = {
            "hit_rate": (hits1 - hits0) / max(queries1 - queries0, 1),
            "ttft_mean_ms": statistics.fmean(ttfts), "ttft_p50_ms": statistics.median(ttfts),
            "requests": len(ttfts), **{f"requests_{rid}": float(s.requests) for rid, s in stats.items()}}
    print("\nprefix vs round-robin:", json.dumps(results, indent=1))
    prefix, rr = results["prefix"], results["round-robin"]
    assert prefix["hit_rate"] >= 0.8, results
    assert prefix["hit_rate"] > rr["hit_rate"], results
    assert prefix["ttft_mean_ms"] < rr["ttft_mean_ms"], results
    assert min(prefix["requests_r0"], prefix["requests_r1"]) > 0, "the prefix policy used one replica only"


def test_sigkill_of_one_replica_under_load_fails_no_request_and_it_comes_back(
        stack: Stack, client: openai.OpenAI, pair: list[Replica]) -> None:
    name = "pool-failover"
    register_pool(stack, client, name, pair, "least-load")
    outcomes: list[str] = []
    streams: list[str] = []
    lock = threading.Lock()
    go = threading.Event()               # the 50 plain calls wait for it: the streams start first
    streaming = threading.Semaphore(0)   # released once by each stream at its first token

    def plain(i: int) -> None:
        go.wait()
        try:
            reply = client.chat.completions.create(
                model=name, max_tokens=64, temperature=0,
                messages=[{"role": "user", "content": f"Count from {i} to {i + 20}."}])
            outcome = "ok" if reply.choices[0].message.content is not None else "empty"
        except openai.APIError as exc:
            outcome = f"error: {exc}"
        with lock:
            outcomes.append(outcome)

    def streamed(i: int) -> None:
        got = 0
        try:
            for chunk in client.chat.completions.create(
                    model=name, max_tokens=400, stream=True, temperature=0,
                    messages=[{"role": "user", "content": f"Write a long story number {i} about a lighthouse."}]):
                if chunk.choices and chunk.choices[0].delta.content:
                    got += 1
                    if got == 1:
                        streaming.release()
            outcome = "complete"
        except openai.APIError as exc:
            outcome = f"cut after {got} chunks: {type(exc).__name__}: {exc}" if got else f"failed before a byte: {exc}"
        with lock:
            streams.append(outcome)

    with ThreadPoolExecutor(56) as pool:
        futures = [pool.submit(streamed, i) for i in range(6)] + [pool.submit(plain, i) for i in range(50)]
        for _ in range(6):  # every stream has sent a token: the killed server's streams are cut mid-way
            assert streaming.acquire(timeout=120), "a stream sent no token in 120 s"
        # Only the streams are in flight: the server with most of them dies (least-load splits by live
        # metrics, which a loaded machine may scrape late, so the split is not known in advance).
        load = replica_stats(stack, name)
        victim_id = max(sorted(load), key=lambda r: load[r].in_flight)
        streams_on_victim = load[victim_id].in_flight
        victim = pair[int(victim_id.removeprefix("r"))]
        assert victim.proc is not None and streams_on_victim > 0, load
        go.set()  # the 50 plain calls; it dies once some of them are in flight on it too
        wait_until(lambda: replica_stats(stack, name)[victim_id].in_flight > streams_on_victim, timeout_s=60,
                   what=f"plain calls in flight on {victim_id}")
        load = replica_stats(stack, name)
        victim.proc.stop(signal.SIGKILL)
        killed_at = time.monotonic()
        for f in futures:
            f.result()
    errors = [o for o in outcomes if o != "ok"]
    cut = [s for s in streams if s.startswith("cut")]
    print(f"\n50 requests: {len(outcomes) - len(errors)} ok; streams: {streams}")
    assert not errors, errors
    assert all(s == "complete" or s.startswith("cut after") for s in streams), streams
    assert cut, f"no stream was on the killed server when it died: {streams}"

    stats = replica_stats(stack, name)
    dead, other = stats[victim_id], stats["r1" if victim_id == "r0" else "r0"]
    assert not dead.healthy and dead.ejections >= 1, dead
    seen = dead.requests
    for i in range(10):
        client.chat.completions.create(model=name, max_tokens=2, messages=[{"role": "user", "content": f"hi {i}"}])
    assert replica_stats(stack, name)[victim_id].requests == seen, "the dead replica was sent a request after ejection"
    print(f"ejected {victim_id} ({load[victim_id].in_flight} of {sum(r.in_flight for r in load.values())} in flight); "
          f"the other {other.requests} requests ({other.retries} retries), "
          f"{victim_id} {seen} requests, {dead.errors} errors, {dead.ejections} ejections; "
          f"{time.monotonic() - killed_at:.1f} s since the kill")

    victim.start()
    healthy_at = time.monotonic()

    def back() -> bool:
        client.chat.completions.create(model=name, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        return replica_stats(stack, name)[victim_id].requests > seen

    took = wait_until(back, 10, 0.2, "the restarted replica receives traffic again")
    print(f"restarted replica took traffic {time.monotonic() - healthy_at:.1f} s after it was healthy ({took:.1f} s)")
