"""Liveness and readiness of one gateway replica.

- `/livez` is 200 while the process serves HTTP. It checks nothing else: restarting a gateway
  brings back neither Redis nor the registry, so a dependency outage must never fail liveness.
- `/readyz` is 200 only when this replica can serve a virtual key: Redis answers a PING (on a
  Redis Cluster, every primary: virtual keys spread over all of them), on a connection of its own,
  with a short timeout, the answer kept for a second so that probes cost at most one PING (round) a
  second; and the route table and the price table have synced from the registry.
  A 503 names what is missing in `failing` (`redis`, `route_table`, `prices`).
- `/healthz` is `/readyz`, kept for the tools and probes that already use it.
- `examlops_gateway_governance_store_up` (1/0) is the answer of the last PING; `/metrics` asks for
  one first, so each scrape sees Redis as it is (alert GatewayGovernanceStoreUnreachable).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import redis.asyncio as redis
from fastapi import APIRouter
from prometheus_client import Gauge
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException
from starlette.responses import Response

from examlops.svc import ping_all, redis_client

from .http import StateDep

PING_TIMEOUT_S = 0.5
PING_CACHE_S = 1.0
# Set by whichever worker answers the scrape (EXAMLOPS_WORKERS > 1): the latest reading is the value.
GOVERNANCE_STORE_UP = Gauge("examlops_gateway_governance_store_up",
                            "1 when the governance store (Redis) answered this replica's last PING, else 0.",
                            multiprocess_mode="livemostrecent")


class RedisPing:
    """Does Redis answer? One PING at a time on a dedicated connection, its answer kept PING_CACHE_S."""

    def __init__(self, url: str) -> None:
        self.client = redis_client(url, max_connections=1, wait_s=PING_TIMEOUT_S, retry=Retry(NoBackoff(), 0),
                                   socket_timeout=PING_TIMEOUT_S, connect_timeout=PING_TIMEOUT_S,
                                   decode_responses=False)
        self._lock = asyncio.Lock()
        self._ok, self._until = False, 0.0

    async def ok(self) -> bool:
        async with self._lock:  # concurrent probes wait for the one PING in flight
            if time.monotonic() >= self._until:
                try:
                    self._ok = await asyncio.wait_for(ping_all(self.client), PING_TIMEOUT_S)
                except (redis.RedisError, RedisClusterException, OSError, TimeoutError):
                    self._ok = False
                self._until = time.monotonic() + PING_CACHE_S
                GOVERNANCE_STORE_UP.set(1 if self._ok else 0)
            return self._ok

    async def aclose(self) -> None:
        await self.client.aclose()


router = APIRouter(include_in_schema=False)


def _json(body: dict[str, Any], status: int) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


@router.get("/livez")
async def livez(state: StateDep) -> Response:
    return _json({"status": "ok", "replica": state.replica_id}, 200)


@router.get("/readyz")
@router.get("/healthz")
async def readyz(state: StateDep) -> Response:
    checks = {"redis": await state.redis_ping.ok(), "route_table": state.routes.synced.is_set(),
              "prices": state.prices.synced.is_set()}
    failing = [name for name, ok in checks.items() if not ok]
    body = {"status": "unavailable" if failing else "ok", "failing": failing,
            "routes": len(state.routes.routable()), "route_table_synced": checks["route_table"],
            "prices_synced": checks["prices"], "redis": checks["redis"], "replica": state.replica_id}
    return _json(body, 503 if failing else 200)
