"""The governance store's durability, as one replica sees it (GOVERNANCE.md, "Durability").

The store runs AOF with `appendfsync everysec`: Redis write(2)s a command's effects before it sends
the reply, except while its background fsync of the previous second is still running, when it
holds the write back (up to 2 s, counted in INFO persistence `aof_delayed_fsync`) and replies
anyway. A Redis process killed in that window loses writes it had acknowledged. So that a settle is
never among them, every replica keeps the settles Redis acknowledged (SettleJournal) until it has
seen the same Redis run (its run_id) alive REPLAY_WINDOW_S after them; when the run_id changes (the
store restarted), it sends every kept settle again. settle.lua is idempotent per reservation: a
settle the store kept answers `duplicate`, one it lost is charged now.

StoreWatch.start(): warns when the store runs without AOF. StoreWatch.observe() (every heartbeat):
the run_id, the journal, and the gauges of `aof_delayed_fsync` and AOF on/off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as redis
from prometheus_client import Counter, Gauge

from examlops.svc import redis_primaries

log = logging.getLogger(__name__)

#: An acknowledged settle is kept this long after it was acknowledged (by a Redis run seen alive
#: since): more than the 2 s Redis may hold a write back, plus an fsync that overran.
REPLAY_WINDOW_S = 10.0
#: At most this many settles are kept (about 0.9 kB each): a store this replica cannot watch (INFO
#: failing while settles land, a cluster node down) confirms nothing, and the oldest go first.
MAX_ENTRIES = 100_000
#: A replay has this many settles in flight at once.
REPLAY_CONCURRENCY = 64

AOF_DELAYED_FSYNC = Gauge("examlops_gateway_governance_store_aof_delayed_fsync",
                          "The governance store's INFO persistence aof_delayed_fsync (summed over a cluster's "
                          "primaries): writes Redis held back past 2 s behind a slow fsync.",
                          multiprocess_mode="livemax")
AOF_ENABLED = Gauge("examlops_gateway_governance_store_aof_enabled",
                    "1 when every governance store node runs with AOF on, else 0.", multiprocess_mode="livemin")
REPLAYED = Counter("examlops_gateway_settles_replayed_total",
                   "Acknowledged settles sent again after the governance store restarted, by answer "
                   "(recovered: the store had lost it; kept: it had it).", ["outcome"])
UNMATCHED = Counter("examlops_gateway_settles_unmatched_total",
                    "Settles answered duplicate, by attempt (first, retry): a store restart lost the "
                    "reservation (the call goes unbilled), or a re-sent settle had landed already (its reply "
                    "was lost; such a call is not in examlops_gateway_calls_total).", ["attempt"])

Settle = Callable[[list[str], list[Any]], Awaitable[Any]]


class SettleJournal:
    """Settles the store acknowledged and may still lose: (acknowledged at, keys, argv)."""

    def __init__(self, window_s: float = REPLAY_WINDOW_S, max_entries: int = MAX_ENTRIES) -> None:
        self.window_s = window_s
        self.entries: deque[tuple[float, list[str], list[Any]]] = deque(maxlen=max_entries)
        self.dropped = 0  # settles pushed out unconfirmed by the bound

    def add(self, keys: list[str], argv: list[Any]) -> None:
        if len(self.entries) == self.entries.maxlen:
            if not self.dropped:
                log.warning("the settle journal is full (%d settles the store was not seen to keep): the oldest "
                            "are no longer re-sent if it restarts", self.entries.maxlen)
            self.dropped += 1
        self.entries.append((time.monotonic(), keys, argv))

    def confirm(self, alive_at: float) -> None:
        """The run that acknowledged them was alive at `alive_at`: what it acknowledged a window
        before is written (and fsynced), so it is dropped."""
        while self.entries and self.entries[0][0] <= alive_at - self.window_s:
            self.entries.popleft()

    async def replay(self, settle: Settle) -> tuple[int, int]:
        """Send every settle kept when it starts again (those acknowledged meanwhile are the new run's:
        chasing them could go on as long as calls keep coming), REPLAY_CONCURRENCY at a time (one by
        one, 50,000 kept settles would hold the heartbeat loop past the replica's TTL); (recovered,
        kept). A Redis error raises once the batch is in, leaving the settles not yet landed for later."""
        recovered = kept = 0
        todo = len(self.entries)
        while todo:
            batch = [self.entries.popleft() for _ in range(min(todo, REPLAY_CONCURRENCY))]
            todo -= len(batch)
            replies = await asyncio.gather(*(settle(keys, argv) for _, keys, argv in batch), return_exceptions=True)
            failed = [entry for entry, reply in zip(batch, replies, strict=True) if isinstance(reply, BaseException)]
            landed = [reply for reply in replies if not isinstance(reply, BaseException)]
            ok = sum(1 for reply in landed if reply[0] == "ok")
            recovered, kept = recovered + ok, kept + len(landed) - ok
            if failed:
                rest = [self.entries.popleft() for _ in range(todo)]  # their turn had not come
                self.entries.extendleft(reversed(failed + rest))
                raise next(r for r in replies if isinstance(r, BaseException))
        return recovered, kept


class StoreWatch:
    """The store's run_id, AOF state and delayed fsyncs; replays the journal after a restart."""

    def __init__(self, client: redis.Redis, journal: SettleJournal, settle: Settle) -> None:
        self.r: Any = client  # redis-py types replies as sync|async unions
        self.journal, self.settle = journal, settle
        self.run_id: str | None = None

    async def _infos(self) -> list[dict[str, Any]]:
        primaries = redis_primaries(self.r)
        if not primaries:
            return [await self.r.info("server", "persistence")]
        replies = await self.r.info("server", "persistence", target_nodes=primaries)
        if "run_id" in replies:  # one primary: its INFO itself
            return [replies]
        return [replies[name] for name in sorted(replies)]

    async def start(self) -> None:
        """The run this replica starts on; a warning when the store would lose its keys on a restart."""
        infos = await self._infos()
        self.run_id = ",".join(str(i.get("run_id")) for i in infos)
        self._gauges(infos)
        if not all(int(i.get("aof_enabled", 0)) for i in infos):
            log.warning("the governance store runs with appendonly no: a Redis restart loses virtual keys, "
                        "budgets, spend and cost records written since its last snapshot; start it with "
                        "--appendonly yes --appendfsync everysec (GOVERNANCE.md, Durability)")

    def _gauges(self, infos: list[dict[str, Any]]) -> None:
        AOF_ENABLED.set(1 if all(int(i.get("aof_enabled", 0)) for i in infos) else 0)
        AOF_DELAYED_FSYNC.set(sum(int(i.get("aof_delayed_fsync", 0)) for i in infos))

    async def observe(self) -> None:
        """One look at the store (a Redis error propagates: the caller retries on its cadence)."""
        asked = time.monotonic()
        infos = await self._infos()
        self._gauges(infos)
        run_id = ",".join(str(i.get("run_id")) for i in infos)
        if run_id == self.run_id:
            self.journal.confirm(asked)
            return
        pending = len(self.journal.entries)
        log.warning("the governance store restarted (run %s, was %s): re-sending the %d settle(s) it "
                    "acknowledged in the last %g s", run_id, self.run_id, pending, self.journal.window_s)
        recovered, kept = await self.journal.replay(self.settle)  # a Redis error: same run_id next time
        self.run_id = run_id
        REPLAYED.labels("recovered").inc(recovered)
        REPLAYED.labels("kept").inc(kept)
        if recovered:
            log.warning("the governance store had lost %d acknowledged settle(s): charged them again", recovered)
