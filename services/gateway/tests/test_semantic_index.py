"""The semantic cache's shared index on a real Redis: two SemanticIndex objects on one Redis are two
gateway replicas. And the embed helper against a real gRPC engine-proxy servicer started here.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import orjson
import pytest
import redis.asyncio as aredis

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb
from examlops.engine_proxy.v1 import engine_proxy_pb2_grpc as ep_grpc
from examlops_gateway.cache._embed import CacheEmbedError, embed
from examlops_gateway.cache._semantic import SemanticIndex, semcache_keys
from examlops_testsupport.fixtures import RedisServer, start_redis

DIM = 384
SYNC_S = 0.05
TEST_DB = 7  # apart from the other tests' keys on the session Redis
REC, SPACE_KEY = semcache_keys()[:2]
Body = Callable[[aredis.Redis], Awaitable[None]]


def unit(seed: int, dim: int = DIM) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(dim).astype(np.float32)
    return (v / np.linalg.norm(v)).astype(np.float32)


def near(v: np.ndarray, cosine: float, seed: int = 99) -> np.ndarray:
    """A unit vector at exactly `cosine` from unit vector `v`."""
    other = unit(seed, v.shape[0])
    other -= (other @ v) * v
    other /= np.linalg.norm(other)
    return (cosine * v + float(np.sqrt(1 - cosine**2)) * other).astype(np.float32)


async def eventually(check: Callable[[], object], timeout_s: float = 1.0, what: str = "condition") -> float:
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"{what} not met within {timeout_s:g} s")
        await asyncio.sleep(0.01)
    return time.monotonic() - started


def run_on(port: int, body: Body, db: int = TEST_DB) -> None:
    async def main() -> None:
        client = aredis.Redis(port=port, db=db, decode_responses=True)
        await client.flushdb()
        try:
            await body(client)
        finally:
            await client.aclose()
    asyncio.run(main())


def found(index: SemanticIndex, space: str, vector: np.ndarray, threshold: float) -> str | None:
    """The entry a lookup finds, checking that its similarity is the cosine it claims."""
    hit = index.lookup(space, vector, threshold)
    if hit is None:
        return None
    assert hit[1] >= threshold
    return hit[0]


def entries(index: SemanticIndex, n: int) -> Callable[[], bool]:
    return lambda: index.stats()["entries"] == n


async def replica(client: aredis.Redis, max_entries: int = 1000, **kw: Any) -> SemanticIndex:
    index = SemanticIndex(client, max_entries=max_entries, sync_interval_s=SYNC_S, **kw)
    await index.start()
    return index


@pytest.fixture
def on_redis(redis_server: RedisServer) -> Callable[[Body], None]:
    return lambda body: run_on(redis_server.port, body)


def test_an_entry_added_through_one_replica_is_found_through_another_within_a_second(on_redis: Any) -> None:
    async def body(client: aredis.Redis) -> None:
        a, b = await replica(client), await replica(client)
        v = unit(1)
        await a.add("m|tenant:t1|sys|minilm", v, "e1", 60)
        assert found(a, "m|tenant:t1|sys|minilm", v, 0.95) == "e1"  # at once
        took = await eventually(lambda: b.lookup("m|tenant:t1|sys|minilm", v, 0.95), what="b sees e1")
        assert took < 1.0
        assert await client.hlen(REC) == 1
        await a.aclose()
        await b.aclose()
    on_redis(body)


def test_threshold_decides_a_hit_and_the_most_similar_entry_wins(on_redis: Any) -> None:
    async def body(client: aredis.Redis) -> None:
        index = await replica(client)
        v = unit(2)
        await index.add("s", v, "close", 60)
        await index.add("s", near(v, 0.80, seed=5), "farther", 60)
        await index.add("s", unit(3), "unrelated", 60)
        query = near(v, 0.96)
        entry_id, similarity = index.lookup("s", query, 0.95) or ("", 0.0)
        assert entry_id == "close" and similarity == pytest.approx(0.96, abs=1e-4)
        assert index.lookup("s", query, 0.97) is None
        assert index.lookup("s", unit(4), 0.5) is None                  # unrelated question: a miss
        assert index.lookup("s", near(v, 0.96) * 3.0, 0.95) is not None  # a query of another norm is normalized
        assert index.lookup("s", np.zeros(DIM, np.float32), 0.0) is None
        await index.aclose()
    on_redis(body)


def test_spaces_never_meet_even_for_an_identical_vector(on_redis: Any) -> None:
    async def body(client: aredis.Redis) -> None:
        a, b = await replica(client), await replica(client)
        v = unit(6)
        await a.add("m|tenant:A|sys|minilm", v, "answer-A", 60)
        await b.add("m|tenant:B|sys|minilm", v, "answer-B", 60)
        for index in (a, b):
            await eventually(entries(index, 2), what="both entries everywhere")
            assert found(index, "m|tenant:A|sys|minilm", v, -1.0) == "answer-A"
            assert found(index, "m|tenant:B|sys|minilm", v, -1.0) == "answer-B"
            assert index.lookup("m|tenant:C|sys|minilm", v, -1.0) is None
            assert index.lookup("m|tenant:A", v, -1.0) is None          # a prefix is another space
        # Another dimension in the same space never matches, and does not disturb the 384-dim rows.
        await a.add("m|tenant:A|sys|minilm", unit(7, dim=128), "small", 60)
        assert a.lookup("m|tenant:A|sys|minilm", unit(7, dim=128)[:64], -1.0) is None
        assert found(a, "m|tenant:A|sys|minilm", v, 0.99) == "answer-A"
        await a.aclose()
        await b.aclose()
    on_redis(body)


def test_expired_entries_never_match_and_leave_memory_and_redis(on_redis: Any) -> None:
    async def body(client: aredis.Redis) -> None:
        a, b = await replica(client), await replica(client)
        v = unit(8)
        await a.add("s", v, "short", 1)
        await a.add("s", unit(9), "long", 60)
        await eventually(lambda: b.lookup("s", v, 0.99), what="b sees the short entry")
        await asyncio.sleep(1.05)
        assert a.lookup("s", v, 0.99) is None and b.lookup("s", v, 0.99) is None
        await eventually(lambda: a.stats()["expired"] == 1 and b.stats()["expired"] == 1, what="housekeeping")
        assert a.stats()["entries"] == b.stats()["entries"] == 1
        await a.add("s", unit(10), "next", 60)  # every add prunes what expired in Redis
        assert sorted(await client.hkeys(REC)) == ["long", "next"]
        late = await replica(client)            # and a replica that starts now never loads it
        assert late.stats()["entries"] == 2
        for index in (a, b, late):
            await index.aclose()
    on_redis(body)


def test_max_entries_evicts_the_least_recently_used_in_redis_and_on_every_replica(on_redis: Any) -> None:
    async def body(client: aredis.Redis) -> None:
        a, b = await replica(client, max_entries=5), await replica(client, max_entries=5)
        vectors = [unit(100 + i) for i in range(8)]
        for i in range(5):
            await a.add("s", vectors[i], f"e{i}", 60)
        await eventually(lambda: b.stats()["entries"] == 5, what="b holds five")
        assert b.lookup("s", vectors[0], 0.99) is not None  # e0 answered on b: no longer the least recently used
        await asyncio.sleep(4 * SYNC_S)                      # b tells Redis about its hit
        for i in range(5, 8):
            await (a if i % 2 else b).add("s", vectors[i], f"e{i}", 60)
        expected = ["e0", "e4", "e5", "e6", "e7"]
        assert sorted(await client.hkeys(REC)) == expected
        assert sorted(await client.hkeys(SPACE_KEY)) == expected

        def held(index: SemanticIndex) -> list[str | None]:
            return [found(index, "s", v, 0.99) for v in vectors]

        await eventually(lambda: held(a) == held(b), what="the replicas converge")
        for index in (a, b):
            assert held(index) == ["e0", None, None, None, "e4", "e5", "e6", "e7"]
            assert index.stats()["entries"] == 5
        assert a.stats()["evicted"] == b.stats()["evicted"] == 3
        for index in (a, b):
            await index.aclose()
    on_redis(body)


def test_flush_by_prefix_converges_on_every_replica(on_redis: Any) -> None:
    async def body(client: aredis.Redis) -> None:
        a, b = await replica(client), await replica(client)
        for i in range(3):
            await a.add(f"m1|tenant:t{i}|sys|minilm", unit(200 + i), f"m1-{i}", 60)
            await b.add(f"m2|tenant:t{i}|sys|minilm", unit(300 + i), f"m2-{i}", 60)
        await eventually(lambda: a.stats()["entries"] == b.stats()["entries"] == 6, what="six everywhere")
        assert await b.flush("m1|") == 3
        for index in (a, b):
            await eventually(entries(index, 3), what="flush reached the replica")
            assert index.lookup("m1|tenant:t0|sys|minilm", unit(200), 0.5) is None
            assert index.lookup("m2|tenant:t0|sys|minilm", unit(300), 0.99) is not None
        assert sorted(await client.hkeys(REC)) == ["m2-0", "m2-1", "m2-2"]
        assert await a.flush("nothing|") == 0
        for index in (a, b):
            await index.aclose()
    on_redis(body)


def test_a_replica_started_later_loads_the_current_set_and_follows(on_redis: Any) -> None:
    async def body(client: aredis.Redis) -> None:
        a = await replica(client)
        for i in range(50):
            await a.add(f"s{i % 3}", unit(400 + i), f"e{i}", 60)
        await a.flush("s2")
        late = await replica(client)
        assert late.stats()["entries"] == 50 - 16 and late.stats()["spaces"] == 2
        assert found(late, "s1", unit(401), 0.99) == "e1"
        assert late.lookup("s2", unit(402), 0.5) is None
        await a.add("s0", unit(999), "after", 60)
        await eventually(lambda: late.lookup("s0", unit(999), 0.99), what="late follows new adds")
        for index in (a, late):
            await index.aclose()
    on_redis(body)


def test_a_replica_reloads_when_redis_lost_the_log(on_redis: Any) -> None:
    async def body(client: aredis.Redis) -> None:
        a, b = await replica(client), await replica(client)
        await a.add("s", unit(500), "old", 60)
        await eventually(lambda: b.lookup("s", unit(500), 0.99), what="b sees old")
        await client.flushdb()                      # Redis lost everything (a restart without persistence)
        await a.add("s", unit(501), "new", 60)      # seq 1 again: b's next event is not the one it expects
        await eventually(lambda: b.lookup("s", unit(501), 0.99) and not b.lookup("s", unit(500), 0.99),
                         what="b reloaded Redis's set")
        assert b.stats()["reloads"] >= 2 and b.stats()["entries"] == 1
        for index in (a, b):
            await index.aclose()
    on_redis(body)


def test_without_redis_lookup_answers_from_memory_and_add_does_not_raise(tmp_path: Path) -> None:
    server = start_redis(tmp_path / "redis")
    try:
        async def body(client: aredis.Redis) -> None:
            index = await replica(client, redis_timeout_s=0.5)
            await index.add("s", unit(600), "kept", 60)
            server.proc.stop()
            assert found(index, "s", unit(600), 0.99) == "kept"
            started = time.monotonic()
            await index.add("s", unit(601), "local-only", 60)  # fails soft, kept in this replica
            assert time.monotonic() - started < 2.0
            assert index.stats()["add_errors"] == 1
            assert index.lookup("s", unit(601), 0.99) is not None
            await eventually(lambda: index.stats()["sync_errors"] > 0, what="the follower notices")
            assert index.lookup("s", unit(600), 0.99) is not None
            started = time.monotonic()
            cold = SemanticIndex(client, max_entries=10, start_timeout_s=0.5)
            await cold.start()                                  # no Redis: start gives up, bounded
            assert time.monotonic() - started < 2.0 and cold.stats()["entries"] == 0
            for i in (index, cold):
                await i.aclose()
        run_on(server.port, body, db=0)
    finally:
        server.proc.stop()


# -- embed ----------------------------------------------------------------------------------------


class EmbeddingsServicer(ep_grpc.EngineProxyServicer):
    """A real engine-proxy servicer whose routes answer what the test needs."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        self.requests.append(request)
        vector = [3.0, 4.0] + [0.0] * 6
        route = request.endpoint
        if route == "floats":
            data = orjson.dumps({"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": vector}],
                                 "model": route, "usage": {"prompt_tokens": 3, "total_tokens": 3}})
        elif route == "b64":
            raw = base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode()
            data = orjson.dumps({"data": [{"index": 0, "embedding": raw}]})
        elif route == "missing":
            context.set_trailing_metadata((("examlops-reason", "model_not_found"),))
            await context.abort(grpc.StatusCode.NOT_FOUND, "no route 'missing'")
        elif route == "slow":
            await asyncio.sleep(5)
        elif route == "nothing":
            return
        else:
            data = {"garbage": b"not json", "zeros": orjson.dumps({"data": [{"embedding": [0.0, 0.0]}]}),
                    "error": orjson.dumps({"error": {"message": "input too long"}}),
                    "strings": orjson.dumps({"data": [{"embedding": ["a", "b"]}]}),
                    "nan": orjson.dumps({"data": [{"embedding": base64.b64encode(
                        np.asarray([1.0, np.nan], "<f4").tobytes()).decode()}]}),
                    "huge": orjson.dumps({"data": [{"embedding": [3e39, 4e39] + [0.0] * 6}]})}[route]
        yield pb.GenerateChunk(data=data, final=True, usage=pb.Usage(prompt_tokens=3))

    async def GenerateOnce(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateChunk:
        """What embed() calls: Generate's messages as one (none: an empty answer)."""
        answer = pb.GenerateChunk()
        async for chunk in self.Generate(request, context):
            answer.MergeFrom(chunk)
        return answer


def call_embed(route: str, timeout_s: float = 2.0) -> tuple[np.ndarray, EmbeddingsServicer]:
    """embed() through a real gRPC channel to the servicer above, served on a free port for this call."""
    servicer = EmbeddingsServicer()

    async def main() -> np.ndarray:
        server = grpc.aio.server()
        ep_grpc.add_EngineProxyServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await embed(ep_grpc.EngineProxyStub(channel), route, "what is a cache?", timeout_s)
        finally:
            await server.stop(None)
    return asyncio.run(main()), servicer


@pytest.mark.parametrize("route", ["floats", "b64", "huge"])
def test_embed_asks_the_route_for_floats_and_returns_a_unit_float32_vector(route: str) -> None:
    """A float32-overflowing answer is still read: the vector is normalized before it becomes float32."""
    vector, servicer = call_embed(route)
    assert vector.dtype == np.float32 and vector.shape == (8,)
    assert vector[:2].tolist() == pytest.approx([0.6, 0.8]) and float(np.linalg.norm(vector)) == pytest.approx(1.0)
    (request,) = servicer.requests
    assert request.endpoint == route and request.kind == pb.REQUEST_KIND_EMBEDDINGS
    assert orjson.loads(request.body_json) == {"model": route, "input": ["what is a cache?"],
                                               "encoding_format": "float"}


@pytest.mark.parametrize(("route", "message"), [
    ("missing", r"the embedding route 'missing' failed: NOT_FOUND \(model_not_found\): no route 'missing'"),
    ("slow", "the embedding route 'slow' failed: DEADLINE_EXCEEDED"),
    ("nothing", "the embedding route 'nothing' answered nothing"),
    ("garbage", "the embedding route 'garbage' answered with something that is not JSON"),
    ("error", "the embedding route 'error' answered with an error: input too long"),
    ("zeros", "the embedding route 'zeros' answered with a zero embedding"),
    ("strings", "the embedding route 'strings' answered with data\\[0\\].embedding of type list"),
    ("nan", "the embedding route 'nan' answered with a non-finite embedding"),
])
def test_embed_raises_a_cache_embed_error_naming_the_route(route: str, message: str) -> None:
    started = time.monotonic()
    with pytest.raises(CacheEmbedError, match=message):
        call_embed(route, timeout_s=0.3)
    assert time.monotonic() - started < 2.0
