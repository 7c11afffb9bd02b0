"""Cache policies and answers in Redis, and each replica's in-memory copy of the policies.

With the governance state, under the gateway's hash tag:
  {exa:gw}:cache:policies         HASH    `model` or `model|key_id` -> the policy's JSON
  {exa:gw}:cache:version          STRING  bumped by every policy change (MULTI with the change)
  {exa:gw}:cache:stats            HASH    `model|mode|result` -> calls (every replica adds its tallies)
  {exa:gw}:cache:x:<model>|<sha>  STRING  an exact answer (the request's sha256), with the policy's TTL
  {exa:gw}:cache:s:<model>|<id>   STRING  a semantic answer; the semantic index (_semantic.py) points at it
Model names cannot hold `|`, so `<model>|` prefixes one model's entries and nothing else.

Every replica polls the version every `refresh_s` (one GET) and reloads on a change, as guardrails
do; the request path reads only memory. The same loop adds this replica's lookup tallies to the
shared stats (one pipelined HINCRBY per changed counter), off the request path.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any, cast

import orjson
import redis.asyncio as redis

from ._policy import CachePolicy, CachePolicyError, parse_policy, policy_slot

log = logging.getLogger(__name__)

PREFIX = "{exa:gw}:cache"
POLICIES = f"{PREFIX}:policies"
VERSION = f"{PREFIX}:version"
STATS = f"{PREFIX}:stats"
_KINDS = {"exact": "x", "semantic": "s"}


def entry_key(mode: str, model: str, entry_id: str) -> str:
    """Where one cached answer lives (`entry_id`: the exact key's digest, or a semantic entry's id)."""
    return f"{PREFIX}:{_KINDS[mode]}:{model}|{entry_id}"


def _from_slot(slot: str, raw: str) -> CachePolicy:
    model, _, key_id = slot.partition("|")
    return parse_policy(model, orjson.loads(raw), key_id)


class CacheStore:
    """Admin-side reads and writes (the request path reads CacheBook)."""

    def __init__(self, client: redis.Redis) -> None:
        self.r: Any = client  # redis-py types replies as sync|async unions

    async def all(self) -> dict[str, CachePolicy]:
        """Policies by slot; a stored policy that no longer parses is skipped."""
        policies: dict[str, CachePolicy] = {}
        for slot, raw in cast(dict[str, str], await self.r.hgetall(POLICIES)).items():
            try:
                policies[slot] = _from_slot(slot, raw)
            except (CachePolicyError, orjson.JSONDecodeError) as exc:
                log.error("cache policy %s is not valid any more and is skipped: %s", slot, exc)
        return policies

    async def get(self, model: str, key_id: str = "") -> CachePolicy | None:
        slot = policy_slot(model, key_id)
        raw = await self.r.hget(POLICIES, slot)
        return _from_slot(slot, raw) if raw else None

    async def version(self) -> int:
        return int(await self.r.get(VERSION) or 0)

    async def put(self, policy: CachePolicy) -> None:
        body = {k: v for k, v in policy.as_json().items() if k not in ("model", "key_id")}
        await self._change(lambda p: p.hset(POLICIES, policy.slot, orjson.dumps(body)))

    async def delete(self, model: str, key_id: str = "") -> None:
        await self._change(lambda p: p.hdel(POLICIES, policy_slot(model, key_id)))

    async def _change(self, write: Any) -> None:
        async with self.r.pipeline(transaction=True) as pipe:
            write(pipe)
            pipe.incr(VERSION)
            await pipe.execute()

    async def stats(self) -> dict[str, int]:
        return {k: int(v) for k, v in cast(dict[str, str], await self.r.hgetall(STATS)).items()}

    async def entries(self) -> Counter[tuple[str, str]]:
        """Stored answers by (model, mode), counted with SCAN (admin only: it walks the keyspace)."""
        found: Counter[tuple[str, str]] = Counter()
        modes = {v: k for k, v in _KINDS.items()}
        async for key in self.r.scan_iter(match=f"{PREFIX}:[xs]:*", count=1000):
            kind, _, rest = key[len(PREFIX) + 1:].partition(":")
            found[(rest.partition("|")[0], modes[kind])] += 1
        return found

    async def flush(self, model: str) -> int:
        """Delete one model's stored answers (every mode and scope); how many there were."""
        deleted = 0
        for kind in _KINDS.values():
            batch: list[str] = []
            async for key in self.r.scan_iter(match=f"{PREFIX}:{kind}:{model}|*", count=1000):
                batch.append(key)
                if len(batch) >= 500:
                    deleted += int(await self.r.unlink(*batch))
                    batch = []
            if batch:
                deleted += int(await self.r.unlink(*batch))
        return deleted


class CacheBook:
    """This replica's copy of the policies, refreshed from Redis, and its unsent lookup tallies."""

    def __init__(self, client: redis.Redis, refresh_s: float = 0.5) -> None:
        self.store, self.refresh_s = CacheStore(client), refresh_s
        self.policies: dict[str, CachePolicy] = {}
        self.version = -1
        self.tallies: Counter[str] = Counter()   # `model|mode|result` -> calls not yet added to STATS

    def policy(self, model: str, key_id: str) -> CachePolicy | None:
        """The key's own policy on this model, else the endpoint's; None when neither (dict lookups)."""
        if not self.policies:
            return None
        return self.policies.get(policy_slot(model, key_id)) or self.policies.get(model)

    def tally(self, model: str, mode: str, result: str) -> None:
        self.tallies[f"{model}|{mode}|{result}"] += 1

    async def refresh(self) -> None:
        version = await self.store.version()
        if version != self.version:
            self.policies, self.version = await self.store.all(), version

    async def send_tallies(self) -> None:
        if not self.tallies:
            return
        tallies, self.tallies = self.tallies, Counter()
        try:
            async with self.store.r.pipeline(transaction=False) as pipe:
                for field, n in tallies.items():
                    pipe.hincrby(STATS, field, n)
                await pipe.execute()
        except (redis.RedisError, OSError):
            self.tallies.update(tallies)  # sent with the next round
            raise

    async def follow(self) -> None:
        while True:
            try:
                await self.refresh()
                await self.send_tallies()
            except (redis.RedisError, OSError) as exc:
                log.warning("cannot refresh the cache policies (keeping the last copy): %s", exc)
            await asyncio.sleep(self.refresh_s)
