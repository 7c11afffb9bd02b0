"""The semantic cache's index: every gateway replica holds the same vectors, in memory, from Redis.

Redis holds the truth; each replica holds a copy it searches without I/O.

- **Redis** (all keys tagged `{exa:gw}`, so every script's keys share a Redis Cluster slot):
  `…:semcache:rec` (hash entry_id -> packed record: expiry, space, base64 float32 vector),
  `…:semcache:space` (hash entry_id -> space, what `flush` scans), `…:semcache:used` (zset
  entry_id -> last use in ms: written, or hit on some replica), `…:semcache:expiry` (zset
  entry_id -> expires_at_ms), `…:semcache:seq` (event counter) and `…:semcache:log` (a stream of
  add / del / flush events, each numbered by `seq`, trimmed to about `LOG_LEN`). One Lua script per
  operation keeps the hashes, zsets and log in step.
- **Sharing**: `add` writes the entry and its event in one script and applies it here at once. A
  background task reads the log from its last stream id every `sync_interval_s` and applies the
  events, so another replica sees an entry within about that interval. An event whose `seq` is
  not the next one (the log was trimmed past this replica, or Redis lost its data) makes the
  replica reload the whole set: it reads (seq, last log id) in one transaction, scans the
  records, then replays the log from that id (replays are idempotent, so entries written during
  the scan converge).
- **Bounds**: at most `max_entries` entries in Redis: the add script drops expired entries
  (up to 100 a call) and then evicts the least recently used (`used` is bumped at write and, in
  batches every sync, for the entries this replica answered from), logging a `del` event that
  every replica applies. Each replica also caps its own copy at `max_entries` (least recently hit
  here first), which matters only while Redis is unreachable. Memory: per space one float32
  matrix, grown by doubling and compacted when a quarter of its rows are dead, so at most about
  2.7 x max_entries x dim x 4 bytes.
- **TTL**: every row keeps its expiry (wall clock, ms); `lookup` never matches an expired row,
  and the sync task drops expired rows and compacts.
- **Loss**: with Redis unreachable, `lookup` keeps answering from memory; `add` logs, counts
  (`add_errors`) and keeps the entry in this replica only; it never raises. Such entries are not
  seen by other replicas and are dropped if this replica later reloads. `start` gives up on the
  first load after `start_timeout_s` and the sync task keeps trying.

Spaces are opaque strings; rows of different spaces are never compared. Rows are held per
(space, dimension), so a vector of another dimension than its space's never meets them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections import OrderedDict
from typing import Any

import numpy as np
import redis.asyncio as redis

from ._semantic_rows import SpaceRows

__all__ = ["LOG_LEN", "SemanticIndex", "semcache_keys"]

log = logging.getLogger(__name__)

TAG = "{exa:gw}"
LOG_LEN = 4096  # events kept in the log; a replica further behind reloads

_ADD = """
local rec, spc, used, exp, seq, logk = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local id, space, expires, payload, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local max, loglen = tonumber(ARGV[6]), ARGV[7]
local function drop(victim)
  redis.call('HDEL', rec, victim); redis.call('HDEL', spc, victim)
  redis.call('ZREM', used, victim); redis.call('ZREM', exp, victim)
end
for _, victim in ipairs(redis.call('ZRANGEBYSCORE', exp, '-inf', now, 'LIMIT', 0, 100)) do drop(victim) end
redis.call('HSET', rec, id, payload); redis.call('HSET', spc, id, space)
redis.call('ZADD', used, now, id); redis.call('ZADD', exp, expires, id)
redis.call('XADD', logk, 'MAXLEN', '~', loglen, '*', 'seq', redis.call('INCR', seq), 'op', 'add', 'id', id,
           'rec', payload)
local evicted = {}
local over = redis.call('ZCARD', used) - max
if over > 0 then
  local popped = redis.call('ZPOPMIN', used, over)
  for i = 1, #popped, 2 do
    drop(popped[i]); evicted[#evicted + 1] = popped[i]
    redis.call('XADD', logk, 'MAXLEN', '~', loglen, '*', 'seq', redis.call('INCR', seq), 'op', 'del', 'id', popped[i])
  end
end
return evicted
"""

_FLUSH = """
local rec, spc, used, exp, seq, logk = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local prefix, loglen = ARGV[1], ARGV[2]
local all = redis.call('HGETALL', spc)
local removed = 0
for i = 1, #all, 2 do
  if string.sub(all[i + 1], 1, #prefix) == prefix then
    local victim = all[i]
    redis.call('HDEL', rec, victim); redis.call('HDEL', spc, victim)
    redis.call('ZREM', used, victim); redis.call('ZREM', exp, victim)
    removed = removed + 1
  end
end
redis.call('XADD', logk, 'MAXLEN', '~', loglen, '*', 'seq', redis.call('INCR', seq), 'op', 'flush', 'prefix', prefix)
return removed
"""


def semcache_keys() -> list[str]:
    """rec, space, used, expiry, seq, log: every key of the index, in the scripts' KEYS order."""
    return [f"{TAG}:semcache:{name}" for name in ("rec", "space", "used", "expiry", "seq", "log")]


def pack_record(space: str, vector: np.ndarray, expires_ms: int) -> str:
    """`<expires_ms>:<space length>:<space><base64 float32 LE>` (text: the gateway's client decodes replies)."""
    vec = base64.b64encode(vector.astype("<f4", copy=False).tobytes()).decode()
    return f"{expires_ms}:{len(space)}:{space}{vec}"


def unpack_record(record: str) -> tuple[str, np.ndarray, int]:
    """(space, vector, expires_ms) of a packed record; ValueError when it is not one."""
    expires, length, rest = record.split(":", 2)
    n = int(length)
    vector = np.frombuffer(base64.b64decode(rest[n:], validate=True), dtype="<f4").astype(np.float32)
    if vector.size == 0 or len(rest) < n:
        raise ValueError("a record without a vector")
    return rest[:n], vector, int(expires)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _unit(vector: np.ndarray) -> np.ndarray | None:
    """A contiguous unit-norm float32 copy-or-view of `vector`; None for a zero or non-finite vector."""
    v = np.ascontiguousarray(vector, dtype=np.float32).reshape(-1)
    norm = float(np.sqrt(v @ v))
    if not np.isfinite(norm) or norm == 0.0:
        return None
    return v if abs(norm - 1.0) < 1e-4 else v / norm


class SemanticIndex:
    """Cached conversations' vectors by space, shared by every replica through Redis (see the module doc)."""

    def __init__(self, client: redis.Redis, *, max_entries: int, sync_interval_s: float = 0.25,
                 start_timeout_s: float = 2.0, redis_timeout_s: float = 2.0) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self._client, self.max_entries, self.sync_interval_s = client, max_entries, sync_interval_s
        self.start_timeout_s, self.redis_timeout_s = start_timeout_s, redis_timeout_s
        self._keys = semcache_keys()
        self._add_script = client.register_script(_ADD)
        self._flush_script = client.register_script(_FLUSH)
        self._spaces: dict[tuple[str, int], SpaceRows] = {}  # (space, dimension) -> its rows
        self._where: OrderedDict[str, SpaceRows] = OrderedDict()  # entry_id -> its rows, least recently used first
        self._hits: set[str] = set()
        self._seq, self._last_id, self._reload = 0, "0-0", True
        self._task: asyncio.Task[None] | None = None
        self._scores = np.empty(0, np.float32)
        self._dead = np.empty(0, np.bool_)
        self._counts = dict.fromkeys(("added", "evicted", "expired", "flushed", "hits", "add_errors",
                                      "sync_errors", "reloads"), 0)
        self._failing = False
        self._adding = 0  # adds applied here whose script has not answered (Redis may evict for them)
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the current entries (bounded by `start_timeout_s`), then follow the log in the background."""
        try:
            async with asyncio.timeout(self.start_timeout_s):
                await self._load()
        except (redis.RedisError, OSError, TimeoutError) as exc:
            self._note_sync_error(exc)
        self._task = asyncio.create_task(self._follow(), name="semantic-index-sync")

    async def aclose(self) -> None:
        """Stop following Redis (bounded: the follower also stops at its next round if a library swallowed
        the cancellation)."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({task}, timeout=max(1.0, 4 * self.sync_interval_s))
            if not task.done():
                log.warning("semantic cache: the follower did not stop when cancelled; it stops at its next round")

    # -- the request path --------------------------------------------------------------------------

    def lookup(self, space: str, vector: np.ndarray, threshold: float) -> tuple[str, float] | None:
        """The most similar live entry of `space` at or above `threshold` (cosine), from memory only."""
        if vector.ndim != 1:
            return None
        rows = self._spaces.get((space, vector.shape[0]))
        if rows is None or rows.live == 0:
            return None
        query = _unit(vector)
        if query is None:
            return None
        n = rows.n
        if self._scores.shape[0] < n:
            self._scores = np.empty(max(n, 2 * self._scores.shape[0]), np.float32)
            self._dead = np.empty(self._scores.shape[0], np.bool_)
        scores, dead = self._scores[:n], self._dead[:n]
        np.matmul(rows.vectors[:n], query, out=scores)
        np.less_equal(rows.expires[:n], _now_ms(), out=dead)  # removed rows have expiry 0
        np.copyto(scores, np.float32(-2.0), where=dead)
        best = int(scores.argmax())
        similarity = float(scores[best])
        entry_id = rows.ids[best]
        if similarity < threshold or entry_id is None:
            return None
        self._where.move_to_end(entry_id)
        self._hits.add(entry_id)
        self._counts["hits"] += 1
        return entry_id, similarity

    async def add(self, space: str, vector: np.ndarray, entry_id: str, ttl_s: int) -> None:
        """Store an entry for every replica (this one at once); never raises (failures are logged and counted)."""
        unit = _unit(vector) if isinstance(vector, np.ndarray) and vector.ndim == 1 else None
        if unit is None or ttl_s <= 0:
            self._counts["add_errors"] += 1
            log.warning("semantic cache: not storing %s (not a non-zero vector, or ttl %s)", entry_id, ttl_s)
            return
        now = _now_ms()
        expires = now + int(ttl_s) * 1000
        self._adding += 1
        try:
            self._apply_add(entry_id, space, unit, expires)
            async with asyncio.timeout(self.redis_timeout_s):
                evicted = await self._add_script(keys=self._keys, args=[
                    entry_id, space, expires, pack_record(space, unit, expires), now, self.max_entries, LOG_LEN])
            for victim in evicted:  # Redis's choice, applied here now (its log events then change nothing)
                if self._remove(_text(victim)):
                    self._counts["evicted"] += 1
        except Exception as exc:  # the request path must not fail because the cache could not store
            self._counts["add_errors"] += 1
            log.warning("semantic cache: could not store %s for other replicas: %s", entry_id,
                        exc or type(exc).__name__)
        finally:
            self._adding -= 1
            self._enforce_cap()

    async def flush(self, space_prefix: str) -> int:
        """Remove every entry whose space starts with `space_prefix`, here and (through Redis) on every replica.

        Returns how many entries Redis held; raises the Redis error when it cannot reach Redis (this
        replica's copy is flushed anyway).
        """
        self._apply_flush(space_prefix)
        async with asyncio.timeout(self.redis_timeout_s):
            return int(await self._flush_script(keys=self._keys, args=[space_prefix, LOG_LEN]))

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._where), "spaces": len({space for space, _ in self._spaces}),
                "max_entries": self.max_entries, "seq": self._seq, **self._counts}

    # -- following Redis ---------------------------------------------------------------------------

    async def _follow(self) -> None:
        while not self._closed:
            try:
                async with asyncio.timeout(max(self.redis_timeout_s, 4 * self.sync_interval_s)):
                    await (self._load() if self._reload else self._poll())
                    await self._push_hits()
                if self._failing:
                    log.info("semantic cache: following Redis again")
                    self._failing = False
            except (redis.RedisError, OSError, TimeoutError) as exc:
                self._note_sync_error(exc)
            except Exception:  # a bad event must not stop the follower: reload from scratch next time
                log.exception("semantic cache: cannot apply the log; reloading")
                self._reload = True
            self._housekeep()
            await asyncio.sleep(self.sync_interval_s)

    def _note_sync_error(self, exc: BaseException) -> None:
        self._counts["sync_errors"] += 1
        if not self._failing:
            log.warning("semantic cache: cannot reach Redis, answering from this replica's copy: %s",
                        exc or type(exc).__name__)
            self._failing = True

    async def _load(self) -> None:
        """Replace this replica's copy with Redis's set, then continue from the log position it matches."""
        rec, _, _, _, seq_key, log_key = self._keys
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.get(seq_key)
            pipe.xrevrange(log_key, count=1)
            seq, last = await pipe.execute()
        loaded: list[tuple[str, str, np.ndarray, int]] = []
        now = _now_ms()
        async for entry_id, record in self._client.hscan_iter(rec, count=500):
            try:
                space, vector, expires = unpack_record(_text(record))
            except ValueError:
                log.warning("semantic cache: skipping unreadable entry %s", _text(entry_id))
                continue
            if expires > now:
                loaded.append((_text(entry_id), space, vector, expires))
        self._spaces.clear()
        self._where.clear()
        for entry_id, space, vector, expires in sorted(loaded, key=lambda e: e[3]):
            self._apply_add(entry_id, space, vector, expires)
        self._enforce_cap()
        self._seq = int(seq or 0)
        self._last_id = _text(last[0][0]) if last else "0-0"
        self._reload = False
        self._counts["reloads"] += 1
        await self._poll()  # events written during the scan (idempotent replays)

    async def _poll(self) -> None:
        log_key = self._keys[5]
        while True:
            answer: Any = await self._client.xread({log_key: self._last_id}, count=1000)
            events: list[tuple[Any, dict[Any, Any]]] = answer[0][1] if answer else []
            for event_id, fields in events:
                data = {_text(k): _text(v) for k, v in fields.items()}
                seq = int(data.get("seq", 0))
                if seq != self._seq + 1:  # trimmed past us, or Redis lost its data: start again
                    log.info("semantic cache: log at seq %s, this replica at %s; reloading", seq, self._seq)
                    self._reload = True
                    return
                self._apply_event(data)
                self._seq, self._last_id = seq, _text(event_id)
            self._enforce_cap()
            if len(events) < 1000:
                return

    def _apply_event(self, data: dict[str, str]) -> None:
        op = data.get("op")
        if op == "add":
            space, vector, expires = unpack_record(data["rec"])
            self._apply_add(data["id"], space, vector, expires)
        elif op == "del":
            if self._remove(data["id"]):
                self._counts["evicted"] += 1
        elif op == "flush":
            self._apply_flush(data["prefix"])

    async def _push_hits(self) -> None:
        """Tell Redis which entries this replica answered from, so the global eviction spares them."""
        if not self._hits:
            return
        hits, self._hits = self._hits, set()
        now = _now_ms()
        await self._client.zadd(self._keys[2], dict.fromkeys(hits, now), xx=True, gt=True)

    # -- this replica's copy -----------------------------------------------------------------------

    def _apply_add(self, entry_id: str, space: str, vector: np.ndarray, expires: int) -> None:
        current = self._where.get(entry_id)
        key = (space, vector.shape[0])
        if current is not None:
            if current.key == key and current.expires_of(entry_id) == expires:
                return  # our own add coming back through the log
            self._remove(entry_id)
        rows = self._spaces.get(key)
        if rows is None:
            rows = self._spaces[key] = SpaceRows(key)
        rows.append(entry_id, vector, expires)
        self._where[entry_id] = rows
        self._counts["added"] += 1

    def _enforce_cap(self) -> None:
        """Redis's evictions keep the copy at `max_entries`; this bounds it when they cannot arrive."""
        while len(self._where) > self.max_entries + self._adding:
            self._remove(next(iter(self._where)))  # the least recently used here
            self._counts["evicted"] += 1

    def _remove(self, entry_id: str) -> bool:
        rows = self._where.pop(entry_id, None)
        if rows is None:
            return False
        rows.remove(entry_id)
        if rows.live == 0:
            self._spaces.pop(rows.key, None)
        return True

    def _apply_flush(self, prefix: str) -> None:
        for key in [k for k in self._spaces if k[0].startswith(prefix)]:
            for entry_id in self._spaces[key].entry_ids():
                self._remove(entry_id)
                self._counts["flushed"] += 1

    def _housekeep(self) -> None:
        now = _now_ms()
        for rows in list(self._spaces.values()):
            for entry_id in rows.expired(now):
                self._remove(entry_id)
                self._counts["expired"] += 1
            if rows.live:
                rows.maybe_compact()

