"""The cache stage of the request path: look up before the engine is called, keep the answer after.

`CacheStage.lookup` costs two dict lookups when no policy applies to the key and the model. Under a
policy, a request that may not be cached (sampled without `sampled`, n>1, tools, logprobs, media,
`Cache-Control: no-cache`) is a `bypass`; otherwise the exact key is one Redis GET, and a semantic
lookup embeds the last user turn through the policy's embedding route and searches the replica's
in-memory index (_semantic.py), then GETs the answer it points at (gone: a miss). The cache never
fails a call: Redis or the embedding route not answering makes the lookup a bypass.

A miss keeps the answer once it has been sent whole and ended by itself (`keep`, `StreamTap`), in
the background; `Cache-Control: no-store` keeps nothing. Every outcome goes into the cost record
(`cache`), the `x-examlops-cache` header, the Prometheus counters and the shared stats.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import orjson
import redis.asyncio as redis
from prometheus_client import Counter, Histogram

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb

from ..governance import Ticket
from ..guardrails import Guard
from ._embed import CacheEmbedError
from ._policy import CachePolicy
from ._replay import assemble, fresh, storable
from ._request import exact_key, scope_of, semantic_space, why_not_cached
from ._semantic import SemanticIndex
from ._store import CacheBook, entry_key

log = logging.getLogger(__name__)

HEADER = "x-examlops-cache"
LOOKUPS = Counter("examlops_gateway_cache_lookups_total", "Cache lookups by endpoint, mode and result "
                  "(hit-exact, hit-semantic, miss, bypass).", ["model", "mode", "result"])
LOOKUP_SECONDS = Histogram("examlops_gateway_cache_lookup_seconds", "Time of a cache lookup (a semantic one "
                           "includes the embedding call).", ["model", "mode"],
                           buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2))
STORES = Counter("examlops_gateway_cache_stores_total", "Answers kept in the cache.", ["model", "mode"])

#: embeds one text through a route: (route, text, timeout_s) -> unit-norm vector; raises CacheEmbedError
Embed = Callable[[str, str, float], Awaitable[np.ndarray]]


class CacheCall:
    """One call under a cache policy: its outcome, the answer of a hit, what a miss is kept under."""

    __slots__ = ("answer", "client_bound", "key", "outcome", "policy", "stage", "store", "vector")

    def __init__(self, stage: CacheStage, policy: CachePolicy, outcome: str, store: bool) -> None:
        self.stage, self.policy, self.outcome, self.store = stage, policy, outcome, store
        self.answer: dict[str, Any] | None = None     # a hit's stored answer
        self.key = ""                                 # exact: the digest; semantic: the space
        self.vector: np.ndarray | None = None         # semantic: the embedded last user turn
        self.client_bound = True                      # the engine got the client's own output bound

    @property
    def headers(self) -> dict[str, str]:
        return {HEADER: self.outcome}

    def keep(self, data: bytes) -> None:
        """A whole answer the client got (its JSON), kept in the background when it may be."""
        if self.store:
            self.stage.in_background(self._keep(data))

    def tap(self) -> StreamTap | None:
        """What a stream reports its chunks to, when its answer may be kept."""
        return StreamTap(self) if self.store else None

    async def _keep(self, answer: Any) -> None:
        """Keep `answer` (a chat.completion, or its JSON) when it may be kept."""
        if isinstance(answer, bytes):
            try:
                answer = orjson.loads(answer)
            except orjson.JSONDecodeError:
                return
        if not storable(answer, self.client_bound):
            return
        policy, stage = self.policy, self.stage
        try:
            if policy.mode == "exact":
                await stage.redis.set(entry_key("exact", policy.model, self.key), orjson.dumps(answer),
                                      ex=policy.ttl_s)
            else:
                assert self.vector is not None
                entry_id = secrets.token_hex(12)
                await stage.redis.set(entry_key("semantic", policy.model, entry_id), orjson.dumps(answer),
                                      ex=policy.ttl_s)
                await stage.index.add(self.key, self.vector, entry_id, policy.ttl_s)
        except (redis.RedisError, OSError) as exc:
            log.warning("cannot keep an answer of %s in the cache: %s", policy.model, exc)
            return
        STORES.labels(policy.model, policy.mode).inc()
        stage.book.tally(policy.model, policy.mode, "store")


class StreamTap:
    """Collects a stream's chunks as they are sent; `end` (a complete 200 stream) keeps the answer
    they amount to, put together in the background, after the client has it."""

    __slots__ = ("call", "chunks")

    def __init__(self, call: CacheCall) -> None:
        self.call = call
        self.chunks: list[bytes] = []

    def add(self, data: bytes) -> None:
        self.chunks.append(data)

    def end(self, usage: pb.Usage | None) -> None:
        self.call.stage.in_background(self._keep(usage))

    async def _keep(self, usage: pb.Usage | None) -> None:
        try:
            answer = assemble(self.chunks, usage)
        except (orjson.JSONDecodeError, AttributeError, TypeError):
            return
        if answer is not None:
            await self.call._keep(answer)


class CacheStage:
    """The stage object of the request path (see the module docstring)."""

    def __init__(self, book: CacheBook, client: redis.Redis, index: SemanticIndex, embed: Embed,
                 embed_timeout_s: float) -> None:
        self.book, self.redis, self.index, self.embed = book, client, index, embed
        self.embed_timeout_s = embed_timeout_s
        self.background: set[asyncio.Task[None]] = set()

    def in_background(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def lookup(self, ticket: Ticket, raw: bytes, cache_control: str, client_bound: bool) -> CacheCall | None:
        """None when no policy applies; else the call's CacheCall, with the stored answer on a hit."""
        policy = self.book.policy(ticket.model, ticket.caller.key_id)
        if policy is None:
            return None
        started = time.perf_counter()
        no_cache, no_store = "no-cache" in cache_control, "no-store" in cache_control
        body = orjson.loads(raw)
        call = CacheCall(self, policy, "bypass", store=False)
        if not no_cache or not no_store:
            why = why_not_cached(body, policy)
            if why is None:
                call.client_bound = client_bound
                try:
                    await self._find(call, ticket, raw, body, no_cache)
                    call.store = not no_store and call.answer is None and bool(call.key)
                except (redis.RedisError, OSError, CacheEmbedError) as exc:
                    log.warning("cache lookup on %s failed, the call goes uncached: %s", policy.model, exc)
                    call.outcome, call.store = "bypass", False
        ticket.cache = call.outcome
        LOOKUPS.labels(policy.model, policy.mode, call.outcome).inc()
        LOOKUP_SECONDS.labels(policy.model, policy.mode).observe(time.perf_counter() - started)
        self.book.tally(policy.model, policy.mode, call.outcome)
        return call

    async def _find(self, call: CacheCall, ticket: Ticket, raw: bytes, body: dict[str, Any], no_cache: bool) -> None:
        policy = call.policy
        scope = scope_of(policy, ticket)
        if policy.mode == "exact":
            call.key = exact_key(policy.model, scope, body)
            if not no_cache:
                stored = await self.redis.get(entry_key("exact", policy.model, call.key))
                self._found(call, stored, "hit-exact")
            return
        engine_body = body if ticket.body is raw else orjson.loads(ticket.body)  # parsed again only when rewritten
        found = semantic_space(policy.model, scope, policy.embedding_model, body, engine_body)
        if found is None:
            return  # no user turn to compare: a bypass
        call.key, text = found
        call.vector = await self.embed(policy.embedding_model, text, self.embed_timeout_s)
        if no_cache:
            return
        best = self.index.lookup(call.key, call.vector, policy.threshold)
        stored = await self.redis.get(entry_key("semantic", policy.model, best[0])) if best else None
        self._found(call, stored, "hit-semantic")

    @staticmethod
    def _found(call: CacheCall, stored: str | bytes | None, hit: str) -> None:
        call.outcome = "miss"
        if stored:
            call.answer, call.outcome = fresh(orjson.loads(stored)), hit

    async def hit_answer(self, call: CacheCall, ticket: Ticket, guard: Guard | None) -> dict[str, Any]:
        """A hit's answer, through the call's output guardrails (a block raises GuardrailBlocked once
        the call is settled); the call is settled at no cost, recorded as the hit it is."""
        answer = call.answer
        assert answer is not None
        if guard is not None and guard.applied.output:
            try:
                checked = await guard.check_answer(pb.GenerateChunk(data=orjson.dumps(answer)))
            except BaseException:
                ticket.settle_later("400")
                raise
            answer = orjson.loads(checked.data)
        ticket.first_chunk()
        ticket.settle_later("200")
        return answer
