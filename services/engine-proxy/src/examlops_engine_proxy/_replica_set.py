"""An endpoint's pool in this proxy: one engine per replica, the router, and the replicas' lives.

A registry change keeps the state (load, health, counters, open connections) of every replica
whose (id, base_url) did not change, adds the new ones, and drains the ones that left or are
draining: they get no new picks, their in-flight requests finish on their open session, and the
session is closed when the last one ends (at most RETIRE_AFTER_S later).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb
from examlops.registry.v1 import registry_pb2 as reg

from ._engines import Engine
from ._replicas import Replica, watch_replica
from ._routing import Router

log = logging.getLogger(__name__)
RETIRE_AFTER_S = 120.0

#: makes the engine of one replica from its base_url
EngineFactory = Callable[[str], Engine]


class ReplicaSet:
    """The replicas an endpoint's requests are routed to, and those still finishing requests."""

    def __init__(self, endpoint: str, policy: str, scrape_interval_s: float) -> None:
        self.endpoint = endpoint
        self.policy = policy
        self.scrape_interval_s = scrape_interval_s
        self.spec_decode = False               # the engine block enables speculative decoding
        self.replicas: list[Replica] = []      # routable, in pool order
        self.draining: list[Replica] = []      # left the pool, finishing their requests
        self.router = Router(policy, [])
        self._watchers: dict[Replica, tuple[asyncio.Task[None], bool]] = {}  # the task, and whether it scrapes
        self._retiring: set[asyncio.Task[None]] = set()

    @classmethod
    def single(cls, endpoint: str, engine: Engine) -> ReplicaSet:
        """An addressless engine (echo, vllm-inproc): one replica, no scraping, no health."""
        pool = cls(endpoint, "least-load", 0.0)
        pool.replicas = [Replica(endpoint, "r0", "", engine)]
        return pool

    def sync(self, wanted: Sequence[reg.Replica], policy: str, make: EngineFactory, spec_decode: bool = False) -> None:
        """Match the registry's routable replicas; called on every change of the endpoint's record.
        Replicas are scraped in the background in pools of two or more (their load, for the router)
        and on endpoints with speculative decoding (the counters each call's SpecDecode is measured
        from, _spec_decode)."""
        self.spec_decode = spec_decode
        current = {(r.id, r.base_url): r for r in self.replicas}
        kept: list[Replica] = []
        for spec in wanted:
            replica = current.pop((spec.id, spec.base_url), None)
            if replica is None:
                replica = Replica(self.endpoint, spec.id, spec.base_url, make(spec.base_url))
                log.info("endpoint %r: replica %s (%s) joins the pool", self.endpoint, spec.id, spec.base_url)
            kept.append(replica)
        for gone in current.values():
            self._drain(gone)
        ids_changed = [r.id for r in kept] != [r.id for r in self.replicas]
        self.replicas = kept
        if ids_changed or policy != self.policy:
            self.policy = policy
            self.router = Router(policy, [r.id for r in kept])
        scrape = len(kept) >= 2 or spec_decode
        for replica in kept:
            watcher = self._watchers.get(replica)
            if watcher is not None and watcher[1] == scrape:
                continue
            if watcher is not None:
                watcher[0].cancel()
            task = asyncio.get_running_loop().create_task(
                watch_replica(replica, self.scrape_interval_s, scrape), name=f"replica {self.endpoint}/{replica.id}")
            self._watchers[replica] = (task, scrape)

    def _drain(self, replica: Replica) -> None:
        """No new picks; close its session once its in-flight requests end."""
        replica.draining = True
        watcher = self._watchers.pop(replica, None)
        if watcher is not None:
            watcher[0].cancel()
        self.draining.append(replica)
        log.info("endpoint %r: replica %s (%s) drains (%d in flight)", self.endpoint, replica.id,
                 replica.base_url, replica.in_flight)

        async def retire() -> None:
            try:
                await asyncio.wait_for(replica.idle.wait(), RETIRE_AFTER_S)
            except TimeoutError:
                log.warning("endpoint %r: replica %s still had %d request(s) after %.0f s; closing it",
                            self.endpoint, replica.id, replica.in_flight, RETIRE_AFTER_S)
            finally:
                self.draining.remove(replica)
                if not any(r.id == replica.id for r in self.replicas):  # a new r0 at another address keeps them
                    replica.forget_series()
                await replica.engine.aclose()

        task = asyncio.get_running_loop().create_task(retire())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def candidates(self) -> list[Replica]:
        """The replicas a new request may use: the healthy ones, or every one when all are ejected
        (trying them beats failing without trying, and a success brings one back at once)."""
        healthy = [r for r in self.replicas if not r.ejected_until]
        return healthy or list(self.replicas)

    def pick(self, candidates: Sequence[Replica], key: str | None) -> tuple[Replica, str]:
        return self.router.pick(candidates, key, time.monotonic())

    def stats(self) -> list[pb.ReplicaStats]:
        now, wall_ms = time.monotonic(), time.time() * 1000
        return [pb.ReplicaStats(
            id=r.id, base_url=r.base_url, healthy=not r.ejected_until, draining=r.draining,
            ejected_until_ms=int(wall_ms + (r.ejected_until - now) * 1000) if r.ejected_until else 0,
            in_flight=r.in_flight, requests_running=r.running, requests_waiting=r.waiting,
            kv_cache_usage=r.kv_cache_usage,
            metrics_age_ms=int((now - r.metrics_at) * 1000) if r.metrics_at else -1,
            requests=r.requests, errors=r.errors, ejections=r.ejections, retries=r.retries, picks=r.picks)
            for r in [*self.replicas, *self.draining]]

    def drain_all(self) -> None:
        """The endpoint is gone (or its engine changed): every replica drains."""
        for replica in self.replicas:
            self._drain(replica)
        self.replicas = []

    async def aclose(self) -> None:
        for task in [*(t for t, _ in self._watchers.values()), *self._retiring]:
            task.cancel()
        for replica in [*self.replicas, *self.draining]:
            await replica.engine.aclose()
