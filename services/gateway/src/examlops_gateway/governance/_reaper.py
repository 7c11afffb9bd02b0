"""Replica heartbeats and the reaper of reservations a crashed gateway left behind.

Every replica refreshes its entry in `{exa:gw}:replicas` (ZSET, id -> alive-until ms on Redis'
clock) every EXAMLOPS_HEARTBEAT_S. Every EXAMLOPS_REAPER_INTERVAL_S each replica runs reap.lua on
every key: a reservation whose replica is no longer alive, or older than its lease
(EXAMLOPS_REQUEST_TIMEOUT_S + EXAMLOPS_RESERVATION_GRACE_S), is given back. Running it on every
replica is harmless: the script is atomic and idempotent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, cast

import redis.asyncio as redis

from .._settings import GatewaySettings
from ._cost import REAPED
from ._durability import StoreWatch
from ._keys import KEY_INDEX, redis_keys
from ._scripts import load_script

log = logging.getLogger(__name__)

REPLICAS = "{exa:gw}:replicas"
BATCH = 500


class Reaper:
    def __init__(self, client: redis.Redis, settings: GatewaySettings, replica_id: str,
                 watch: StoreWatch | None = None) -> None:
        self.r: Any = client  # redis-py types replies as sync|async unions; checked by the tests instead
        self.settings = settings
        self.replica_id = replica_id
        self.heartbeat_script = load_script(client, "heartbeat.lua")
        self.reap_script = load_script(client, "reap.lua")
        self.live: list[str] = []
        self.watch = watch

    async def start(self) -> None:
        """Alive before the first reservation; the store's run and AOF state noted (a warning without AOF)."""
        await self.heartbeat()
        if self.watch is not None:
            await self.watch.start()

    async def heartbeat(self) -> list[str]:
        ttl_ms = int(self.settings.replica_ttl_s * 1000)
        live: list[str] = await self.heartbeat_script(keys=[REPLICAS], args=[self.replica_id, ttl_ms])
        self.live = live
        return live

    async def reap_once(self) -> int:
        """Run reap.lua on every key (pipelined in batches); returns the reservations given back."""
        live = await self.heartbeat()
        s = self.settings
        keep_ms = int((s.request_timeout_s + s.reservation_grace_s) * 2000)
        trim_ms = int(s.cost_retention_days * 86_400_000)
        total = 0
        cursor: Any = 0
        # A Redis Cluster pipeline runs no Script object (it cannot load one): load it on every
        # primary, then pipeline plain EVALSHAs, each routed to its key's node.
        await self.r.script_load(self.reap_script.script)
        while True:
            cursor, found = await self.r.sscan(KEY_INDEX, cursor, count=BATCH)
            ids = cast(list[str], found)
            if ids:
                async with self.r.pipeline(transaction=False) as pipe:
                    for key_id in ids:
                        keys = redis_keys(key_id)
                        pipe.execute_command("EVALSHA", self.reap_script.sha, len(keys), *keys,
                                             key_id, keep_ms, trim_ms, *live)
                    total += sum(int(n) for n in await pipe.execute())
            if int(cursor) == 0:
                break
        if total:
            REAPED.inc(total)
            log.warning("returned %d reservation(s) left by a dead or stuck gateway replica", total)
        return total

    async def run(self) -> None:
        """Heartbeat forever; reap on its own cadence. Errors are logged and retried."""
        s = self.settings
        last_reap = time.monotonic()
        while True:
            try:
                if time.monotonic() - last_reap >= s.reaper_interval_s:
                    last_reap = time.monotonic()
                    await self.reap_once()
                else:
                    await self.heartbeat()
                if self.watch is not None:
                    await self.watch.observe()
            except redis.RedisError as exc:
                log.warning("heartbeat/reaper: Redis error %s; retrying", exc)
            except Exception:  # a surprise (in the store's INFO, say) must not stop the heartbeat
                log.exception("heartbeat/reaper: unexpected error; retrying")
            await asyncio.sleep(min(s.heartbeat_s, s.reaper_interval_s))

    async def leave(self) -> None:
        """A clean shutdown: this replica's (settled) reservations are no one's to wait for."""
        try:
            await self.r.zrem(REPLICAS, self.replica_id)
        except redis.RedisError:
            pass
